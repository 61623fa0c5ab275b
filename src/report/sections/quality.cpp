// Quality: KLD against the original model per criterion, K and domain.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

namespace {

json kld_rows(const EvalFile & eval, int64_t n_expert) {
    json kld_rows = json::array();
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind != "keep") {
            continue;
        }
        // Named, not bound: a lambda of clang 15 cannot capture a structured binding.
        const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
        const std::string & criterion = map.first;
        const int64_t k = map.second;
        const auto row = [&](const std::string & domain, const EvalFigures & st) {
            kld_rows.push_back({{"criterion", criterion},
                                {"k", k},
                                {"domain", domain},
                                {"kld_mean", or_null(st.kld_mean)},
                                {"kld_p99", or_null(st.kld_p99)},
                                {"same_top1", or_null(st.same_top1)},
                                {"tokens", st.tokens}});
        };
        row("all", c.all);
        for (const auto & [d, st] : c.domains) {
            row(d, st);
        }
    }
    return kld_rows;
}

json quality_charts(const json & kld_rows) {
    json charts = json::object();
    charts["kld_vs_k"] = chart("Mean KLD against the original model, by K and criterion (per domain)", kld_rows,
                               {{"mark", {{"type", "line"}, {"point", true}}},
                                {"encoding", {{"x", {{"field", "k"}, {"type", "quantitative"}, {"title", "experts kept per layer (K)"}}},
                                              {"y", {{"field", "kld_mean"}, {"type", "quantitative"}, {"title", "mean KLD (nats)"}}},
                                              {"color", {{"field", "criterion"}, {"type", "nominal"}}},
                                              {"strokeDash", {{"field", "domain"}, {"type", "nominal"}}},
                                              {"tooltip", json::array({{{"field", "criterion"}}, {{"field", "k"}}, {{"field", "domain"}},
                                                                       {{"field", "kld_mean"}}, {{"field", "same_top1"}}})}}}});
    return charts;
}

} // namespace

ReportSection quality_section() {
    return {.id = "kld",
            .csv_columns = {"criterion", "k", "domain", "kld_mean", "kld_p99", "same_top1", "tokens"},
            .csv_when_empty = true,
            .rows = [](ReportData & d) { return d.report["kld"] = kld_rows(d.eval, d.plan.n_expert); },
            .charts = quality_charts,
            .html = [](const ReportData &) {
                return chart_place("kld_vs_k", "Quality cost",
                                   "Keep maps masked inside the original model, scored on the held-out side (report/kld.csv).");
            }};
}

} // namespace moeprune
