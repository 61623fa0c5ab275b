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

namespace moeprune {

// The first `warmup` tokens of `trace` are decoded uncounted, as the measured runs decode
// them; `residency_after` lists timed tokens (0 = the first after the warm-up) after which
// the resident experts are sampled, as `measure` samples them with mincore().
StreamPrediction predict_stream(const GgufModel & model, const TraceSource & trace, uint64_t warmup,
                                uint64_t limit_bytes, const StreamCalibration & c,
                                const std::vector<uint64_t> & residency_after = {});

} // namespace moeprune
