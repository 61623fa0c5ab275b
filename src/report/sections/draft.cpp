// A model with an MTP head: the front's options with and without one draft token per step.
#include "report/html.h"
#include "report/section.h"

#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

// A model with an MTP head: each option of the front, and the recommendation, with and
// without one draft token per step.
std::string draft_html(const PlanFile & plan, const PlanInputFigures & inputs) {
    if (inputs.mtp_layers == 0) {
        return "";
    }
    std::string body = "<h2>With and without the MTP draft</h2>\n<p>Speculative decoding with the model's MTP head "
                       "drafting one token per step: tokens per step = 1 + acceptance, at the cost of a step that "
                       "verifies two positions and runs the head (plan.json's mtp_draft; report/plan.csv's mtp_* "
                       "columns). Acceptance is what eval measured for the keep map; a blank is not measured.</p>\n"
                       "<table><tr><th>option</th><th>tokens/s</th><th>acceptance</th><th>tokens/s with the draft</th>"
                       "<th>source</th></tr>";
    const std::set<size_t> front(plan.pareto.begin(), plan.pareto.end());
    for (size_t i = 0; i < plan.options.size(); ++i) {
        const bool recommended = plan.recommended == i;
        if (!front.count(i) && !recommended) {
            continue;
        }
        const PlanOption & o = plan.options[i];
        const std::optional<PlanDraft> & d = o.mtp_draft;
        body += "<tr><td>" + html_escape(plan_option_label(o)) + (recommended ? " (recommended)" : "") + "</td><td>" +
                cell(or_null(o.tok_per_s)) + "</td><td>" + cell(d ? or_null(d->acceptance) : json()) + "</td><td>" +
                cell(d ? or_null(d->tok_per_s) : json()) + "</td><td>" +
                cell(d ? or_null(d->acceptance_source) : json()) + "</td></tr>";
    }
    return body + "</table>\n";
}

} // namespace

ReportSection draft_section() {
    return {.id = "draft", .html = [](const ReportData & d) { return draft_html(d.plan, d.plan_inputs); }};
}

} // namespace moeprune
