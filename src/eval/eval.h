#pragma once
// What a keep map (or another model file) costs in quality: KL divergence, same top-1,
// Δp and perplexity ratio against the base model, per token, whole and per domain.
// Keep maps are evaluated inside the base model, their removed experts made
// unselectable in llama.cpp's own router graph (route/mask.h), so N keep maps cost
// one model load and N + 1 forward passes. Definitions: docs/eval.md.
#include "core/defaults.h"
#include "eval/behaviour.h"
#include "route/tap.h"
#include "eval/tasks.h"
#include "sim/policy.h"
#include "replay/replay.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct EvalOptions {
    std::filesystem::path model, corpus;
    std::vector<std::filesystem::path> keeps;       // keep maps
    std::filesystem::path keep_dir;                 // every *.json keep map in it
    std::vector<std::filesystem::path> candidates;  // other GGUFs with the same vocabulary
    std::filesystem::path base_out, base_in;        // compact base logits (.mpkl)
    std::filesystem::path against;                  // compare with this candidate file instead of the base
    uint32_t top = 0;                               // top-T in the base file; 0: the largest within 1% of llama's
    std::string score = "all";                      // "all" or "second-half"
    int ctx = kDefaultContext;
    int batch = 2048;
    int ubatch = 512;
    int threads = 0;
    int gpu_layers = 0;
    std::vector<std::string> rpc;
    int64_t chunks = -1;                            // windows to evaluate; -1: all
    bool parse_special = true;
    std::filesystem::path json_out, per_token_out;
    int top_tokens = 10;                            // tokens with the largest KLD listed per candidate
    bool progress = true;
    // Run the MTP (nextn) head of every model that has one and measure its drafts;
    // false (--mtp drop): the trunk only, and keep maps may leave the nextn layers out.
    bool mtp = true;

    // Closed loop (route/tap.h): every policy x cache x lambda is a candidate,
    // on the full model and on each keep map.
    std::vector<std::string> cache_policies;
    std::vector<int> caches;                        // slots per layer
    std::vector<double> lambdas{0.0};
    bool closed_loop_full_model = true;             // false: only on the keep maps (one per map, their own caches)
    std::optional<int> j;                           // MoCE's J; unset: 2, or k - 1 when k <= 2
    std::string moce = "prior";                     // "prior" or "topk-gap"
    int trace_top = kDefaultTraceTop;                           // candidates per token and layer, as collect's trace
    PolicyParams policy_params;
    ThroughputParams throughput;
    std::filesystem::path trace_out;                // the base pass's router trace (for replay)
    bool record_routing = false;                    // keep every closed-loop row in EvalCandidate::routing

    // Behaviour checks (eval/behaviour.h): greedy continuations of this many tokens for
    // every chat prompt, by the base and by every candidate.
    int generate = 0;
    std::filesystem::path prompts;                  // JSONL with "messages"; default: the -f file
    std::filesystem::path mmproj;                   // projector for the corpus' images and audio (libmtmd)
    bool text_only = false;                         // leave out documents with media (run's closed loop)

    // Task accuracy (eval/tasks.h): llama.cpp's HellaSwag file, WinoGrande CSV or binary
    // multiple-choice file, scored as llama-perplexity --hellaswag, --winogrande or
    // --multiple-choice scores it, on `tasks` of its tasks chosen as it chooses them (0:
    // its default, 400 HellaSwag tasks, every other one).
    std::filesystem::path hellaswag, winogrande, multiple_choice;
    int64_t tasks = 0;
    // With --hellaswag: corpus' tasks.json for that file, whose domains give per-domain figures.
    std::filesystem::path task_domains;
    int parallel = 4;                               // llama-perplexity's -np: sequences per decode (at least 4)
};

struct EvalStats {
    uint64_t tokens = 0;
    double kld_mean = 0, kld_stderr = 0, kld_median = 0, kld_p90 = 0, kld_p99 = 0, kld_p999 = 0, kld_max = 0;
    double same_top1 = 0, same_top1_stderr = 0;
    double dp_rms = 0;
    double ln_ppl_ratio = 0, ln_ppl_ratio_stderr = 0;
    double ppl = 0, ppl_base = 0;
    // MTP drafts (docs/eval.md): over the positions with a draft, the share whose top-1
    // is the trunk's top-1 there, and the KLD of the draft distribution against the
    // reference's draft (when the reference decodes live and has an MTP head).
    uint64_t mtp_tokens = 0, mtp_kld_tokens = 0;
    double mtp_acceptance = 0, mtp_acceptance_stderr = 0, mtp_kld_mean = 0;
};

struct TokenScore {
    uint32_t window = 0;
    int32_t pos = 0;        // position of the predicting token in its window
    int32_t target = 0;     // the token predicted
    int domain = -1;        // index into EvalReport::domains
    double kld = 0, nll = 0, nll_base = 0;
    bool same_top1 = false;
    int8_t mtp_accept = -1;   // the MTP head's draft here equals the trunk's top-1; -1: no draft
    int32_t mtp_draft = -1;   // the MTP head's top-1 here
    double mtp_kld = -1;      // -1: no reference draft
};

// A closed-loop candidate's cache figures over every token decoded, and the open-loop
// replay of the base pass's trace under the same configuration.
struct ClosedLoopStats {
    double misses_per_token = 0, hit_rate = 0, swap_rate = 0, moved_gate_mass = 0, tok_per_s = 0;
    double open_loop_misses_per_token = 0, open_loop_tok_per_s = 0;
};

struct EvalCandidate {
    std::string name, kind, source;  // kind: "keep", "file" or "closed-loop"
    EvalStats all;
    std::vector<std::pair<std::string, EvalStats>> domains;
    // With media in the corpus: "text" (tokens scored under the corpus' own domains), then
    // "image" and "audio" (the text after each document's last media), as in the corpus.
    std::vector<std::pair<std::string, EvalStats>> modalities;
    std::vector<TokenScore> tokens;
    nlohmann::json worst = nlohmann::json::array();  // tokens with the largest KLD, text shown
    nlohmann::json config;                           // closed loop: policy, cache, lambda, j, moce, keep
    std::optional<ClosedLoopStats> closed;
    std::vector<RoutedRow> routing;                  // with EvalOptions::record_routing
    std::optional<BehaviourStats> behaviour;         // with --generate
    std::vector<std::pair<std::string, BehaviourStats>> behaviour_domains;
    nlohmann::json behaviour_worst = nlohmann::json::array();
    std::optional<TaskFigures> tasks;                // with --hellaswag; not for closed-loop candidates
};

struct EvalReport {
    nlohmann::json base, inputs;   // base["mtp"]: the base model's own drafts, when it decodes live
    nlohmann::json generation;                       // with --generate: the prompts and the base's own figures
    nlohmann::json tasks;                            // with --hellaswag: the file, the tasks and the base's accuracy
    std::vector<std::string> domains;
    std::vector<EvalCandidate> candidates;
};

EvalReport run_eval(const EvalOptions & opt);
// The documented report (docs/formats.md, "moeprune-eval").
nlohmann::json to_json(const EvalReport & r);
std::string to_text(const EvalReport & r);
// Statistics of a set of scored tokens, as llama-perplexity defines them.
EvalStats eval_stats(const std::vector<const TokenScore *> & tokens);

} // namespace moeprune
