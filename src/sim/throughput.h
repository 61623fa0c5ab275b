#pragma once
// The one time model of a decoded token (docs/replay.md#throughput-model), used by
// replay's records, eval's closed loop and plan's options alike:
//   t = compute + layers * sync + exposed_bytes / bandwidth + rounds * latency
//       + max(0, prefetched_bytes / bandwidth - compute)
// Prefetched bytes overlap compute; only what outlasts it is paid.
#include <nlohmann/json.hpp>

#include <cstddef>

namespace moeprune {

struct ThroughputParams {
    double ssd_gbps = 6.8;        // sequential read bandwidth, 10^9 bytes/s
    double read_latency_us = 80;  // per round of reads
    int queue_depth = 32;         // reads in flight per round
    double compute_ms = 0;        // per token, all layers
    double sync_us = 0;           // per layer and token
};

// What storage serves for one token, averaged over the tokens counted.
struct TokenTraffic {
    double exposed_bytes = 0;     // read while the token waits
    double rounds = 0;            // rounds of reads, each paying the latency once
    double prefetched_bytes = 0;  // staged ahead, hidden behind compute where it fits
};

double token_seconds(const TokenTraffic & io, size_t n_layer, const ThroughputParams & p);

// The settings as every result file records them (replay, eval, plan).
nlohmann::json to_json(const ThroughputParams & p);

} // namespace moeprune
