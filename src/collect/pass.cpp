// Collect's pass: every window decoded from a clean context (text in batches, media
// through the projector, the MTP head after the trunk), generation after it, checkpoints.
#include "collect/collect_run.h"
#include "core/errors.h"
#include "engine/batch.h"
#include "formats/stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

namespace moeprune::collect_impl {

double CollectPass::run(const std::vector<CorpusWindow> & windows, size_t first_window) {
    uint64_t todo_tokens = 0;
    for (size_t w = first_window; w < windows.size(); ++w) {
        todo_tokens += windows[w].tokens.size() + size_t(opt.generate);
    }
    Progress progress("collect", todo_tokens, "tokens");
    progress_ = &progress;
    std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)> sampler(nullptr, llama_sampler_free);
    const auto started = std::chrono::steady_clock::now();
    for (size_t wi = first_window; wi < windows.size(); ++wi) {
        const CorpusWindow & w = windows[wi];
        llama_memory_clear(llama_get_memory(ctx), true);
        if (mtp) {
            mtp->reset();
        }
        const int32_t pos = prefill(w);
        if (opt.generate > 0) {
            // Greedy, or sampled with a seed per window so a resumed run generates the same text.
            sampler.reset(opt.seed < 0 ? llama_sampler_init_greedy()
                                       : llama_sampler_init_dist(uint32_t(opt.seed + int64_t(wi))));
            for (int g = 0; g < opt.generate; ++g) {
                const llama_token next = llama_sampler_sample(sampler.get(), ctx, -1);
                if (llama_vocab_is_eog(vocab, next)) {
                    break;
                }
                decode({token_info(w, next, pos + g, TracePhase::Decode)});
            }
        }
        if (opt.save_every > 0 && (wi + 1) % size_t(opt.save_every) == 0 && wi + 1 < windows.size()) {
            checkpoint(wi + 1);
        }
    }
    progress.finish();
    progress_ = nullptr;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

void CollectPass::describe(size_t windows_done, bool complete) {
    json prog = {{"windows", windows_done},
                 {"traced_tokens", res.traced_tokens},
                 {"prob_drops", collector.prob_drops()},
                 {"complete", complete}};
    if (trace) {
        trace->flush();
        prog["trace_bytes"] = trace->resume_point().bytes;
        prog["trace_count"] = collector.trace_count();
    }
    stats.settings = {{"model_file", opt.model.string()},
                      {"corpus", opt.corpus.string()},
                      {"corpus_digest", corpus.digest},
                      {"corpus_windows", total_windows},
                      {"trace", opt.trace.empty() ? json() : json(opt.trace.string())},
                      {"batch", opt.batch},
                      {"ubatch", opt.ubatch},
                      {"threads", threads},
                      {"gpu_layers", opt.gpu_layers},
                      {"rpc", opt.rpc},
                      {"result_settings", settings},
                      {"progress", prog},
                      {"tool", "moeprune collect"}};
}

void CollectPass::checkpoint(size_t windows_done) {
    describe(windows_done, false);
    write_stats(collect_checkpoint_path(opt.output), stats);
}

// The window's prompt: text in batches of -b, each media span encoded and decoded
// through the projector. Returns the next position.
int32_t CollectPass::prefill(const CorpusWindow & w) {
    const std::vector<MediaSpan> no_media;
    return walk_rows(
        w.media ? w.media->media : no_media, w.tokens.size(), size_t(opt.batch),
        [&](size_t first, size_t n, int32_t pos0) {
            std::vector<TokenInfo> infos;
            for (size_t i = 0; i < n; ++i) {
                infos.push_back(token_info(w, w.tokens[first + i], pos0 + int32_t(i), TracePhase::Prefill));
            }
            decode(std::move(infos));
        },
        [&](const MediaSpan & span, int32_t pos0) { return decode_media(w, span, pos0); });
}

// A media span's rows, recorded under its modality's domain with no token id.
int32_t CollectPass::decode_media(const CorpusWindow & w, const MediaSpan & span, int32_t pos0) {
    size_t rows = 0;
    const auto before = [&](size_t first, size_t n) {
        std::vector<TokenInfo> infos;
        for (size_t r = first - span.offset; r < first - span.offset + n; ++r) {
            // Rows past the positions an M-RoPE image takes share its last one.
            infos.push_back(media_info(w, span.modality,
                                       pos0 + int32_t(std::min<size_t>(r, size_t(std::max(span.n_pos, 1) - 1)))));
        }
        rows = n;
        collector.begin_batch(std::move(infos));
    };
    const auto after = [&] { finish_batch(rows); };
    try {
        return media->decode(ctx, *w.media, span, pos0, opt.batch, before, after);
    } catch (const Error &) {
        collector.rethrow_failure();
        throw;
    }
}

void CollectPass::finish_batch(size_t n) {
    collector.rethrow_failure();
    collector.end_batch(trace);
    ++res.decodes;
    stats.n_tokens += n;
    res.tokens += n;
    progress_->advance(n);
}

void CollectPass::decode(std::vector<TokenInfo> infos) {
    DecodeBatch batch(infos.size());
    std::vector<llama_token> tokens;
    for (const TokenInfo & t : infos) {
        batch.add(t.meta.token, t.meta.pos, true);  // every row through the last layer
        tokens.push_back(t.meta.token);
    }
    const size_t n = infos.size();
    const int32_t pos0 = infos.front().meta.pos;
    collector.begin_batch(std::move(infos));
    batch.decode(ctx, [&] { return fmt::format("a batch of {} tokens", n); }, [&] { collector.rethrow_failure(); });
    if (mtp) {
        collector.in_mtp_graph(true);
        try {
            mtp->decode(tokens, pos0);
        } catch (const Error &) {
            collector.rethrow_failure();
            throw;
        }
        collector.in_mtp_graph(false);
        collector.rethrow_failure();
    }
    finish_batch(n);
}

TokenInfo CollectPass::token_info(const CorpusWindow & w, llama_token tok, int32_t pos, TracePhase phase) {
    return row_info(w, corpus.documents[w.doc].domain, tok, pos, phase);
}

TokenInfo CollectPass::media_info(const CorpusWindow & w, Modality modality, int32_t pos) {
    return row_info(w, modality_name(modality), LLAMA_TOKEN_NULL, pos, TracePhase::Prefill);
}

TokenInfo CollectPass::row_info(const CorpusWindow & w, const std::string & domain, llama_token tok, int32_t pos,
                                TracePhase phase) {
    const CorpusDocument & doc = corpus.documents[w.doc];
    TokenInfo t;
    t.meta.token = tok;
    t.meta.pos = pos;
    t.meta.seq = int32_t(doc.session ? *doc.session : int64_t(w.doc));
    t.meta.phase = phase;
    const auto it = std::find(corpus.domains.begin(), corpus.domains.end(), domain);
    t.domain = domain.empty() ? -1 : int(it - corpus.domains.begin());
    t.meta.domain = uint16_t(t.domain + 1);
    t.traced = trace && (opt.trace_tokens == 0 || res.traced_tokens < opt.trace_tokens);
    res.traced_tokens += t.traced;
    if (t.domain >= 0) {
        ++stats.domains[domain].n_tokens;
    }
    return t;
}

} // namespace moeprune::collect_impl
