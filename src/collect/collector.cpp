// Collect's graph observer (collect/collector.h): the router nodes come from route's
// capture; how each token's routing adds to the statistics and the trace.
#include "collect/collector.h"
#include "engine/arch_quirks.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moeprune::collect_impl {

Collector::Collector(const CollectOptions & opt, std::string arch, std::vector<int> moe_layers, int n_expert,
                     int n_expert_used, int n_embd, std::string down_node, const std::vector<std::string> & domains,
                     SaliencyStats & stats, ImatrixAccumulator * imatrix)
    : opt_(opt), imatrix_(imatrix), arch_(std::move(arch)), moe_layers_(std::move(moe_layers)), n_expert_(n_expert),
      n_expert_used_(n_expert_used), down_node_(std::move(down_node)), domains_(domains),
      stats_(stats),
      capture_({arch_, moe_layers_, n_expert, n_expert_used, n_embd, down_node_, !opt.trace.empty()}),
      done_tokens_(moe_layers_.size(), 0),
      trace_count_(moe_layers_.size(), std::vector<uint64_t>(size_t(n_expert), 0)),
      prob_drops_(moe_layers_.size(), 0) {
    trace_m_ = std::min(opt.trace_top, n_expert);
}

void Collector::begin_batch(std::vector<TokenInfo> tokens) {
    batch_ = std::move(tokens);
    std::fill(done_tokens_.begin(), done_tokens_.end(), 0);
    capture_.new_graph();
    trace_ids_.assign(batch_.size() * moe_layers_.size() * size_t(trace_m_), 0);
    trace_logits_.assign(trace_ids_.size(), 0.0f);
}

void Collector::end_batch(TraceWriter * trace) {
    rethrow_failure();
    for (size_t l = 0; l < moe_layers_.size(); ++l) {
        if (done_tokens_[l] != batch_.size()) {
            throw Error(fmt::format("{}: layer {} reported {} of the batch's {} tokens: its node {}-{} was not "
                                    "computed for every token (architecture not supported as built)",
                                    arch_, moe_layers_[l], done_tokens_[l], batch_.size(), down_node_, moe_layers_[l]));
        }
    }
    if (trace) {
        const size_t per_token = moe_layers_.size() * size_t(trace_m_);
        for (size_t i = 0; i < batch_.size(); ++i) {
            if (batch_[i].traced) {
                trace->append(batch_[i].meta, trace_ids_.data() + i * per_token, trace_logits_.data() + i * per_token);
            }
        }
    }
}

bool Collector::on_node(ggml_tensor * t, bool ask) {
    // Every MoE layer is done once the final norm is computed: stopping the graph there
    // spares the output head, the largest matmul of a small-expert model, which only
    // feeds logits nobody reads (nor the imatrix, which leaves the head out).
    if (std::strcmp(t->name, "result_norm") == 0) {
        if (!ask) {
            capture_.new_graph();
        }
        // The MTP head reads the trunk's outputs, and its own graph routes only output rows.
        if (opt_.generate == 0 && !runs_mtp_) {
            head_stops_ += !ask;
            return ask;
        }
        return true;
    }
    // llama-imatrix runs no MTP head: the importance matrix stays the trunk's.
    const bool for_imatrix = imatrix_ && !in_mtp_graph_ && ImatrixAccumulator::wants(t);
    const auto complete = [&](int li, int il, LayerCapture & c) { process(li, c, il); };
    if (ask) {
        return capture_.on_node(t, true, complete) || for_imatrix;
    }
    if (for_imatrix) {
        imatrix_->observe(t);
    }
    capture_.on_node(t, false, complete);
    return true;
}

Error Collector::missing_node(int il, const char * what) const {
    return Error(fmt::format("{}: layer {} computed {} without {}: this graph variant is not supported "
                             "(refusing to record zeros)",
                             arch_, il, down_node_, what));
}

void Collector::process(int li, LayerCapture & c, int il) {
    if (c.topk.empty()) {
        throw missing_node(il, "ffn_moe_topk");
    }
    if (c.probs.empty()) {
        throw missing_node(il, "ffn_moe_probs");
    }
    if (c.weights.empty()) {
        throw missing_node(il, "ffn_moe_weights");
    }
    if (c.logits.empty() && !opt_.trace.empty()) {
        throw missing_node(il, "ffn_moe_logits");
    }
    const int64_t T = c.n_tokens;
    const size_t first = done_tokens_[size_t(li)];
    if (first + size_t(T) > batch_.size()) {
        throw Error(fmt::format("{}: layer {} saw more tokens than the batch holds", arch_, il));
    }
    const int k = n_expert_used_, E = n_expert_;
    LayerStats & L = stats_.layers[size_t(li)];
    std::vector<int32_t> chosen(static_cast<size_t>(k));
    for (int64_t r = 0; r < T; ++r) {
        const TokenInfo & tok = batch_[first + size_t(r)];
        LayerStats * D = tok.domain >= 0 ? &stats_.domains[domains_[size_t(tok.domain)]].layers[size_t(li)] : nullptr;
        for (int j = 0; j < k; ++j) {
            const float id = c.topk[size_t(r * k + j)];
            if (!(id >= 0 && id < float(E))) {
                throw Error(fmt::format("{}: ffn_moe_topk-{} holds expert id {} (n_expert {})", arch_, il, id, E));
            }
            chosen[size_t(j)] = int32_t(id);
        }
        const bool probs_finite = add_probabilities(li, il, c, r, chosen, tok, L, D);
        add_outputs(il, c, r, chosen, tok, probs_finite, li, L, D);
        if (opt_.coact && !L.coact.empty()) {
            add_coactivation(L, chosen);
        }
        if (tok.traced) {
            trace_row(li, first + size_t(r), c, r, chosen);
        }
    }
    done_tokens_[size_t(li)] += size_t(T);
}

// Router probability per expert, in the model's own gating function; a token whose
// probabilities or gate weights are not finite is dropped instead. Returns whether they were.
bool Collector::add_probabilities(int li, int il, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen,
                                  const TokenInfo & tok, LayerStats & L, LayerStats * D) {
    const int k = n_expert_used_, E = n_expert_;
    bool probs_finite = true;
    const float * p = c.probs.data() + r * E;
    for (int e = 0; e < E && c.gating != Gating::SoftmaxWeight; ++e) {
        probs_finite = probs_finite && std::isfinite(p[e]);
    }
    const float * w = c.weights.data() + r * k;
    for (int j = 0; j < k; ++j) {
        probs_finite = probs_finite && std::isfinite(w[j]);
    }
    if (!probs_finite) {
        drop(L, D, il, tok, -1);
        ++prob_drops_[size_t(li)];
    } else if (c.gating == Gating::SoftmaxWeight) {
        // The probabilities are the softmax over the selected experts: ffn_moe_weights_softmax.
        if (c.softmax_weights.empty()) {
            throw missing_node(il, "ffn_moe_weights_softmax");
        }
        for (int j = 0; j < k; ++j) {
            add_prob(L, D, chosen[size_t(j)], c.softmax_weights[size_t(r * k + j)]);
        }
    } else {
        for (int e = 0; e < E; ++e) {
            add_prob(L, D, e, p[e]);
        }
    }
    return probs_finite;
}

// Each chosen expert's count and its output's saliency (REAP, EAN, largest activation).
void Collector::add_outputs(int il, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen,
                            const TokenInfo & tok, bool probs_finite, int li, LayerStats & L, LayerStats * D) {
    const int k = n_expert_used_;
    const float * w = c.weights.data() + r * k;
    for (int j = 0; j < k; ++j) {
        const int32_t e = chosen[size_t(j)];
        ++L.count[size_t(e)];
        if (D) {
            ++D->count[size_t(e)];
        }
        if (tok.traced) {
            ++trace_count_[size_t(li)][size_t(e)];
        }
        const double g = w[j], fn = c.f_norm[size_t(r * k + j)], fm = c.f_max[size_t(r * k + j)];
        if (!std::isfinite(g) || !std::isfinite(fn)) {
            if (probs_finite) {
                drop(L, D, il, tok, e);
            }
            continue;
        }
        // Weights applied before the experts are already inside f.
        const double reap = arch_quirks(arch_).weights_before_experts ? fn : g * fn;
        for (LayerStats * S : {&L, D}) {
            if (!S) {
                continue;
            }
            S->reap_sum[size_t(e)] += reap;
            S->reap_sq_sum[size_t(e)] += reap * reap;
            S->ean_sum[size_t(e)] += fn;
            S->max_act[size_t(e)] = std::max(S->max_act[size_t(e)], fm);
        }
    }
}

void Collector::add_coactivation(LayerStats & L, const std::vector<int32_t> & chosen) const {
    const int k = n_expert_used_, E = n_expert_;
    std::vector<int32_t> sorted = chosen;
    std::sort(sorted.begin(), sorted.end());
    for (int a = 0; a < k; ++a) {
        for (int b = a + 1; b < k; ++b) {
            ++L.coact[LayerStats::pair_index(size_t(E), size_t(sorted[size_t(a)]), size_t(sorted[size_t(b)]))];
        }
    }
}

void Collector::add_prob(LayerStats & L, LayerStats * D, int e, double p) {
    L.prob_sum[size_t(e)] += p;
    if (D) {
        D->prob_sum[size_t(e)] += p;
    }
}

void Collector::drop(LayerStats & L, LayerStats * D, int il, const TokenInfo & tok, int expert) {
    if (opt_.strict) {
        throw Error(fmt::format("{}: non-finite router or expert output at layer {}, token position {} of sequence {}{} "
                                "(--strict)",
                                arch_, il, tok.meta.pos, tok.meta.seq,
                                expert >= 0 ? fmt::format(", expert {}", expert) : std::string()));
    }
    ++L.nonfinite_drops;
    ++stats_.nonfinite_drops;
    if (D) {
        ++D->nonfinite_drops;
    }
}

// The trace's candidates (rank_candidates), logits alongside.
void Collector::trace_row(int li, size_t token, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen) {
    const int E = n_expert_;
    const float * sel = c.selection.data() + r * E;
    const float * z = c.logits.data() + r * E;
    order_.resize(size_t(E));
    for (int e = 0; e < E; ++e) {
        order_[size_t(e)] = e;
    }
    is_chosen_.assign(size_t(E), 0);
    for (int32_t e : chosen) {
        is_chosen_[size_t(e)] = 1;
    }
    rank_candidates(order_, size_t(E), size_t(trace_m_), is_chosen_, sel);
    const size_t base = (token * moe_layers_.size() + size_t(li)) * size_t(trace_m_);
    for (int m = 0; m < trace_m_; ++m) {
        trace_ids_[base + size_t(m)] = uint16_t(order_[size_t(m)]);
        trace_logits_[base + size_t(m)] = z[order_[size_t(m)]];
    }
}

} // namespace moeprune::collect_impl
