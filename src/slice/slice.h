#pragma once
// Cutting routed experts out of a MoE GGUF (and its imatrix) with a keep map.
// Every per-expert tensor is sliced along its outermost (expert) axis in the keep
// map's ascending id order; everything else is copied byte for byte. Planning
// reads metadata only, so --dry-run and every refusal cost nothing.
#include "formats/keep_map.h"
#include "model/model_file.h"
#include "model/stream_writer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

enum class MtpMode { Unset, Keep, Drop };

struct SliceOptions {
    std::filesystem::path model;
    std::filesystem::path keep;
    std::filesystem::path output;
    std::filesystem::path imatrix;      // optional, with imatrix_out
    std::filesystem::path imatrix_out;
    MtpMode mtp = MtpMode::Unset;
    bool dry_run = false;
    uint64_t split_max_bytes = 0;
};

struct TensorChange {
    std::string name;
    std::string action;  // "slice", "copy" or "drop"
    TensorRole role;
    std::array<int64_t, GGML_MAX_DIMS> ne_before, ne_after;
    int n_dims;
    uint64_t bytes_before = 0, bytes_after = 0;
};

struct SliceResult {
    std::string arch;
    int64_t n_expert_before = 0, k = 0, n_expert_used = 0;
    std::vector<int> dropped_layers;      // MTP layers removed with --mtp drop
    std::vector<TensorChange> tensors;
    uint64_t tensor_bytes_before = 0, tensor_bytes_after = 0;
    std::vector<std::filesystem::path> outputs;          // empty on a dry run
    std::vector<std::filesystem::path> imatrix_outputs;
    int imatrix_entries_sliced = 0;
    nlohmann::json provenance;
};

SliceResult slice_model(const SliceOptions & opt);

nlohmann::json to_json(const SliceResult & r, bool per_tensor);
std::string to_text(const SliceResult & r, bool per_tensor);

} // namespace moeprune
