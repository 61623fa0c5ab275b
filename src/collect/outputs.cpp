// Collect's outputs: the empty statistics a run fills, the trace it grows, and all of
// them given their final names together once whole.
#include "collect/collect_run.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"

#include <algorithm>

namespace moeprune::collect_impl {

SaliencyStats empty_stats(const CollectOptions & opt, const GgufModel & gguf, const InspectReport & info,
                          const Corpus & corpus) {
    const std::vector<int> moe_layers = collected_layers(opt, info);
    SaliencyStats stats = SaliencyStats::empty(int64_t(moe_layers.size()), info.n_expert, info.n_expert_used);
    stats.model = {{"digest", model_digest(gguf.shard_paths())},
                   {"arch", info.arch},         {"name", info.name},           {"file_bytes", info.file_bytes},
                   {"n_expert", info.n_expert}, {"n_expert_used", info.n_expert_used}, {"moe_layers", moe_layers},
                   {"expert_group_count", std::max<int64_t>(1, info.expert_group_count)}};
    if (opt.mtp && !info.mtp_layers().empty()) {
        stats.model["mtp_layers"] = info.mtp_layers();
    }
    for (const std::string & d : corpus.domains) {
        stats.domains[d] = {0, std::vector<LayerStats>(moe_layers.size(), LayerStats(size_t(info.n_expert)))};
    }
    if (opt.coact) {
        for (LayerStats & L : stats.layers) {
            L.coact.assign(size_t(info.n_expert) * size_t(info.n_expert - 1) / 2, 0);
        }
    }
    return stats;
}

// The trace, growing under `partial`; continued from `resume_at` when resuming.
std::unique_ptr<TraceWriter> open_trace(const CollectOptions & opt, const InspectReport & info, const Corpus & corpus,
                                        const json & model, const json & settings, int top_m, const fs::path & partial,
                                        const std::optional<TraceResumePoint> & resume_at) {
    const std::vector<int> moe_layers = collected_layers(opt, info);
    TraceHeader h;
    h.n_layer = uint32_t(moe_layers.size());
    h.n_expert = uint32_t(info.n_expert);
    h.top_m = uint32_t(top_m);
    h.domains = {""};
    h.domains.insert(h.domains.end(), corpus.domains.begin(), corpus.domains.end());
    h.meta = {{"n_expert_used", info.n_expert_used}, {"moe_layers", moe_layers}, {"model", model},
              {"corpus", opt.corpus.string()},          {"settings", settings}};
    if (model.contains("mtp_layers")) {
        h.meta["mtp_layers"] = model["mtp_layers"];
    }
    return resume_at ? std::make_unique<TraceWriter>(partial, h, *resume_at) : std::make_unique<TraceWriter>(partial, h);
}

// Every output is written whole under a temporary name before any takes its final
// one, the statistics last: a failed write (disk full) leaves no finished trace or
// imatrix beside no statistics. Only a failed rename between the renames could.
// `trace_partial`: the closed trace to rename into place, or empty.
void commit_outputs(const CollectOptions & opt, SaliencyStats & stats, std::optional<ImatrixAccumulator> & imatrix,
                    const fs::path & trace_partial) {
    std::optional<AtomicOutput> imatrix_out;
    if (imatrix) {
        imatrix_out.emplace(opt.imatrix);
        imatrix->write(*imatrix_out, {opt.corpus.string()}, uint32_t(opt.ctx));
        stats.settings["imatrix"] = opt.imatrix.string();
    }
    AtomicOutput stats_out(opt.output);
    write_stats(stats_out, stats);
    if (imatrix_out) {
        imatrix_out->commit();
    }
    if (!trace_partial.empty()) {
        std::error_code ec;
        fs::rename(trace_partial, opt.trace, ec);
        if (ec) {
            fail_file(opt.trace.string(), "cannot rename " + trace_partial.string() + " into place: " + ec.message());
        }
    }
    stats_out.commit();
}

} // namespace moeprune::collect_impl
