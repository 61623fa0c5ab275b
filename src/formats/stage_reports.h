#pragma once
// What later stages read back of select's, eval's, replay's and plan's report files (docs/formats.md),
// typed and checked once here: plan and report take these records instead of indexing
// the JSON by key. (The stages' own EvalReport and ReplayReport are what they write.) A record keeps its place in the file, so a reader that knows more (the
// model's expert count, its layers) refuses a value by file and field.
#include "core/json.h"
#include "formats/model_identity.h"
#include "formats/plan_option.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeprune {

// eval's figures over a set of positions ("all", or one domain). Null in the file
// (no position scored) reads as nullopt.
struct EvalFigures {
    std::optional<double> kld_mean, kld_p99, same_top1;
    int64_t tokens = 0;
    // With an MTP head: the share of drafts the trunk accepts (teacher-forced), and the
    // accepted length per step of its greedy continuations (with --generate).
    std::optional<double> mtp_acceptance, mtp_tokens_per_step;
};

// A closed-loop candidate's cache figures beside the open-loop replay of its tokens.
struct ClosedLoopFigures {
    std::optional<double> misses_per_token, open_loop_misses_per_token, tok_per_s, open_loop_tok_per_s;
};

// A model's answers to eval's task file (docs/eval.md, "Task accuracy").
struct EvalTaskDomain;

struct EvalTaskFigures {
    int64_t tasks = 0, correct = 0, kept_base_correct = 0, new_correct = 0;
    double accuracy = 0, stderr_ = 0;
    std::vector<EvalTaskDomain> domains;   // with the tasks' domains (corpus' tasks.json)
};
struct EvalTaskDomain {
    std::string domain;
    EvalTaskFigures figures;
};

struct EvalFileCandidate {
    JsonPlace place;                 // "candidates[3]"
    std::string kind;                // "keep" (a masked keep map), "closed-loop", or one later stages pass over
    std::string name;
    std::string source;              // keep: the map's file as given ("" when none)
    std::optional<std::string> keep; // closed-loop: the keep map it ran under
    std::string policy;              // closed-loop: its cache
    int64_t cache = 0;
    double lambda = 0;
    EvalFigures all;
    std::vector<std::pair<std::string, EvalFigures>> domains;
    std::vector<std::pair<std::string, EvalFigures>> modalities;  // text, image, audio; empty without media
    ClosedLoopFigures loop;          // closed-loop only
    std::optional<EvalTaskFigures> tasks;   // keep: with a task file
};

// The base model's MTP head, as eval measured it.
struct EvalMtpFigures {
    double acceptance = 0;                         // teacher-forced
    std::optional<double> tokens_per_step;         // greedy continuations' accepted length per step
};

struct EvalFile {
    std::string path;
    std::string digest;              // of the bytes read (core/digest's content_digest)
    ModelIdentity base;              // the model measured ("base")
    std::optional<EvalMtpFigures> base_mtp;        // "base.mtp", for a model with an MTP head
    std::vector<EvalFileCandidate> candidates;
    // With a task file: its format ("hellaswag", "winogrande", "multiple-choice"), the file
    // and the base's answers.
    std::string task_format, task_file;
    std::optional<EvalTaskFigures> base_tasks;
};

// A moeprune-eval report; refuses another format and impossible values by field.
EvalFile read_eval_report(const std::filesystem::path & path);

struct ReplayRecordFigures {
    JsonPlace place;                 // "records[3]"
    std::string policy;
    std::vector<int64_t> slots;      // one size, or one per MoE layer
    std::optional<int64_t> cache;    // the size asked for, where slots were derived from it
    double lambda = 0;
    bool cliff = false;              // a global cache smaller than one token's experts
    double misses_per_token = 0;
    std::optional<std::vector<double>> misses_per_token_by_layer;  // per-layer caches, one per MoE layer
    std::optional<double> read_rounds_per_token, hit_rate, tokens_per_s;
};

struct ReplayFile {
    std::string path;
    std::string digest;              // of the bytes read
    std::optional<ModelIdentity> trace_model;   // inputs.trace_meta.model, when the trace names its model
    std::vector<int64_t> trace_mtp_layers;       // inputs.trace_meta.mtp_layers: the trace's last layers are these
    int64_t n_layer = 0, n_expert = 0;
    std::optional<std::string> keep;             // the keep map replayed (none: null or "")
    std::optional<int64_t> n_expert_after_keep;
    bool global = false;                         // one cache shared by all layers
    nlohmann::json throughput;                   // the throughput settings, as recorded (null when absent)
    JsonPlace inputs_place;
    std::vector<ReplayRecordFigures> records;
};

// A moeprune-replay result; refuses another format and impossible values by field.
ReplayFile read_replay_report(const std::filesystem::path & path);

// select's figures for one layer of one keep map.
struct SelectLayerFigures {
    int64_t layer = 0;
    double reap_share = 0, count_share = 0;          // of the statistics' routing the map keeps
    std::optional<double> heldout_reap_share;        // with held-out statistics
    std::optional<double> replaced_share, moved_mass; // the substitution screen, with a trace
};

struct SelectResultFigures {
    std::string criterion;
    int64_t k = 0;
    std::vector<SelectLayerFigures> layers;
};

struct SelectFile {
    std::string path;
    std::vector<SelectResultFigures> results;
    std::vector<std::string> warnings;   // e.g. a multimodal model calibrated without media
};

// A moeprune-select report; refuses another format and impossible values by field.
SelectFile read_select_report(const std::filesystem::path & path);

// The throughput model's settings as a plan or a replay recorded them.
struct ThroughputFigures {
    double ssd_gbps = 0, read_latency_us = 0, compute_ms = 0;
    int64_t queue_depth = 1;
};

// What a plan was made from, as the report shows it.
struct PlanInputFigures {
    std::string source;                // the model, or the geometry given by hand
    int64_t moe_layers = 0, experts = 0, used = 0, mtp_layers = 0;
    std::vector<double> expert_bytes;  // one routed expert, per MoE layer
    std::optional<double> other_bytes, budget_bytes;
    ThroughputFigures throughput;
    std::string throughput_model;      // the formula, in words
    bool measured = false;             // calibrated by a measure report
    std::optional<double> measured_median_error, measured_max_error;
};

struct PlanFile {
    std::string path;
    nlohmann::json document;           // the whole file as written (the run's report carries it)
    nlohmann::json inputs;             // geometry, RAM, throughput, measured: as written (read_plan_inputs)
    int64_t n_expert = 0;              // inputs.geometry.experts
    std::vector<PlanOption> options;
    std::vector<size_t> pareto;        // indices into options: the front of all of them
    std::vector<size_t> pareto_runs_on;   // the front of those the recommendation was chosen from
    RunsOn runs_on = RunsOn::Any;      // what the recommendation was chosen among (older plans: any)
    std::optional<size_t> recommended;
    std::optional<PlanCommands> commands;   // the recommendation's
    std::string why;
    uint64_t infeasible = 0;

    const PlanOption * recommendation() const { return recommended ? &options[*recommended] : nullptr; }
};

// A moeprune-plan report; refuses another format, impossible values and indices that
// name no option, by field.
PlanFile read_plan_report(const std::filesystem::path & path);
// The same, of a plan already parsed; `origin` names it in refusals.
PlanFile read_plan_document(const nlohmann::json & document, const std::string & origin);

// The plan's inputs typed, every field the report shows required; refused by field of
// the plan's file.
PlanInputFigures read_plan_inputs(const PlanFile & plan);

// Throughput settings as a plan or a replay recorded them (`where`: the file and the
// path to the object), refused by field.
ThroughputFigures read_throughput(const nlohmann::json & settings, const JsonPlace & where);

} // namespace moeprune
