#pragma once
// How eval scores one position against the reference: the reference's distribution, exact
// or compact KL, and the compact record of --base-out. Private to eval.
#include "eval/eval.h"
#include "formats/base_logits.h"

#include <cstdint>
#include <vector>

namespace moeprune::eval_impl {

// The reference distribution of one scored position, from the live base context.
struct BaseRow {
    const float * logits = nullptr;
    float max = 0;
    double lse = 0;  // ln Σ exp(l - max)
    int argmax = 0;
};

BaseRow base_row(const float * l, int n_vocab, std::vector<float> * exps = nullptr);
TokenScore score_exact(const BaseRow & b, const float * c, int n_vocab, int32_t target);
TokenScore score_compact(const BaseRecord & r, const float * c, int n_vocab, std::vector<uint8_t> & in_top);
BaseRecord compact_record(const BaseRow & b, const std::vector<float> & exps, uint32_t top, int32_t target);
double kld_of_logits(const float * p, const float * q, int n_vocab);
int top1(const float * l, int n_vocab);

} // namespace moeprune::eval_impl
