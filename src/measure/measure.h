#pragma once
// What llama.cpp really does with a model larger than memory: its own decode (batch 1,
// one token per llama_decode, teacher-forced on a text, the model mapped as llama.cpp
// maps it) in a child process confined by a memory cgroup, once per RAM limit, with
// wall time, major faults and bytes read per token; once fully resident for compute
// time, with the router trace of the timed tokens; and a probe of the storage as the
// decode meets it (random experts through page faults). See docs/measure.md.
#include "measure/predict.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct MeasureOptions {
    std::filesystem::path model, text;
    // Limits of the whole child process: a size as plan reads one ("768M", "2G") or "P%": what stays
    // resident (measured) plus P% of the routed expert bytes.
    std::vector<std::string> ram = {"50%"};
    int tokens = 128;           // timed tokens per run
    int warmup = 32;            // untimed tokens decoded first in every run
    int ctx = 0;                // 0: warmup + tokens
    int threads = 0;            // 0: one per core
    int64_t probe_mib = 256;    // storage probe: MiB of random experts read; 0: no probe
    uint64_t seed = 1;          // the probe's order of experts
    bool repack = true;         // false: llama.cpp's --no-repack (weights stay mapped, as streaming needs)
    bool text_only = false;     // leave out a corpus' documents with media instead of refusing them (run)
    std::filesystem::path json_out, trace_out;
    std::filesystem::path worker_exe = "/proc/self/exe";   // the program that runs `measure-worker`
    // llama.cpp's llama-bench, run under every limit too (its text generation): the check that
    // measure's tokens/s are llama.cpp's. Empty: not run.
    std::filesystem::path llama_bench;
    double llama_bench_timeout = 0;   // seconds one llama-bench run may take; 0: from the model's size and measure's runs
};

// One --ram limit as written: bytes, or a share of the routed expert bytes above what
// stays resident. Refuses anything else, naming `flag`.
struct RamLimit {
    bool share = false;
    double value = 0;   // bytes, or percent
};
RamLimit parse_ram_limit(const std::string & text, const std::string & flag);

// Per-token figures of one decode run (the timed tokens).
struct DecodeFigures {
    uint64_t tokens = 0;
    double tokens_per_second = 0;
    double ms_mean = 0, ms_median = 0, ms_p90 = 0;
    double major_faults_per_token = 0;
    double read_bytes_per_token = -1;   // -1: the kernel keeps no per-process I/O counts
};

struct MeasuredRun {
    std::string ram;                 // as given; "resident" for the run without a limit
    uint64_t limit_bytes = 0;        // 0: no limit
    uint64_t cache_bytes = 0;        // the limit less what stays resident: the experts' share
    uint64_t peak_bytes = 0;         // the cgroup's most memory charged at once
    DecodeFigures decode;
    nlohmann::json detail;           // load, per-token series, the process's resident set
    bool predicted = false;          // a limited run, with a storage probe to calibrate reads
    StreamPrediction prediction;     // from the resident run, the probe and the trace only
    double error = 0;                // |predicted - measured| / measured tokens/s
    nlohmann::json llama_bench;      // llama-bench under the same limit; null when not run
    nlohmann::json residency;        // experts resident by mincore() against the simulation; null when not sampled
};

struct ProbeFigures {
    uint64_t limit_bytes = 0, experts = 0, bytes_needed = 0;
    int64_t bytes_read = -1;
    uint64_t major_faults = 0;
    int threads = 0;
    double seconds = 0;
    double effective_gbps = 0;         // bytes needed per second (10^9)
    double read_gbps = -1;             // bytes the device delivered per second
    double readahead_amplification = -1;   // bytes read per byte needed
    double fault_latency_us = 0;       // reader time per major fault
    double expert_ms_median = 0, expert_ms_p90 = 0;
};

struct MeasureReport {
    nlohmann::json model, text, settings, system;
    uint64_t routed_expert_bytes = 0;    // of the layers a decode routes through
    uint64_t resident_weight_bytes = 0;  // every weight outside the routed experts
    uint64_t process_bytes = 0;          // the resident run's own memory (KV cache, buffers, code)
    uint64_t resident_need_bytes = 0;    // weights outside the experts + process memory
    MeasuredRun resident;
    bool probed = false;
    ProbeFigures probe;
    std::vector<MeasuredRun> runs;
    StreamCalibration calibration;       // what the predictions are computed from
    double median_error = -1, max_error = -1;   // over the predicted runs; -1 when none
    std::string busy;                    // why the figures cannot be a quiet machine's; empty when they can
    std::string trace;                   // --trace, or empty
};

nlohmann::json to_json(const MeasureReport & r);
std::string to_text(const MeasureReport & r);

// Why `r` cannot come from a quiet machine (a resident decode slower than a limited one,
// or far from llama-bench's), or empty: such a run calibrates nothing.
std::string machine_was_busy(const MeasureReport & r);

// Runs everything; writes --json and --trace when given (each complete, or not at all).
MeasureReport run_measure(const MeasureOptions & opt);

} // namespace moeprune
