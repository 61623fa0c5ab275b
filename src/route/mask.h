#pragma once
// Makes a keep map's removed experts unselectable inside the base model's forward pass,
// through llama.cpp's eval callback, so that the result equals the sliced model's:
// -inf is written, for every token, into the node whose values decide both selection
// and the gate weights of the kept experts as slicing would leave them:
//   softmax gating          ffn_moe_logits (or _biased): the softmax then runs over
//                           the kept experts only (also ffn_moe_probs_biased if the
//                           model has a selection bias)
//   sigmoid, sqrt-softplus  the selection scores (ffn_moe_probs_biased, else ffn_moe_probs):
//                           element-wise gating leaves the kept experts' weights as they are
//   softmax over selected   ffn_moe_probs (the logits under that name)
// Expert groups are reproduced when every group keeps the same number of experts (as
// slice requires), at least two per group, and the used groups can hold the top-k.
// What the masked pass does is checked while it runs: the gating op is the one planned
// and every chosen expert is a kept one.
#include "route/router_graph.h"
#include "formats/keep_map.h"
#include "model/inspect.h"

#include "ggml.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace moeprune {

// How the router of each MoE layer is built, read from node names and ops of a probe pass.
struct RouterShape {
    std::map<int, std::set<std::string>> nodes;   // layer -> ffn_moe_* node names present
    std::map<int, int> probs_op;                  // layer -> ggml_op of ffn_moe_probs
    std::map<int, int> probs_unary;               // layer -> unary op when probs_op is UNARY
};

struct MaskFacts {
    std::string arch;
    int64_t n_expert = 0, n_expert_used = 0, n_groups = 0, n_group_used = 0;
    std::vector<int> moe_layers;  // block indices the forward pass runs
};

// The facts of a model the mask and the router tap need, as inspect reads them.
MaskFacts mask_facts(const InspectReport & info);

class RouterMask : public GraphObserverFailure {
public:
    explicit RouterMask(const MaskFacts & facts) : facts_(facts) {}

    static bool callback(ggml_tensor * t, bool ask, void * ud);

    // Between these, passes only record which router nodes the graph has.
    void start_probe() { probing_ = true; }
    void stop_probe() { probing_ = false; }

    // Plans the mask of `km`; throws an Error naming `origin` where masking cannot
    // reproduce the sliced model. Applies it to every later pass until clear().
    void set(const KeepMap & km, const std::string & origin);
    void clear() { targets_.clear(); removed_.clear(); }

private:
    bool on_node(ggml_tensor * t, bool ask);
    MaskFacts facts_;
    bool probing_ = false;
    RouterShape shape_;
    std::map<int, std::vector<uint8_t>> removed_;   // layer -> 1 for each removed expert
    std::map<std::string, int> targets_;            // "ffn_moe_logits-3" -> layer
    std::map<int, int> expected_probs_op_;          // layer -> op ffn_moe_probs must have
    std::vector<float> buf_;
};

} // namespace moeprune
