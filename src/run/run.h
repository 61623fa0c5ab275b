#pragma once
// `moeprune run`: corpus -> collect (calib statistics) -> heldout (statistics and trace
// on eval) [-> measure] -> select -> eval -> replay -> plan -> report [-> slice -> verify],
// each stage in its
// own folder of RUN_DIR with a stage.json of its inputs (digests), settings and outputs
// (digests). A stage whose inputs and settings are unchanged is skipped; one whose
// outputs changed since it wrote them is an error; a killed collect resumes from its
// checkpoint. docs/run.md is the user's description.
#include "run/config.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct RunOptions {
    RunConfig config;
    std::filesystem::path run_dir;
    std::string from;                      // re-run this stage and every later one
    bool progress = true;
    std::filesystem::path moeprune_bin = "moeprune";   // this program, as the plan's commands name it
};

const std::vector<std::string> & run_stages();

// Runs or skips every stage; returns the plan's recommendation sentence.
std::string run_pipeline(const RunOptions & opt);

} // namespace moeprune
