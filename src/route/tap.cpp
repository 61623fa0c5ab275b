#include "route/tap.h"
#include "engine/arch_quirks.h"
#include "core/errors.h"
#include "route/router_graph.h"
#include "formats/trace.h"

#include "ggml-backend.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moeprune {

RouterTap::RouterTap(const MaskFacts & facts, int top_m, const ClosedLoopConfig * config, const KeepMap * keep,
                     RouterMask * mask, std::vector<double> expert_bytes)
    : facts_(facts), top_m_(top_m), config_(config), keep_(keep), mask_(mask), expert_bytes_(std::move(expert_bytes)) {
    if (arch_quirks(facts_.arch).gate_reads_derived_ids) {
        throw Error(facts_.arch + ": the gate reads expert ids scaled from ffn_moe_topk (adjugate experts), so written "
                    "ids would not be the experts used; closed-loop routing does not support this architecture");
    }
    if (top_m_ < facts_.n_expert_used || top_m_ > facts_.n_expert) {
        throw Error(fmt::format("--trace-top {} must be between the {} experts a token uses and the {} of a layer", top_m_,
                                facts_.n_expert_used, facts_.n_expert));
    }
    layers_.resize(facts_.moe_layers.size());
    for (size_t i = 0; i < facts_.moe_layers.size(); ++i) {
        ordinal_[facts_.moe_layers[i]] = int(i);
    }
    if (keep_) {
        for (int layer : facts_.moe_layers) {
            std::vector<int32_t> map(size_t(facts_.n_expert), -1);
            const std::vector<int32_t> & ids = keep_->layers.at(layer);
            for (size_t n = 0; n < ids.size(); ++n) {
                map[size_t(ids[n])] = int32_t(n);
            }
            old_to_new_.push_back(std::move(map));
        }
    }
    if (config_) {
        if (policy_reads_future(config_->policy)) {
            throw Error(fmt::format("{} reads the future requests, which a closed loop decides as it goes; replay it "
                                    "on a trace instead",
                                    config_->policy));
        }
        const int n_ids = keep_ ? int(keep_->k) : int(facts_.n_expert);
        if (config_->cache < facts_.n_expert_used || config_->cache > n_ids) {
            throw Error(fmt::format("a cache of {} experts per layer must hold the {} a token uses and at most the {} "
                                    "there are",
                                    config_->cache, facts_.n_expert_used, n_ids));
        }
        for (Layer & l : layers_) {
            l.policy = make_policy(config_->policy, n_ids, config_->cache, config_->params);
            l.step = std::make_unique<RoutingStep>(*l.policy, config_->lambda, config_->j,
                                                   policy_credits_candidates(config_->policy));
        }
    }
}

bool RouterTap::callback(ggml_tensor * t, bool ask, void * ud) {
    auto * self = static_cast<RouterTap *>(ud);
    bool mask_wants = false;
    if (self->mask_) {
        // The mask writes first, so the tap ranks what the masked router computed.
        mask_wants = RouterMask::callback(t, ask, self->mask_);
        if (!ask && self->mask_->failed()) {
            return false;
        }
    }
    // After the compute, a node only the mask asked for must not stop the graph.
    return self->guarded([&] { return self->on_node(t, ask) || !ask || mask_wants; });
}

void RouterTap::rethrow_failure() {
    if (mask_) {
        mask_->rethrow_failure();
    }
    GraphObserverFailure::rethrow_failure();
}

void RouterTap::begin_window(uint32_t window, size_t n_tokens) {
    window_ = window;
    window_tokens_ = n_tokens;
    for (Layer & l : layers_) {
        l.seen = 0;
    }
    if (!config_) {
        win_ids_.assign(n_tokens * layers_.size() * size_t(top_m_), 0);
        win_logits_.assign(win_ids_.size(), 0.0f);
    }
}

void RouterTap::end_window() const {
    for (size_t i = 0; i < layers_.size(); ++i) {
        if (layers_[i].seen != window_tokens_) {
            throw Error(fmt::format("{}: layer {} routed {} of the window's {} tokens", facts_.arch, facts_.moe_layers[i],
                                    layers_[i].seen, window_tokens_));
        }
    }
}

std::vector<float> RouterTap::read(const ggml_tensor * t) {
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[0] != facts_.n_expert || t->ne[2] != 1 ||
        t->ne[3] != 1) {
        throw Error(fmt::format("{}: node {} is not a dense f32 [{} experts, tokens] tensor", facts_.arch, t->name,
                                facts_.n_expert));
    }
    std::vector<float> out(size_t(ggml_nelements(t)));
    ggml_backend_tensor_get(t, out.data(), 0, ggml_nbytes(t));
    return out;
}

bool RouterTap::on_node(ggml_tensor * t, bool ask) {
    const RouterNode parsed = parse_router_node(t->name);
    if (parsed.layer < 0) {
        return false;
    }
    const std::string & node = parsed.name;
    const bool watched = node == "ffn_moe_logits" || node == "ffn_moe_logits_biased" || node == "ffn_moe_probs" ||
                         node == "ffn_moe_probs_biased" || node == "ffn_moe_probs_masked" || node == "ffn_moe_topk" ||
                         node == "ffn_moe_weights";  // the observer too: the same graph splits give the same sums
    if (!watched) {
        return false;
    }
    if (ask) {
        return true;
    }
    const auto it = ordinal_.find(parsed.layer);
    if (it == ordinal_.end()) {
        throw Error(fmt::format("{}: node {} belongs to layer {}, which has no routed experts", facts_.arch, t->name,
                                parsed.layer));
    }
    Layer & L = layers_[size_t(it->second)];
    if (node == "ffn_moe_logits" || node == "ffn_moe_logits_biased") {
        L.logits = read(t);
        L.logits_from_probs = false;
    } else if (node == "ffn_moe_probs") {
        L.probs = read(t);
        L.selection = L.probs;
        // Softmax over the selected experts: the router's logits carry this name.
        if (gating_of(t) == Gating::SoftmaxWeight) {
            L.logits_from_probs = true;
        }
    } else if (node == "ffn_moe_probs_biased" || node == "ffn_moe_probs_masked") {
        L.selection = read(t);
    } else if (node == "ffn_moe_topk") {
        route_layer(it->second, t);
    } else if (config_) {
        check_gate(it->second, t);
    }
    return true;
}

void RouterTap::route_layer(int ordinal, ggml_tensor * topk) {
    Layer & L = layers_[size_t(ordinal)];
    const int layer = facts_.moe_layers[size_t(ordinal)];
    const int E = int(facts_.n_expert), k = int(facts_.n_expert_used);
    const std::vector<float> & logits = L.logits_from_probs ? L.probs : L.logits;
    if (topk->type != GGML_TYPE_I32 || topk->ne[0] != k || topk->nb[0] != sizeof(int32_t)) {
        throw Error(fmt::format("{}: node {} is not i32 [{}, tokens]", facts_.arch, topk->name, k));
    }
    const int64_t T = topk->ne[1];
    if (logits.size() != size_t(E * T) || L.selection.size() != size_t(E * T)) {
        throw Error(fmt::format("{}: layer {} computed ffn_moe_topk without {} for its {} tokens: this graph variant is "
                                "not supported",
                                facts_.arch, layer, logits.size() != size_t(E * T) ? "ffn_moe_logits" : "ffn_moe_probs",
                                T));
    }
    if (L.seen + size_t(T) > window_tokens_) {
        throw Error(fmt::format("{}: layer {} saw more tokens than the window holds", facts_.arch, layer));
    }
    raw_.resize(ggml_nbytes(topk));
    ggml_backend_tensor_get(topk, raw_.data(), 0, raw_.size());
    const std::vector<int32_t> * to_new = keep_ ? &old_to_new_[size_t(ordinal)] : nullptr;
    bool wrote = false;
    L.expected.assign(size_t(T * k), 0);
    L.log_first = log.size();
    order_.resize(size_t(E));
    for (int64_t tok = 0; tok < T; ++tok) {
        int32_t * graph_row = reinterpret_cast<int32_t *>(raw_.data() + size_t(tok) * topk->nb[1]);
        const float * z = logits.data() + tok * E;
        rank_token(layer, graph_row, L.selection.data() + tok * E, z, to_new);
        const size_t pos = L.seen + size_t(tok);
        if (!config_) {
            const size_t base = (pos * layers_.size() + size_t(ordinal)) * size_t(top_m_);
            for (size_t r = 0; r < ranked_.size(); ++r) {
                win_ids_[base + r] = uint16_t(ranked_[r]);
                win_logits_[base + r] = z[ranked_[r]];
            }
            continue;
        }
        wrote = route_token(ordinal, graph_row, tok, pos, to_new) || wrote;
    }
    if (wrote) {
        ggml_backend_tensor_set(topk, raw_.data(), 0, raw_.size());
    }
    L.seen += size_t(T);
}

// Candidates as a trace ranks them (rank_candidates): the graph's top-k first. Leaves the
// top-M ids in ranked_ and their traced logits in z_.
void RouterTap::rank_token(int layer, const int32_t * graph_row, const float * sel, const float * z,
                           const std::vector<int32_t> * to_new) {
    const int E = int(facts_.n_expert), k = int(facts_.n_expert_used);
    std::vector<char> & in_topk = in_topk_;
    in_topk.assign(size_t(E), 0);
    for (int i = 0; i < k; ++i) {
        if (graph_row[i] < 0 || graph_row[i] >= E) {
            throw Error(fmt::format("{}: ffn_moe_topk-{} holds expert id {} (n_expert {})", facts_.arch, layer,
                                    graph_row[i], E));
        }
        in_topk[size_t(graph_row[i])] = 1;
    }
    size_t n_cand = 0;
    for (int e = 0; e < E; ++e) {
        if (!to_new || (*to_new)[size_t(e)] >= 0) {
            order_[n_cand++] = e;
        }
    }
    const size_t m = std::min(n_cand, size_t(top_m_));
    rank_candidates(order_, n_cand, m, in_topk, sel);
    ranked_.assign(order_.begin(), order_.begin() + long(m));
    z_.resize(m);
    for (size_t r = 0; r < m; ++r) {
        z_[r] = traced_logit(z[ranked_[r]]);
    }
}

// The replay rules (docs/replay.md) on this token's candidates and this layer's cache: the
// graph's row rewritten where the policy reroutes (returns whether it did), and the
// token's misses counted.
bool RouterTap::route_token(int ordinal, int32_t * graph_row, int64_t tok, size_t pos,
                            const std::vector<int32_t> * to_new) {
    Layer & L = layers_[size_t(ordinal)];
    const int layer = facts_.moe_layers[size_t(ordinal)];
    const int k = int(facts_.n_expert_used);
    const size_t m = ranked_.size();
    bool wrote = false;
    ranked_new_.resize(m);
    for (size_t r = 0; r < m; ++r) {
        ranked_new_[r] = to_new ? (*to_new)[size_t(ranked_[r])] : ranked_[r];
    }
    unbiased_new_.resize(size_t(k));
    int32_t removed = -1;   // a graph choice the keep map removes: an error unless MoCE routes around it
    for (int i = 0; i < k; ++i) {
        unbiased_new_[size_t(i)] = to_new ? (*to_new)[size_t(graph_row[i])] : graph_row[i];
        removed = removed < 0 && unbiased_new_[size_t(i)] < 0 ? graph_row[i] : removed;
    }
    std::sort(unbiased_new_.begin(), unbiased_new_.end());
    double delta = double(z_[0]) - double(z_[size_t(k - 1)]);
    if (config_->moce_prior) {
        delta = L.prior.add(delta);
    }
    PhaseCounts & c = counting_ ? counts_ : uncounted_;
    const std::span<const int32_t> chosen = L.step->choose(ranked_new_, z_, unbiased_new_, k, delta, c);
    if (removed >= 0 && !L.step->rerouted()) {
        throw Error(fmt::format("{}: layer {} routed to expert {}, which the keep map removes", facts_.arch, layer,
                                removed));
    }
    row_.assign(graph_row, graph_row + k);
    if (L.step->rerouted()) {
        const std::span<const uint32_t> ranks = L.step->chosen_ranks(k);
        for (int i = 0; i < k; ++i) {
            row_[size_t(i)] = ranked_[ranks[size_t(i)]];
        }
        std::memcpy(graph_row, row_.data(), size_t(k) * sizeof(int32_t));
        wrote = true;
    }
    const int misses = L.step->request(chosen, ranked_new_, z_);
    c.tokens += ordinal == 0;
    c.picks += uint64_t(k);
    c.misses += uint64_t(misses);
    c.add_exposed_reads(uint64_t(misses), config_->queue_depth,
                        expert_bytes_.empty() ? 0.0 : expert_bytes_[size_t(ordinal)]);
    std::copy(row_.begin(), row_.end(), L.expected.begin() + long(tok * k));
    if (record && counting_) {
        log.push_back({window_, int32_t(pos), layer, ranked_, z_, {}});
    }
    return wrote;
}

// The gate must have read the written ids (and their unbiased gate values): otherwise
// this architecture computes its experts from something else and the closed loop
// would measure routing that never happened.
void RouterTap::check_gate(int ordinal, ggml_tensor * weights) {
    Layer & L = layers_[size_t(ordinal)];
    const int layer = facts_.moe_layers[size_t(ordinal)];
    const int E = int(facts_.n_expert), k = int(facts_.n_expert_used);
    const ggml_tensor * ids = weights->src[1];
    const int64_t T = int64_t(L.expected.size()) / k;
    if (weights->op != GGML_OP_GET_ROWS || !ids || ids->type != GGML_TYPE_I32 || ids->ne[0] != k || ids->ne[1] != T ||
        weights->type != GGML_TYPE_F32 || ggml_nelements(weights) != int64_t(k) * T || !ggml_is_contiguous(weights)) {
        throw Error(fmt::format("{}: node {} is not the gate's read of ffn_moe_topk-{}; the closed loop cannot rewrite "
                                "this architecture's routing",
                                facts_.arch, weights->name, layer));
    }
    std::vector<uint8_t> raw(ggml_nbytes(ids));
    ggml_backend_tensor_get(ids, raw.data(), 0, raw.size());
    std::vector<float> w(size_t(k * T));
    ggml_backend_tensor_get(weights, w.data(), 0, ggml_nbytes(weights));
    for (int64_t tok = 0; tok < T; ++tok) {
        const int32_t * used = reinterpret_cast<const int32_t *>(raw.data() + size_t(tok) * ids->nb[1]);
        for (int i = 0; i < k; ++i) {
            const int32_t want = L.expected[size_t(tok * k + i)];
            const float gate = w[size_t(tok * k + i)], prob = L.probs[size_t(tok * E + used[i])];
            if (used[i] != want || !(gate == prob || (std::isnan(gate) && std::isnan(prob)))) {
                throw Error(fmt::format("{}: layer {} token {} gated expert {} with {} where the closed loop wrote expert "
                                        "{} (probability {}): node {} did not follow ffn_moe_topk; this architecture's "
                                        "routing cannot be rewritten",
                                        facts_.arch, layer, tok, used[i], gate, want, prob, weights->name));
            }
        }
        if (record && counting_) {
            log[L.log_first + size_t(tok)].used.assign(used, used + k);
        }
    }
}

} // namespace moeprune
