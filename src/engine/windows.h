#pragma once
// A corpus cut into the windows a pass decodes, each from a clean context: a text document
// in stretches of a fixed number of rows, a document with media whole, which must fit.
#include "engine/media.h"
#include "formats/corpus.h"

#include "llama.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace moeprune {

// A window of a document: its rows, and for a document with media the prompt libmtmd made
// (a media row holds LLAMA_TOKEN_NULL).
struct CorpusWindow {
    size_t doc = 0;
    std::vector<llama_token> tokens;
    std::shared_ptr<const MediaPrompt> media;
};

// How a stage cuts its windows.
struct WindowRule {
    std::filesystem::path corpus;  // the corpus file, for naming a document in errors
    size_t length = 0;             // rows per window
    bool for_generation = false;   // chats rendered up to their last user turn (document_text)
    bool parse_special = true;
    // A document with media longer than `length` is refused: how the message names the
    // length (the flags it comes from), and what it advises after "is not split".
    std::string length_named, advice;
};

// How errors name a document: FILE:LINE, or FILE for one without a line.
std::string document_where(const std::filesystem::path & corpus, const CorpusDocument & doc);

// Every document's windows, in corpus order. A document with media needs `media`, the
// projector that encodes it.
std::vector<CorpusWindow> corpus_windows(const Corpus & corpus, const llama_model * model, const MediaEncoder * media,
                                         const WindowRule & rule);

// --chunks: only the first `chunks` windows (-1: all). Returns whether any were left out.
template <class W> bool keep_first_chunks(std::vector<W> & windows, int64_t chunks) {
    if (chunks < 0 || size_t(chunks) >= windows.size()) {
        return false;
    }
    windows.resize(size_t(chunks));
    return true;
}

} // namespace moeprune
