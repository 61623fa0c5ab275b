#pragma once
// One option of a moeprune plan (docs/plan.md, docs/formats.md "Plan"): the record plan
// builds, prices and writes, and run and report read back. Its reader refuses impossible
// values by field.
#include "core/json.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// What can run an option. Stock llama.cpp runs a model mapped from disk with the kernel's
// page cache as its only expert cache, or a sliced model resident in RAM; the policies
// with slots of experts are simulated for a runtime that would implement them.
inline constexpr const char * kRunsOnLlamaCpp = "llama.cpp";
inline constexpr const char * kRunsOnExpertCache = "expert-cache runtime";
// An option's `policy` is what holds its experts: a cache policy of sim's registry, or one
// of these, which are how stock llama.cpp runs a model (or "given": misses by hand).
inline constexpr const char * kPolicyResident = "resident";     // every kept expert in RAM
inline constexpr const char * kPolicyPageCache = "page-cache";  // mapped from disk, the kernel's page cache its cache
const char * runs_on_of(const std::string & policy);

// What a plan recommends among: what stock llama.cpp runs, or any option (the simulated
// expert caches too). Spelled "llama.cpp" and "any" in flags, run.toml and plan.json.
enum class RunsOn { LlamaCpp, Any };
const char * runs_on_name(RunsOn r);
// nullopt for any other spelling.
std::optional<RunsOn> parse_runs_on(const std::string & name);

// An option priced with one MTP draft token per step (a model with an MTP head).
struct PlanDraft {
    std::optional<double> acceptance;          // none: not measured
    std::optional<std::string> acceptance_source;
    std::optional<double> tokens_per_step;
    std::optional<double> mtp_read_bytes_per_token;   // none: the head's traffic is unknown
    std::optional<double> resident_bytes;      // the option's RAM with the head's experts
    bool feasible = true;
    std::optional<double> step_ms, tok_per_s, speedup;
    std::string note;                          // why a figure is missing; empty when none is
};

// What llama.cpp did under a memory limit, for an option measured rather than modelled.
struct PlanMeasuredFigures {
    std::string ram;                           // the limit as measure was given it
    double limit_bytes = 0;
    double major_faults_per_token = 0;
    std::optional<double> predicted_tok_per_s;   // measure's own prediction of that run
    std::optional<uint64_t> read_ahead_kb;     // the model's device's read-ahead then
};

// An option of the shortlist `moeprune run --measure` measured: the model that runs it
// (sliced where K is less than all) decoded by llama.cpp under the RAM budget.
struct PlanShortlistFigures {
    std::string ram;                           // the limit it was measured under
    std::string model;
    std::string measure;                       // the measure report
    double measured_tok_per_s = 0;
    std::optional<double> predicted_tok_per_s; // the plan's before the measurement; none: unbounded
    // |predicted - measured| / measured.
    std::optional<double> error() const;
};

struct PlanOption {
    int64_t k = 0;                             // experts kept per layer
    std::string criterion;                     // "none" for the unpruned model
    std::optional<int64_t> cache_experts;      // none: no cache size (the page cache, misses by hand)
    std::string cache_scope = "per-layer";     // or "global"
    std::string policy;
    double lambda = 0;                         // cache-aware routing strength
    double routed_bytes = 0;
    std::optional<double> resident_bytes;      // none: unknown
    std::optional<double> misses_per_token;
    std::optional<double> read_bytes_per_token;
    std::optional<double> tok_per_s;           // none: unbounded (no time per token known)
    std::string source;                        // where the figures come from, in words
    std::string note;
    std::string runs_on;                       // kRunsOnLlamaCpp or kRunsOnExpertCache
    std::string runs_on_note;                  // which runtime would run a simulated one
    std::optional<std::string> keep_map;       // the keep map's file, when the plan saw it
    // A sliced model streamed by llama.cpp: the device read-ahead it was priced at (KB);
    // none: the device's own when measured.
    std::optional<uint64_t> read_ahead_kb;
    // Why its predicted tokens/s is outside what measure's predictor models (measure's
    // StreamPrediction::outside_model); empty when it is not. Such a prediction is never the
    // answer: the option is recommended only once measured.
    std::string outside_model;
    std::optional<PlanMeasuredFigures> measured;
    std::optional<PlanShortlistFigures> shortlist;   // measured: tok_per_s is the measured figure
    bool feasible = true;
    bool bound = false;                        // an offline bound (Belady): never recommended
    std::optional<double> kld_mean;
    std::optional<double> task_accuracy;       // its keep map's on the eval's choice tasks (the base's at K = all)
    std::optional<bool> kld_measured;          // false: interpolated in K
    std::string kld_loop = "open";             // "closed": measured with the cache in the loop
    std::string kld_note;
    std::optional<PlanDraft> mtp_draft;

    // The fastest an option decodes: an unknown time per token is unbounded.
    double speed() const;
    // One line for a person: K, criterion, cache and tokens/s.
    std::string describe() const;
};

nlohmann::json to_json(const PlanOption & o);
// `o`: one element of a plan's "options".
PlanOption read_plan_option(const JsonFields & o);

// The commands that run a plan's recommendation with stock llama.cpp (plan.json's
// "commands"): each an argv, and `lines`, the whole sequence as a person types it.
struct PlanCommands {
    std::string model;                         // the GGUF llama.cpp loads
    std::vector<std::string> slice;            // makes `model` from the original; empty when none is needed
    std::vector<std::string> memory_limit;     // the prefix that runs a command under the RAM given; empty without one
    std::vector<std::string> read_ahead;       // sets the device's read-ahead it was measured at; empty: leave it
    std::vector<std::string> llama_completion; // llama.cpp's single-shot tool, without prompt or length
    std::vector<std::string> llama_server;
    std::vector<std::string> lines;
    std::vector<std::string> notes;            // what the flags are for, and what is not measured
};

nlohmann::json to_json(const PlanCommands & c);
PlanCommands read_plan_commands(const JsonFields & c);
// One argv as a POSIX shell reads it back.
std::string shell_line(const std::vector<std::string> & argv);

} // namespace moeprune
