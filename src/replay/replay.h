#pragma once
// Replays a router trace through expert caches: per layer, each token's top-k
// (re-chosen among a keep map's survivors when one is given) is looked up in a
// cache of C experts run by an eviction policy; misses are what an SSD must serve.
// Layers run in parallel and every configuration advances in the same pass over a
// layer's tokens.
#include "replay/policy.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct ReplayOptions {
    std::filesystem::path trace;
    std::filesystem::path keep;        // optional
    std::vector<std::string> policies;
    std::vector<int> caches;           // experts per layer
    int k = 0;                         // experts per token; 0: the trace's meta.n_expert_used
    uint64_t warmup = 0;               // tokens replayed but not counted
    bool reset_on_session = false;     // empty every cache when the sequence id changes
    int threads = 0;                   // workers over layers; 0: one per core
    PolicyParams params;
};

struct PhaseCounts {
    uint64_t tokens = 0, picks = 0, misses = 0, forced_misses = 0;
};

struct ReplayRecord {
    std::string policy;
    int cache = 0;
    PhaseCounts prefill, decode;
    PhaseCounts total() const;
};

struct ReplayReport {
    nlohmann::json inputs;   // trace, keep map, k, warmup, settings
    int n_layer = 0, k = 0;
    uint64_t trace_tokens = 0;
    std::vector<ReplayRecord> records;
};

ReplayReport run_replay(const ReplayOptions & opt);
nlohmann::json to_json(const ReplayReport & r);
std::string to_text(const ReplayReport & r);

} // namespace moeprune
