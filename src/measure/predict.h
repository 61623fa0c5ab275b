#pragma once
// A decode's tokens/s under a memory limit, predicted from what is known before any
// limited run: the model's layout, the routing of the decoded tokens (a trace), compute
// time per token (the resident run) and the storage as the probe met it. The kernel's
// page cache is simulated over every weight llama.cpp maps (sim/page_cache.h): llama.cpp
// faults the whole file in at load, then each token touches every block's dense tensors,
// the experts its router chose, and the output head. See docs/measure.md.
#include "formats/trace.h"
#include "model/model_file.h"

#include <cstdint>

namespace moeprune {

struct StreamCalibration {
    double compute_ms = 0;                 // per token, fully resident
    double read_gbps = 0;                  // what the storage delivers through page faults (10^9 bytes/s)
    uint64_t process_bytes = 0;            // the process's own memory, charged to the same limit
    uint64_t page_bytes = 4096;
    uint64_t readaround_bytes = 0;         // the mapping's readahead window
};

struct StreamPrediction {
    uint64_t page_cache_bytes = 0;         // the limit less the process's own memory
    double tokens_per_second = 0, ms_per_token = 0;
    double read_bytes_per_token = 0;       // pages faulted in, readahead included
    double expert_read_bytes_per_token = 0, other_read_bytes_per_token = 0;   // by the range that faulted
    double faults_per_token = 0, expert_faults_per_token = 0;                 // read-arounds started
    // After each timed token of `residency_after`: the experts (routed_expert_slabs order)
    // every page of which the simulated cache holds.
    std::vector<std::vector<uint32_t>> resident_experts;
};

// The first `warmup` tokens of `trace` are decoded uncounted, as the measured runs decode
// them; `residency_after` lists timed tokens (0 = the first after the warm-up) after which
// the resident experts are sampled, as `measure` samples them with mincore().
StreamPrediction predict_stream(const GgufModel & model, const TraceSource & trace, uint64_t warmup,
                                uint64_t limit_bytes, const StreamCalibration & c,
                                const std::vector<uint64_t> & residency_after = {});

} // namespace moeprune
