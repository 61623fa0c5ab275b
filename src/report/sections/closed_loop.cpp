// Cache-aware routing (λ > 0) in the closed loop, beside the open-loop replay of the same tokens.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::vector<std::string> kClosedColumns = {"map", "policy", "cache", "lambda", "kld_mean", "same_top1",
                                                 "misses_per_token", "open_loop_misses_per_token", "tok_per_s",
                                                 "open_loop_tok_per_s"};

// Cache-aware routing (λ > 0) in the closed loop, beside the open-loop replay of the
// same tokens: the difference is the open-loop error.
json closed_loop_rows(const std::vector<fs::path> & evals, int64_t n_expert) {
    json rows = json::array();
    for (const fs::path & p : evals) {
        for (const EvalFileCandidate & c : read_eval_report(p).candidates) {
            if (c.kind != "closed-loop") {
                continue;
            }
            const auto [criterion, k] = map_name(c.keep.value_or(""), n_expert);
            rows.push_back({{"map", map_label(criterion, k)},
                            {"criterion", criterion},
                            {"k", k},
                            {"policy", c.policy},
                            {"cache", c.cache},
                            {"lambda", c.lambda},
                            {"kld_mean", or_null(c.all.kld_mean)},
                            {"same_top1", or_null(c.all.same_top1)},
                            {"misses_per_token", or_null(c.loop.misses_per_token)},
                            {"open_loop_misses_per_token", or_null(c.loop.open_loop_misses_per_token)},
                            {"tok_per_s", or_null(c.loop.tok_per_s)},
                            {"open_loop_tok_per_s", or_null(c.loop.open_loop_tok_per_s)}});
        }
    }
    return rows;
}

std::string closed_loop_html(const json & closed_rows) {
    std::string body = "<h2>Open- vs closed-loop cache routing</h2>\n";
    if (closed_rows.empty()) {
        body += "<p>Not measured in this run (no λ > 0 asked for): every cache figure here is open-loop (the trace was "
                "recorded with the unbiased router).</p>\n";
    } else {
        body += "<p>Cache-aware routing (λ > 0) measured in the closed loop: the model routed with its cache, KLD against "
                "the unbiased base, misses beside the open-loop replay of the base pass's trace (report/closed_loop.csv). "
                "The plan gives these options only their closed-loop KLD.</p>\n";
        body += rows_table(closed_rows, kClosedColumns);
    }
    return body;
}

} // namespace

ReportSection closed_loop_section() {
    return {.id = "closed_loop",
            .csv_columns = kClosedColumns,
            .rows = [](ReportData & d) {
                const json rows = closed_loop_rows(d.in.closed_loop_evals, d.plan.n_expert);
                d.report["closed_loop"] = rows.empty() ? json(nullptr) : rows;
                return rows;
            },
            .html = [](const ReportData & d) { return closed_loop_html(d.rows.at("closed_loop")); }};
}

} // namespace moeprune
