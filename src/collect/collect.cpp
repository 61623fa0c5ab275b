// collect: the run from its options to the statistics, and the checks before llama.cpp
// loads the model (options, the model's routed layers, media in the corpus).
#include "collect/collect.h"
#include "engine/arch_quirks.h"
#include "collect/collect_run.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "engine/session.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <thread>

namespace moeprune {

namespace collect_impl {

// The layers collect records: the trunk's routed ones, then the MTP head's unless --no-mtp.
std::vector<int> collected_layers(const CollectOptions & opt, const InspectReport & info) {
    std::vector<int> layers = info.routed_layers();
    if (opt.mtp) {
        const std::vector<int> mtp = info.mtp_layers();
        layers.insert(layers.end(), mtp.begin(), mtp.end());
    }
    return layers;
}

namespace {

// Which expert-output node is f before gating: the last of down, its per-expert scale,
// its bias, as build_moe_ffn applies them.
std::string down_node_of(const GgufModel & model, int layer) {
    bool scale = false, bias = false;
    const std::string prefix = fmt::format("blk.{}.ffn_down_exps.", layer);
    for (const TensorEntry & t : model.tensors()) {
        scale = scale || t.name == prefix + "scale";
        bias = bias || t.name == prefix + "bias";
    }
    return bias ? "ffn_moe_down_biased" : scale ? "ffn_moe_down_scaled" : "ffn_moe_down";
}

void check_collect_options(const CollectOptions & opt) {
    if (opt.ctx < 8 || opt.batch < 1 || opt.ubatch < 1 || opt.trace_top < 1) {
        throw Error("-c must be at least 8, -b, -ub and --trace-top at least 1");
    }
    if (opt.threads < 0 || opt.gpu_layers < 0 || opt.chunks == 0 || opt.chunks < -1 || opt.save_every < 0) {
        throw Error("-t, -ngl and --save-every must be >= 0, --chunks >= 1 (or -1 for all)");
    }
    if (opt.generate < 0 || opt.generate >= opt.ctx / 2) {
        throw Error(fmt::format("--generate {} must be below half the context ({})", opt.generate, opt.ctx));
    }
    if (opt.resume && opt.save_every <= 0) {
        throw Error("--resume continues from the checkpoints of --save-every N: give it too");
    }
    if (!opt.imatrix.empty() && opt.save_every > 0) {
        throw Error(
            "--imatrix is gathered in one uninterrupted run: checkpoints (--save-every, --resume) do not hold it");
    }
}

// The model's routed layers, refused before llama.cpp loads it when collect cannot run.
InspectReport inspect_for_collect(const CollectOptions & opt, const GgufModel & gguf) {
    InspectReport info = inspect_model(gguf, {});
    if (!info.problems.empty()) {
        fail_file(opt.model.string(), "is inconsistent: " + fmt::format("{}", fmt::join(info.problems, "; ")));
    }
    if (info.routed_layers().empty()) {
        fail_file(opt.model.string(),
                  "has routed experts only in MTP (nextn) layers, which a forward pass does not run");
    }
    if (!opt.trace.empty() && opt.trace_top < info.n_expert_used) {
        throw Error(fmt::format("--trace-top {} is below the {} experts the model uses per token", opt.trace_top,
                                info.n_expert_used));
    }
    return info;
}

// Windows of every document, in corpus order, the first --chunks of them; `total` counts
// them all.
std::vector<CorpusWindow> collect_windows(const CollectOptions & opt, const Corpus & corpus, const llama_model * model,
                                          const MediaEncoder * media, size_t & total) {
    WindowRule rule;
    rule.corpus = opt.corpus;
    rule.length = size_t(opt.ctx - opt.generate);
    rule.for_generation = opt.generate > 0;
    rule.parse_special = opt.parse_special;
    rule.length_named = fmt::format("a window of {} (-c {} less --generate {})", rule.length, opt.ctx, opt.generate);
    rule.advice = ": raise -c";
    std::vector<CorpusWindow> windows = corpus_windows(corpus, model, media, rule);
    total = windows.size();
    if (keep_first_chunks(windows, opt.chunks)) {
        std::fprintf(stderr, "moeprune collect: --chunks %lld: evaluating %lld of the corpus' %zu windows\n",
                     (long long)opt.chunks, (long long)opt.chunks, total);
    }
    return windows;
}

// The corpus, its media among the inputs no output may overwrite, and its domains (a
// trace's ids are 16 bits).
Corpus read_collect_corpus(const CollectOptions & opt, const GgufModel & gguf) {
    std::vector<std::filesystem::path> inputs = gguf.shard_paths();
    inputs.push_back(opt.corpus);
    inputs.push_back(opt.mmproj);
    Corpus corpus = read_corpus(opt.corpus);
    for (const fs::path & m : media_paths(corpus)) {
        inputs.push_back(m);
    }
    refuse_output_clashes({opt.output, opt.trace, opt.imatrix, collect_checkpoint_path(opt.output)}, inputs);
    add_modality_domains(corpus);
    if (!opt.trace.empty() && corpus.domains.size() + 1 > kMaxTraceDomains) {
        fail_file(opt.corpus.string(), fmt::format("has {} domains; a trace stores domain ids in 16 bits and holds at most "
                                                   "{} besides \"no domain\"", corpus.domains.size(), kMaxTraceDomains - 1));
    }
    return corpus;
}

// A multimodal model calibrated on text alone is warned about; media with the MTP head refused.
void check_media_calibration(const CollectOptions & opt, const InspectReport & info, const Corpus & corpus,
                             bool with_mtp) {
    if ((!opt.mmproj.empty() || arch_quirks(info.arch).vision_language) && corpus.media_modalities.empty()) {
        std::fprintf(stderr,
                     "moeprune collect: WARNING: %s calibrates a multimodal model (%s) with no images or audio: experts "
                     "that only media route to will look dead in these statistics. Add image or audio parts to the "
                     "corpus (docs/formats.md) and give --mmproj.\n",
                     opt.corpus.c_str(),
                     opt.mmproj.empty() ? (info.arch + " is a vision-language architecture").c_str()
                                        : ("a projector was given, " + opt.mmproj.string()).c_str());
    }
    if (with_mtp && !corpus.media_modalities.empty()) {
        fail_file(opt.corpus.string(), "holds media, and the model's MTP head drafts from token ids, which media "
                                       "positions have none: give --no-mtp");
    }
}

// A context whose graph callback is the collector.
ContextPtr collect_context(const CollectOptions & opt, llama_model * model, int threads, Collector & collector) {
    return new_context(model, {opt.ctx, opt.batch, std::min(opt.ubatch, opt.batch), threads, &Collector::callback,
                               &collector});
}

} // namespace

} // namespace collect_impl

CollectResult collect(const CollectOptions & opt) {
    using namespace collect_impl;
    check_collect_options(opt);
    const GgufModel gguf = GgufModel::open(opt.model);
    Corpus corpus = read_collect_corpus(opt, gguf);
    const InspectReport info = inspect_for_collect(opt, gguf);
    const std::vector<int> moe_layers = collected_layers(opt, info);
    const bool with_mtp = moe_layers.size() > info.routed_layers().size();

    check_media_calibration(opt, info, corpus, with_mtp);

    init_llama(opt.rpc);
    const ModelPtr model = load_model(opt.model, opt.gpu_layers, with_mtp);
    const int n_embd = llama_model_n_embd(model.get());
    const int threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    std::unique_ptr<MediaEncoder> media;
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, model.get(), threads, opt.gpu_layers > 0);
    }
    size_t total_windows = 0;
    const std::vector<CorpusWindow> windows = collect_windows(opt, corpus, model.get(), media.get(), total_windows);

    CollectResult res;
    SaliencyStats & stats = res.stats;
    stats = empty_stats(opt, gguf, info, corpus);
    const json settings = result_settings(opt);
    // The trace grows under TRACE.partial and takes its name only when the statistics are
    // complete, so a killed or failed run never leaves a trace that reads as whole.
    const fs::path trace_partial = opt.trace.empty() ? fs::path() : fs::path(opt.trace.string() + ".partial");
    // Checkpoints live under their own name: a reader that never looks at "complete"
    // cannot take one for finished statistics.
    const fs::path checkpoint_path = collect_checkpoint_path(opt.output);
    const ResumePoint resumed =
        opt.resume ? resume_from_checkpoint(opt, corpus, settings, trace_partial, stats, res) : ResumePoint{};

    const std::string down_node = down_node_of(gguf, moe_layers.front());
    std::optional<ImatrixAccumulator> imatrix;
    if (!opt.imatrix.empty()) {
        imatrix.emplace();
    }
    Collector collector(opt, info.arch, moe_layers, int(info.n_expert), int(info.n_expert_used), n_embd, down_node,
                        corpus.domains, stats, imatrix ? &*imatrix : nullptr);
    if (!resumed.trace_count.empty()) {
        collector.set_trace_count(resumed.trace_count);
    }
    if (!resumed.prob_drops.empty()) {
        collector.set_prob_drops(resumed.prob_drops);
    }
    PartialTrace trace_guard{trace_partial, opt.save_every > 0};
    const std::unique_ptr<TraceWriter> trace =
        opt.trace.empty() ? nullptr : open_trace(opt, info, corpus, stats.model, settings, collector.trace_m(),
                                                 trace_partial, resumed.trace_from);
    const ContextPtr ctx = collect_context(opt, model.get(), threads, collector);
    std::unique_ptr<MtpHead> mtp;
    if (with_mtp) {
        collector.runs_mtp();
        mtp = std::make_unique<MtpHead>(model.get(), ctx.get(),
                                        ContextSettings{opt.ctx, opt.batch, std::min(opt.ubatch, opt.batch), threads,
                                                        &Collector::callback, &collector});
    }

    CollectPass pass(opt, corpus, ctx.get(), mtp.get(), media.get(), collector, trace.get(), res, settings, total_windows,
                     threads);
    const double seconds = pass.run(windows, resumed.first_window);
    res.windows = windows.size();
    if (trace) {
        trace->close();
    }
    const std::vector<Invariant> inv =
        check_invariants(stats, info, moe_layers, collector, trace_partial, trace != nullptr, res);
    pass.describe(windows.size(), true);
    record_run(stats, res, collector, down_node, seconds, inv);
    refuse_broken_invariants(opt, stats, inv);
    commit_outputs(opt, stats, imatrix, trace ? trace_partial : fs::path());
    trace_guard.committed = true;
    std::error_code ec;
    fs::remove(checkpoint_path, ec);  // a leftover checkpoint only makes a later --resume refuse
    return res;
}

} // namespace moeprune
