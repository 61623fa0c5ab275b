#pragma once
// The one way moeprune fills and decodes a llama.cpp batch (collect's passes, eval's
// windows and choice tasks, measure's generation): tokens with their positions,
// sequences and whether each is an output, decoded in pieces of the context's n_batch as
// llama-perplexity decodes a long batch.
#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace moeprune {

class DecodeBatch {
public:
    // Room for `tokens` rows, each in at most `seqs` sequences.
    explicit DecodeBatch(size_t tokens, size_t seqs = 1);
    ~DecodeBatch();
    DecodeBatch(const DecodeBatch &) = delete;
    DecodeBatch & operator=(const DecodeBatch &) = delete;

    void clear();
    void add(llama_token tok, int32_t pos, std::span<const int> seqs, bool output);
    void add(llama_token tok, int32_t pos, std::initializer_list<int> seqs, bool output) {
        add(tok, pos, std::span<const int>(seqs.begin(), seqs.size()), output);
    }
    // In sequence 0.
    void add(llama_token tok, int32_t pos, bool output) { add(tok, pos, {0}, output); }
    // Makes the last row added an output.
    void output_last();

    int32_t size() const { return batch_.n_tokens; }
    size_t outputs() const { return outputs_; }

    // llama_decode over every row, in pieces of at most llama_n_batch(ctx) rows. After
    // each piece, `after` runs (a graph observer's rethrow_failure) before a failed
    // decode is reported, naming `what()` (made only then: a timed decode pays nothing for
    // it); `on_piece(first_row, rows, outputs)` then reads the piece's outputs
    // (llama_get_logits holds `outputs` rows).
    void decode(llama_context * ctx, const std::function<std::string()> & what, const std::function<void()> & after = {},
                const std::function<void(int32_t, int32_t, int32_t)> & on_piece = {}) const;

private:
    llama_batch batch_;
    size_t capacity_, seqs_;
    size_t outputs_ = 0;
};

} // namespace moeprune
