// One layer's routing read from the trace through the keep map, and next-layer prefetch's
// predictions of a layer's experts from the layer before.
#include "replay/internal.h"
#include "core/errors.h"
#include "sim/moce.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace moeprune::replay_impl {

LayerData load_layer(const Setup & s, uint32_t layer) {
    const TraceHeader & h = s.reader->header();
    const uint64_t n_tok = s.reader->n_tokens();
    const int k = s.k;
    LayerData d;
    d.width = s.keep_candidates ? h.top_m : 0;  // plain replays need only the unbiased top-k
    d.n_cand.assign(n_tok, 0);
    d.cand_ids = std::make_unique_for_overwrite<int32_t[]>(n_tok * d.width);
    d.cand_logits = std::make_unique_for_overwrite<float[]>(n_tok * d.width);
    d.n_unbiased.assign(n_tok, 0);
    d.unbiased.assign(n_tok * uint64_t(k), -1);
    d.forced.assign(n_tok, 0);
    if (s.moce_prior) {
        d.prior_delta.assign(n_tok, 0.0);
    }
    const std::vector<int32_t> * remap = s.old_to_new.empty() ? nullptr : &s.old_to_new[layer];
    MocePrior prior;
    s.reader->for_each_layer_chunk(layer, [&](uint64_t first, uint32_t n, const uint16_t * ids, const float * logits) {
        for (uint32_t i = 0; i < n; ++i) {
            const uint64_t t = first + i;
            int32_t * u = d.unbiased.data() + t * uint64_t(k);
            int32_t * cand = d.cand(t);
            float * logit = d.logit(t);
            uint32_t survivors = 0;
            float z0 = 0, zk = 0;
            for (uint32_t m = 0; m < h.top_m; ++m) {
                const float z = logits[size_t(i) * h.top_m + m];
                if (std::isnan(z)) {
                    fail_file(s.origin, fmt::format("NaN logit at token {} layer {} rank {}", t, layer, m));
                }
                const uint16_t old = ids[size_t(i) * h.top_m + m];
                const int32_t id = remap ? (*remap)[old] : int32_t(old);
                if (id < 0) {
                    continue;
                }
                if (survivors < d.width) {
                    cand[survivors] = id;
                    logit[survivors] = z;
                }
                if (survivors < uint32_t(k)) {
                    u[survivors] = id;
                    z0 = survivors == 0 ? z : z0;
                    zk = z;
                }
                ++survivors;
            }
            d.n_cand[t] = uint16_t(std::min(survivors, d.width));
            const uint32_t nu = std::min<uint32_t>(survivors, uint32_t(k));
            d.n_unbiased[t] = uint8_t(nu);
            d.forced[t] = uint8_t(uint32_t(k) - nu);
            std::sort(u, u + nu);
            if (s.moce_prior) {
                d.prior_delta[t] = survivors >= uint32_t(k) ? prior.add(double(z0) - double(zk)) : prior.value();
            }
        }
    });
    return d;
}

Predictions predict_layer(const LayerData & prev, const LayerData & cur, int k, int n_expert, int n_predict,
                          uint64_t train_tokens) {
    const uint64_t n_tok = cur.n_unbiased.size();
    Predictions p;
    p.n = n_predict;
    p.n_pred.assign(n_tok, 0);
    p.ids.assign(n_tok * uint64_t(n_predict), -1);
    std::vector<uint32_t> together(size_t(n_expert) * size_t(n_expert), 0);
    std::vector<uint64_t> score(static_cast<size_t>(n_expert));
    std::vector<int32_t> order;
    for (uint64_t t = 0; t < n_tok; ++t) {
        std::fill(score.begin(), score.end(), 0);
        for (int32_t a : prev.unbiased_of(t, k)) {
            const uint32_t * row = together.data() + size_t(a) * size_t(n_expert);
            for (int b = 0; b < n_expert; ++b) {
                score[size_t(b)] += row[b];
            }
        }
        order.clear();
        for (int b = 0; b < n_expert; ++b) {
            if (score[size_t(b)] > 0) {
                order.push_back(b);
            }
        }
        const size_t take = std::min(order.size(), size_t(n_predict));
        std::partial_sort(order.begin(), order.begin() + long(take), order.end(), [&](int32_t x, int32_t y) {
            return score[size_t(x)] != score[size_t(y)] ? score[size_t(x)] > score[size_t(y)] : x < y;
        });
        std::sort(order.begin(), order.begin() + long(take));
        std::copy_n(order.begin(), take, p.ids.begin() + long(t * uint64_t(n_predict)));
        p.n_pred[t] = uint8_t(take);
        if (train_tokens > 0 && t >= train_tokens) {
            continue;
        }
        for (int32_t a : prev.unbiased_of(t, k)) {
            for (int32_t b : cur.unbiased_of(t, k)) {
                ++together[size_t(a) * size_t(n_expert) + size_t(b)];
            }
        }
    }
    return p;
}

} // namespace moeprune::replay_impl
