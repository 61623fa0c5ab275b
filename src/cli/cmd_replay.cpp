#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "replay/replay.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_cache_model_flags(CLI::App & sub, PolicyParams & params, ThroughputParams & throughput, std::string & ssd) {
    sub.add_option("--ema-decay", params.ema_decay, "ema family: per-token decay of every score")->capture_default_str();
    sub.add_option("--near-pick", params.near_pick, "near-pick-ema: candidates ranked below N earn credit")
        ->capture_default_str();
    sub.add_option("--lfru-half-life", params.lfru_half_life, "lfru: tokens after which a use counts half")
        ->capture_default_str();
    sub.add_option("--slru-protected", params.slru_protected, "slru: protected share of the slots")->capture_default_str();
    sub.add_option("--s3fifo-small", params.s3fifo_small, "s3fifo: small-FIFO share of the slots")->capture_default_str();
    sub.add_option("--ssd", ssd, "Throughput preset: 3.9 or 6.8 (GB/s NVMe)");
    sub.add_option("--ssd-gbps", throughput.ssd_gbps, "Read bandwidth, GB/s")->capture_default_str();
    sub.add_option("--read-latency-us", throughput.read_latency_us, "Latency of one round of reads")->capture_default_str();
    sub.add_option("--queue-depth", throughput.queue_depth, "Reads in flight per round")->capture_default_str();
    sub.add_option("--compute-ms", throughput.compute_ms, "Compute time per token")->capture_default_str();
    sub.add_option("--sync-us", throughput.sync_us, "Synchronization per layer and token")->capture_default_str();
}

void apply_ssd_preset(const std::string & ssd, ThroughputParams & throughput) {
    if (ssd.empty()) {
        return;
    }
    if (ssd != "3.9" && ssd != "6.8") {
        throw Error(fmt::format("--ssd presets are 3.9 and 6.8, got \"{}\"; use --ssd-gbps", ssd));
    }
    throughput.ssd_gbps = std::stod(ssd);
}

void add_replay(CLI::App & app, Action & action) {
    auto opt = std::make_shared<ReplayOptions>();
    auto json_out = std::make_shared<std::string>();
    auto csv_out = std::make_shared<std::string>();
    auto prefetch = std::make_shared<std::string>();
    auto ssd = std::make_shared<std::string>();
    CLI::App * sub = app.add_subcommand("replay", "Replay a router trace through expert caches (docs/replay.md)");
    sub->add_option("--trace", opt->trace, "Router trace (moeprune trace or Q4RT v1)")->required();
    sub->add_option("--keep", opt->keep, "Keep map: re-choose the top-k among its survivors");
    sub->add_option("--policy", opt->policies, fmt::format("Policies: {}", fmt::join(policy_names(), ", ")))
        ->delimiter(',')
        ->required();
    sub->add_option("--cache", opt->caches, "Cache sizes in experts (per layer, or in all with --global)")->delimiter(',');
    sub->add_option("--cache-mib", opt->cache_mib, "Cache budgets in MiB (needs --model or --expert-mb)")->delimiter(',');
    sub->add_option("--model", opt->model, "GGUF model: bytes of an expert per layer, for budgets and throughput");
    sub->add_option("--expert-mb", opt->expert_mb, "Bytes of one expert in MB (10^6), every layer");
    sub->add_flag("--global", opt->global, "One cache shared by all layers");
    sub->add_option("--lambda", opt->lambdas, "MoCE bias strengths (0: unbiased routing)")->delimiter(',')
        ->capture_default_str();
    sub->add_option("--j", opt->j,
                    "MoCE: the top J candidates get the bonus whether cached or not (default: 2, or k - 1 when k <= 2)");
    sub->add_option("--moce", opt->moce, "MoCE bias: prior or topk-gap")->capture_default_str();
    sub->add_option("--k", opt->k, "Experts per token (default: the trace's meta.n_expert_used)");
    sub->add_option("--warmup", opt->warmup, "Tokens replayed before counting starts")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    sub->add_flag("--reset-on-session", opt->reset_on_session, "Empty the caches where the sequence id changes");
    sub->add_option("--prefill-union", opt->prefill_union,
                    "Prefill batch size: each layer loads the union of a batch's experts once (0: off)")
        ->capture_default_str();
    sub->add_option("--prefetch", *prefetch, "Prefetch mode: next-layer");
    sub->add_option("--prefetch-n", opt->prefetch_n, "Experts staged per layer (default k)");
    sub->add_option("--prefetch-train", opt->prefetch_train,
                    "Learn the predictor from the first N tokens only (a training split; pair with --warmup N)")
        ->check(CLI::NonNegativeNumber);
    add_cache_model_flags(*sub, opt->params, opt->throughput, *ssd);
    sub->add_option("-t,--threads", opt->threads, "Worker threads (0: one per core)")->check(thread_count())->capture_default_str();
    sub->add_option("--json", *json_out, "Write one record per configuration as JSON (docs/formats.md)");
    sub->add_option("--csv", *csv_out, "Write the records as CSV, one row per configuration and phase");
    sub->callback([=, &action] {
        action = [=] {
            if (opt->caches.empty() && opt->cache_mib.empty()) {
                throw Error("give cache sizes with --cache or --cache-mib");
            }
            if (!prefetch->empty()) {
                if (*prefetch != "next-layer") {
                    throw Error(fmt::format("--prefetch supports next-layer, got \"{}\"", *prefetch));
                }
                opt->prefetch = true;
            }
            apply_ssd_preset(*ssd, opt->throughput);
            const ReplayReport r = run_replay(*opt, {*json_out, *csv_out});
            std::printf("%s", to_text(r).c_str());
            if (!json_out->empty()) {
                write_file_atomic(*json_out, to_json(r).dump(1) + "\n");
            }
            if (!csv_out->empty()) {
                write_file_atomic(*csv_out, to_csv(r));
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
