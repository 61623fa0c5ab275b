// Expert caches: misses per token per policy and size, for every keep map, Belady as the bound.
#include "report/html.h"
#include "report/section.h"

#include "sim/policy.h"

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json replay_rows(const std::vector<fs::path> & replays, int64_t n_expert, json & throughput_inputs,
                 std::optional<ThroughputFigures> & throughput) {
    json rows = json::array();
    for (const fs::path & p : replays) {
        const ReplayFile r = read_replay_report(p);
        const auto [criterion, k] = map_name(r.keep.value_or(""), n_expert);
        throughput_inputs = r.throughput;
        // The last replay's settings, as report.json's "throughput" holds them.
        throughput = r.throughput.is_null() ? std::nullopt
                                            : std::optional(read_throughput(r.throughput, {r.path, "inputs.throughput"}));
        for (const ReplayRecordFigures & rec : r.records) {
            rows.push_back({{"map", map_label(criterion, k)},
                            {"criterion", criterion},
                            {"k", k},
                            {"policy", rec.policy},
                            {"cache", rec.slots.at(0)},
                            {"lambda", rec.lambda},
                            {"misses_per_token", rec.misses_per_token},
                            {"hit_rate", or_null(rec.hit_rate)},
                            {"tokens_per_s", or_null(rec.tokens_per_s)},
                            {"bound", policy_reads_future(rec.policy) ? "Belady (offline bound)" : "online policy"}});
        }
    }
    return rows;
}

json replay_charts(const json & replay_rows) {
    json charts = json::object();
    charts["misses_vs_cache"] = chart("Misses per token against cache size, per policy (Belady dashed: the offline bound)", replay_rows,
                                      {{"facet", {{"field", "map"}, {"type", "nominal"}}},
                                       {"columns", 3},
                                       {"spec", {{"width", 220}, {"height", 160},
                                                 {"mark", {{"type", "line"}, {"point", true}}},
                                                 {"encoding", {{"x", {{"field", "cache"}, {"type", "quantitative"}, {"title", "experts cached per layer"}}},
                                                               {"y", {{"field", "misses_per_token"}, {"type", "quantitative"}}},
                                                               {"color", {{"field", "policy"}, {"type", "nominal"}}},
                                                               {"strokeDash", {{"field", "bound"}, {"type", "nominal"}}}}}}},
                                       {"resolve", {{"scale", {{"y", "independent"}}}}}});
    return charts;
}

} // namespace

ReportSection replay_section() {
    return {.id = "replay",
            .csv_columns = {"map", "criterion", "k", "policy", "cache", "lambda", "misses_per_token", "hit_rate",
                            "tokens_per_s"},
            .csv_when_empty = true,
            .rows = [](ReportData & d) {
                json throughput;
                d.report["replay"] = replay_rows(d.in.replays, d.plan.n_expert, throughput, d.replay_throughput);
                d.report["throughput"] = throughput;
                return d.report["replay"];
            },
            .charts = replay_charts,
            .html = [](const ReportData &) {
                return chart_place("misses_vs_cache", "Expert cache", "Replayed on the held-out router trace (report/replay.csv).");
            }};
}

} // namespace moeprune
