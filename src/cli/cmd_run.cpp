#include "cli/commands.h"
#include "core/errors.h"
#include "engine/session.h"
#include "run/run.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <optional>

namespace moeprune::cli {

void add_run(CLI::App & app, Action & action) {
    auto opt = std::make_shared<RunOptions>();
    auto config = std::make_shared<std::filesystem::path>();
    auto c = std::make_shared<RunConfig>();  // flags given on the command line
    auto max_kld = std::make_shared<std::optional<double>>();
    auto min_accuracy = std::make_shared<std::optional<double>>();
    auto tokens = std::make_shared<std::optional<uint64_t>>();
    CLI::App * sub = app.add_subcommand(
        "run", "From a model and a corpus to an answer: corpus, collect, select, eval, replay, plan and an HTML report "
               "in one resumable run (docs/run.md)");
    sub->add_option("--config", *config, "Settings of every stage (run.toml; flags override it)");
    sub->add_option("-m,--model", c->model, "The model (GGUF; first shard of a split model)");
    sub->add_option("--corpus", c->corpus, "A corpus manifest (.toml) or DOMAIN=PATH_OR_GLOB sources (repeatable)");
    sub->add_option("--mmproj", c->mmproj, "The model's projector GGUF: media sources (images, audio) flow through corpus, collect and eval");
    sub->add_option("-k", c->ks, "Experts to keep per layer, one map per K and criterion")->delimiter(',');
    sub->add_option("-o,--out", opt->run_dir, "Run directory")->required();
    sub->add_option("--criteria", c->criteria, "Selection criteria")->delimiter(',');
    sub->add_option("--ram", c->ram, "RAM for the model (24G = GiB, 24GB = 10^9 bytes)");
    sub->add_option("--reserve", c->reserve, "RAM kept for the KV cache and the OS");
    sub->add_option("--ssd", c->ssd, "SSD read bandwidth, GB/s")->check(CLI::PositiveNumber);
    sub->add_option("--compute-ms", c->compute_ms, "Compute time per token")->check(CLI::NonNegativeNumber);
    sub->add_option("--policies", c->policies, "Cache policies to replay")->delimiter(',');
    sub->add_option("--cache-shares", c->cache_shares, "Per-layer cache sizes as shares of K")->delimiter(',');
    sub->add_option("--lambda", c->lambdas, "Cache-aware routing strengths (0: unbiased)")->delimiter(',');
    sub->add_option("--max-kld", *max_kld, "Recommend the fastest option within this mean KLD");
    sub->add_option("--min-accuracy", *min_accuracy,
                    "Recommend only options keeping this share of the base's task accuracy")
        ->check(CLI::Range(0.0, 1.0));
    sub->add_option("--runs-on", c->runs_on,
                    "Recommend among what stock llama.cpp runs, or any option (the simulated expert caches too)")
        ->check(CLI::IsMember({"llama.cpp", "any"}));
    sub->add_option("--llama-bin", c->llama_bin, "The folder of llama.cpp's tools the printed commands name");
    sub->add_option("--tokens", *tokens, "Calib tokens shared by weighted corpus sources");
    sub->add_option("--hellaswag", c->hellaswag, "Task accuracy beside KLD: llama.cpp's HellaSwag file, scored by eval "
                                                 "for the base and every keep map as llama-perplexity scores it");
    sub->add_option("--winogrande", c->winogrande, "Task accuracy: llama.cpp's WinoGrande CSV");
    sub->add_option("--multiple-choice", c->multiple_choice, "Task accuracy: llama.cpp's binary multiple-choice file");
    sub->add_option("--tasks", c->tasks, "Tasks of the task file, drawn as llama-perplexity draws them (0: its default)");
    sub->add_option("-c,--ctx-size", c->ctx, "Context of collect and eval windows");
    sub->add_option("-t,--threads", c->threads, "Threads (0: one per core)")->check(thread_count());
    auto seed = std::make_shared<uint64_t>(0);
    sub->add_option("--seed", *seed, "Seed of the corpus split and order (default: the manifest's)");
    sub->add_option("--slice", c->slice, "Write sliced GGUFs at the end: best (the recommendation) or all")
        ->check(CLI::IsMember({"best", "all"}));
    sub->add_option("--measure", c->measure,
                    "Measure llama.cpp's decode under these RAM limits (as measure --ram: 25%,50% or sizes) on the "
                    "held-out text; the plan's timing then comes from the measurement")
        ->delimiter(',');
    sub->add_option("--measure-tokens", c->measure_tokens, "Timed tokens per measured run")->check(CLI::PositiveNumber);
    sub->add_option("--measure-repeats", c->measure_repeats,
                    "Every measured run (limits, shortlist, verify) this many times, interleaved, each kept at its "
                    "median (measure --repeats)")
        ->check(CLI::Range(1, 100));
    sub->add_option("--read-ahead-kb", c->read_ahead_kb,
                    "With --measure: every limit at each of these read-aheads of the model's device, in KB (root); "
                    "the plan then recommends the fastest")
        ->delimiter(',');
    sub->add_option("--measure-shortlist", c->measure_shortlist,
                    "With --measure and --ram: the plan's most promising llama.cpp options measured under --ram, at "
                    "most this many (0: none); the recommendation is made from what they measured")
        ->check(CLI::Range(0, 64));
    sub->add_flag("--verify", c->verify,
                  "Measure the recommendation for real at --ram (its sliced model) and print predicted vs measured");
    sub->add_option("--from", opt->from, "Re-run this stage and every later one");
    sub->callback([=, &action] {
        action = [=] {
            RunConfig merged = config->empty() ? RunConfig{} : read_run_config(*config);
            const RunConfig defaults;
            const auto given = [&](const char * flag) { return sub->count(flag) > 0; };
            // Paths from the command line are the working directory's; run.toml is read from its own folder.
            const std::filesystem::path cwd = std::filesystem::current_path();
            if (given("--model")) merged.model = std::filesystem::absolute(c->model).lexically_normal();
            if (given("--corpus")) {
                merged.corpus.clear();
                for (const std::string & entry : c->corpus) {
                    merged.corpus.push_back(corpus_entry_from(entry, cwd));
                }
            }
            if (given("--mmproj")) merged.mmproj = std::filesystem::absolute(c->mmproj).lexically_normal();
            if (given("-k")) merged.ks = c->ks;
            if (given("--criteria")) merged.criteria = c->criteria;
            if (given("--ram")) merged.ram = c->ram;
            if (given("--reserve")) merged.reserve = c->reserve;
            if (given("--ssd")) merged.ssd = c->ssd;
            if (given("--compute-ms")) merged.compute_ms = c->compute_ms;
            if (given("--policies")) merged.policies = c->policies;
            if (given("--cache-shares")) merged.cache_shares = c->cache_shares;
            if (given("--lambda")) merged.lambdas = c->lambdas;
            if (given("--max-kld")) merged.max_kld = *max_kld;
            if (given("--min-accuracy")) merged.min_accuracy = *min_accuracy;
            if (given("--tokens")) merged.tokens = *tokens;
            if (given("--ctx-size")) merged.ctx = c->ctx;
            if (given("--hellaswag")) merged.hellaswag = std::filesystem::absolute(c->hellaswag).lexically_normal();
            if (given("--winogrande")) merged.winogrande = std::filesystem::absolute(c->winogrande).lexically_normal();
            if (given("--multiple-choice")) {
                merged.multiple_choice = std::filesystem::absolute(c->multiple_choice).lexically_normal();
            }
            if (given("--tasks")) merged.tasks = c->tasks;
            if (given("--threads")) merged.threads = c->threads;
            if (given("--seed")) merged.seed = *seed;
            if (given("--slice")) merged.slice = c->slice;
            if (given("--measure")) merged.measure = c->measure;
            if (given("--measure-tokens")) merged.measure_tokens = c->measure_tokens;
            if (given("--measure-repeats")) merged.measure_repeats = c->measure_repeats;
            if (given("--verify")) merged.verify = c->verify;
            if (given("--measure-shortlist")) merged.measure_shortlist = c->measure_shortlist;
            if (given("--read-ahead-kb")) merged.read_ahead_kb = c->read_ahead_kb;
            if (given("--runs-on")) merged.runs_on = c->runs_on;
            if (given("--llama-bin")) merged.llama_bin = std::filesystem::absolute(c->llama_bin).lexically_normal().string();
            if (given("--measure-shortlist") && merged.measure_shortlist > 0 && (merged.measure.empty() || merged.ram.empty())) {
                throw Error(fmt::format("--measure-shortlist {}: the shortlist is measured under --ram after the measure "
                                        "stage: give --measure and --ram as well",
                                        merged.measure_shortlist));
            }
            opt->config = merged;
            opt->moeprune_bin = this_program();
            init_llama({});
            std::printf("%s\n", run_pipeline(*opt).c_str());
            return 0;
        };
    });
}

} // namespace moeprune::cli
