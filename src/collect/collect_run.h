#pragma once
// Collect's internals shared by the files of its phases: the pass over the windows, the
// checkpoint a resumed run continues from, the invariants and the outputs. Private to
// collect (its interface: collect/collect.h).
#include "collect/collect.h"
#include "collect/collector.h"
#include "collect/imatrix.h"
#include "core/progress.h"
#include "engine/media.h"
#include "engine/mtp.h"
#include "engine/windows.h"
#include "formats/corpus.h"
#include "formats/trace.h"
#include "model/inspect.h"
#include "model/model_file.h"

#include "llama.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace moeprune::collect_impl {

namespace fs = std::filesystem;
using nlohmann::json;

// The settings that change what is counted: a resumed run must use the same.
json result_settings(const CollectOptions & o);

// The layers collect records: the trunk's routed ones, then the MTP head's unless --no-mtp.
std::vector<int> collected_layers(const CollectOptions & opt, const InspectReport & info);

// Where a resumed run continues: what its checkpoint had counted.
struct ResumePoint {
    size_t first_window = 0;
    std::optional<TraceResumePoint> trace_from;
    std::vector<std::vector<uint64_t>> trace_count;
    std::vector<uint64_t> prob_drops;
};

// Reads the checkpoint into `stats` and `res` after checking it is this run's.
ResumePoint resume_from_checkpoint(const CollectOptions & opt, const Corpus & corpus, const json & settings,
                                   const fs::path & trace_partial, SaliencyStats & stats, CollectResult & res);

// The forward passes over the windows, with what the statistics' settings record.
class CollectPass {
public:
    CollectPass(const CollectOptions & opt, const Corpus & corpus, llama_context * ctx, MtpHead * mtp,
                const MediaEncoder * media, Collector & collector, TraceWriter * trace, CollectResult & res, json settings,
                size_t total_windows, int threads)
        : opt(opt), corpus(corpus), ctx(ctx), mtp(mtp), media(media), vocab(llama_model_get_vocab(llama_get_model(ctx))),
          collector(collector), trace(trace), res(res), stats(res.stats), settings(std::move(settings)),
          total_windows(total_windows), threads(threads) {}

    // Returns the seconds the passes took.
    double run(const std::vector<CorpusWindow> & windows, size_t first_window);
    // The statistics' settings: the run, its result settings and how far it got.
    void describe(size_t windows_done, bool complete);

private:
    void checkpoint(size_t windows_done);
    int32_t prefill(const CorpusWindow & w);
    int32_t decode_media(const CorpusWindow & w, const MediaSpan & span, int32_t pos0);
    void finish_batch(size_t n);
    void decode(std::vector<TokenInfo> infos);
    TokenInfo token_info(const CorpusWindow & w, llama_token tok, int32_t pos, TracePhase phase);
    TokenInfo media_info(const CorpusWindow & w, Modality modality, int32_t pos);
    TokenInfo row_info(const CorpusWindow & w, const std::string & domain, llama_token tok, int32_t pos, TracePhase phase);

    const CollectOptions & opt;
    const Corpus & corpus;
    llama_context * ctx;
    MtpHead * mtp;
    const MediaEncoder * media;
    const llama_vocab * vocab;
    Collector & collector;
    TraceWriter * trace;
    CollectResult & res;
    SaliencyStats & stats;
    const json settings;
    const size_t total_windows;
    const int threads;
    Progress * progress_ = nullptr;
};

struct Invariant {
    std::string name;
    bool ok;
    std::string detail;
};

std::vector<Invariant> check_invariants(const SaliencyStats & stats, const InspectReport & info,
                                        const std::vector<int> & moe_layers, const Collector & collector,
                                        const fs::path & trace_partial, bool traced, const CollectResult & res);
void record_run(SaliencyStats & stats, CollectResult & res, const Collector & collector, const std::string & down_node,
                double seconds, const std::vector<Invariant> & inv);
void refuse_broken_invariants(const CollectOptions & opt, const SaliencyStats & stats,
                              const std::vector<Invariant> & inv);

SaliencyStats empty_stats(const CollectOptions & opt, const GgufModel & gguf, const InspectReport & info,
                          const Corpus & corpus);
std::unique_ptr<TraceWriter> open_trace(const CollectOptions & opt, const InspectReport & info, const Corpus & corpus,
                                        const json & model, const json & settings, int top_m, const fs::path & partial,
                                        const std::optional<TraceResumePoint> & resume_at);

// Without checkpoints nothing can resume a failed run's trace: it goes with the failure.
struct PartialTrace {
    fs::path path;
    bool keep = false, committed = false;
    ~PartialTrace() {
        if (!committed && !keep && !path.empty()) {
            std::error_code ec;
            fs::remove(path, ec);
        }
    }
};

void commit_outputs(const CollectOptions & opt, SaliencyStats & stats, std::optional<ImatrixAccumulator> & imatrix,
                    const fs::path & trace_partial);

} // namespace moeprune::collect_impl
