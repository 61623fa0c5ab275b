#pragma once
// A plan calibrated by `moeprune measure`: which of its guesses the measurement replaces,
// and how the plan says where its time per token came from.
#include "formats/measure_report.h"
#include "plan/plan.h"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// What `moeprune measure` found, and which of the plan's parameters came from it.
struct Measured {
    MeasureFile file;
    std::vector<std::string> taken;
    const MeasureReport & report() const { return file.report; }
};

// A measurement calibrates a plan only when it is a quiet machine's, with a storage probe.
Measured read_measured(const std::filesystem::path & path);

// The guesses the measurement replaces in `opt`, unless given by hand (PlanOptions::by_hand).
void calibrate(PlanOptions & opt, Measured & m);

// Where the time per token came from, for the plan's `why`.
std::string timing_source(const PlanOptions & opt, const std::optional<Measured> & m);

} // namespace moeprune
