#pragma once
// A decode's tokens/s under a memory limit, predicted from what is known before any
// limited run: the model's layout, the routing of the decoded tokens (a trace), compute
// time per token (the resident run) and the storage as the probe met it. The kernel's
// page cache is simulated over every weight llama.cpp maps (sim/page_cache.h): llama.cpp
// faults the whole file in at load, then each token touches every block's dense tensors,
// the experts its router chose, and the output head. See docs/measure.md.
#include "formats/measure_report.h"
#include "formats/trace.h"
#include "model/model_file.h"

#include <cstdint>
#include <span>
#include <string>

namespace moeprune {

// The first `warmup` tokens of `trace` are decoded uncounted, as the measured runs decode
// them; `residency_after` lists timed tokens (0 = the first after the warm-up) after which
// the resident experts are sampled, as `measure` samples them with mincore().
StreamPrediction predict_stream(const GgufModel & model, const TraceSource & trace, uint64_t warmup,
                                uint64_t limit_bytes, const StreamCalibration & c,
                                const std::vector<uint64_t> & residency_after = {});

// Why a limit is outside what the simulation's one LRU list follows, in words, or empty:
// a read-around window over half the page cache, or a model that does not fit whose
// weights every token reads (`every_token_bytes`) are more than the kernel's active file
// list may hold of the page cache (predict.cpp says what each was measured at).
std::string outside_model(uint64_t page_cache_bytes, uint64_t readaround_bytes, uint64_t file_bytes,
                          uint64_t every_token_bytes);

// The bytes of `model` a decode reads for every token: each block's tensors outside the
// routed experts (the nextn blocks left out) and the output head.
uint64_t every_token_bytes(const GgufModel & model);

// The prediction's time per token from its simulated faults and reads, at `c`: compute,
// the faults' waits, the routed experts' reads at `c.read_gbps`, the rest at
// `c.sequential_gbps`, and `c.stream_ms` where it reads at all. The tensors outside the
// routed experts are read whole by every token, start to end, which the kernel's readahead
// streams at the device's sequential rate; the experts are a few slabs of each tensor,
// wherever the router sends the token, each a read-around of its own. Priced alike,
// bench/stream.sh's 75% limit at 8192 KB was predicted 28% too fast from the 25% and 50%
// limits, which read 150-200 MB of whole tensors per token where it read 7 (docs/measure.md).
void time_stream(StreamPrediction & p, const StreamCalibration & c);

// One limited run, as the simulation read it and as llama.cpp took it.
struct StreamFitPoint {
    double scattered_read_bytes_per_token = 0;   // what the fitted rate prices (the experts')
    double measured_ms_per_token = 0;
    double sequential_ms_per_token = 0;          // the rest, at the device's sequential rate
};

// A limited run's point at `c`'s sequential rate.
StreamFitPoint fit_point(const StreamPrediction & p, const StreamCalibration & c, double measured_ms_per_token);

// How a decode's time beyond compute and its sequential reads follows the bytes the
// simulation says its experts fault in, fitted on limited runs at one read-ahead: a rate
// (10^9 bytes/s) for the bytes, and a time per token whenever it reads at all
// (`stream_ms`). The rate folds in what the probe's random reads do not see (how the
// graph's threads wait on each other's faults), which put the probe's figures 30-80% from
// the measured ones; the time per token is what streaming costs beyond its bytes (reclaim
// at the limit: bench/stream.sh's 75% limits took 40% longer than their bytes at the rate
// of the 25% and 50% limits, at both read-aheads).
// Least squares over two points or more of different bytes; where that gives no positive
// rate or a negative time, and over one point, the time is 0 and the rate the points'
// time beyond compute and sequential reads, summed, per scattered byte, summed
// (docs/measure.md).
struct StreamFit {
    double read_gbps = 0;   // 0: nothing to fit on (no point read, or none took longer than compute)
    double stream_ms = 0;
};

// 0 rate when the points read nothing, took no longer than compute, or make a rate above
// `most_gbps` (the device's sequential rate: faults never read faster, so such a fit is
// timing noise over a few simulated bytes, as a limit that reads almost nothing gives).
StreamFit fit_stream(std::span<const StreamFitPoint> points, double compute_ms, double most_gbps);

} // namespace moeprune
