#pragma once
// Cache-aware routing inside llama.cpp's forward pass (closed loop): every MoE layer
// keeps a simulated expert cache run by a replay policy, and each token's experts are
// re-chosen with the cache bonus of docs/replay.md and written into the graph
// (ffn_moe_topk) through the eval callback, so later layers and tokens see the changed
// routing. The tokens of a micro-batch pass a layer together, so they are routed in
// order against the cache as the earlier tokens left it, exactly as a per-layer replay.
// The same tap, without a configuration, observes the unbiased routing of a base pass
// as a trace records it (for the open-loop replay of the same tokens).
//
// Candidates are ranked as collect's trace ranks them (the unbiased top-k first, then
// by the score the router selects on; the top M) and their logits are rounded to half
// precision as a trace stores them, so that at lambda 0 the closed loop and a replay of
// the base pass's trace apply the policies to identical requests.
#include "route/mask.h"
#include "formats/keep_map.h"
#include "sim/moce.h"
#include "sim/policy.h"
#include "sim/routing.h"
#include "sim/throughput.h"

#include "ggml.h"

#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace moeprune {

struct ClosedLoopConfig {
    std::string policy;
    int cache = 0;            // slots per layer
    double lambda = 0;
    int j = 2;
    bool moce_prior = true;   // false: topk-gap
    PolicyParams params;
    int queue_depth = ThroughputParams{}.queue_depth;   // reads per round, for the throughput model's rounds
};

// One token's routing in one layer as the closed loop ranked and wrote it.
struct RoutedRow {
    uint32_t window = 0;
    int32_t pos = 0;
    int layer = 0;                   // model block index
    std::vector<int32_t> ranked;     // candidate ids (the base model's numbering), best unbiased first
    std::vector<float> logits;       // their logits, rounded to half precision
    std::vector<int32_t> used;       // ids llama.cpp's gate read from ffn_moe_topk after the write
};

class RouterTap : public GraphObserverFailure {
public:
    // Observes when `config` is null, routes otherwise. `keep` (with its `mask`, which
    // the tap chains before itself) restricts candidates to the kept experts, numbered
    // for the cache as in the sliced model. `expert_bytes`: per MoE layer, for the
    // throughput model (may be empty).
    RouterTap(const MaskFacts & facts, int top_m, const ClosedLoopConfig * config, const KeepMap * keep,
              RouterMask * mask, std::vector<double> expert_bytes);

    static bool callback(ggml_tensor * t, bool ask, void * ud);

    // Before each window's decode: its index and token count.
    void begin_window(uint32_t window, size_t n_tokens);
    // After the decode: the failure inside the pass (the tap's or the mask's), if any.
    void rethrow_failure();
    // After the decode: throws unless every layer routed every token of the window.
    void end_window() const;

    // Observer: the last window's rows, [token][layer][top_m] ids and f32 logits.
    const std::vector<uint16_t> & window_ids() const { return win_ids_; }
    const std::vector<float> & window_logits() const { return win_logits_; }
    int top_m() const { return top_m_; }

    // Router: counters over every token routed so far (all in `prefill`'s sense: one
    // request per token and layer).
    const PhaseCounts & counts() const { return counts_; }

    // Off: tokens are routed and the caches evolve, but nothing is counted or logged
    // (generation after the scored windows).
    void set_counting(bool on) { counting_ = on; }

    // When set, every routed row is kept in `log`.
    bool record = false;
    std::vector<RoutedRow> log;

private:
    struct Layer {
        std::unique_ptr<CachePolicy> policy;
        std::unique_ptr<RoutingStep> step;   // routes through `policy`
        MocePrior prior;
        std::vector<float> logits, selection, probs;
        bool logits_from_probs = false;
        std::vector<int32_t> expected;   // per token of the micro-batch: the k ids the gate must read
        size_t seen = 0;                 // tokens of this window so far
        size_t log_first = 0;            // first log row of the current micro-batch
    };

    bool on_node(ggml_tensor * t, bool ask);
    void route_layer(int ordinal, ggml_tensor * topk);
    void rank_token(int layer, const int32_t * graph_row, const float * sel, const float * z,
                    const std::vector<int32_t> * to_new);
    bool route_token(int ordinal, int32_t * graph_row, int64_t tok, size_t pos, const std::vector<int32_t> * to_new);
    void check_gate(int ordinal, ggml_tensor * weights);
    std::vector<float> read(const ggml_tensor * t);

    MaskFacts facts_;
    int top_m_;
    const ClosedLoopConfig * config_;
    const KeepMap * keep_;
    RouterMask * mask_;
    std::vector<double> expert_bytes_;
    std::map<int, int> ordinal_;
    std::vector<Layer> layers_;
    std::vector<std::vector<int32_t>> old_to_new_;   // per ordinal, with a keep map
    uint32_t window_ = 0;
    size_t window_tokens_ = 0;
    std::vector<uint16_t> win_ids_;
    std::vector<float> win_logits_;
    PhaseCounts counts_, uncounted_;
    bool counting_ = true;
    std::vector<int32_t> order_, ranked_, ranked_new_, unbiased_new_, row_;
    std::vector<float> z_;
    std::vector<char> in_topk_;
    std::vector<uint8_t> raw_;
};

} // namespace moeprune
