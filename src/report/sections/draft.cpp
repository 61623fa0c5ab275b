// A model with an MTP head: the front's options with and without one draft token per step.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

namespace {

// A model with an MTP head: each option of the front, and the recommendation, with and
// without one draft token per step.
std::string draft_html(const json & plan_rows, const PlanInputFigures & plan) {
    if (plan.mtp_layers == 0) {
        return "";
    }
    std::string body = "<h2>With and without the MTP draft</h2>\n<p>Speculative decoding with the model's MTP head "
                       "drafting one token per step: tokens per step = 1 + acceptance, at the cost of a step that "
                       "verifies two positions and runs the head (plan.json's mtp_draft; report/plan.csv's mtp_* "
                       "columns). Acceptance is what eval measured for the keep map; a blank is not measured.</p>\n"
                       "<table><tr><th>option</th><th>tokens/s</th><th>acceptance</th><th>tokens/s with the draft</th>"
                       "<th>source</th></tr>";
    for (const json & row : plan_rows) {
        if (!row["pareto"].get<bool>() && !row["recommended"].get<bool>()) {
            continue;
        }
        const json draft = row.value("mtp_draft", json::object());
        body += "<tr><td>" + html_escape(row["label"].get<std::string>()) + (row["recommended"].get<bool>() ? " (recommended)" : "") +
                "</td><td>" + cell(row.value("tok_per_s", json())) + "</td><td>" + cell(row["mtp_acceptance"]) + "</td><td>" +
                cell(row["mtp_tok_per_s"]) + "</td><td>" +
                cell(draft.value("acceptance_source", draft.value("note", json()))) + "</td></tr>";
    }
    return body + "</table>\n";
}

} // namespace

ReportSection draft_section() {
    return {.id = "draft", .html = [](const ReportData & d) { return draft_html(d.rows.at("plan"), d.plan_inputs); }};
}

} // namespace moeprune
