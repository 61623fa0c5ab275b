#include "sim/throughput.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moeprune {

double token_seconds(const TokenTraffic & io, size_t n_layer, const ThroughputParams & p) {
    const double bw = p.ssd_gbps * 1e9, compute = p.compute_ms * 1e-3;
    const double read = io.exposed_bytes / bw + io.rounds * p.read_latency_us * 1e-6;
    const double staged = io.prefetched_bytes / bw;
    return compute + double(n_layer) * p.sync_us * 1e-6 + read + std::max(0.0, staged - compute);
}

double tokens_per_step(double acceptance, int draft_tokens) {
    double tokens = 1, p = 1;
    for (int i = 0; i < draft_tokens; ++i) {
        p *= acceptance;
        tokens += p;
    }
    return tokens;
}

double speculative_step_seconds(const TokenTraffic & trunk, size_t n_layer, const DraftStep & d,
                                const ThroughputParams & p) {
    const double positions = 1.0 + d.draft_tokens, caught_up = tokens_per_step(d.acceptance, d.draft_tokens);
    const TokenTraffic io{trunk.exposed_bytes * positions + d.mtp.exposed_bytes * caught_up,
                          trunk.rounds * positions + d.mtp.rounds * caught_up,
                          trunk.prefetched_bytes * positions + d.mtp.prefetched_bytes * caught_up};
    ThroughputParams step = p;
    if (n_layer > 0) {
        step.compute_ms = p.compute_ms * (1.0 + double(d.draft_tokens) * double(d.mtp_layers) / double(n_layer));
    }
    return token_seconds(io, n_layer + d.mtp_layers, step);
}

double speculative_tokens_per_second(const TokenTraffic & trunk, size_t n_layer, const DraftStep & d,
                                     const ThroughputParams & p) {
    const double t = speculative_step_seconds(trunk, n_layer, d, p);
    return t > 0 ? tokens_per_step(d.acceptance, d.draft_tokens) / t : std::numeric_limits<double>::infinity();
}

void PhaseCounts::add(const PhaseCounts & o) {
    tokens += o.tokens;
    picks += o.picks;
    misses += o.misses;
    forced_misses += o.forced_misses;
    swaps += o.swaps;
    moved_mass += o.moved_mass;
    predicted += o.predicted;
    predicted_chosen += o.predicted_chosen;
    hidden += o.hidden;
    prefetch_loads += o.prefetch_loads;
    rounds += o.rounds;
    exposed_bytes += o.exposed_bytes;
    prefetch_bytes += o.prefetch_bytes;
}

double tokens_per_second(const PhaseCounts & c, int n_layer, const ThroughputParams & p) {
    if (c.tokens == 0) {
        return 0.0;
    }
    const double tokens = double(c.tokens);
    const double t = token_seconds({c.exposed_bytes / tokens, double(c.rounds) / tokens, c.prefetch_bytes / tokens},
                                   size_t(n_layer), p);
    return t > 0 ? 1.0 / t : std::numeric_limits<double>::infinity();
}

double read_rounds(double misses, int queue_depth) { return std::ceil(misses / double(queue_depth)); }

double read_rounds_spread(double misses, size_t n_layer, int queue_depth) {
    return double(n_layer) * read_rounds(misses / double(n_layer), queue_depth);
}

void PhaseCounts::add_exposed_reads(uint64_t exposed, int queue_depth, double expert_bytes) {
    if (exposed > 0) {
        rounds += uint64_t(read_rounds(double(exposed), queue_depth));
        exposed_bytes += double(exposed) * expert_bytes;
    }
}

nlohmann::json to_json(const ThroughputParams & p) {
    return {{"ssd_gbps", p.ssd_gbps},
            {"read_latency_us", p.read_latency_us},
            {"queue_depth", p.queue_depth},
            {"compute_ms", p.compute_ms},
            {"sync_us", p.sync_us}};
}

} // namespace moeprune
