#pragma once
// Token units: a document, or a piece of one, counted in the model's tokens exactly as
// collect and eval will read it, and cut to doc_tokens by its source's truncate rule.
#include "corpus/manifest.h"
#include "corpus/sources.h"
#include "engine/media.h"

#include "llama.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moeprune::corpus_build {

// A unit of output: one document or one piece of one, with its exact token count.
struct Unit {
    size_t doc;
    std::string text;
    std::vector<CorpusMessage> messages;
    uint64_t tokens = 0;
    bool truncated = false;
    bool piece = false;
};

// Snaps a byte offset of UTF-8 text back to the start of a code point.
size_t char_start(const std::string & s, size_t at);

class Tokenizer {
public:
    Tokenizer(const llama_model * model, uint32_t limit, const MediaEncoder * media)
        : model_(model), vocab_(llama_model_get_vocab(model)), limit_(limit), media_(media) {}

    uint64_t count(const std::string & text, const std::string & where) const;

    // Whether a prompt already holds the model's chat template: it has control tokens.
    bool templated(const std::string & prompt) const;

    // With media, the rows collect decodes: libmtmd's text tokens and media embeddings.
    uint64_t count_chat(const std::vector<CorpusMessage> & msgs, const std::string & where) const;

    // The units one document becomes under the limit.
    std::vector<Unit> units(size_t index, const SourceDocument & src, Truncate rule, const std::string & where) const;

private:
    // The longest end of `text` (starting at a line, word or character boundary) within the limit.
    Unit text_tail(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const;

    // Consecutive pieces within the limit, cut at line ends where possible.
    std::vector<Unit> text_pieces(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const;

    // Drops the fewest leading messages that brings the conversation within the limit; a
    // last message still too long keeps its end.
    Unit chat_tail(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const;

    std::vector<Unit> chat_pieces(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const;

    const llama_model * model_;
    const llama_vocab * vocab_;
    uint64_t limit_;
    const MediaEncoder * media_;
    mutable std::mutex media_mutex_;
};

} // namespace moeprune::corpus_build
