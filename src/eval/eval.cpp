// run_eval, the chain of an eval run's phases, and its first ones: the options, the model,
// the keep maps, the base and its recorded file checked before anything runs.
#include "eval/eval.h"
#include "eval/eval_run.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <thread>

namespace moeprune {

namespace eval_impl {

namespace {

// What a base file compares: the model's content, never its file name.
json model_identity(const InspectReport & info, const GgufModel & gguf, const std::string & vocab) {
    return {{"digest", model_digest(gguf.shard_paths())}, {"file_bytes", info.file_bytes}, {"arch", info.arch},
            {"name", info.name},                          {"n_expert", info.n_expert},     {"vocab", vocab}};
}

} // namespace

// Every option checked, and the keep maps of --keep-dir listed, before any file is read.
void EvalRun::check_options() {
    if (opt.score != "all" && opt.score != "second-half") {
        throw Error(fmt::format("--score must be all or second-half, got \"{}\"", opt.score));
    }
    if (opt.ctx < 8 || opt.batch < 1 || opt.ubatch < 1 || opt.threads < 0 || opt.gpu_layers < 0 || opt.chunks == 0 ||
        opt.chunks < -1) {
        throw Error("-c must be at least 8, -b and -ub at least 1, -t and -ngl >= 0, --chunks >= 1 (or -1 for all)");
    }
    if (opt.top_tokens < 0) {
        throw Error(fmt::format("--worst {}: the number of worst tokens to list must be >= 0", opt.top_tokens));
    }
    if (!opt.base_out.empty() + !opt.base_in.empty() + !opt.against.empty() > 1) {
        throw Error("--base-out records the base, --base reads a recorded one, --against compares with a candidate "
                    "instead: give one of them");
    }
    keeps = opt.keeps;
    if (!opt.keep_dir.empty()) {
        std::error_code ec;
        std::vector<fs::path> found;
        for (const auto & e : fs::directory_iterator(opt.keep_dir, ec)) {
            if (e.path().extension() == ".json") {
                found.push_back(e.path());
            }
        }
        if (ec) {
            fail_file(opt.keep_dir.string(), "cannot list keep maps: " + ec.message());
        }
        if (found.empty()) {
            fail_file(opt.keep_dir.string(), "holds no keep maps (*.json)");
        }
        std::sort(found.begin(), found.end());
        keeps.insert(keeps.end(), found.begin(), found.end());
    }
    if (closed_loop) {
        if (opt.caches.empty()) {
            throw Error("--cache-policy needs --cache: the slots per layer of each simulated expert cache");
        }
        if (opt.lambdas.empty()) {
            throw Error("--lambda needs at least one value");
        }
        for (double l : opt.lambdas) {
            if (!(l >= 0.0) || !std::isfinite(l)) {
                throw Error(fmt::format("--lambda must be finite and >= 0, got {}", l));
            }
        }
        if (opt.moce != "prior" && opt.moce != "topk-gap") {
            throw Error(fmt::format("--moce must be prior or topk-gap, got \"{}\"", opt.moce));
        }
        if (opt.j && *opt.j < 0) {
            throw Error(fmt::format("--j must be >= 0, got {}", *opt.j));
        }
        for (const std::string & p : opt.cache_policies) {
            if (std::find(policy_names().begin(), policy_names().end(), p) == policy_names().end()) {
                throw Error(fmt::format("unknown --cache-policy {} (known: {})", p, fmt::join(policy_names(), ", ")));
            }
        }
    } else if (!opt.caches.empty() || !opt.trace_out.empty()) {
        throw Error("--cache and --trace-out belong to the closed loop: give --cache-policy too");
    }
    if (opt.generate < 0 || (opt.generate == 0 && !opt.prompts.empty())) {
        throw Error("--generate takes the number of tokens to generate per prompt (--prompts needs it)");
    }
    if (opt.tasks < 0) {
        throw Error(fmt::format("--tasks {}: the number of tasks to score must be at least 1 (0: llama-perplexity's "
                                "default)", opt.tasks));
    }
    const int task_files = !opt.hellaswag.empty() + !opt.winogrande.empty() + !opt.multiple_choice.empty();
    if (task_files > 1) {
        throw Error("--hellaswag, --winogrande, --multiple-choice: give one task file per run");
    }
    if (!opt.task_domains.empty() && opt.hellaswag.empty()) {
        throw Error("--task-domains describes a HellaSwag file made by corpus: give it with --hellaswag");
    }
    if (opt.parallel < 1 || opt.parallel > 256) {
        throw Error(fmt::format("--parallel {}: llama-perplexity's sequences per decode, 1 to 256 (fewer than 4 count as 4)",
                                opt.parallel));
    }
    if (keeps.empty() && opt.candidates.empty() && opt.base_out.empty() && !closed_loop && task_files == 0) {
        throw Error("nothing to evaluate: give --keep, --keep-dir, --candidate or --cache-policy (or --base-out to record "
                    "the base alone, a task file to score its accuracy alone)");
    }
}

// Outputs checked against every input, then the model's facts (MoCE's J among them).
void EvalRun::read_model() {
    gguf = GgufModel::open(opt.model);
    std::vector<fs::path> inputs = gguf.shard_paths();
    inputs.push_back(opt.corpus);
    inputs.push_back(opt.base_in);
    inputs.push_back(opt.prompts);
    inputs.push_back(opt.mmproj);
    inputs.push_back(opt.hellaswag);
    inputs.push_back(opt.winogrande);
    inputs.push_back(opt.multiple_choice);
    inputs.push_back(opt.task_domains);
    inputs.insert(inputs.end(), keeps.begin(), keeps.end());
    for (const fs::path & c : opt.candidates) {
        const GgufModel cm = GgufModel::open(c);
        inputs.insert(inputs.end(), cm.shard_paths().begin(), cm.shard_paths().end());
    }
    refuse_output_clashes({opt.base_out, opt.json_out, opt.per_token_out, opt.trace_out}, inputs);

    info = inspect_model(gguf, {});
    if (!info.problems.empty()) {
        fail_file(opt.model.string(), "is inconsistent (see moeprune inspect): " + fmt::format("{}", fmt::join(info.problems, "; ")));
    }
    facts = mask_facts(info);
    run_mtp = opt.mtp && !info.mtp_layers().empty();
    mask_layers = facts;
    if (run_mtp) {
        const std::vector<int> mtp = info.mtp_layers();
        mask_layers.moe_layers.insert(mask_layers.moe_layers.end(), mtp.begin(), mtp.end());
    }
    opt.j = moce_j(given.j, int(info.n_expert_used));
    if (closed_loop) {
        refuse_inert_moce(*opt.j, int(info.n_expert_used), opt.lambdas);
    }
}

// Keep maps are read and checked against the model before anything runs.
void EvalRun::read_keep_maps() {
    for (const fs::path & k : keeps) {
        KeepMap km = read_keep_map(k);
        if (run_mtp) {
            std::vector<int> missing;
            for (int l : info.mtp_layers()) {
                if (!km.layers.count(l)) {
                    missing.push_back(l);
                }
            }
            if (!missing.empty()) {
                fail_file(k.string(), fmt::format("leaves out the MTP (nextn) layer(s) {} of {}, whose head eval runs and "
                                                  "masks too: use a keep map from moeprune select on this model's "
                                                  "statistics (it covers them), or evaluate the trunk only with --mtp drop",
                                                  fmt::join(missing, ", "), opt.model.string()));
            }
        } else {
            for (auto it = km.layers.begin(); it != km.layers.end();) {
                // Without the head, a map may still cover the nextn layers for slice.
                it = info.is_nextn(it->first) ? km.layers.erase(it) : std::next(it);
            }
        }
        validate_keep_map_for_model(km, k.string(), info.n_expert, mask_layers.moe_layers);
        require_top_k_room(km, k.string(), info.n_expert_used);
        maps.emplace_back(k, std::move(km));
    }
}

// The recorded base (--base), the text and the base model with its vocabulary.
void EvalRun::load_base() {
    if (!opt.base_in.empty()) {
        base_file = BaseLogitsReader::open(opt.base_in);
    }

    corpus = read_corpus(opt.corpus);
    refuse_output_clashes({opt.base_out, opt.json_out, opt.per_token_out, opt.trace_out}, media_paths(corpus));
    if (opt.text_only) {
        media_documents_left_out = drop_media_documents(corpus);
    }
    add_modality_domains(corpus);
    refuse_unsupported_media();
    init_llama(opt.rpc);
    threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));

    base.model = load_model(opt.model, opt.gpu_layers, run_mtp);
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, base.model.get(), threads, opt.gpu_layers > 0);
    }
    vocab = llama_model_get_vocab(base.model.get());
    n_vocab = llama_vocab_n_tokens(vocab);
    base_vocab = vocab_digest(vocab);
}

// What does not take media yet, refused before a model loads: media without a
// projector, the passes that need every row's routing or token (the closed loop, MTP
// drafts), llama-perplexity's second-half scoring and the behaviour checks' prompts.
void EvalRun::refuse_unsupported_media() {
    if (corpus.media_modalities.empty()) {
        return;
    }
    const auto refuse = [&](const std::string & why) { refuse_media(corpus, why); };
    if (opt.mmproj.empty()) {
        refuse("no projector was given to encode it (--mmproj FILE)");
    }
    if (closed_loop) {
        refuse("the closed loop (--cache-policy) routes text only; evaluate media without it");
    }
    if (run_mtp) {
        refuse("the model's MTP head drafts from token ids, which media positions have none: give --mtp drop");
    }
    if (opt.score == "second-half") {
        refuse("--score second-half splits windows, and a document with media is one window: use --score all");
    }
    if (opt.generate > 0 && opt.prompts.empty()) {
        refuse("the behaviour checks (--generate) take text prompts: give them with --prompts FILE");
    }
}

// What a base file records: the settings, the model and T. A base given with --base must
// match them, and T is then its own.
void EvalRun::check_base_file() {
    settings = {{"ctx", opt.ctx}, {"score", opt.score}, {"parse_special", opt.parse_special}, {"chunks", opt.chunks}};
    base_identity = model_identity(info, gguf, base_vocab);
    // The compact base: T such that a record is at most 0.99% of llama-perplexity's 2 bytes per
    // vocabulary entry; the rest of 1% is the file's header, not negligible below ~100k tokens.
    const uint32_t top_max = uint32_t(std::max<int64_t>(1, (int64_t(n_vocab) * 2 * 99 / 10000 - 12) / 8));
    top = opt.top > 0 ? opt.top : std::min<uint32_t>(256, top_max);
    // Media rows come from the projector: a base recorded through another one scored other inputs.
    if (!corpus.media_modalities.empty()) {
        mmproj_identity = {{"file", opt.mmproj.string()}, {"digest", model_digest({opt.mmproj})}};
    }
    if (base_file) {
        const json & h = base_file->header();
        const std::string origin = opt.base_in.string();
        const json recorded_mmproj = h.contains("mmproj") && h["mmproj"].is_object() ? h["mmproj"] : json();
        const auto digest_of = [](const json & id) { return id.is_object() ? id.value("digest", json()) : json(); };
        if (digest_of(recorded_mmproj) != digest_of(mmproj_identity)) {
            fail_file(origin, fmt::format("was recorded through another projector ({}), not {}",
                                          recorded_mmproj.is_null() ? "none" : recorded_mmproj.value("file", json()).dump(),
                                          mmproj_identity.is_null() ? "none" : opt.mmproj.string()));
        }
        if (h.value("model", json()) != base_identity) {
            fail_file(origin, "was recorded on another model: " + h.value("model", json()).dump() + ", not " +
                                  base_identity.dump());
        }
        if (h.value("corpus", json()).value("digest", "") != corpus.digest) {
            fail_file(origin, "was recorded on other text (its corpus digest differs from " + opt.corpus.string() + ")");
        }
        if (h.value("settings", json()) != settings) {
            fail_file(origin, "was recorded with other settings: " + h.value("settings", json()).dump() + ", not " +
                                  settings.dump());
        }
        if (base_file->n_vocab() != n_vocab) {
            fail_file(origin, fmt::format("was recorded on a vocabulary of {} tokens, the model has {}", base_file->n_vocab(),
                                          n_vocab));
        }
        if (base_file->n_scored() != n_scored) {
            fail_file(origin, fmt::format("holds {} scored tokens, this text and settings score {}", base_file->n_scored(),
                                          n_scored));
        }
        top = base_file->top();
    }
    if (top > uint32_t(n_vocab)) {
        throw Error(fmt::format("--top {} exceeds the vocabulary of {} tokens", top, n_vocab));
    }
}

} // namespace eval_impl

EvalReport run_eval(const EvalOptions & given) {
    eval_impl::EvalRun run(given);
    run.check_options();
    run.read_model();
    run.read_keep_maps();
    run.read_tasks();
    run.load_base();
    run.make_windows();
    run.read_prompts();
    run.check_base_file();
    run.open_candidates();
    run.choose_reference();
    run.plan_closed_loop();
    run.open_base_context();
    run.name_candidates();
    run.open_outputs();
    run.score_windows();
    run.check_behaviour();
    run.score_tasks();
    run.finish_passes();
    run.score_statistics();
    run.describe_run();
    run.write_outputs();
    return run.take_report();
}

} // namespace moeprune
