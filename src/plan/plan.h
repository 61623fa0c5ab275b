#pragma once
// `moeprune plan`: from a model's geometry, a RAM budget, an SSD, and whatever was
// measured (replay sweeps, eval reports), every feasible (K, criterion, cache, policy, λ)
// with its bytes, misses, tokens/s and KLD, the Pareto front of speed against quality,
// and one recommendation with the reason. Unknown numbers stay null, never invented.
// With a measurement (`--measured`), time per token comes from what llama.cpp really did.
#include "core/defaults.h"
#include "formats/measure_report.h"
#include "formats/stage_reports.h"
#include "sim/throughput.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// A sliced model mapped from disk under a RAM limit, priced by measure's page-cache
// predictor over the held-out trace as that model routes it (moeprune run makes these).
struct StreamedSlice {
    std::string criterion;
    int64_t k = 0;
    std::string keep_map;
    std::string ram;                       // the limit, as given
    double limit_bytes = 0;
    std::optional<uint64_t> read_ahead_kb; // the calibration's it was priced with
    StreamPrediction prediction;
};

struct PlanOptions {
    // Geometry: a model, or the numbers of one not at hand.
    std::filesystem::path model;
    double expert_mb = 0;                  // one routed expert of one layer, 10^6 bytes
    int layers = 0;                        // MoE layers
    int64_t experts = 0, used = 0;
    std::optional<double> other_gb;        // everything but routed experts, 10^9 bytes
    std::vector<int64_t> ks;               // expert counts to plan (default: those measured)
    double ram_bytes = 0;                  // 0: no RAM limit given
    double reserve_bytes = kDefaultReserveBytes;  // KV cache, the OS, the program
    ThroughputParams throughput;
    std::vector<std::filesystem::path> replays;   // moeprune-replay JSON
    std::vector<std::filesystem::path> evals;     // moeprune-eval JSON
    std::vector<double> misses_per_token;  // given by hand, for a plan without a replay
    std::vector<int64_t> cache_experts;    // per-layer cache sizes that go with them
    // A model with an MTP head: every option is also priced with one draft token per step
    // at this acceptance, in place of the one its eval measured.
    std::optional<double> mtp_acceptance;
    std::optional<double> max_kld;         // recommend the fastest option within this
    // Recommend only options whose keep map answers the eval's choice tasks with at least
    // this share of the base model's accuracy.
    std::optional<double> min_accuracy;
    double speed_share = 0.9;              // else the most accurate within this share of the fastest
    // A moeprune-measure report of the same model: compute time per token, storage as page
    // faults meet it, and the process's own memory replace the guesses, and every measured
    // RAM limit becomes an option of its own. What is in `by_hand` stays as given.
    std::filesystem::path measured;
    std::vector<std::string> by_hand;      // "--ssd", "--compute-ms", "--read-latency-us", "--reserve" given on the command line
    RunsOn runs_on = RunsOn::LlamaCpp;
    // Options llama.cpp was measured running (`moeprune run --measure`'s shortlist, each a
    // moeprune-verify summary): their measured tokens/s replace the predicted ones, which
    // stay beside them, and rank.
    std::vector<std::filesystem::path> shortlist;
    // Sliced models that do not fit in RAM, streamed as llama.cpp streams them: options that
    // run in llama.cpp, priced page by page rather than by the expert-cache formula.
    std::vector<StreamedSlice> streamed;
    // The recommendation's commands: where its sliced model goes (moeprune slice's output),
    // where llama.cpp's tools are (empty: on the PATH), and their -t and -c (0: llama.cpp's default).
    std::filesystem::path sliced_dir;
    std::filesystem::path llama_bin;
    std::filesystem::path moeprune_bin = "moeprune";   // the slice command's
    int threads = 0, ctx = 0;
};

nlohmann::json make_plan(const PlanOptions & opt);

// The timing a moeprune-measure report gives, in place of `guesses` except the flags in
// `by_hand`: what make_plan uses with PlanOptions::measured, for stages that price tokens
// the same way (run's replay).
ThroughputParams measured_throughput(const std::filesystem::path & measure_json, const ThroughputParams & guesses,
                                     const std::vector<std::string> & by_hand);
// The plan as a table for a terminal, its recommendation and the commands that run it.
std::string plan_text(const PlanFile & plan);

} // namespace moeprune
