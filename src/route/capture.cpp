#include "route/capture.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace moeprune {

RouterCapture::RouterCapture(CaptureShape shape)
    : shape_(std::move(shape)), capture_(shape_.moe_layers.size()), routed_this_graph_(shape_.moe_layers.size(), 0) {
    for (size_t i = 0; i < shape_.moe_layers.size(); ++i) {
        ordinal_[shape_.moe_layers[i]] = int(i);
    }
}

void RouterCapture::new_graph() { std::fill(routed_this_graph_.begin(), routed_this_graph_.end(), 0); }

bool RouterCapture::on_node(ggml_tensor * t, bool ask, const Complete & complete) {
    const char * name = t->name;
    const RouterNode parsed = parse_router_node(name);
    if (parsed.layer < 0) {
        return false;
    }
    const std::string & node = parsed.name;
    // Every watched node splits llama.cpp's graph there, so only what this run uses:
    // logits and selection scores only for a trace; all gate stages, since the last
    // one present is the gate the model applies; f only at its final stage, where the
    // layer is complete.
    static const std::vector<std::string> kAlways = {"ffn_moe_probs",        "ffn_moe_topk",
                                                     "ffn_moe_weights",      "ffn_moe_weights_softmax",
                                                     "ffn_moe_weights_norm", "ffn_moe_weights_scaled"};
    static const std::vector<std::string> kForTrace = {"ffn_moe_logits", "ffn_moe_logits_biased", "ffn_moe_probs_biased",
                                                       "ffn_moe_probs_masked"};
    const bool watched = node == shape_.down_node || std::find(kAlways.begin(), kAlways.end(), node) != kAlways.end() ||
                         (shape_.trace_nodes && std::find(kForTrace.begin(), kForTrace.end(), node) != kForTrace.end());
    if (!watched) {
        return false;
    }
    if (ask) {
        return true;
    }
    const int il = parsed.layer;
    const auto it = ordinal_.find(il);
    if (it == ordinal_.end()) {
        throw Error(fmt::format("{}: node {} belongs to layer {}, which has no routed experts in the model's tensors",
                                shape_.arch, name, il));
    }
    // A second routing of a layer in one graph adds no routing decision of its own.
    if (routed_this_graph_[size_t(it->second)]) {
        repeat_routings_ += node == shape_.down_node;
        return true;
    }
    LayerCapture & c = capture_[size_t(it->second)];
    if (t->type != GGML_TYPE_F32 && !(node == "ffn_moe_topk" && t->type == GGML_TYPE_I32)) {
        throw Error(fmt::format("{}: node {} has type {}, expected {}", shape_.arch, name, ggml_type_name(t->type),
                                node == "ffn_moe_topk" ? "i32" : "f32"));
    }
    if (node == "ffn_moe_topk") {
        expect_shape(t, {shape_.n_expert_used, -1}, name);
        c.n_tokens = t->ne[1];
        c.topk = read_node_f32(t, raw_);
    } else if (node == "ffn_moe_probs") {
        expect_shape(t, {shape_.n_expert, -1}, name);
        c.gating = gating_of(t);
        if (c.gating == Gating::Unknown) {
            throw Error(fmt::format("{}: node {} comes from op {}, not a gating function moeprune knows", shape_.arch, name,
                                    ggml_op_desc(t)));
        }
        gating_ = c.gating;
        c.probs = read_node_f32(t, raw_);
        c.selection = c.probs;
        if (c.gating == Gating::SoftmaxWeight) {
            c.logits = c.probs;
        }
    } else if (node == "ffn_moe_probs_biased" || node == "ffn_moe_probs_masked") {
        expect_shape(t, {shape_.n_expert, -1}, name);
        c.selection = read_node_f32(t, raw_);
    } else if (node == "ffn_moe_logits" || node == "ffn_moe_logits_biased") {
        expect_shape(t, {shape_.n_expert, -1}, name);
        c.logits = read_node_f32(t, raw_);
    } else if (node.rfind("ffn_moe_weights", 0) == 0) {
        // [1, k, tokens], or [k, tokens] where build_moe_ffn reshaped to normalize.
        expect_shape(t, t->ne[0] == 1 ? std::vector<int64_t>{1, shape_.n_expert_used, -1} : std::vector<int64_t>{shape_.n_expert_used, -1},
                     name);
        c.weights = read_node_f32(t, raw_);
        if (node == "ffn_moe_weights_softmax") {
            c.softmax_weights = c.weights;
        }
    } else if (node == shape_.down_node) {
        expect_shape(t, {shape_.n_embd, shape_.n_expert_used, -1}, name);
        reduce_down(t, c);
        complete(it->second, il, c);
        c.clear();
        routed_this_graph_[size_t(it->second)] = 1;
    }
    return true;
}

void RouterCapture::expect_shape(const ggml_tensor * t, std::vector<int64_t> ne, const char * name) const {
    bool ok = true;
    for (size_t i = 0; i < ne.size(); ++i) {
        ok = ok && (ne[i] < 0 || t->ne[i] == ne[i]);
    }
    for (size_t i = ne.size(); i < GGML_MAX_DIMS; ++i) {
        ok = ok && t->ne[i] == 1;
    }
    if (!ok) {
        throw Error(fmt::format("{}: node {} has shape [{}, {}, {}, {}], expected [{}] (-1: the token count)", shape_.arch, name,
                                t->ne[0], t->ne[1], t->ne[2], t->ne[3], fmt::join(ne, ", ")));
    }
}

void RouterCapture::reduce_down(const ggml_tensor * t, LayerCapture & c) {
    const std::vector<float> f = read_node_f32(t, raw_);
    const int64_t slots = t->ne[1] * t->ne[2];
    c.f_norm.assign(size_t(slots), 0.0);
    c.f_max.assign(size_t(slots), 0.0);
    for (int64_t s = 0; s < slots; ++s) {
        double sq = 0, mx = 0;
        bool finite = true;
        for (int64_t i = 0; i < t->ne[0]; ++i) {
            const double v = f[size_t(s * t->ne[0] + i)];
            finite = finite && std::isfinite(v);
            sq += v * v;
            mx = std::max(mx, std::fabs(v));
        }
        c.f_norm[size_t(s)] = finite ? std::sqrt(sq) : std::nan("");
        c.f_max[size_t(s)] = mx;
    }
}

} // namespace moeprune
