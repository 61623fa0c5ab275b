// What collect checks of its statistics before it writes them (counts against tokens,
// probabilities against tokens, the trace against the counts), and what it records of the run.
#include "collect/collect_run.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace moeprune::collect_impl {

// Invariants, recorded in the file and fatal when broken.
std::vector<Invariant> check_invariants(const SaliencyStats & stats, const InspectReport & info,
                                        const std::vector<int> & moe_layers, const Collector & collector,
                                        const fs::path & trace_partial, bool traced, const CollectResult & res) {
    std::vector<Invariant> inv;
    const uint64_t k = uint64_t(info.n_expert_used);
    for (size_t l = 0; l < stats.layers.size(); ++l) {
        uint64_t picks = 0;
        double prob = 0;
        for (size_t e = 0; e < size_t(info.n_expert); ++e) {
            picks += stats.layers[l].count[e];
            prob += stats.layers[l].prob_sum[e];
        }
        if (picks != stats.n_tokens * k) {
            inv.push_back({"count_sum", false, fmt::format("layer {}: sum of counts {} != tokens {} x k {}", moe_layers[l],
                                                           picks, stats.n_tokens, k)});
        }
        const Gating g = collector.gating();
        const uint64_t finite_tokens = stats.n_tokens - collector.prob_drops()[l];
        if ((g == Gating::Softmax || g == Gating::SoftmaxWeight) &&
            std::fabs(prob - double(finite_tokens)) > 1e-3 * double(std::max<uint64_t>(1, finite_tokens))) {
            inv.push_back({"prob_sum", false, fmt::format("layer {}: sum of router probabilities {} != tokens {}",
                                                          moe_layers[l], prob, finite_tokens)});
        }
    }
    if (traced) {
        const TraceReader reader = TraceReader::open(trace_partial);
        for (uint32_t l = 0; l < reader.header().n_layer; ++l) {
            std::vector<uint64_t> recount(static_cast<size_t>(info.n_expert), 0);
            reader.for_each_layer_chunk(l, [&](uint64_t, uint32_t n, const uint16_t * ids, const float *) {
                for (uint32_t t = 0; t < n; ++t) {
                    for (uint64_t j = 0; j < k; ++j) {
                        ++recount[ids[size_t(t) * reader.header().top_m + j]];
                    }
                }
            });
            if (recount != collector.trace_count()[l] || reader.n_tokens() != res.traced_tokens) {
                inv.push_back({"trace_counts", false,
                               fmt::format("layer {}: the trace's top-{} counts differ from the statistics over its {} "
                                           "tokens", moe_layers[l], k, res.traced_tokens)});
            }
        }
    }
    return inv;
}

// What the statistics record of how the run went: gating, the expert-output node,
// ignored second routings, the output head, timing and the invariants.
void record_run(SaliencyStats & stats, CollectResult & res, const Collector & collector, const std::string & down_node,
                double seconds, const std::vector<Invariant> & inv) {
    const bool ok = inv.empty();
    stats.settings["gating"] = gating_name(collector.gating());
    stats.settings["expert_output_node"] = down_node;
    // Second routings of a layer within one graph (grovemoe's adjugate experts) were not counted.
    stats.settings["repeated_routings_ignored"] = collector.repeat_routings();
    // This process's forward passes only: a resumed run times what it evaluated.
    // Skipped on every evaluation unless --generate samples from the logits.
    res.head_skipped = res.decodes > 0 && collector.head_stops() >= res.decodes;
    stats.settings["output_head"] = res.head_skipped ? "skipped" : "computed";
    stats.settings["timing"] = {{"tokens", res.tokens}, {"seconds", seconds},
                                {"tok_per_s", seconds > 0 ? double(res.tokens) / seconds : 0.0}};
    stats.settings["invariants"] = {{"ok", ok},
                                    {"checked", {"count_sum", "prob_sum (softmax gating)", "trace_counts"}},
                                    {"violations", json::array()}};
    for (const Invariant & i : inv) {
        stats.settings["invariants"]["violations"].push_back({{"name", i.name}, {"detail", i.detail}});
    }
}

// Broken invariants stop the run, the statistics kept beside the output for inspection.
void refuse_broken_invariants(const CollectOptions & opt, const SaliencyStats & stats,
                              const std::vector<Invariant> & inv) {
    if (!inv.empty()) {
        std::filesystem::path bad = opt.output;
        bad += ".invalid";
        write_stats(bad, stats);
        throw Error(fmt::format("{} invariant(s) broken, statistics kept in {} for inspection: {}", inv.size(),
                                bad.string(), inv.front().detail));
    }
}

} // namespace moeprune::collect_impl
