#pragma once
// `moeprune run --verify`'s summary (docs/formats.md): the plan's recommendation beside
// what measure found when llama.cpp ran it under --ram. run writes it, and reads it back
// when the verify stage is already done.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>

namespace moeprune {

struct VerifySummary {
    std::string plan;                         // the plan's path
    nlohmann::json option;                    // the plan's recommended option, as the plan wrote it
    std::string model;                        // what was measured: the sliced model, or the model itself
    std::string ram;
    std::optional<double> predicted_tok_per_s;   // the plan's; none when unbounded
    double measured_tok_per_s = 0;
    std::optional<double> measured_read_bytes_per_token;   // none where the kernel keeps no I/O counts
    double measured_major_faults_per_token = 0;
    std::string measure;                      // the measure report beside it
    // The same model decoded fully resident in that measure, and where the option was a
    // shortlist's, in the shortlist's measure: how much faster or slower the machine ran
    // than when the plan's figure was measured (none: not known).
    std::optional<double> resident_tok_per_s, shortlist_resident_tok_per_s;
    std::string digest;                       // read back: of the bytes read (not in the file)

    // |predicted - measured| / measured, when the plan predicted a speed.
    std::optional<double> error() const;
    // resident_tok_per_s / shortlist_resident_tok_per_s - 1, when both are known.
    std::optional<double> drift() const;
};

nlohmann::json to_json(const VerifySummary & v);

// Refuses another format or impossible figures by file and field.
VerifySummary read_verify_summary(const std::filesystem::path & path);

} // namespace moeprune
