#pragma once
// The measured child process of `measure`: a fresh process per run, so that what it maps,
// faults and allocates is all charged to its own memory cgroup and counted by its own
// counters. It decodes as llama.cpp generates (one token per llama_decode, the model
// mapped as llama.cpp maps it by default), or probes the storage under the model.
#include "core/defaults.h"
#include "model/inspect.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct WorkerSpec {
    std::string mode;                 // "decode" or "probe"
    std::string label;                // progress label, e.g. "measure 512 MiB"
    std::filesystem::path model;
    int threads = 1;
    // decode: `warmup` untimed tokens, then the timed ones, at positions 0.. of one sequence.
    std::vector<int32_t> tokens;
    int warmup = 0;
    // decode: the timed tokens are decoded again (from an empty context) until this much
    // decode is timed; each token's time is then its median over the passes.
    double min_seconds = 0;
    int ctx = 0;
    bool repack = true;               // llama.cpp's default: weights it can repack are copied into memory
    // decode: after every `residency_every`-th timed token (0: never), which of
    // `residency_experts` (the measure process's routed_expert_slabs of `shards`) are wholly
    // in the page cache, by mincore() on a mapping of the worker's own that faults nothing.
    // Given rather than read from the model here, so that the worker's own memory is what
    // the resident run measured.
    int residency_every = 0;
    std::vector<std::vector<ExpertSlab>> residency_experts;
    std::vector<std::filesystem::path> shards;
    // decode: when `trace_all` is set, a second pass under a router tap writes the routing
    // of every token there and of the timed ones to `trace` (when set): the resident run,
    // warm from llama.cpp's prefetch at load.
    std::filesystem::path trace, trace_all;
    int trace_top = kDefaultTraceTop;
    nlohmann::json trace_meta = nlohmann::json::object();
    // probe: random routed experts (every slab of each) read through page faults, until
    // `probe_bytes` have been asked for, then the same reads simulated (sim/page_cache.h)
    // over a page cache of `probe_cache_bytes` and the device's read-around.
    uint64_t probe_bytes = 0;
    uint64_t seed = 0;
    uint64_t probe_cache_bytes = 0, readaround_bytes = 0;
};

nlohmann::json to_json(const WorkerSpec & s);
WorkerSpec worker_spec_from_json(const nlohmann::json & j, const std::string & origin);

// Runs the spec in this process and returns what it measured (docs/formats.md, "measure").
nlohmann::json run_worker(const WorkerSpec & spec);

} // namespace moeprune
