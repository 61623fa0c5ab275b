#pragma once
// Reads each MoE layer's router and expert-output nodes as llama.cpp computes them, one
// micro-batch at a time, into a LayerCapture, checking each node's type and shape; a
// layer is complete when its expert output (the last node) arrives. collect's statistics
// and trace are made from what it captures.
#include "route/router_graph.h"

#include "ggml.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace moeprune {

// What one MoE layer's nodes gave for the current micro-batch.
struct LayerCapture {
    std::vector<float> topk, probs, selection, logits, weights, softmax_weights;
    Gating gating = Gating::Unknown;
    // Per (token, slot) of the final expert output f: its L2 norm and largest |value|;
    // NaN norm when any value is not finite.
    std::vector<double> f_norm, f_max;
    int64_t n_tokens = -1;
    void clear() { *this = LayerCapture(); }
};

struct CaptureShape {
    std::string arch;
    std::vector<int> moe_layers;   // block indices, in order
    int n_expert = 0, n_expert_used = 0, n_embd = 0;
    std::string down_node;         // the expert-output node, the layer's last
    bool trace_nodes = false;      // also the logits and selection scores a trace ranks candidates by
};

class RouterCapture {
public:
    explicit RouterCapture(CaptureShape shape);

    // A layer's capture is complete: its ordinal among the MoE layers, its block index.
    using Complete = std::function<void(int ordinal, int layer, LayerCapture & capture)>;

    // With `ask`, whether `t` is a node it reads; else reads it (throwing an Error that
    // names the node when its type or shape is not the one expected) and calls `complete`
    // when it ends a layer. False for a node that is not one of its router nodes.
    bool on_node(ggml_tensor * t, bool ask, const Complete & complete);

    // A new graph begins (at its result_norm, or a new batch): within one graph, a layer
    // routed a second time (grovemoe's adjugate experts, chosen by the same router from the
    // same probabilities) adds no routing decision of its own.
    void new_graph();

    Gating gating() const { return gating_; }
    uint64_t repeat_routings() const { return repeat_routings_; }

private:
    void expect_shape(const ggml_tensor * t, std::vector<int64_t> ne, const char * name) const;
    void reduce_down(const ggml_tensor * t, LayerCapture & c);

    CaptureShape shape_;
    std::map<int, int> ordinal_;
    std::vector<LayerCapture> capture_;
    std::vector<char> routed_this_graph_;   // per MoE layer, until new_graph()
    uint64_t repeat_routings_ = 0;
    Gating gating_ = Gating::Unknown;
    std::vector<uint8_t> raw_;
};

} // namespace moeprune
