#include "report/report.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"
#include "report/html.h"
#include "report/section.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path chart_library_dir() { return fs::path(MOEPRUNE_VEGA_DIR); }

namespace {

// The chart library inlined into the page.
std::string chart_scripts() {
    std::string libs;
    for (const char * f : {"vega.min.js", "vega-lite.min.js", "vega-embed.min.js"}) {
        const fs::path p = chart_library_dir() / f;
        std::error_code ec;
        if (!fs::exists(p, ec)) {
            fail_file(p.string(), "is missing: the report's chart library is fetched by set-up (make build, scripts/fetch-vega.sh)");
        }
        std::string js = read_text_file(p);
        for (size_t at = js.find("</script"); at != std::string::npos; at = js.find("</script", at)) {
            js.replace(at, 2, "<\\/");
        }
        libs += "<script>" + js + "</script>\n";
    }
    return libs;
}

// The page: the chart library inlined, the sections' parts in order, every spec with its data.
std::string report_page(const std::string & body, const json & charts) {
    const std::string libs = chart_scripts();
    const std::string specs = script_json(charts);
    std::string page = "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>moeprune report</title>\n<style>"
                       "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
                       "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}"
                       "pre{background:#f6f6f6;padding:1em;overflow:auto}.why{font-size:1.1em}.chart{margin:1em 0}"
                       "#errors{color:#b00}.warning{color:#b00;border:2px solid #b00;padding:0.5em}</style>\n";
    page += libs;
    page += "</head><body data-charts=\"" + std::to_string(charts.size()) + "\" data-rendered=\"0\">\n" + body;
    page += "<pre id=\"errors\"></pre>\n<script>\nconst specs = " + specs + ";\n" + R"JS(
const errors = document.getElementById('errors');
window.addEventListener('error', e => { errors.textContent += 'error: ' + e.message + '\n'; });
let rendered = 0;
Promise.all(Object.entries(specs).map(([id, spec]) =>
  vegaEmbed('#' + id, spec, {renderer: 'svg', actions: false})
    .then(() => { rendered += 1; document.body.dataset.rendered = String(rendered); })
    .catch(e => { errors.textContent += id + ': ' + e + '\n'; })));
</script>
</body></html>
)JS";
    return page;
}

ReportData read_inputs(const ReportInputs & in) {
    ReportData d{.in = in,
                 .plan = read_plan_report(in.plan),
                 .corpus = read_corpus_report(in.corpus),
                 .eval = read_eval_report(in.eval),
                 .select = read_select_report(in.select)};
    d.plan_inputs = read_plan_inputs(d.plan);
    if (!in.measure.empty()) {
        d.measure = read_measure_report(in.measure);
    }
    return d;
}

} // namespace

std::vector<fs::path> write_report(const ReportInputs & in) {
    ReportData d = read_inputs(in);
    const fs::path data_dir = in.run_dir / "report";
    fs::create_directories(data_dir);
    std::vector<fs::path> written;
    json charts = json::object();
    std::string body;
    with_json_errors(in.plan.string(), [&] {
        for (const ReportSection & s : report_sections()) {
            const json rows = s.rows ? s.rows(d) : json::array();
            d.rows[s.id] = rows;
            if (!s.csv_columns.empty() && (s.csv_when_empty || !rows.empty())) {
                write_file_atomic(data_dir / (s.id + ".csv"), to_csv(rows, s.csv_columns));
                written.push_back(data_dir / (s.id + ".csv"));
            }
            if (s.charts) {
                charts.update(s.charts(rows));
            }
        }
        for (const ReportSection & s : report_sections()) {
            body += s.html(d);
        }
    });
    json report = d.report;
    report.update({{"format", "moeprune-report"}, {"version", 1}, {"config", in.config}, {"charts", charts}});
    write_file_atomic(in.run_dir / "report.json", report.dump(1) + "\n");
    written.push_back(in.run_dir / "report.json");
    write_file_atomic(in.run_dir / "report.html", report_page(body, charts));
    written.push_back(in.run_dir / "report.html");
    return written;
}

} // namespace moeprune
