// The one windowing rule of collect and eval: text cut into windows, a document with
// media one window that must fit.
#include "engine/windows.h"
#include "core/errors.h"
#include "engine/session.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

std::string document_where(const std::filesystem::path & corpus, const CorpusDocument & doc) {
    return doc.line ? fmt::format("{}:{}", corpus.string(), doc.line) : corpus.string();
}

namespace {

size_t media_markers(const std::string & text) {
    size_t markers = 0;
    for (size_t at = text.find(kMediaMarker); at != std::string::npos; at = text.find(kMediaMarker, at + 1)) {
        ++markers;
    }
    return markers;
}

// A document with media, as libmtmd tokenizes it: one window, which must fit.
CorpusWindow media_window(const MediaEncoder & media, const std::string & text, const CorpusDocument & doc, size_t d,
                          const WindowRule & rule, const std::string & where) {
    std::vector<CorpusMedia> parts = media_of(doc.messages);
    if (rule.for_generation) {
        // Rendered for generation, the conversation stops at its last user turn: its media
        // are the first ones, as many as the text holds markers.
        parts.resize(std::min(parts.size(), media_markers(text)));
    }
    auto prompt = std::make_shared<MediaPrompt>(media.tokenize(text, parts, rule.parse_special, where));
    if (prompt->tokens.size() > rule.length) {
        fail_file(where, fmt::format("takes {} rows with its media, more than {}; a document with media is not split{}",
                                     prompt->tokens.size(), rule.length_named, rule.advice));
    }
    return {d, prompt->tokens, std::move(prompt)};
}

} // namespace

std::vector<CorpusWindow> corpus_windows(const Corpus & corpus, const llama_model * model, const MediaEncoder * media,
                                         const WindowRule & rule) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<CorpusWindow> windows;
    for (size_t d = 0; d < corpus.documents.size(); ++d) {
        const CorpusDocument & doc = corpus.documents[d];
        const std::string where = document_where(rule.corpus, doc);
        const std::string text = document_text(model, doc, rule.for_generation, where);
        const std::vector<CorpusMedia> doc_media = media_of(doc.messages);
        if (!doc_media.empty()) {
            if (!media) {
                const CorpusMedia & first = doc_media.front();
                fail_file(where, fmt::format("has an {} ({}), but no projector was given to encode it (--mmproj FILE)",
                                             modality_name(first.modality), first.path.string()));
            }
            windows.push_back(media_window(*media, text, doc, d, rule, where));
            continue;
        }
        const std::vector<llama_token> toks = tokenize(vocab, text, rule.parse_special, where);
        for (size_t i = 0; i < toks.size(); i += rule.length) {
            windows.push_back({d, std::vector<llama_token>(toks.begin() + long(i),
                                                           toks.begin() + long(std::min(toks.size(), i + rule.length))),
                               nullptr});
        }
    }
    return windows;
}

} // namespace moeprune
