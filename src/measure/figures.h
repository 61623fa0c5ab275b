#pragma once
// The figures of a measure report, from what its child processes recorded: a decode's
// per-token series, the storage probe's reads, and the experts the kernel held against
// the simulation's.
#include "formats/measure_report.h"
#include "measure/worker.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

namespace moeprune {

// Linear between the order statistics.
double quantile(std::vector<double> v, double q);

DecodeFigures decode_figures(const DecodeDetail & detail);

ProbeFigures probe_figures(const ProbeResult & r, uint64_t limit);

// How far the simulated page cache holds the experts the kernel held, sample by sample
// (mincore() in the run, the simulation after the same tokens); null without samples.
nlohmann::json residency_agreement(const std::vector<ResidencySample> & measured,
                                   const std::vector<std::vector<uint32_t>> & predicted, size_t n_experts);

} // namespace moeprune
