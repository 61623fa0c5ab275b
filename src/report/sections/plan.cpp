// The plan: every option's speed, RAM and quality, the Pareto front and the recommendation.
#include "report/html.h"
#include "report/section.h"

#include <fmt/format.h>

#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

json plan_rows(const PlanFile & plan) {
    json plan_rows = json::array();
    const std::set<size_t> front(plan.pareto.begin(), plan.pareto.end());
    for (size_t i = 0; i < plan.options.size(); ++i) {
        const PlanOption & o = plan.options[i];
        json row = to_json(o);
        row["option"] = i;
        row["resident_gb"] = o.resident_bytes ? json(*o.resident_bytes / 1e9) : json(nullptr);
        row["pareto"] = front.count(i) > 0;
        row["recommended"] = plan.recommended == i;
        row["label"] = plan_option_label(o);
        row["mtp_acceptance"] = o.mtp_draft ? or_null(o.mtp_draft->acceptance) : json();
        row["mtp_tok_per_s"] = o.mtp_draft ? or_null(o.mtp_draft->tok_per_s) : json();
        plan_rows.push_back(row);
    }
    return plan_rows;
}

json plan_charts(const json & plan_rows) {
    json charts = json::object();
    charts["speed_vs_ram"] = chart(
        "Tokens/s against resident RAM: every feasible option, the Pareto front (line) and the recommendation (star)", plan_rows,
        {{"layer", json::array({{{"mark", {{"type", "point"}, {"filled", true}, {"opacity", 0.6}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}, {"title", "resident GB"},
                                                      {"scale", {{"zero", false}}}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}, {"title", "tokens/s"}}},
                                               {"color", {{"field", "kld_mean"}, {"type", "quantitative"}, {"title", "mean KLD"}}},
                                               {"tooltip", json::array({{{"field", "label"}}, {{"field", "tok_per_s"}}, {{"field", "kld_mean"}}})}}}},
                                {{"transform", json::array({{{"filter", "datum.pareto"}}})},
                                 {"mark", {{"type", "line"}, {"color", "#444"}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}}},
                                               {"order", {{"field", "resident_gb"}}}}}},
                                {{"transform", json::array({{{"filter", "datum.recommended"}}})},
                                 {"mark", {{"type", "point"}, {"shape", "diamond"}, {"size", 300}, {"color", "#d62728"}, {"filled", true}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}}}}}}})}});
    return charts;
}

} // namespace

ReportSection plan_section() {
    return {.id = "plan",
            .csv_columns = {"option", "k", "criterion", "policy", "cache_experts", "cache_scope", "lambda", "routed_bytes",
                            "resident_bytes", "misses_per_token", "tok_per_s", "kld_mean", "kld_measured", "pareto",
                            "recommended", "mtp_acceptance", "mtp_tok_per_s", "runs_on"},
            .csv_when_empty = true,
            .rows = [](ReportData & d) {
                d.report["plan"] = d.plan.document;
                return plan_rows(d.plan);
            },
            .charts = plan_charts,
            .html = [](const ReportData &) {
                return chart_place("speed_vs_ram", "Speed, RAM and quality", "From the plan (plan/plan.json, report/plan.csv).");
            }};
}

} // namespace moeprune
