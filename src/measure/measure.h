#pragma once
// What llama.cpp really does with a model larger than memory: its own decode (batch 1,
// one token per llama_decode, teacher-forced on a text, the model mapped as llama.cpp
// maps it) in a child process confined by a memory cgroup, once per RAM limit, with
// wall time, major faults and bytes read per token; once fully resident for compute
// time, with the router trace of the timed tokens; and a probe of the storage as the
// decode meets it (random experts through page faults). See docs/measure.md.
#include "formats/measure_report.h"

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
    double min_seconds = 1;     // a run's timed tokens decoded again until this much decode is timed
    // Every limit, and the resident decode each read-ahead's predictions start from, measured
    // this many times, the repeats interleaved (all limits once, then again), so that a
    // machine's drift over minutes falls on every limit alike; each kept at its median.
    int repeats = 1;
    int ctx = 0;                // 0: warmup + tokens
    int threads = 0;            // 0: one per core
    int64_t probe_mib = 256;    // storage probe: MiB of random experts read; 0: no probe
    uint64_t seed = 1;          // the probe's order of experts
    bool repack = true;         // false: llama.cpp's --no-repack (weights stay mapped, as streaming needs)
    // Every limit measured at each of these read-aheads of the model's device (KB; root
    // only), which is put back afterwards. Empty: at the device's own.
    std::vector<uint64_t> read_ahead_kb;
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


std::string to_text(const MeasureReport & r);

// Why `r` cannot come from a quiet machine (a resident decode slower than a limited one,
// or far from llama-bench's), or empty: such a run calibrates nothing.
std::string machine_was_busy(const MeasureReport & r);

// Runs everything; writes --json and --trace when given (each complete, or not at all).
MeasureReport run_measure(const MeasureOptions & opt);

} // namespace moeprune
