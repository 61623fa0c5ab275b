#pragma once
// The deliberately simple replay the engine is checked against: one configuration,
// the whole trace in memory, eager decay, scans over every expert, no cleverness.
// Semantics: docs/replay.md.
#include "sim/policy.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moeprune::test {

// A trace after the keep map: per token and layer the surviving candidates (ids as in
// the sliced model, 0..n_expert-1), best first, with their logits.
struct RefTrace {
    int n_layer = 0, n_expert = 0, k = 0;
    std::vector<std::vector<std::vector<int32_t>>> ranked;   // [token][layer][rank]
    std::vector<std::vector<std::vector<float>>> logits;     // [token][layer][rank]
    std::vector<int32_t> seq;                                // [token] sequence id
    std::vector<char> decode;                                // [token] 1 = decode phase
};

struct RefConfig {
    std::string policy;
    std::vector<int> capacity;      // slots per layer (n_layer entries), or one entry with global
    bool global = false;
    double lambda = 0.0;
    int j = 2;
    std::string moce = "prior";     // "prior" or "topk-gap"
    uint64_t warmup = 0;
    bool reset_on_session = false;
    int prefill_union = 0;          // batch size; 0 = off
    int prefetch_n = 0;             // experts predicted per layer; 0 = no prefetch
    uint64_t prefetch_train = 0;    // learn co-occurrence from tokens before this one only; 0 = all
    int queue_depth = 32;
    PolicyParams params;
};

struct RefCounts {
    uint64_t tokens = 0, picks = 0, misses = 0, forced = 0, swaps = 0;
    double moved_mass = 0;          // summed over counted (token, layer) pairs
    uint64_t predicted = 0, predicted_chosen = 0, hidden = 0, prefetch_loads = 0;
    uint64_t rounds = 0;            // sum over requests of ceil(exposed misses / queue depth)
    std::vector<uint64_t> exposed_per_layer;   // misses + forced - hidden, per layer
};

struct RefResult {
    RefCounts prefill, decode;
};

RefResult reference_replay(const RefTrace & trace, const RefConfig & config);

} // namespace moeprune::test
