#pragma once
// `moeprune measure`'s report (docs/measure.md, docs/formats.md "Measure"): the one record
// measure writes and plan, report and run read back. Its reader checks every figure
// against the others it was computed from; what a reader then accepts (a busy machine, a
// report without a probe) is the reader's policy, not the format's.
#include "core/json.h"
#include "formats/model_identity.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// What a prediction of a limited run is computed from.
// One per read-ahead measured: a resident decode's speed depends on it too (the page
// cache's folios, and so the TLB's reach, grow with the read-ahead that brought them in).
struct StreamCalibration {
    std::optional<uint64_t> read_ahead_kb; // the device's read-ahead it was measured at, where sysfs says
    double compute_ms = 0;                 // per token, fully resident
    double read_gbps = 0;                  // the storage's transfer rate (10^9 bytes/s)
    double fault_ms = 0;                   // what a read-around waits beyond its transfer
    double stream_ms = 0;                  // per token whenever it reads: streaming's cost beyond its bytes
    // The device's sequential rate (the probe's), at which the tensors every token reads whole
    // are priced; 0 (a report from before it): every byte at read_gbps.
    double sequential_gbps = 0;
    uint64_t process_bytes = 0;            // the process's own memory, charged to the same limit
    uint64_t page_bytes = 4096;
    uint64_t readaround_bytes = 0;         // the mapping's readahead window
    // The limited runs (--ram as written) whose decode read_gbps and stream_ms were fitted
    // on, fault_ms then 0; empty: read_gbps and fault_ms are the storage probe's.
    std::vector<std::string> fitted_on;
    // With measure --repeats: every repeat's resident decode at this read-ahead, in the
    // order measured; compute_ms is their median.
    std::vector<double> compute_ms_repeats;
};

struct StreamPrediction {
    uint64_t page_cache_bytes = 0;         // the limit less the process's own memory
    double tokens_per_second = 0, ms_per_token = 0;
    double read_bytes_per_token = 0;       // pages faulted in, readahead included
    double expert_read_bytes_per_token = 0, other_read_bytes_per_token = 0;   // by the range that faulted
    double faults_per_token = 0, expert_faults_per_token = 0;                 // read-arounds started
    // Why this limit is outside what the predictor models, in words; empty when it is not.
    std::string outside_model;
    // Not in the file (its agreement with mincore() is, as the run's residency): after each
    // sampled timed token, the experts (routed_expert_slabs order) every page of which the
    // simulated cache holds.
    std::vector<std::vector<uint32_t>> resident_experts;
};

// Per-token figures of one decode run (the timed tokens).
struct DecodeFigures {
    uint64_t tokens = 0;
    double tokens_per_second = 0;
    double ms_mean = 0, ms_median = 0, ms_p90 = 0;
    double major_faults_per_token = 0;
    double read_bytes_per_token = -1;   // -1: the kernel keeps no per-process I/O counts
};

// After a sampled timed token, the experts (routed_expert_slabs order) every page of
// which the kernel's page cache held, by mincore().
struct ResidencySample {
    uint64_t token = 0;
    std::vector<uint32_t> resident;
};

// One decode of the measure worker: its result, and each run's "detail" in the report.
struct DecodeDetail {
    double load_seconds = 0;
    std::optional<int64_t> load_read_bytes;    // none: the kernel keeps no per-process I/O counts
    int64_t load_major_faults = 0;
    int64_t passes = 1;                        // the timed tokens were decoded this many times
    double timed_seconds = 0;
    // Per timed token: its wall time (the median over the passes), and the first pass's
    // bytes read (-1 uncounted), major and minor faults.
    std::vector<double> wall_us;
    std::vector<int64_t> read_bytes, major_faults, minor_faults;
    bool read_bytes_counted = false;
    std::optional<std::vector<ResidencySample>> residency;   // when sampled
    // The worker's own memory after the decode, from /proc/self/status: RssAnon, RssFile,
    // VmHWM, VmPTE (bytes), the ones the kernel reported.
    std::vector<std::pair<std::string, uint64_t>> process;
    uint64_t process_value(const std::string & key) const;   // 0 where not reported
};

nlohmann::json to_json(const DecodeDetail & d);
// Refuses impossible values by field (`f` names the file and the place).
DecodeDetail read_decode_detail(const JsonFields & f);

struct MeasuredRun {
    std::string ram;                 // as given; "resident" for the run without a limit
    uint64_t limit_bytes = 0;        // 0: no limit
    uint64_t cache_bytes = 0;        // the limit less what stays resident: the experts' share
    uint64_t peak_bytes = 0;         // the cgroup's most memory charged at once
    std::optional<uint64_t> read_ahead_kb;   // the model's device's read-ahead during the run, where sysfs says
    DecodeFigures decode;
    std::optional<DecodeDetail> detail;   // none in a report written without it
    bool predicted = false;          // a limited run, with a storage probe to calibrate reads
    StreamPrediction prediction;     // from the resident run, the trace and the other limits' read rate (or the probe's)
    double error = 0;                // |predicted - measured| / measured tokens/s
    nlohmann::json llama_bench;      // llama-bench under the same limit; null when not run
    nlohmann::json residency;        // experts resident by mincore() against the simulation; null when not sampled
    // With measure --repeats: every repeat's tokens/s under this limit, in the order
    // measured; the run kept (decode, detail) is the one of their median.
    std::vector<double> repeats_tokens_per_second;
};

struct ProbeFigures {
    std::optional<uint64_t> read_ahead_kb;   // the device's read-ahead during the probe, where sysfs says
    uint64_t limit_bytes = 0, experts = 0, bytes_needed = 0;
    int64_t bytes_read = -1;
    uint64_t major_faults = 0;
    int threads = 0;
    double seconds = 0;
    double effective_gbps = 0;         // bytes needed per second (10^9)
    double read_gbps = -1;             // bytes the device delivered per second
    double readahead_amplification = -1;   // bytes read per byte needed
    double fault_latency_us = 0;       // reader time per major fault
    double sequential_gbps = -1;       // direct sequential reads of the experts (10^9 bytes/s); -1: not read
    uint64_t simulated_faults = 0;     // the read-arounds the simulated page cache starts for the same reads
    double fault_ms = -1;              // wall time beyond what sequential_gbps transfers, per simulated read-around
    double expert_ms_median = 0, expert_ms_p90 = 0;
};

struct MeasureReport {
    nlohmann::json model, text, settings, system;
    // The model's block device and its read-ahead when measured (system.storage), where
    // sysfs names them.
    std::string storage_device;
    std::optional<uint64_t> read_ahead_kb;
    int threads = 0;                     // every decode's (settings.threads); 0 where the report does not say
    uint64_t routed_expert_bytes = 0;    // of the layers a decode routes through
    uint64_t resident_weight_bytes = 0;  // every weight outside the routed experts
    uint64_t process_bytes = 0;          // the resident run's own memory (KV cache, buffers, code)
    uint64_t resident_need_bytes = 0;    // weights outside the experts + process memory
    MeasuredRun resident;
    bool probed = false;
    ProbeFigures probe;                  // at the device's own read-ahead, or the first measured
    std::vector<ProbeFigures> probes;    // one per read-ahead measured, `probe` among them
    std::vector<MeasuredRun> runs;
    StreamCalibration calibration;       // `probe`'s: what plan prices with
    std::vector<StreamCalibration> calibrations;   // one per probe: what each run's prediction is computed from
    double median_error = -1, max_error = -1;   // over the predicted runs; -1 when none
    std::string busy;                    // why the figures cannot be a quiet machine's; empty when they can
    std::string trace;                   // --trace, or empty
};

nlohmann::json to_json(const MeasureReport & r);

// A measure report as read back, with where it came from.
struct MeasureFile {
    std::string path;
    std::string digest;      // of the bytes read (core/digest's content_digest)
    MeasureReport report;
    ModelIdentity model;     // report.model, read
    JsonPlace place(const std::string & path_in_file = "") const { return {path, path_in_file}; }
};

// Refuses another format, another version, and figures impossible alone or together (a
// speed its own per-token times do not make, a limit below what must stay resident), by
// file and field. Figures no reader needs may be absent (older reports, hand-made ones).
MeasureFile read_measure_report(const std::filesystem::path & path);

// The resident run, then every limited one.
std::vector<const MeasuredRun *> all_runs(const MeasureReport & r);

} // namespace moeprune
