// Predicted against measured: llama.cpp's decode under each memory limit measure ran it
// under, beside what moeprune predicted for it.
#include "report/html.h"
#include "report/section.h"

#include <fmt/format.h>

namespace moeprune {

using nlohmann::json;

namespace {

const std::vector<std::string> kMeasuredColumns = {
    "ram", "limit_bytes", "predicted_tok_per_s", "measured_tok_per_s", "error", "predicted_read_bytes_per_token",
    "measured_read_bytes_per_token", "predicted_faults_per_token", "measured_major_faults_per_token", "outside_model"};

// Every limit `measure` ran llama.cpp under, its prediction beside it.
json measured_rows(const MeasureReport & m) {
    json rows = json::array();
    for (const MeasuredRun & r : m.runs) {
        const DecodeFigures & d = r.decode;
        const auto predicted = [&](double v) { return r.predicted ? json(v) : json(nullptr); };
        rows.push_back({{"ram", r.ram},
                        {"limit_bytes", r.limit_bytes},
                        {"predicted_tok_per_s", predicted(r.prediction.tokens_per_second)},
                        {"measured_tok_per_s", d.tokens_per_second},
                        {"error", r.predicted ? json(r.error) : json(nullptr)},
                        {"predicted_read_bytes_per_token", predicted(r.prediction.read_bytes_per_token)},
                        {"measured_read_bytes_per_token",
                         d.read_bytes_per_token < 0 ? json(nullptr) : json(d.read_bytes_per_token)},
                        {"predicted_faults_per_token", predicted(r.prediction.faults_per_token)},
                        {"measured_major_faults_per_token", d.major_faults_per_token},
                        {"outside_model", r.predicted && !r.prediction.outside_model.empty()
                                              ? json(r.prediction.outside_model) : json(nullptr)}});
    }
    return rows;
}

std::string measured_html(const json & rows, const PlanInputFigures & plan) {
    std::string body = "<h2>Predicted vs measured</h2>\n";
    if (rows.empty()) {
        return body + "<p>Nothing measured in this run (run --measure): every tokens/s here rests on the guessed SSD "
                      "bandwidth and compute time below.</p>\n";
    }
    body += "<p>llama.cpp's own decode of the whole model under each memory limit (moeprune measure, measure/measure.json), "
            "beside what moeprune predicts for it from the resident run, the router trace and the read rate llama.cpp "
            "met under the other limits at the same read-ahead (the storage probe's where none other streamed), never "
            "from that limit's own run (report/measured.csv). Error is |predicted - measured| / measured tokens/s";
    if (plan.measured_median_error && plan.measured_max_error) {
        body += fmt::format(": median {:.0f}%, max {:.0f}%", 100 * *plan.measured_median_error,
                            100 * *plan.measured_max_error);
    }
    body += ".</p>\n";
    for (const json & row : rows) {
        if (!row["outside_model"].is_null()) {
            body += "<p class=\"warning\"><b>At " + html_escape(row["ram"].get<std::string>()) +
                    ", the prediction is not an answer:</b> " + html_escape(row["outside_model"].get<std::string>()) +
                    "</p>\n";
        }
    }
    return body + rows_table(rows, kMeasuredColumns);
}

} // namespace

ReportSection measured_section() {
    return {.id = "measured",
            .csv_columns = kMeasuredColumns,
            .rows = [](ReportData & d) {
                const json rows = d.measure ? measured_rows(d.measure->report) : json::array();
                d.report["measured"] = rows.empty() ? json(nullptr) : rows;
                return rows;
            },
            .html = [](const ReportData & d) { return measured_html(d.rows.at("measured"), d.plan_inputs); }};
}

} // namespace moeprune
