#pragma once
// What a MoE GGUF holds, from metadata alone: the expert geometry every other
// stage needs, sizes at other expert counts, and the inconsistencies that make a
// model unloadable (pruned files from other tools often carry them).
#include "model/model_file.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moeprune {

struct ExpertTensorInfo {
    std::string name;
    TensorRole role;
    ggml_type type;
    int64_t n_expert;          // length of the expert axis (outermost)
    uint64_t bytes;
    uint64_t bytes_per_expert;
};

struct LayerInfo {
    int layer;
    bool nextn;                // an MTP / next-token-prediction layer
    std::vector<ExpertTensorInfo> tensors;
    uint64_t expert_bytes;     // one routed expert of this layer: the unit an expert cache moves
};

struct InspectReport {
    std::vector<std::string> shards;
    uint64_t file_bytes = 0;
    std::string arch;
    std::string name;
    int64_t n_layer = 0;       // block_count, nextn layers included
    int64_t n_nextn = 0;
    int64_t n_expert = 0;      // from metadata
    int64_t n_expert_used = 0;
    std::string gating_func;
    int64_t expert_group_count = 0;
    int64_t expert_group_used_count = 0;
    int64_t n_expert_shared = 0;
    bool has_shared_expert_tensors = false;
    std::vector<LayerInfo> layers;  // only layers with per-expert tensors
    uint64_t routed_expert_bytes = 0;
    uint64_t other_bytes = 0;
    uint64_t expert_bytes_max = 0;  // largest one-expert unit over layers
    std::map<int64_t, uint64_t> size_at_k;
    std::vector<std::string> problems;

    // The layers a forward pass routes through: every layer with experts but the
    // nextn (MTP) ones, ascending.
    std::vector<int> routed_layers() const;
    // The nextn (MTP) layers with experts, ascending: a second graph runs them.
    std::vector<int> mtp_layers() const;
    // One expert's bytes in each of routed_layers(), in that order.
    std::vector<double> routed_layer_expert_bytes() const;
    bool is_nextn(int layer) const;
};

InspectReport inspect_model(const GgufModel & model, const std::vector<int64_t> & at_k);


// One per-expert tensor's share of one expert, in file coordinates.
struct ExpertSlab {
    int shard = 0;
    uint64_t offset = 0, bytes = 0;
    uint64_t row_bytes = 0;   // one output row of the expert's matrix, as ggml splits it among threads
};
// Every routed expert as the byte ranges it is read from: entry `ordinal * n_expert + e`
// holds expert e of routed_layers()[ordinal], one slab per per-expert tensor.
std::vector<std::vector<ExpertSlab>> routed_expert_slabs(const GgufModel & model, const InspectReport & info);
nlohmann::json to_json(const InspectReport & r);
std::string to_text(const InspectReport & r);

} // namespace moeprune
