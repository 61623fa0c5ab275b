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
#include <optional>
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

// What a probe run measured (the worker's result in probe mode; measure turns it into
// ProbeFigures).
struct ProbeResult {
    uint64_t experts = 0, bytes_needed = 0;
    std::optional<int64_t> bytes_read;      // none: the kernel keeps no per-process I/O counts
    uint64_t major_faults = 0;
    double seconds = 0;
    std::vector<double> expert_ms;          // each expert's read time, summed over its readers
    int threads = 1;
    // The device's sequential rate before it: bytes read directly (or buffered and dropped)
    // in `seconds`; none where the model has no expert tensor to read.
    struct Sequential {
        uint64_t bytes = 0;
        double seconds = 0;
        bool direct = true;
    };
    std::optional<Sequential> sequential;
    uint64_t simulated_faults = 0, simulated_read_bytes = 0;   // the same reads through sim/page_cache.h
    uint64_t checksum = 0;                  // of the bytes read, so that no read is optimized away
};

nlohmann::json to_json(const ProbeResult & r);
ProbeResult probe_result_from_json(const nlohmann::json & j, const std::string & origin);

nlohmann::json to_json(const WorkerSpec & s);
WorkerSpec worker_spec_from_json(const nlohmann::json & j, const std::string & origin);

// Runs the spec in this process and returns what it measured (docs/formats.md, "measure").
nlohmann::json run_worker(const WorkerSpec & spec);

} // namespace moeprune
