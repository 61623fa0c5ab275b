#pragma once
// Read-only view of a GGUF model's metadata, across every shard of a split model.
// Never touches tensor data, so it costs the same for a 10 MB and an 80 GB model.
#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ggml.h"

struct gguf_context;

namespace moeprune {

struct GgufDeleter { void operator()(gguf_context * ctx) const; };
using GgufPtr = std::unique_ptr<gguf_context, GgufDeleter>;

// Opens one GGUF file's metadata; errors name the file.
GgufPtr open_gguf_metadata(const std::filesystem::path & path);

// What a tensor is to an MoE model, decided from its name alone.
enum class TensorRole {
    Expert,         // blk.N.ffn_*_exps.{weight,bias,scale}: one slab per routed expert
    Router,         // blk.N.ffn_gate_inp.{weight,bias}: one row per routed expert
    SelectionBias,  // blk.N.exp_probs_b.bias: one value per routed expert
    Shared,         // blk.N.*_shexp*: the always-on shared expert
    Other,
};
const char * tensor_role_name(TensorRole role);

struct TensorClass {
    TensorRole role = TensorRole::Other;
    int layer = -1;  // -1 for tensors outside blk.N
};
TensorClass classify_tensor(const std::string & name);
inline bool is_per_expert(TensorRole r) {
    return r == TensorRole::Expert || r == TensorRole::Router || r == TensorRole::SelectionBias;
}

struct TensorEntry {
    std::string name;
    ggml_type type;
    int n_dims;
    std::array<int64_t, GGML_MAX_DIMS> ne;
    uint64_t nbytes;
    int shard;            // index into GgufModel::shard_paths
    uint64_t file_offset; // absolute offset of the data in its shard
    TensorClass cls;

    int64_t outer_dim() const { return ne[n_dims - 1]; }
};

class GgufModel {
public:
    // `path` is a single file or the first shard of a split model.
    static GgufModel open(const std::filesystem::path & path);

    const std::vector<std::filesystem::path> & shard_paths() const { return shard_paths_; }
    const gguf_context * meta() const { return meta_.get(); }
    const std::string & arch() const { return arch_; }
    const std::vector<TensorEntry> & tensors() const { return tensors_; }
    uint64_t file_bytes() const { return file_bytes_; }
    uint64_t shard_bytes(int shard) const { return shard_bytes_[size_t(shard)]; }

    // Typed metadata lookups. `arch_key("expert_count")` is "<arch>.expert_count".
    std::string arch_key(const std::string & suffix) const { return arch_ + "." + suffix; }
    std::optional<int64_t> get_int(const std::string & key) const;
    std::optional<bool> get_bool(const std::string & key) const;
    std::optional<std::string> get_string(const std::string & key) const;

private:
    std::vector<std::filesystem::path> shard_paths_;
    GgufPtr meta_;  // shard 1 holds the model's metadata
    std::string arch_;
    std::vector<TensorEntry> tensors_;
    uint64_t file_bytes_ = 0;
    std::vector<uint64_t> shard_bytes_;
};

// Split naming as llama.cpp and gguf-split use it: PREFIX-00001-of-0000N.gguf.
std::filesystem::path split_shard_path(const std::filesystem::path & prefix, int split_no, int split_count);

} // namespace moeprune
