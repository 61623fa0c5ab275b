#include "route/router_graph.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace moeprune {

RouterNode parse_router_node(const char * tensor_name) {
    // nemotron-h-moe's MTP graph computes the router logits itself, under this name, and
    // hands them to build_moe_ffn.
    static constexpr char kMtpLogits[] = "mtp_ffn_moe_logits-";
    if (std::strncmp(tensor_name, kMtpLogits, sizeof(kMtpLogits) - 1) == 0) {
        tensor_name += 4;
    }
    if (std::strncmp(tensor_name, "ffn_moe_", 8) != 0) {
        return {};
    }
    const char * dash = std::strrchr(tensor_name, '-');
    if (!dash || dash[1] == '\0' || std::strspn(dash + 1, "0123456789") != std::strlen(dash + 1)) {
        return {};
    }
    return {std::string(tensor_name, size_t(dash - tensor_name)), std::atoi(dash + 1)};
}

Gating gating_of(const ggml_tensor * probs) {
    switch (probs->op) {
    case GGML_OP_SOFT_MAX: return Gating::Softmax;
    case GGML_OP_UNARY: return ggml_get_unary_op(probs) == GGML_UNARY_OP_SIGMOID ? Gating::Sigmoid : Gating::Unknown;
    case GGML_OP_SQRT: return Gating::SqrtSoftplus;
    case GGML_OP_MUL_MAT:
    case GGML_OP_ADD: return Gating::SoftmaxWeight;
    default: return Gating::Unknown;
    }
}

const char * gating_name(Gating g) {
    switch (g) {
    case Gating::Softmax: return "softmax";
    case Gating::Sigmoid: return "sigmoid";
    case Gating::SoftmaxWeight: return "softmax-over-selected";
    case Gating::SqrtSoftplus: return "sqrt-softplus";
    default: return "unknown";
    }
}

std::vector<float> read_node_f32(const ggml_tensor * t, std::vector<uint8_t> & raw) {
    raw.resize(ggml_nbytes(t));
    ggml_backend_tensor_get(const_cast<ggml_tensor *>(t), raw.data(), 0, raw.size());
    std::vector<float> out(size_t(ggml_nelements(t)));
    size_t i = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
            for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
                for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
                    const size_t off = size_t(i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
                    if (t->type == GGML_TYPE_F32) {
                        std::memcpy(&out[i++], raw.data() + off, sizeof(float));
                    } else {
                        int32_t v;
                        std::memcpy(&v, raw.data() + off, sizeof(v));
                        out[i++] = float(v);
                    }
                }
            }
        }
    }
    return out;
}

void rank_candidates(std::vector<int32_t> & order, size_t n_cand, size_t m, const std::vector<char> & is_chosen,
                     const float * selection) {
    std::partial_sort(order.begin(), order.begin() + long(m), order.begin() + long(n_cand), [&](int32_t a, int32_t b) {
        if (is_chosen[size_t(a)] != is_chosen[size_t(b)]) {
            return is_chosen[size_t(a)] > is_chosen[size_t(b)];
        }
        return selection[a] != selection[b] ? selection[a] > selection[b] : a < b;
    });
}

void GraphObserverFailure::rethrow_failure() {
    if (failure_) {
        std::exception_ptr f = failure_;
        failure_ = nullptr;
        std::rethrow_exception(f);
    }
}

} // namespace moeprune
