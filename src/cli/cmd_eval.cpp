#include "cli/commands.h"
#include "eval/eval.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_eval(CLI::App & app, Action & action) {
    auto opt = std::make_shared<EvalOptions>();
    auto no_special = std::make_shared<bool>(false);
    auto ssd = std::make_shared<std::string>();
    CLI::App * sub = app.add_subcommand(
        "eval", "Quality cost of keep maps (masked inside the base model) and of other model files: KLD, same top-1, "
                "Δp, PPL ratio (docs/eval.md)");
    sub->add_option("-m,--model", opt->model, "Base model (GGUF; first shard of a split model)")->required();
    sub->add_option("-f,--file", opt->corpus, "Evaluation text: plain text, or .jsonl documents (docs/formats.md)")
        ->required();
    sub->add_option("--keep", opt->keeps, "Keep maps to evaluate inside the base model")->delimiter(',');
    sub->add_option("--keep-dir", opt->keep_dir, "Evaluate every *.json keep map in this directory");
    sub->add_option("--candidate", opt->candidates, "Other GGUFs with the base's vocabulary (sliced, quantized, ...)")
        ->delimiter(',');
    sub->add_option("--against", opt->against, "Compare every candidate with this --candidate file instead of the "
                                               "base (e.g. a keep map masked vs. the same map sliced)");
    sub->add_option("--base-out", opt->base_out, "Record the base pass as compact top-T logits here (.mpkl)");
    sub->add_option("--base", opt->base_in, "Compare against a recorded base instead of running the base model");
    sub->add_option("--top", opt->top, "Log-probabilities kept per token in --base-out (0: the most within 1% of "
                                       "llama-perplexity's base file, at most 256)")
        ->capture_default_str();
    sub->add_option("--score", opt->score, "all: every next-token prediction; second-half: llama-perplexity's "
                                           "convention (whole -c windows, first half context)")
        ->check(CLI::IsMember({"all", "second-half"}))
        ->capture_default_str();
    sub->add_option("-c,--ctx-size", opt->ctx, "Window: documents are cut into windows of this many tokens")
        ->capture_default_str();
    sub->add_option("-b,--batch-size", opt->batch, "Tokens per llama_decode (a window is decoded whole)")
        ->capture_default_str();
    sub->add_option("--ubatch-size", opt->ubatch, "Tokens per micro-batch (-ub)")->capture_default_str();
    sub->add_option("-t,--threads", opt->threads, "CPU threads (0: one per core)")->check(thread_count())->capture_default_str();
    sub->add_option("--gpu-layers", opt->gpu_layers, "Layers offloaded to GPU or RPC devices (-ngl)")->capture_default_str();
    sub->add_option("--rpc", opt->rpc, "llama.cpp RPC servers host:port (with -ngl)")->delimiter(',');
    sub->add_option("--chunks", opt->chunks, "Evaluate only the first N windows (-1: all)")->capture_default_str();
    sub->add_flag("--no-parse-special", *no_special, "Treat special-token text as plain text");
    auto mtp = std::make_shared<std::string>("keep");
    sub->add_option("--mtp", *mtp, "MTP (nextn) head: keep (run it, mask it with the keep maps, measure its drafts) or "
                                   "drop (the trunk only; keep maps may leave the nextn layers out)")
        ->check(CLI::IsMember({"keep", "drop"}))
        ->capture_default_str();
    sub->add_option("--worst", opt->top_tokens, "Tokens with the largest KLD listed per candidate")->capture_default_str();
    sub->add_option("--json", opt->json_out, "Write the report (moeprune-eval JSON, docs/formats.md)");
    sub->add_option("--per-token", opt->per_token_out, "Write every scored token of every candidate (JSON lines)");
    sub->add_option("--cache-policy", opt->cache_policies,
                    "Closed loop: route every token against simulated per-layer expert caches run by these replay "
                    "policies, inside the forward pass (docs/eval.md)")
        ->delimiter(',');
    sub->add_option("--cache", opt->caches, "Closed loop: cache sizes in experts per layer")->delimiter(',');
    sub->add_option("--lambda", opt->lambdas, "Closed loop: MoCE bias strengths (0: unbiased routing)")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--j", opt->j,
                    "Closed loop: the top J candidates get the bonus whether cached or not (default: 2, or k - 1 when "
                    "k <= 2)");
    sub->add_option("--moce", opt->moce, "Closed loop: MoCE bias, prior or topk-gap")
        ->check(CLI::IsMember({"prior", "topk-gap"}))
        ->capture_default_str();
    sub->add_option("--trace-top", opt->trace_top, "Closed loop: router candidates per token and layer, as collect's "
                                                   "trace keeps them")
        ->capture_default_str();
    sub->add_option("--trace-out", opt->trace_out, "Closed loop: keep the base pass's router trace here (for replay)");
    add_cache_model_flags(*sub, opt->policy_params, opt->throughput, *ssd);
    sub->add_option("--generate", opt->generate, "Behaviour checks: greedy continuations of N tokens for every chat "
                                                 "prompt, base vs. every candidate (docs/eval.md)")
        ->capture_default_str();
    sub->add_option("--mmproj", opt->mmproj,
                    "Projector GGUF (llama.cpp's libmtmd) for the corpus' images and audio: the text after a "
                    "document's last media is scored under the domain \"image\" or \"audio\"");
    sub->add_option("--prompts", opt->prompts, "Chat prompts for --generate (JSONL with \"messages\"; default: -f)");
    sub->add_option("--hellaswag", opt->hellaswag,
                    "Task accuracy: llama.cpp's HellaSwag file (6 lines per task), scored as llama-perplexity "
                    "--hellaswag scores it, for the base and every keep map and --candidate (docs/eval.md)");
    sub->add_option("--task-domains", opt->task_domains,
                    "With --hellaswag: corpus' tasks.json for that file; accuracy is also given per domain");
    sub->add_option("--winogrande", opt->winogrande,
                    "Task accuracy: llama.cpp's WinoGrande CSV, scored as llama-perplexity --winogrande scores it");
    sub->add_option("--multiple-choice", opt->multiple_choice,
                    "Task accuracy: llama.cpp's binary multiple-choice file (ARC, MMLU, TruthfulQA), scored as "
                    "llama-perplexity --multiple-choice scores it");
    sub->add_option("--parallel", opt->parallel, "Task accuracy: sequences per decode, as llama-perplexity's -np (at "
                                                 "least 4; a task needs one per answer)")
        ->capture_default_str();
    sub->add_option("--tasks", opt->tasks, "Task accuracy: how many tasks, chosen as llama-perplexity's "
                                           "--hellaswag-tasks or --winogrande-tasks chooses them (0: its default, "
                                           "400 HellaSwag tasks, every WinoGrande one)")
        ->capture_default_str();
    sub->callback([=, &action] {
        action = [=] {
            opt->parse_special = !*no_special;
            opt->mtp = *mtp == "keep";
            apply_ssd_preset(*ssd, opt->throughput);
            const EvalReport r = run_eval(*opt);
            std::printf("%s", to_text(r).c_str());
            return 0;
        };
    });
}

} // namespace moeprune::cli
