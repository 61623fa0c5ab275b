#pragma once
// Helpers shared by the slice tests: keep maps, byte-level comparison of a sliced
// model with its source, llama.cpp's KL divergence, and metadata-only MoE files
// whose tensor data is a sparse hole (large tensors at no disk cost).
#include "formats/keep_map.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moeprune::test {

// Keeps every expert except `drop[layer]` in each listed layer.
KeepMap keep_all_but(int64_t n_expert, const std::map<int, std::vector<int32_t>> & drop, int n_layer);
void write_keep(const std::filesystem::path & path, const KeepMap & km);

// Every tensor of `sliced` holds exactly the source bytes it should: per-expert
// tensors the kept slabs in keep-map order, everything else a byte-for-byte copy.
// Large slabs are compared at their first and last 4 KiB.
void expect_sliced_bytes(const std::filesystem::path & source, const std::filesystem::path & sliced, const KeepMap & km);

struct Kld {
    double mean = -1;
    double same_top_p = -1;  // percent
    std::string log;
};
// Runs llama-perplexity on `base` to record its logits, then on `model` with
// --kl-divergence over the same text.
Kld kl_divergence(const std::filesystem::path & base, const std::filesystem::path & model,
                  const std::filesystem::path & dir);

struct FakeMoe {
    std::string arch = "qwen3moe";
    int n_layer = 2;
    int n_nextn = 0;
    int64_t n_expert = 8;
    int64_t n_used = 2;
    int64_t n_group = 0;
    int64_t n_embd = 64;
    int64_t n_ff = 64;                       // expert slab = n_embd * n_ff f32 values
    bool with_down = true;                   // false: one expert tensor per layer (big-tensor tests)
    std::vector<std::string> extra_per_layer;  // extra [n_embd, n_expert] tensors, e.g. "ffn_foo_exps.qweight"
};
// Writes metadata and tensor infos; the data section is a hole except for a
// marker at both ends of every expert slab, so slices can be checked by bytes.
void write_fake_moe(const std::filesystem::path & path, const FakeMoe & spec);

} // namespace moeprune::test
