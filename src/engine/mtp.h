#pragma once
// The MTP (nextn) head as llama.cpp's own MTP drafting drives it (common/speculative.cpp,
// draft-mtp): a second context of type LLAMA_CONTEXT_TYPE_MTP over the same model, whose
// row k is the trunk's token k with the trunk's hidden state of position k-1 (h_nextn).
// Its logits at row k are the draft of the token the trunk's logits at position k predict,
// made before the trunk has run position k. The head keeps its own KV cache at the
// trunk's positions. A model must be loaded with its MTP layers (load_model's `mtp`).
#include "engine/session.h"

#include <cstdint>
#include <vector>

namespace moeprune {

class MtpHead {
public:
    // Also makes `trunk` output its h_nextn rows for every token of a batch.
    MtpHead(llama_model * model, llama_context * trunk, const ContextSettings & s);

    // A new sequence: an empty cache, and a zero hidden state before its first token (as
    // llama.cpp's drafter starts one).
    void reset();

    // Runs every head over the batch the trunk just decoded (`tokens` at `pos0`, `pos0+1`,
    // ...): row k gets the trunk's hidden state of the row before it, the first row the
    // last one of the previous batch. Heads after the first run on the same rows, as
    // llama.cpp's drafter catches them up; only the first one's drafts are measured.
    void decode(const std::vector<llama_token> & tokens, int32_t pos0);

    // The first head's logits of row `i` of the last decode.
    const float * logits(int32_t i) const;

    int n_heads() const { return n_heads_; }
    llama_context * context() const { return ctx_.get(); }

private:
    llama_context * trunk_;
    ContextPtr ctx_;
    int n_embd_ = 0, n_heads_ = 1;
    std::vector<float> carried_h_;
};

} // namespace moeprune
