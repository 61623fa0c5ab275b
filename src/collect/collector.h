#pragma once
// Collect's graph observer: every MoE layer's router and expert-output nodes, as route's
// capture reads them, added to the saliency statistics and the trace (and the imatrix).
// Private to collect.
#include "collect/collect.h"
#include "collect/imatrix.h"
#include "core/errors.h"
#include "route/capture.h"
#include "formats/trace.h"

#include "ggml-backend.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moeprune::collect_impl {

// One token as the run knows it, for the trace and the per-domain statistics.
struct TokenInfo {
    TraceTokenMeta meta;
    int domain = -1;   // index into the corpus' domains, -1 for none
    bool traced = false;
};

class Collector : public GraphObserverFailure {
public:
    Collector(const CollectOptions & opt, std::string arch, std::vector<int> moe_layers, int n_expert, int n_expert_used,
              int n_embd, std::string down_node, const std::vector<std::string> & domains, SaliencyStats & stats,
              ImatrixAccumulator * imatrix);

    static bool callback(ggml_tensor * t, bool ask, void * ud) {
        auto * self = static_cast<Collector *>(ud);
        return self->guarded([&] { return self->on_node(t, ask); });
    }

    // The tokens of the next llama_decode, in batch order.
    void begin_batch(std::vector<TokenInfo> tokens);
    // After llama_decode: every MoE layer must have seen every token of the batch.
    void end_batch(TraceWriter * trace);

    // The MTP head's graph runs too, after the trunk's, between begin_batch and end_batch.
    void runs_mtp() { runs_mtp_ = true; }
    void in_mtp_graph(bool on) { in_mtp_graph_ = on; }

    Gating gating() const { return capture_.gating(); }
    // Graph evaluations stopped before the output head.
    uint64_t head_stops() const { return head_stops_; }
    uint64_t repeat_routings() const { return capture_.repeat_routings(); }
    int trace_m() const { return trace_m_; }
    const std::vector<std::vector<uint64_t>> & trace_count() const { return trace_count_; }
    void set_trace_count(std::vector<std::vector<uint64_t>> c) { trace_count_ = std::move(c); }
    // Tokens per layer whose router probabilities were not finite (left out of prob_sum).
    const std::vector<uint64_t> & prob_drops() const { return prob_drops_; }
    void set_prob_drops(std::vector<uint64_t> d) { prob_drops_ = std::move(d); }

private:
    bool on_node(ggml_tensor * t, bool ask);
    Error missing_node(int il, const char * what) const;
    void process(int li, LayerCapture & c, int il);
    bool add_probabilities(int li, int il, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen,
                           const TokenInfo & tok, LayerStats & L, LayerStats * D);
    void add_outputs(int il, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen,
                     const TokenInfo & tok, bool probs_finite, int li, LayerStats & L, LayerStats * D);
    void add_coactivation(LayerStats & L, const std::vector<int32_t> & chosen) const;
    void add_prob(LayerStats & L, LayerStats * D, int e, double p);
    void drop(LayerStats & L, LayerStats * D, int il, const TokenInfo & tok, int expert);
    void trace_row(int li, size_t token, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen);

    const CollectOptions & opt_;
    ImatrixAccumulator * imatrix_;
    std::string arch_;
    std::vector<int> moe_layers_;
    int n_expert_, n_expert_used_;
    std::string down_node_;
    const std::vector<std::string> & domains_;
    SaliencyStats & stats_;
    RouterCapture capture_;
    std::vector<size_t> done_tokens_;
    std::vector<TokenInfo> batch_;
    std::vector<uint16_t> trace_ids_;
    std::vector<float> trace_logits_;
    std::vector<std::vector<uint64_t>> trace_count_;
    std::vector<uint64_t> prob_drops_;
    std::vector<int32_t> order_;
    std::vector<char> is_chosen_;
    int trace_m_ = 0;
    uint64_t head_stops_ = 0;
    bool runs_mtp_ = false, in_mtp_graph_ = false;
};

} // namespace moeprune::collect_impl
