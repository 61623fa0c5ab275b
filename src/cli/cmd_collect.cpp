#include "cli/commands.h"
#include "collect/collect.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_collect(CLI::App & app, Action & action) {
    auto opt = std::make_shared<CollectOptions>();
    auto no_special = std::make_shared<bool>(false);
    CLI::App * sub = app.add_subcommand(
        "collect", "Run a model over a corpus and record per-expert saliency (and a router trace) from llama.cpp's graph");
    sub->add_option("-m,--model", opt->model, "MoE model (GGUF; first shard of a split model)")->required();
    sub->add_option("-f,--file", opt->corpus, "Corpus: plain text, or .jsonl documents (docs/formats.md)")->required();
    sub->add_option("-o,--output", opt->output, "Statistics (moeprune-stats JSON)")->required();
    sub->add_option("--trace", opt->trace, "Also write a router trace here");
    sub->add_option("--mmproj", opt->mmproj,
                    "Projector GGUF (llama.cpp's libmtmd) for the corpus' images and audio; their positions are "
                    "recorded under the domains \"image\" and \"audio\"");
    sub->add_option("--imatrix", opt->imatrix,
                    "Also write llama.cpp's importance matrix (GGUF, as llama-imatrix) from the same pass");
    sub->add_option("--trace-top", opt->trace_top, "Candidates per layer and token in the trace")->capture_default_str();
    sub->add_option("--trace-tokens", opt->trace_tokens, "Trace only the first N tokens (0: all)")->capture_default_str();
    sub->add_option("-c,--ctx-size", opt->ctx, "Context: long documents are cut into windows of this many tokens")
        ->capture_default_str();
    sub->add_option("-b,--batch-size", opt->batch, "Tokens per llama_decode")->capture_default_str();
    sub->add_option("--ubatch-size", opt->ubatch, "Tokens per micro-batch (-ub)")->capture_default_str();
    sub->add_option("-t,--threads", opt->threads, "CPU threads (0: one per core)")->check(thread_count())->capture_default_str();
    sub->add_option("--gpu-layers", opt->gpu_layers, "Layers offloaded to GPU or RPC devices (-ngl)")->capture_default_str();
    sub->add_option("--chunks", opt->chunks, "Evaluate only the first N windows (-1: all)")->capture_default_str();
    sub->add_flag("--no-parse-special", *no_special, "Treat special-token text as plain text");
    sub->add_option("--generate", opt->generate, "Generate N tokens after each prompt, recorded as decode")
        ->capture_default_str();
    sub->add_option("--seed", opt->seed, "Sample generated tokens with this seed (default: greedy)");
    sub->add_option("--rpc", opt->rpc, "llama.cpp RPC servers host:port (with -ngl)")->delimiter(',');
    sub->add_option("--save-every", opt->save_every, "Write the statistics so far every N windows")->capture_default_str();
    sub->add_flag("--resume", opt->resume, "Continue a killed run from its last --save-every checkpoint");
    sub->add_flag("--no-mtp", [opt](int64_t) { opt->mtp = false; },
                  "Leave the MTP (nextn) layers out: run the trunk only, as llama.cpp does without a draft");
    sub->add_flag("--coact", opt->coact, "Also count how often two experts are chosen for the same token");
    sub->add_flag("--strict", opt->strict, "Stop at the first non-finite router or expert value");
    sub->callback([=, &action] {
        action = [=] {
            opt->parse_special = !*no_special;
            const CollectResult r = collect(*opt);
            std::printf("%llu windows, %llu tokens (%llu traced), %llu non-finite rows dropped -> %s\n",
                        (unsigned long long) r.windows, (unsigned long long) r.stats.n_tokens,
                        (unsigned long long) r.traced_tokens, (unsigned long long) r.stats.nonfinite_drops,
                        opt->output.c_str());
            return 0;
        };
    });
}

} // namespace moeprune::cli
