#pragma once
// What moeprune knows about llama.cpp's router graph (build_moe_ffn in llama-graph.cpp),
// in one place for every observer of it (collect's statistics, eval's mask and closed
// loop): the nodes' names, the gating function behind ffn_moe_probs, reading a node's
// values, the order a trace ranks candidates in (how it stores them is formats/trace.h),
// and how an observer reports a failure across ggml's eval callback.
#include "ggml.h"

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace moeprune {

// A router node by its graph name, "ffn_moe_logits-12" -> {"ffn_moe_logits", 12};
// layer -1 for any other node (views and reshapes carry suffixes such as " (reshaped)").
struct RouterNode {
    std::string name;
    int layer = -1;
};
RouterNode parse_router_node(const char * tensor_name);

enum class Gating { Unknown, Softmax, Sigmoid, SoftmaxWeight, SqrtSoftplus };

// The function that produced ffn_moe_probs, read from the node's op: the name alone is
// the same for every variant (and with softmax over the selected, the logits tensor
// itself carries the name).
Gating gating_of(const ggml_tensor * probs);
// As statistics record it: "softmax", "sigmoid", "softmax-over-selected", "sqrt-softplus".
const char * gating_name(Gating g);

// A graph node's values as a dense float array in ggml's index order (ne0 fastest),
// read through its strides (several router nodes are views); i32 nodes are converted.
// `raw` is scratch space kept by the caller between calls.
std::vector<float> read_node_f32(const ggml_tensor * t, std::vector<uint8_t> & raw);

// The candidates of one token as a trace ranks them: the chosen experts first (so a
// trace's top-k is exactly the routing), then by the score the router selects on, ties
// to the lowest id. `order` holds the candidate ids in its first `n_cand` entries; its
// first `m` are ranked on return. `is_chosen` and `selection` are indexed by expert id.
void rank_candidates(std::vector<int32_t> & order, size_t n_cand, size_t m, const std::vector<char> & is_chosen,
                     const float * selection);

// ggml's eval callback cannot throw: an observer runs its work through guarded(), which
// keeps the first exception and stops the graph; llama_decode then fails and the caller
// rethrows the reason with rethrow_failure().
class GraphObserverFailure {
public:
    bool failed() const { return bool(failure_); }
    void rethrow_failure();

protected:
    template <class F> bool guarded(F && observe) noexcept {
        try {
            return observe();
        } catch (...) {
            if (!failure_) {
                failure_ = std::current_exception();
            }
            return false;
        }
    }

private:
    std::exception_ptr failure_;
};

} // namespace moeprune
