// Task accuracy beside KLD: the base's and every keep map's answers to the run's task file,
// as llama-perplexity scores them.
#include "report/html.h"
#include "report/section.h"

#include "formats/keep_map.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

using nlohmann::json;

namespace {

json task_row(const std::string & map, const std::string & criterion, const json & k, const std::string & domain,
              const EvalTaskFigures & f, const EvalTaskFigures & base) {
    return {{"map", map},
            {"criterion", criterion},
            {"k", k},
            {"domain", domain},
            {"tasks", f.tasks},
            {"correct", f.correct},
            {"accuracy", f.accuracy},
            {"stderr", f.stderr_},
            {"of_base", base.accuracy > 0 ? json(f.accuracy / base.accuracy) : json(nullptr)},
            {"kept_base_correct", f.kept_base_correct},
            {"new_correct", f.new_correct}};
}

// A row over every task ("all"), then one per domain where the tasks have domains.
void add_rows(json & rows, const std::string & map, const std::string & criterion, int64_t k, const EvalTaskFigures & f,
              const EvalTaskFigures & base) {
    rows.push_back(task_row(map, criterion, k, "all", f, base));
    for (const EvalTaskDomain & d : f.domains) {
        const auto b = std::find_if(base.domains.begin(), base.domains.end(),
                                    [&](const EvalTaskDomain & x) { return x.domain == d.domain; });
        rows.push_back(task_row(map, criterion, k, d.domain, d.figures, b == base.domains.end() ? d.figures : b->figures));
    }
}

json task_rows(const EvalFile & eval, int64_t n_expert) {
    json rows = json::array();
    if (!eval.base_tasks) {
        return rows;
    }
    add_rows(rows, "base", "", n_expert, *eval.base_tasks, *eval.base_tasks);
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind == "keep" && c.tasks) {
            const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
            add_rows(rows, keep_map_label(map.first, map.second), map.first, map.second, *c.tasks, *eval.base_tasks);
        }
    }
    return rows;
}

json task_charts(const json & rows) {
    json maps = json::array();
    for (const json & r : rows) {
        if (!r.at("criterion").get<std::string>().empty()) {
            maps.push_back(r);
        }
    }
    json charts = json::object();
    if (maps.empty()) {
        return charts;
    }
    charts["accuracy_vs_k"] = chart(
        "Task accuracy by K and criterion (per domain)", maps,
        {{"mark", {{"type", "line"}, {"point", true}}},
         {"encoding", {{"x", {{"field", "k"}, {"type", "quantitative"}, {"title", "experts kept per layer (K)"}}},
                       {"y", {{"field", "accuracy"}, {"type", "quantitative"}, {"title", "accuracy"}}},
                       {"color", {{"field", "criterion"}, {"type", "nominal"}}},
                       {"strokeDash", {{"field", "domain"}, {"type", "nominal"}}},
                       {"tooltip", json::array({{{"field", "criterion"}}, {{"field", "k"}}, {{"field", "domain"}},
                                                {{"field", "accuracy"}}, {{"field", "stderr"}}, {{"field", "tasks"}}})}}}});
    return charts;
}

std::string task_table(const ReportData & d) {
    json rows = json::array(), domains = json::array();
    for (const json & r : d.rows.at("tasks")) {
        (r.at("domain") == "all" ? rows : domains).push_back(r);
    }
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
    body += "</table>\n";
    if (!domains.empty()) {
        body += "<p>Per domain of the held-out text the tasks were made from (chance is 25%):</p>\n<table><tr><th>model</th>"
                "<th>domain</th><th>tasks</th><th>accuracy</th><th>of the base's</th><th>base's kept</th><th>new</th></tr>";
        for (const json & r : domains) {
            body += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1f}% ± {:.1f}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                                html_escape(r.at("map").get<std::string>()), html_escape(r.at("domain").get<std::string>()),
                                r.at("tasks").get<int64_t>(), 100 * r.at("accuracy").get<double>(),
                                100 * r.at("stderr").get<double>(),
                                r.at("of_base").is_null() ? std::string("-")
                                                          : fmt::format("{:.0f}%", 100 * r.at("of_base").get<double>()),
                                r.at("kept_base_correct").get<int64_t>(), r.at("new_correct").get<int64_t>());
        }
        body += "</table>\n";
    }
    if (rows.size() == 1) {
        return body;   // the base alone
    }
    return body + chart_place("accuracy_vs_k", "Task accuracy against K",
                              "Keep maps masked inside the original model, answering the same tasks (report/tasks.csv).");
}

} // namespace

ReportSection tasks_section() {
    return {.id = "tasks",
            .csv_columns = {"map", "criterion", "k", "domain", "tasks", "correct", "accuracy", "stderr", "of_base",
                            "kept_base_correct", "new_correct"},
            .rows = [](ReportData & d) {
                const json rows = task_rows(d.eval, d.plan.n_expert);
                d.report["tasks"] = rows.empty() ? json(nullptr)
                                                 : json{{"format", d.eval.task_format}, {"file", d.eval.task_file},
                                                        {"rows", rows}};
                return rows;
            },
            .charts = task_charts,
            .html = task_table};
}

} // namespace moeprune
