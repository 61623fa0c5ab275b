#include "engine/mtp.h"
#include "core/errors.h"

#include "llama-ext.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace moeprune {

MtpHead::MtpHead(llama_model * model, llama_context * trunk, const ContextSettings & s) : trunk_(trunk), ctx_(nullptr, llama_free) {
    if (llama_model_n_layer_nextn(model) < 1) {
        throw Error("the model was loaded without MTP (nextn) layers");
    }
    ContextSettings mtp = s;
    mtp.type = LLAMA_CONTEXT_TYPE_MTP;
    ctx_ = new_context(model, mtp);
    n_embd_ = llama_model_n_embd_out(model);
    n_heads_ = llama_model_n_layer_nextn(model);
    // The trunk's rows for every token, whatever its logits flags; the head's only for its
    // output rows, which are all of them here.
    llama_set_embeddings_nextn(trunk_, true, false);
    llama_set_embeddings_nextn(ctx_.get(), true, true);
    carried_h_.assign(size_t(n_embd_), 0.0f);
}

void MtpHead::reset() {
    llama_memory_clear(llama_get_memory(ctx_.get()), true);
    std::fill(carried_h_.begin(), carried_h_.end(), 0.0f);
}

void MtpHead::decode(const std::vector<llama_token> & tokens, int32_t pos0) {
    const int32_t n = int32_t(tokens.size());
    const float * h = llama_get_embeddings_nextn(trunk_);
    if (!h) {
        throw Error("llama.cpp gave no hidden states (h_nextn) of the trunk for the MTP head");
    }
    llama_batch batch = llama_batch_init(n, n_embd_, 1);
    // llama_batch_init allocates embeddings or tokens; the head reads both (freed with the batch).
    batch.token = static_cast<llama_token *>(std::malloc(sizeof(llama_token) * size_t(n)));
    const size_t row = size_t(n_embd_);
    for (int32_t k = 0; k < n; ++k) {
        batch.token[k] = tokens[size_t(k)];
        batch.pos[k] = pos0 + k;
        batch.n_seq_id[k] = 1;
        batch.seq_id[k][0] = 0;
        // Every row an output: some MTP graphs route only their output rows.
        batch.logits[k] = true;
        std::memcpy(batch.embd + size_t(k) * row, k == 0 ? carried_h_.data() : h + size_t(k - 1) * row,
                    row * sizeof(float));
    }
    batch.n_tokens = n;
    std::memcpy(carried_h_.data(), h + size_t(n - 1) * row, row * sizeof(float));
    // The first head last: its logits and its cache are the ones left for the caller.
    int rc = 0;
    for (int head = n_heads_ - 1; head >= 0 && rc == 0; --head) {
        if (n_heads_ > 1) {
            llama_memory_seq_rm(llama_get_memory(ctx_.get()), 0, pos0, -1);
            llama_set_nextn_layer_offset(ctx_.get(), head);
        }
        rc = llama_decode(ctx_.get(), batch);
    }
    llama_batch_free(batch);
    if (rc != 0) {
        throw Error(fmt::format("llama_decode of the MTP head failed ({}) on a batch of {} tokens", rc, n));
    }
}

const float * MtpHead::logits(int32_t i) const {
    return llama_get_logits_ith(ctx_.get(), i);
}

} // namespace moeprune
