#include "cli/commands.h"
#include "core/errors.h"
#include "corpus/build.h"
#include "engine/session.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <optional>

namespace moeprune::cli {

namespace {

std::string summary(const CorpusReport & r) {
    std::string out;
    for (const auto & [side, o] : {std::pair{"calib", r.outputs.calib}, std::pair{"eval", r.outputs.eval}}) {
        out += fmt::format("{:<5} {} documents, {} tokens -> {}\n", side, o.documents, o.tokens, o.path);
    }
    for (const CorpusDomainRow & d : r.domains) {
        out += fmt::format("  {:<16} calib {:>10} tokens ({:5.1f}%, target {:5.1f}%)  eval {:>9} tokens\n", d.domain,
                           d.calib.tokens, 100 * d.calib.share, 100 * d.calib.target_share, d.eval.tokens);
    }
    out += fmt::format("dedupe: {} exact and {} near duplicates dropped; {} boilerplate prefixes found\n", r.dedupe.exact,
                       r.dedupe.near, r.boilerplate.size());
    const CorpusLeakCheck & l = r.leak_check;
    out += fmt::format("leak check (eval vs calib): exact {}, near {}, shared {}-grams {}, shared groups {}{}\n", l.exact,
                       l.near, l.ngram_units, l.shared_ngrams, l.shared_groups,
                       l.clean ? " (clean)" : " (see corpus.json for examples)");
    out += fmt::format("tasks {} choice tasks -> {}\n", r.outputs.tasks.tasks, r.outputs.tasks.path);
    for (const std::string & s : r.shortfalls) {
        out += "shortfall: " + s + "\n";
    }
    return out;
}

} // namespace

void add_corpus(CLI::App & app, Action & action) {
    auto opt = std::make_shared<CorpusOptions>();
    auto manifest = std::make_shared<std::filesystem::path>();
    auto sources = std::make_shared<std::vector<std::string>>();
    auto seed = std::make_shared<std::optional<uint64_t>>();
    auto near_dup = std::make_shared<std::optional<double>>();
    auto eval_share = std::make_shared<std::optional<double>>();
    auto tokens = std::make_shared<std::optional<uint64_t>>();
    auto doc_tokens = std::make_shared<std::optional<uint32_t>>();
    auto strip = std::make_shared<bool>(false);
    auto task_context = std::make_shared<std::optional<int64_t>>();
    auto task_ending = std::make_shared<std::optional<int64_t>>();
    auto tasks_per_domain = std::make_shared<std::optional<int64_t>>();
    CLI::App * sub = app.add_subcommand(
        "corpus", "Build leak-free, token-budgeted calib.jsonl and eval.jsonl from text, Markdown and JSONL sources "
                  "(docs/corpus.md)");
    sub->add_option("-m,--model", opt->model, "Model whose tokenizer and chat template measure the budgets (GGUF)")
        ->required();
    sub->add_option("--manifest", *manifest, "Sources and settings (TOML, docs/corpus.md)");
    sub->add_option("--mmproj", opt->mmproj, "The model's projector GGUF: counts the tokens of images and audio as libmtmd does (needed for media sources)");
    sub->add_option("--source", *sources, "DOMAIN=PATH_OR_GLOB, one group per file (repeatable)");
    sub->add_option("-o,--out", opt->out_dir, "Output directory: calib.jsonl, eval.jsonl, corpus.json")->required();
    sub->add_option("--seed", *seed, "Seed of the split and the order (default: the manifest's, or 0)");
    sub->add_option("--near-dup", *near_dup, "Jaccard over shingles at which two documents are one (default 0.5)")
        ->check(CLI::Range(0.01, 1.0));
    sub->add_option("--eval-share", *eval_share, "Share of groups held out for eval (default 0.1)")
        ->check(CLI::Range(0.0, 0.99));
    sub->add_option("--tokens", *tokens, "Calib tokens shared by the weighted sources (default: all they have)")
        ->check(CLI::Range(uint64_t(1), uint64_t(1) << 50));
    sub->add_option("--doc-tokens", *doc_tokens, "Longest document in tokens; longer ones are cut (default 4096)")
        ->check(CLI::Range(16u, 1u << 24));
    sub->add_option("--tasks-per-domain", *tasks_per_domain,
                    "Choice tasks per domain from the held-out side, in tasks.txt (default 100; 0: none)")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    sub->add_option("--task-context", *task_context, "Tokens of context per choice task (default 64)")
        ->check(CLI::Range(int64_t(1), int64_t(kMostTaskTokens)));
    sub->add_option("--task-ending", *task_ending, "Tokens per ending of a choice task (default 48)")
        ->check(CLI::Range(int64_t(1), int64_t(kMostTaskTokens)));
    sub->add_flag("--strip-boilerplate", *strip, "Keep a long prefix shared by many documents in the first only");
    sub->add_flag("--allow-shortfall", opt->allow_shortfall, "Build even when a source cannot meet its budget");
    sub->add_option("--json", opt->report, "Also write the report (moeprune-corpus JSON) here");
    sub->add_option("-t,--threads", opt->threads, "Threads (0: one per core)")->check(thread_count())->capture_default_str();
    sub->callback([=, &action] {
        action = [=] {
            if (manifest->empty() == sources->empty()) {
                throw Error("give either --manifest FILE or --source DOMAIN=PATH (one or more)");
            }
            if (!manifest->empty()) {
                opt->spec = read_manifest(*manifest);
            }
            for (const std::string & s : *sources) {
                opt->spec.sources.push_back(source_from_flag(s));
            }
            if (*seed) {
                opt->spec.seed = **seed;
            }
            if (*near_dup) {
                opt->spec.near_dup = **near_dup;
            }
            if (*eval_share) {
                opt->spec.eval_share = **eval_share;
            }
            if (*tokens) {
                opt->spec.tokens = **tokens;
            }
            if (*doc_tokens) {
                opt->spec.doc_tokens = **doc_tokens;
            }
            opt->spec.strip_boilerplate = opt->spec.strip_boilerplate || *strip;
            opt->spec.task_context = task_context->value_or(opt->spec.task_context);
            opt->spec.task_ending = task_ending->value_or(opt->spec.task_ending);
            opt->spec.tasks_per_domain = tasks_per_domain->value_or(opt->spec.tasks_per_domain);
            init_llama({});
            std::printf("%s", summary(build_corpus(*opt)).c_str());
            return 0;
        };
    });
}

} // namespace moeprune::cli
