#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/defaults.h"
#include "core/errors.h"
#include "core/sizes.h"
#include "measure/read_ahead.h"
#include "plan/plan.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <optional>

namespace moeprune::cli {

namespace {

// What the recommendation is chosen among, and what its commands name.
void add_answer_flags(CLI::App & sub, PlanOptions & o) {
    sub.add_option("--runs-on", o.runs_on,
                   "Recommend among what stock llama.cpp runs (a mapped or sliced model), or among any option, the "
                   "simulated expert caches included")
        ->transform(runs_on_names())
        ->type_name("TEXT")
        ->default_str(runs_on_name(o.runs_on));
    sub.add_option("--shortlist", o.shortlist,
                   "moeprune-verify summaries of options llama.cpp ran (run --measure's plan/shortlist/): their "
                   "measured tokens/s replace the predicted ones")
        ->delimiter(',')
        ->check(CLI::ExistingFile);
    sub.add_option("--sliced-dir", o.sliced_dir,
                   "Where the recommendation's commands put its sliced model (default: the current folder)");
    sub.add_option("--llama-bin", o.llama_bin,
                   "The folder of llama.cpp's tools the commands name (default: found on the PATH)");
    sub.add_option("-t,--threads", o.threads, "The commands' -t (default: llama.cpp's)")->check(CLI::Range(1, 4096));
    sub.add_option("-c,--ctx", o.ctx, "The commands' -c (default: llama.cpp's)")->check(CLI::Range(1, 1 << 24));
}

// The flags held until the plan is made: sizes parsed then, optionals copied then.
struct PlanFlags {
    std::optional<std::string> ram;
    std::string reserve;
    std::optional<double> other_gb, max_kld, min_accuracy, mtp_acceptance;
    std::filesystem::path json_out;
};

// The model's geometry, from its GGUF or given, and the RAM it gets.
void add_geometry_flags(CLI::App & sub, PlanOptions & o, PlanFlags & f) {
    sub.add_option("-m,--model", o.model, "The model's geometry from its GGUF (first shard)");
    sub.add_option("--expert-mb", o.expert_mb, "Or: one routed expert of one layer, MB (10^6 bytes)");
    sub.add_option("--layers", o.layers, "MoE layers (with --expert-mb)");
    sub.add_option("--experts", o.experts, "Routed experts per layer (with --expert-mb)");
    sub.add_option("--used", o.used, "Experts per token (with --expert-mb)");
    sub.add_option("--other-gb", f.other_gb, "Weights that are not routed experts, GB (with --expert-mb)")
        ->check(CLI::Range(0.0, 1e6));
    sub.add_option("-k", o.ks, "Expert counts to plan (default: those measured)")->delimiter(',');
    sub.add_option("--ram", f.ram, "RAM for the model: 24G (GiB), 24GB (10^9 bytes), or bytes");
    sub.add_option("--reserve", f.reserve, fmt::format("RAM kept for the KV cache, the OS and the program (default {})", kDefaultReserve));
}

// The throughput model's inputs (docs/replay.md).
void add_throughput_flags(CLI::App & sub, ThroughputParams & t) {
    sub.add_option("--ssd", t.ssd_gbps, "SSD read bandwidth, GB/s (3.9: PCIe 3, 6.8: PCIe 4)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub.add_option("--read-latency-us", t.read_latency_us, "Latency of one round of reads")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    sub.add_option("--queue-depth", t.queue_depth, "Reads in flight per round")
        ->check(CLI::Range(1, 65536))
        ->capture_default_str();
    sub.add_option("--compute-ms", t.compute_ms, "Compute time per token")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    sub.add_option("--sync-us", t.sync_us, "Synchronization per layer and token")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
}

// What was measured or replayed, and the quality the recommendation must keep.
void add_evidence_flags(CLI::App & sub, PlanOptions & o, PlanFlags & f) {
    sub.add_option("--replay", o.replays, "moeprune-replay results (JSON)")->delimiter(',');
    sub.add_option("--eval", o.evals, "moeprune-eval reports (JSON)")->delimiter(',');
    sub.add_option("--misses-per-token", o.misses_per_token, "Misses per token, all layers, given by hand")
        ->delimiter(',')
        ->check(CLI::NonNegativeNumber);
    sub.add_option("--cache-experts", o.cache_experts, "Per-layer cache size of each --misses-per-token value")
        ->delimiter(',')
        ->check(CLI::NonNegativeNumber);
    sub.add_option("--max-kld", f.max_kld, "Recommend the fastest option with mean KLD at most this")
        ->check(CLI::NonNegativeNumber);
    sub.add_option("--min-accuracy", f.min_accuracy,
                   "Recommend only options whose task accuracy (eval's choice tasks) is at least this share of the "
                   "base's")
        ->check(CLI::Range(0.0, 1.0));
    sub.add_option("--mtp-acceptance", f.mtp_acceptance,
                   "A model with an MTP head: price every option with one draft token per step at this acceptance, "
                   "in place of the ones --eval measured")
        ->check(CLI::Range(0.0, 1.0));
    sub.add_option("--speed-share", o.speed_share, "Else the most accurate option within this share of the fastest")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
    sub.add_option("--measured", o.measured,
                   "A moeprune-measure report of this model: compute time, storage and reserve from it instead of "
                   "--compute-ms/--ssd/--read-latency-us/--reserve (unless given), each measured limit an option")
        ->check(CLI::ExistingFile);
}

} // namespace

void add_plan(CLI::App & app, Action & action) {
    auto opt = std::make_shared<PlanOptions>();
    auto flags = std::make_shared<PlanFlags>();
    CLI::App * sub = app.add_subcommand(
        "plan", "Every feasible (K, criterion, cache, policy, λ) for a RAM budget and an SSD: bytes, misses, tokens/s, "
                "KLD, the Pareto front and a recommendation (docs/plan.md)");
    add_geometry_flags(*sub, *opt, *flags);
    add_throughput_flags(*sub, opt->throughput);
    add_evidence_flags(*sub, *opt, *flags);
    add_answer_flags(*sub, *opt);
    sub->add_option("--json", flags->json_out, "Write the plan (moeprune-plan JSON, docs/formats.md)");
    sub->callback([=, &action] {
        action = [=] {
            // Given, --ram is a budget: "" or 0 are refused, not taken for "no budget".
            if (flags->ram) {
                opt->ram_bytes = parse_size(*flags->ram, "--ram");
                if (!(opt->ram_bytes > 0)) {
                    throw Error("--ram " + *flags->ram + " leaves no RAM for the model: give a size, or leave --ram out to plan "
                                "without a budget");
                }
            }
            if (!flags->reserve.empty()) {
                opt->reserve_bytes = parse_size(flags->reserve, "--reserve");
            }
            opt->other_gb = flags->other_gb;
            for (const char * flag : {"--ssd", "--compute-ms", "--read-latency-us", "--reserve"}) {
                if (sub->count(flag) > 0) {
                    opt->by_hand.push_back(flag);
                }
            }
            opt->max_kld = flags->max_kld;
            opt->min_accuracy = flags->min_accuracy;
            opt->mtp_acceptance = flags->mtp_acceptance;
            std::vector<std::filesystem::path> inputs = opt->replays;
            inputs.insert(inputs.end(), opt->evals.begin(), opt->evals.end());
            if (!opt->measured.empty()) {
                inputs.push_back(opt->measured);
            }
            if (!opt->model.empty()) {
                inputs.push_back(opt->model);
            }
            const std::filesystem::path & json_out = flags->json_out;
            if (!json_out.empty()) {
                refuse_output_clashes({json_out}, inputs);
            }
            opt->moeprune_bin = this_program();
            // The commands it prints serve at the device's own read-ahead, not a killed measure's.
            print_left_read_ahead();
            const nlohmann::json plan = make_plan(*opt);
            std::printf("%s", plan_text(read_plan_document(plan, json_out.empty() ? "the plan" : json_out.string())).c_str());
            if (!json_out.empty()) {
                write_file_atomic(json_out, plan.dump(1) + "\n");
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
