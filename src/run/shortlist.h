#pragma once
// `moeprune run --measure`'s shortlist: the options of the plan's llama.cpp front that
// llama.cpp is then measured running under the RAM budget, so that the recommendation
// rests on measured tokens/s (docs/run.md).
#include "formats/stage_reports.h"
#include "formats/verify_summary.h"
#include "plan/plan.h"

#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

// At most `n` options of what llama.cpp runs with a known KLD, most promising first: the
// recommendation, the rest of the front it was chosen from, then the others, fastest
// first. Limits measure already ran are left out.
std::vector<size_t> shortlist_of(const PlanFile & plan, int n);

// What llama.cpp did with option `o` (of the plan at `plan_path`), from the measure
// report `measure_json` of `model` under `ram`; the prediction is the plan's.
VerifySummary measured_option(const PlanOption & o, const std::string & plan_path, const std::filesystem::path & model,
                              const std::string & ram, const std::filesystem::path & measure_json);

// Every keep map in `maps` whose model does not fit in `ram` with `measure_json`'s process
// memory, sliced into `scratch` (then deleted) and priced by measure's page-cache predictor
// over the held-out `trace` as the sliced model routes it: one per read-ahead measure
// calibrated at, so that the plan can recommend the read-ahead too. None without a probe.
std::vector<StreamedSlice> price_streamed_slices(const std::filesystem::path & model,
                                                 const std::vector<std::filesystem::path> & maps,
                                                 const std::filesystem::path & trace,
                                                 const std::filesystem::path & measure_json, const std::string & ram,
                                                 const std::filesystem::path & scratch);

} // namespace moeprune
