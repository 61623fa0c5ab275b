#include "model/inspect.h"

#include <map>
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>

namespace moeprune {

static std::string gating_func_name(std::optional<int64_t> v) {
    if (!v) {
        return "unset";
    }
    switch (*v) {
        case 0: return "default";  // the architecture's own choice
        case 1: return "softmax";
        case 2: return "sigmoid";
        case 3: return "softmax_weight";
        case 4: return "sqrt_softplus";
        default: return "unknown(" + std::to_string(*v) + ")";
    }
}

std::vector<int> InspectReport::routed_layers() const {
    std::vector<int> out;
    for (const LayerInfo & l : layers) {
        if (!l.nextn) {
            out.push_back(l.layer);
        }
    }
    return out;
}

std::vector<int> InspectReport::mtp_layers() const {
    std::vector<int> out;
    for (const LayerInfo & l : layers) {
        if (l.nextn) {
            out.push_back(l.layer);
        }
    }
    return out;
}

std::vector<double> InspectReport::routed_layer_expert_bytes() const {
    std::vector<double> out;
    for (const LayerInfo & l : layers) {
        if (!l.nextn) {
            out.push_back(double(l.expert_bytes));
        }
    }
    return out;
}

bool InspectReport::is_nextn(int layer) const {
    return std::any_of(layers.begin(), layers.end(), [&](const LayerInfo & l) { return l.layer == layer && l.nextn; });
}

namespace {

void read_metadata(const GgufModel & model, InspectReport & r) {
    r.file_bytes = model.file_bytes();
    r.arch = model.arch();
    r.name = model.get_string("general.name").value_or("");
    r.n_layer = model.get_int(model.arch_key("block_count")).value_or(0);
    r.n_nextn = model.get_int(model.arch_key("nextn_predict_layers")).value_or(0);
    r.n_expert = model.get_int(model.arch_key("expert_count")).value_or(0);
    r.n_expert_used = model.get_int(model.arch_key("expert_used_count")).value_or(0);
    r.gating_func = gating_func_name(model.get_int(model.arch_key("expert_gating_func")));
    r.expert_group_count = model.get_int(model.arch_key("expert_group_count")).value_or(0);
    r.expert_group_used_count = model.get_int(model.arch_key("expert_group_used_count")).value_or(0);
    r.n_expert_shared = model.get_int(model.arch_key("expert_shared_count")).value_or(0);
}

// Tensors whose data runs past their file's end; returns the highest block a tensor names.
int check_tensor_extents(const GgufModel & model, InspectReport & r) {
    int max_block = -1;
    for (const auto & t : model.tensors()) {
        max_block = std::max(max_block, t.cls.layer);
        if (t.file_offset > model.shard_bytes(t.shard) || t.nbytes > model.shard_bytes(t.shard) - t.file_offset) {
            r.problems.push_back(fmt::format("{}: is truncated (or {} has a wrong dimension): the tensor's data ends "
                                             "at byte {}, the file at {}", r.shards[size_t(t.shard)], t.name,
                                             t.file_offset + t.nbytes, model.shard_bytes(t.shard)));
        }
    }
    return max_block;
}

void check_routing_metadata(const GgufModel & model, InspectReport & r, int max_block) {
    // llama.cpp asserts (and aborts) on these instead of refusing the file, so they are
    // reported here, before any stage hands the model to it.
    if (r.n_layer <= 0 || r.n_layer <= max_block || r.n_layer > max_block + 1) {
        r.problems.push_back(fmt::format("{} is {} but the tensors cover blocks 0..{}", model.arch_key("block_count"),
                                         r.n_layer, max_block));
    }
    if (r.n_expert_used < 1) {
        r.problems.push_back(fmt::format("{} is {}; a MoE model uses at least one expert per token",
                                         model.arch_key("expert_used_count"), r.n_expert_used));
    }
    if (r.expert_group_count > 1 || r.expert_group_used_count > 0) {
        if (r.expert_group_count < 1 || r.n_expert % r.expert_group_count != 0) {
            r.problems.push_back(fmt::format("{} is {}, which does not divide the {} experts into equal groups",
                                             model.arch_key("expert_group_count"), r.expert_group_count, r.n_expert));
        } else if (r.expert_group_used_count < 1 || r.expert_group_used_count > r.expert_group_count ||
                   r.n_expert_used > r.n_expert / r.expert_group_count * r.expert_group_used_count) {
            r.problems.push_back(fmt::format("{} is {} of {} groups of {} experts: it cannot hold {} experts per token",
                                             model.arch_key("expert_group_used_count"), r.expert_group_used_count,
                                             r.expert_group_count, r.n_expert / r.expert_group_count, r.n_expert_used));
        }
    }
}

struct ExpertTensors {
    std::map<int, LayerInfo> layers;
    std::set<int64_t> axis_lengths;
    uint64_t bytes = 0, bytes_one = 0;  // over every per-expert tensor: all experts, and one
};

ExpertTensors collect_expert_tensors(const GgufModel & model, InspectReport & r) {
    ExpertTensors e;
    for (const auto & t : model.tensors()) {
        if (t.cls.role == TensorRole::Shared) {
            r.has_shared_expert_tensors = true;
        }
        if (!is_per_expert(t.cls.role)) {
            r.other_bytes += t.nbytes;
            continue;
        }
        const int64_t ne_exp = t.outer_dim();
        e.axis_lengths.insert(ne_exp);
        auto & L = e.layers[t.cls.layer];
        L.layer = t.cls.layer;
        L.nextn = r.n_nextn > 0 && t.cls.layer >= r.n_layer - r.n_nextn;
        const uint64_t per = t.nbytes / uint64_t(std::max<int64_t>(ne_exp, 1));
        L.tensors.push_back({t.name, t.cls.role, t.type, ne_exp, t.nbytes, per});
        e.bytes += t.nbytes;
        e.bytes_one += per;
        if (t.cls.role == TensorRole::Expert) {
            L.expert_bytes += per;
            r.routed_expert_bytes += t.nbytes;
        } else {
            r.other_bytes += t.nbytes;
        }
        if (ne_exp != r.n_expert) {
            r.problems.push_back(fmt::format("{}: expert axis has {} experts but {} says {}", t.name, ne_exp,
                                             model.arch_key("expert_count"), r.n_expert));
        }
    }
    return e;
}

void check_expert_counts(const GgufModel & model, InspectReport & r, const std::set<int64_t> & axis_lengths) {
    if (r.n_expert == 0) {
        r.problems.push_back(fmt::format("{} is missing although the model has per-expert tensors",
                                         model.arch_key("expert_count")));
    }
    if (axis_lengths.size() > 1) {
        std::string lens;
        for (auto n : axis_lengths) {
            lens += (lens.empty() ? "" : ", ") + std::to_string(n);
        }
        r.problems.push_back("per-expert tensors disagree on the number of experts: " + lens);
    }
    if (r.n_expert_used > r.n_expert) {
        r.problems.push_back(fmt::format("expert_used_count {} exceeds expert_count {}", r.n_expert_used, r.n_expert));
    }
}

} // namespace

InspectReport inspect_model(const GgufModel & model, const std::vector<int64_t> & at_k) {
    InspectReport r;
    for (const auto & p : model.shard_paths()) {
        r.shards.push_back(p.string());
    }
    const std::string & file = r.shards.front();
    read_metadata(model, r);
    const int max_block = check_tensor_extents(model, r);
    check_routing_metadata(model, r, max_block);
    ExpertTensors e = collect_expert_tensors(model, r);
    if (e.layers.empty()) {
        fail_file(file, "not a MoE model: no per-expert tensors (ffn_*_exps, ffn_gate_inp) in architecture " + r.arch);
    }
    check_expert_counts(model, r, e.axis_lengths);
    for (auto & [il, L] : e.layers) {
        r.expert_bytes_max = std::max(r.expert_bytes_max, L.expert_bytes);
        r.layers.push_back(std::move(L));
    }
    // Metadata and padding stay; only the per-expert tensors scale with K.
    for (int64_t k : at_k) {
        r.size_at_k[k] = r.file_bytes - e.bytes + e.bytes_one * uint64_t(k);
    }
    return r;
}

nlohmann::json to_json(const InspectReport & r) {
    using nlohmann::json;
    json layers = json::array();
    for (const auto & L : r.layers) {
        json ts = json::array();
        for (const auto & t : L.tensors) {
            ts.push_back({{"name", t.name}, {"role", tensor_role_name(t.role)}, {"type", ggml_type_name(t.type)},
                          {"n_expert", t.n_expert}, {"bytes", t.bytes}, {"bytes_per_expert", t.bytes_per_expert}});
        }
        layers.push_back({{"layer", L.layer}, {"nextn", L.nextn}, {"expert_bytes", L.expert_bytes}, {"tensors", ts}});
    }
    json at_k = json::object();
    for (const auto & [k, bytes] : r.size_at_k) {
        at_k[std::to_string(k)] = bytes;
    }
    return {
        {"format", "moeprune-inspect"}, {"version", 1},
        {"shards", r.shards}, {"file_bytes", r.file_bytes},
        {"arch", r.arch}, {"name", r.name},
        {"n_layer", r.n_layer}, {"n_nextn", r.n_nextn},
        {"n_expert", r.n_expert}, {"n_expert_used", r.n_expert_used},
        {"gating_func", r.gating_func},
        {"expert_groups", {{"count", r.expert_group_count}, {"used", r.expert_group_used_count}}},
        {"shared_experts", {{"count", r.n_expert_shared}, {"has_tensors", r.has_shared_expert_tensors}}},
        {"routed_expert_bytes", r.routed_expert_bytes}, {"other_bytes", r.other_bytes},
        {"expert_bytes", r.expert_bytes_max},
        {"size_at_k", at_k},
        {"layers", layers},
        {"problems", r.problems},
    };
}

static std::string human_bytes(uint64_t b) {
    const char * units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = double(b);
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        ++u;
    }
    return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

std::string to_text(const InspectReport & r) {
    std::ostringstream o;
    o << fmt::format("model        {}{}\n", r.shards.front(),
                     r.shards.size() > 1 ? fmt::format(" ({} shards)", r.shards.size()) : "");
    o << fmt::format("architecture {}\n", r.arch);
    o << fmt::format("layers       {} ({} nextn/MTP)\n", r.n_layer, r.n_nextn);
    o << fmt::format("experts      {} routed, {} used per token, gating {}\n", r.n_expert, r.n_expert_used, r.gating_func);
    o << fmt::format("groups       {} (used {})\n", r.expert_group_count, r.expert_group_used_count);
    o << fmt::format("shared       {} in metadata, tensors {}\n", r.n_expert_shared,
                     r.has_shared_expert_tensors ? "present" : "absent");
    o << fmt::format("file size    {}\n", human_bytes(r.file_bytes));
    o << fmt::format("routed       {} of experts, {} everything else\n", human_bytes(r.routed_expert_bytes),
                     human_bytes(r.other_bytes));
    o << fmt::format("one expert   {} (largest layer; the unit of an expert cache)\n", human_bytes(r.expert_bytes_max));
    for (const auto & [k, bytes] : r.size_at_k) {
        o << fmt::format("size at K={:<4} {}\n", k, human_bytes(bytes));
    }
    o << "\nper layer (per-expert tensors)\n";
    for (const auto & L : r.layers) {
        o << fmt::format("  blk.{}{}  one expert {}\n", L.layer, L.nextn ? " (nextn)" : "", human_bytes(L.expert_bytes));
        for (const auto & t : L.tensors) {
            o << fmt::format("    {:<34} {:<14} {:<7} x{:<5} {} per expert\n", t.name, tensor_role_name(t.role),
                             ggml_type_name(t.type), t.n_expert, human_bytes(t.bytes_per_expert));
        }
    }
    if (!r.problems.empty()) {
        o << "\nproblems\n";
        for (const auto & p : r.problems) {
            o << "  " << p << "\n";
        }
    }
    return o.str();
}

std::vector<std::vector<ExpertSlab>> routed_expert_slabs(const GgufModel & model, const InspectReport & info) {
    const std::vector<int> routed = info.routed_layers();
    std::map<int, size_t> ordinal;
    for (size_t o = 0; o < routed.size(); ++o) {
        ordinal[routed[o]] = o;
    }
    std::vector<std::vector<ExpertSlab>> experts(routed.size() * size_t(info.n_expert));
    for (const TensorEntry & t : model.tensors()) {
        const auto it = ordinal.find(t.cls.layer);
        if (it == ordinal.end() || t.cls.role != TensorRole::Expert || t.outer_dim() != info.n_expert) {
            continue;
        }
        const uint64_t per = t.nbytes / uint64_t(t.outer_dim());
        for (int64_t e = 0; e < info.n_expert; ++e) {
            experts[it->second * size_t(info.n_expert) + size_t(e)].push_back(
                {t.shard, t.file_offset + uint64_t(e) * per, per, uint64_t(ggml_row_size(t.type, t.ne[0]))});
        }
    }
    return experts;
}

} // namespace moeprune
