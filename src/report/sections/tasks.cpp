// Task accuracy beside KLD: the base's and every keep map's answers to the run's task file,
// as llama-perplexity scores them.
#include "report/html.h"
#include "report/section.h"

#include "formats/keep_map.h"

#include <fmt/format.h>

namespace moeprune {

using nlohmann::json;

namespace {

json task_row(const std::string & map, const std::string & criterion, const json & k, const EvalTaskFigures & f,
              const EvalTaskFigures & base) {
    return {{"map", map},
            {"criterion", criterion},
            {"k", k},
            {"tasks", f.tasks},
            {"correct", f.correct},
            {"accuracy", f.accuracy},
            {"stderr", f.stderr_},
            {"of_base", base.accuracy > 0 ? json(f.accuracy / base.accuracy) : json(nullptr)},
            {"kept_base_correct", f.kept_base_correct},
            {"new_correct", f.new_correct}};
}

json task_rows(const EvalFile & eval, int64_t n_expert) {
    json rows = json::array();
    if (!eval.base_tasks) {
        return rows;
    }
    rows.push_back(task_row("base", "", n_expert, *eval.base_tasks, *eval.base_tasks));
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind == "keep" && c.tasks) {
            const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
            rows.push_back(task_row(keep_map_label(map.first, map.second), map.first, map.second, *c.tasks, *eval.base_tasks));
        }
    }
    return rows;
}

std::string task_table(const ReportData & d) {
    const json & rows = d.rows.at("tasks");
    std::string body = "<h3>Task accuracy</h3>\n";
    if (rows.empty()) {
        return body + "<p>No task file was given (run.toml <code>hellaswag</code>, <code>winogrande</code> or "
                      "<code>multiple_choice</code>): quality here is KLD alone.</p>\n";
    }
    body += fmt::format("<p>Answers to {} ({} tasks, {}), scored for the base and every keep map as "
                        "<code>llama-perplexity</code> scores them: accuracy ± its standard error, the share of the "
                        "base's accuracy kept, the base's right answers kept and the new ones (report/tasks.csv).</p>\n"
                        "<table><tr><th>model</th><th>accuracy</th><th>of the base's</th><th>right</th>"
                        "<th>base's kept</th><th>new</th></tr>",
                        html_escape(d.eval.task_file), rows.front().at("tasks").get<int64_t>(),
                        html_escape(d.eval.task_format));
    for (const json & r : rows) {
        body += fmt::format("<tr><td>{}</td><td>{:.1f}% ± {:.1f}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                            html_escape(r.at("map").get<std::string>()), 100 * r.at("accuracy").get<double>(),
                            100 * r.at("stderr").get<double>(),
                            r.at("of_base").is_null() ? std::string("-")
                                                      : fmt::format("{:.0f}%", 100 * r.at("of_base").get<double>()),
                            r.at("correct").get<int64_t>(), r.at("kept_base_correct").get<int64_t>(),
                            r.at("new_correct").get<int64_t>());
    }
    return body + "</table>\n";
}

} // namespace

ReportSection tasks_section() {
    return {.id = "tasks",
            .csv_columns = {"map", "criterion", "k", "tasks", "correct", "accuracy", "stderr", "of_base",
                            "kept_base_correct", "new_correct"},
            .rows = [](ReportData & d) {
                const json rows = task_rows(d.eval, d.plan.n_expert);
                d.report["tasks"] = rows.empty() ? json(nullptr)
                                                 : json{{"format", d.eval.task_format}, {"file", d.eval.task_file},
                                                        {"rows", rows}};
                return rows;
            },
            .html = task_table};
}

} // namespace moeprune
