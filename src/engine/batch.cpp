#include "engine/batch.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

DecodeBatch::DecodeBatch(size_t tokens, size_t seqs)
    : batch_(llama_batch_init(int32_t(tokens), 0, int32_t(seqs))), capacity_(tokens), seqs_(seqs) {}

DecodeBatch::~DecodeBatch() { llama_batch_free(batch_); }

void DecodeBatch::clear() {
    batch_.n_tokens = 0;
    outputs_ = 0;
}

void DecodeBatch::add(llama_token tok, int32_t pos, std::span<const int> seqs, bool output) {
    if (size_t(batch_.n_tokens) >= capacity_ || seqs.size() > seqs_ || seqs.empty()) {
        throw Error(fmt::format("a decode batch of {} rows in at most {} sequences cannot take row {} in {} sequences",
                                capacity_, seqs_, batch_.n_tokens, seqs.size()));
    }
    const int32_t k = batch_.n_tokens++;
    batch_.token[k] = tok;
    batch_.pos[k] = pos;
    batch_.n_seq_id[k] = int32_t(seqs.size());
    std::copy(seqs.begin(), seqs.end(), batch_.seq_id[k]);
    batch_.logits[k] = output;
    outputs_ += output;
}

void DecodeBatch::output_last() {
    outputs_ += !batch_.logits[batch_.n_tokens - 1];
    batch_.logits[batch_.n_tokens - 1] = true;
}

void DecodeBatch::decode(llama_context * ctx, const std::function<std::string()> & what, const std::function<void()> & after,
                         const std::function<void(int32_t, int32_t, int32_t)> & on_piece) const {
    const int32_t n_batch = int32_t(llama_n_batch(ctx));
    for (int32_t i = 0; i < batch_.n_tokens; i += n_batch) {
        const int32_t n = std::min(n_batch, batch_.n_tokens - i);
        const llama_batch piece = {n,
                                   batch_.token + i,
                                   nullptr,
                                   batch_.pos + i,
                                   batch_.n_seq_id + i,
                                   batch_.seq_id + i,
                                   batch_.logits + i};
        const int rc = llama_decode(ctx, piece);
        if (after) {
            after();
        }
        if (rc != 0) {
            throw Error(fmt::format("llama_decode failed ({}) on {}", rc, what()));
        }
        if (on_piece) {
            on_piece(i, n, int32_t(std::count_if(piece.logits, piece.logits + n, [](int8_t o) { return o != 0; })));
        }
    }
}

} // namespace moeprune
