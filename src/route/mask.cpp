#include "route/mask.h"
#include "engine/arch_quirks.h"
#include "core/errors.h"

#include "ggml-backend.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace moeprune {

MaskFacts mask_facts(const InspectReport & info) {
    MaskFacts facts;
    facts.arch = info.arch;
    facts.n_expert = info.n_expert;
    facts.n_expert_used = info.n_expert_used;
    facts.n_groups = info.expert_group_count;
    facts.n_group_used = info.expert_group_used_count;
    facts.moe_layers = info.routed_layers();
    return facts;
}

bool RouterMask::callback(ggml_tensor * t, bool ask, void * ud) {
    auto * self = static_cast<RouterMask *>(ud);
    return self->guarded([&] { return self->on_node(t, ask); });
}

void RouterMask::set(const KeepMap & km, const std::string & origin) {
    clear();
    const auto refuse = [&](const std::string & why) {
        fail_file(origin, fmt::format("masking cannot reproduce the sliced model here ({}): slice it with moeprune slice "
                                      "and pass the result with --candidate",
                                      why));
    };
    if (arch_quirks(facts_.arch).weights_before_experts) {
        refuse(facts_.arch + " applies the gate weights before the experts and selects on raw logits");
    }
    require_top_k_room(km, origin, facts_.n_expert_used);
    if (facts_.n_groups > 1) {
        // Without a used-group count the masked router's group choice cannot be checked.
        if (facts_.n_group_used < 1) {
            refuse(fmt::format("the model has {} expert groups but no count of groups a token uses", facts_.n_groups));
        }
        const std::string problem = expert_groups_problem(
            km, {facts_.n_expert, facts_.n_groups, facts_.n_group_used, facts_.n_expert_used});
        if (!problem.empty()) {
            refuse(problem);
        }
    }
    for (int layer : facts_.moe_layers) {
        const auto it = shape_.nodes.find(layer);
        if (it == shape_.nodes.end() || !shape_.probs_op.count(layer)) {
            refuse(fmt::format("layer {} showed no ffn_moe_probs node in llama.cpp's graph", layer));
        }
        const std::set<std::string> & has = it->second;
        if (has.count("ffn_moe_group_topk") && facts_.n_groups <= 1) {
            refuse(fmt::format("layer {} selects expert groups the metadata does not declare", layer));
        }
        const int op = shape_.probs_op.at(layer);
        std::vector<std::string> nodes;
        if (op == GGML_OP_SOFT_MAX) {
            nodes.push_back(has.count("ffn_moe_logits_biased") ? "ffn_moe_logits_biased" : "ffn_moe_logits");
            if (has.count("ffn_moe_probs_biased")) {
                nodes.push_back("ffn_moe_probs_biased");
            }
        } else if ((op == GGML_OP_UNARY && shape_.probs_unary.at(layer) == GGML_UNARY_OP_SIGMOID) || op == GGML_OP_SQRT) {
            nodes.push_back(has.count("ffn_moe_probs_biased") ? "ffn_moe_probs_biased" : "ffn_moe_probs");
        } else if (op == GGML_OP_MUL_MAT || op == GGML_OP_ADD) {
            nodes.push_back("ffn_moe_probs");  // softmax over the selected: these are the logits
        } else {
            refuse(fmt::format("layer {} gates with op {}, which moeprune does not know", layer,
                               ggml_op_name(ggml_op(op))));
        }
        for (const std::string & n : nodes) {
            if (!has.count(n)) {
                refuse(fmt::format("layer {} has no {} node to mask", layer, n));
            }
            targets_[fmt::format("{}-{}", n, layer)] = layer;
        }
        expected_probs_op_[layer] = op;
        const auto ids = km.layers.find(layer);
        if (ids == km.layers.end()) {
            fail_file(origin, fmt::format("layer {} is missing; the model routes it", layer));
        }
        std::vector<uint8_t> removed(size_t(facts_.n_expert), 1);
        for (int32_t e : ids->second) {
            removed[size_t(e)] = 0;
        }
        removed_[layer] = std::move(removed);
    }
}

bool RouterMask::on_node(ggml_tensor * t, bool ask) {
    const auto [node, layer] = parse_router_node(t->name);
    if (layer < 0) {
        return false;
    }
    if (probing_) {
        if (ask) {
            shape_.nodes[layer].insert(node);
            if (node == "ffn_moe_probs") {
                shape_.probs_op[layer] = t->op;
                shape_.probs_unary[layer] = t->op == GGML_OP_UNARY ? int(ggml_get_unary_op(t)) : -1;
            }
        }
        return false;
    }
    if (removed_.empty()) {
        return false;
    }
    const bool target = targets_.count(t->name) > 0;
    const bool check_probs = node == "ffn_moe_probs", check_topk = node == "ffn_moe_topk";
    if (ask) {
        return target || check_probs || check_topk;
    }
    const auto removed = removed_.find(layer);
    if (removed == removed_.end()) {
        return true;
    }
    if (check_probs && t->op != expected_probs_op_.at(layer)) {
        throw Error(fmt::format("{}: ffn_moe_probs-{} comes from op {} in this pass, not the op the mask was planned "
                                "for; slice the keep map and pass it with --candidate",
                                facts_.arch, layer, ggml_op_desc(t)));
    }
    if (target) {
        if (t->type != GGML_TYPE_F32 || t->view_src != nullptr || t->ne[0] != facts_.n_expert ||
            t->nb[1] != size_t(t->ne[0]) * sizeof(float) || t->ne[2] != 1 || t->ne[3] != 1) {
            throw Error(fmt::format("{}: node {} is not a dense f32 [{} experts, tokens] tensor; cannot mask it", facts_.arch,
                                    t->name, facts_.n_expert));
        }
        buf_.resize(size_t(ggml_nelements(t)));
        ggml_backend_tensor_get(t, buf_.data(), 0, ggml_nbytes(t));
        const std::vector<uint8_t> & r = removed->second;
        for (int64_t tok = 0; tok < t->ne[1]; ++tok) {
            float * row = buf_.data() + tok * t->ne[0];
            for (int64_t e = 0; e < t->ne[0]; ++e) {
                if (r[size_t(e)]) {
                    row[e] = -std::numeric_limits<float>::infinity();
                }
            }
        }
        ggml_backend_tensor_set(t, buf_.data(), 0, ggml_nbytes(t));
    }
    if (check_topk) {
        if (t->type != GGML_TYPE_I32) {
            throw Error(fmt::format("{}: node {} has type {}, expected i32", facts_.arch, t->name, ggml_type_name(t->type)));
        }
        std::vector<uint8_t> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        const std::vector<uint8_t> & r = removed->second;
        for (int64_t tok = 0; tok < t->ne[1]; ++tok) {
            for (int64_t i = 0; i < t->ne[0]; ++i) {
                int32_t id;
                std::memcpy(&id, raw.data() + tok * t->nb[1] + i * t->nb[0], sizeof(id));
                if (id < 0 || id >= facts_.n_expert || r[size_t(id)]) {
                    throw Error(fmt::format("{}: layer {} chose expert {} although the keep map removes it: the mask "
                                            "did not take effect for this architecture; slice the keep map and pass it "
                                            "with --candidate",
                                            facts_.arch, layer, id));
                }
            }
        }
    }
    return true;
}

} // namespace moeprune
