#include "sim/throughput.h"

#include <algorithm>

namespace moeprune {

double token_seconds(const TokenTraffic & io, size_t n_layer, const ThroughputParams & p) {
    const double bw = p.ssd_gbps * 1e9, compute = p.compute_ms * 1e-3;
    const double read = io.exposed_bytes / bw + io.rounds * p.read_latency_us * 1e-6;
    const double staged = io.prefetched_bytes / bw;
    return compute + double(n_layer) * p.sync_us * 1e-6 + read + std::max(0.0, staged - compute);
}

nlohmann::json to_json(const ThroughputParams & p) {
    return {{"ssd_gbps", p.ssd_gbps},
            {"read_latency_us", p.read_latency_us},
            {"queue_depth", p.queue_depth},
            {"compute_ms", p.compute_ms},
            {"sync_us", p.sync_us}};
}

} // namespace moeprune
