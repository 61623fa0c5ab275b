#pragma once
// Replays a router trace through expert caches: per layer (or in one cache shared by
// all layers), each token's top-k, re-chosen among a keep map's survivors and
// optionally biased toward cached experts (MoCE), is requested from a cache run by an
// eviction policy; misses are what storage must serve. Every configuration advances
// in one pass over a layer's tokens, layers in parallel. Semantics: docs/replay.md.
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "sim/policy.h"
#include "sim/throughput.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct ReplayOptions {
    std::filesystem::path trace;
    const TraceSource * trace_source = nullptr;  // a trace in memory (eval's closed loop): used instead of `trace`
    std::filesystem::path keep;           // optional
    std::optional<KeepMap> keep_map;      // read and checked by the caller (eval): used instead of reading `keep`,
                                          // which then only names it
    std::vector<std::string> policies;
    std::vector<int> caches;              // slots per layer (per cache with global)
    std::vector<double> cache_mib;        // budgets, converted with the bytes of an expert
    std::filesystem::path model;          // bytes per expert from this GGUF
    double expert_mb = 0;                 // or this (10^6 bytes) for every layer
    bool global = false;
    std::vector<double> lambdas{0.0};
    std::optional<int> j;                 // MoCE's J; unset: 2, or k - 1 when k <= 2 (moce_j)
    std::string moce = "prior";           // "prior" or "topk-gap"
    int k = 0;                            // experts per token; 0: the trace's meta.n_expert_used
    uint64_t warmup = 0;                  // tokens replayed but not counted
    bool reset_on_session = false;        // empty every cache when the sequence id changes
    int prefill_union = 0;                // prefill batch size; 0: every token its own request
    bool prefetch = false;                // next-layer prefetch
    int prefetch_n = 0;                   // experts staged per layer; 0: k
    uint64_t prefetch_train = 0;          // learn from the first N tokens only; 0: from every earlier token
    int threads = 0;                      // workers over layers; 0: one per core
    PolicyParams params;
    ThroughputParams throughput;
};

struct ReplayRecord {
    std::string policy;
    std::optional<int> cache;             // slots as given
    std::optional<double> cache_mib;      // budget as given
    std::vector<int> slots;               // per layer, or one entry with global
    double lambda = 0;
    bool cliff = false;                   // global cache below one token's working set
    PhaseCounts prefill, decode;
    std::vector<uint64_t> missed_by_layer;  // per-layer caches: misses and forced misses of each layer, counted tokens
    PhaseCounts total() const;
};

struct ReplayReport {
    nlohmann::json inputs;                // everything that produced the records
    int n_layer = 0, k = 0;
    uint64_t trace_tokens = 0;
    bool bytes_known = false;
    ThroughputParams throughput;
    std::vector<ReplayRecord> records;
};

// `outputs`: the files the caller will write from the report, refused when one is an input.
ReplayReport run_replay(const ReplayOptions & opt, const std::vector<std::filesystem::path> & outputs = {});
nlohmann::json to_json(const ReplayReport & r);
std::string to_text(const ReplayReport & r);
std::string to_csv(const ReplayReport & r);

} // namespace moeprune
