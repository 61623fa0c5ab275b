// Eval's windows: which stretches of the corpus it scores (from engine's windows), and how
// one is decoded, with its media before it and its MTP head's drafts after it.
#include "eval/eval_run.h"
#include "core/errors.h"
#include "engine/batch.h"
#include "engine/windows.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune::eval_impl {

// `rethrow` reports what a callback of the pass caught. A pass that watches routing makes
// every token an output: llama.cpp's last layer computes only output rows.
// Decodes tokens [0, n) at positions pos0.. of sequence 0; outputs are [first, last].
void decode_tokens(llama_context * ctx, const llama_token * tokens, int n, int pos0, int first, int last,
                   const std::function<void()> & rethrow) {
    DecodeBatch batch{size_t(n)};
    for (int i = 0; i < n; ++i) {
        batch.add(tokens[i], pos0 + i, i >= first && i <= last);
    }
    batch.decode(ctx, [&] { return fmt::format("{} tokens at position {}", n, pos0); }, rethrow);
}

namespace {

// The text and media before a media window's scored text, without outputs.
void decode_media_prefix(llama_context * ctx, const Window & w, int batch, const std::function<void()> & rethrow) {
    const MediaPrompt & p = *w.media;
    walk_rows(
        p.media, w.prefix_rows, size_t(batch),
        [&](size_t first, size_t n, int32_t pos0) { decode_tokens(ctx, p.tokens.data() + first, int(n), pos0, 0, -1, rethrow); },
        [&](const MediaSpan & span, int32_t pos0) {
            try {
                return w.encoder->decode(ctx, p, span, pos0, batch, {}, rethrow);
            } catch (const Error &) {
                if (rethrow) {
                    rethrow();
                }
                throw;
            }
        });
}

} // namespace

void decode_window(llama_context * ctx, const Window & w, const std::function<void()> & rethrow,
                   bool all_outputs) {
    llama_memory_clear(llama_get_memory(ctx), true);
    if (w.media) {
        decode_media_prefix(ctx, w, int(llama_n_batch(ctx)), rethrow);
    }
    const int n = int(w.tokens.size());
    decode_tokens(ctx, w.tokens.data(), n, w.pos0, all_outputs ? 0 : w.first, all_outputs ? n - 1 : w.last, rethrow);
}

// The MTP head's drafts over the window its trunk just decoded.
void draft_window(MtpHead * head, const Window & w, const std::function<void()> & rethrow) {
    head->reset();
    try {
        head->decode(w.tokens, 0);
    } catch (const Error &) {
        if (rethrow) {
            rethrow();
        }
        throw;
    }
    if (rethrow) {
        rethrow();
    }
}

namespace {

int domain_index(const Corpus & corpus, const std::string & domain) {
    return int(std::find(corpus.domains.begin(), corpus.domains.end(), domain) - corpus.domains.begin());
}

// A document with media: the text after its last media span is scored, under that
// span's modality's domain, after the rest is decoded.
Window media_window(const Corpus & corpus, const MediaEncoder & encoder, CorpusWindow && whole) {
    const MediaPrompt & prompt = *whole.media;
    const MediaSpan & last = prompt.media.back();
    Window w;
    w.doc = whole.doc;
    w.domain = domain_index(corpus, modality_name(last.modality));
    w.prefix_rows = last.offset + last.n_tokens;
    w.tokens.assign(prompt.tokens.begin() + long(w.prefix_rows), prompt.tokens.end());
    // A media span takes n_pos positions for its n_tokens rows (fewer for an M-RoPE image).
    w.pos0 = int32_t(w.prefix_rows);
    for (const MediaSpan & s : prompt.media) {
        w.pos0 -= int32_t(s.n_tokens) - s.n_pos;
    }
    w.last = int(w.tokens.size()) - 2;
    w.media = std::move(whole.media);
    w.encoder = &encoder;
    return w;
}

} // namespace

// Windows and the positions they score.
void EvalRun::make_windows() {
    const bool second_half = opt.score == "second-half";
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    WindowRule rule;
    rule.corpus = opt.corpus;
    rule.length = size_t(opt.ctx);
    rule.parse_special = opt.parse_special;
    rule.length_named = fmt::format("-c {}", opt.ctx);
    for (CorpusWindow & whole : corpus_windows(corpus, base.model.get(), media.get(), rule)) {
        Window w;
        if (whole.media) {
            w = media_window(corpus, *media, std::move(whole));
        } else {
            const CorpusDocument & doc = corpus.documents[whole.doc];
            w.doc = whole.doc;
            w.domain = doc.domain.empty() ? -1 : domain_index(corpus, doc.domain);
            w.tokens = std::move(whole.tokens);
            if (second_half) {
                // llama-perplexity's convention: whole windows only, each starting with BOS,
                // the first half context, the second half scored.
                if (int(w.tokens.size()) < opt.ctx) {
                    continue;
                }
                if (add_bos) {
                    w.tokens[0] = llama_vocab_bos(vocab);
                }
                w.first = opt.ctx / 2;
            }
            w.last = int(w.tokens.size()) - 2;
        }
        if (w.n_scored() > 0) {
            windows.push_back(std::move(w));
        }
    }
    keep_first_chunks(windows, opt.chunks);
    for (Window & w : windows) {
        w.first_record = n_scored;
        n_scored += uint64_t(w.n_scored());
    }
    if (n_scored == 0) {
        fail_file(opt.corpus.string(), second_half ? fmt::format("has no document of at least -c {} tokens, so "
                                                                 "--score second-half scores nothing", opt.ctx)
                                                   : "scores no tokens (every document is a single token)");
    }
}

} // namespace moeprune::eval_impl
