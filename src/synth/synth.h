#pragma once
// Small MoE models in exactly llama.cpp's format, made by llama.cpp itself
// (llama_model_init_from_user + llama_model_save_to_file), with optional planted
// ground truth: experts no input can reach, experts only one kind of text reaches, and
// experts only images reach (with a projector GGUF for llama.cpp's libmtmd beside the model).
#include <nlohmann/json.hpp>

#include "ggml.h"
#include "synth/vocabulary.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct SynthOptions {
    std::string arch = "qwen3moe";
    int n_layer = 4;
    int n_expert = 16;
    int n_expert_used = 4;
    int n_embd = 64;
    int n_ff = 64;                       // routed-expert FFN width
    ggml_type expert_type = GGML_TYPE_F32;
    bool gate_up = false;                // merged ffn_gate_up_exps
    bool expert_scales = false;          // per-expert ffn_*_exps.scale tensors
    int groups = 0;                      // expert groups (DeepSeek-V3 style group-limited routing)
    bool mtp = false;                    // one nextn (multi-token prediction) layer at the end
    int dense_leading = -1;              // dense FFN layers before the MoE ones; -1: one when there is room
    int split = 1;                       // shards in gguf-split layout
    uint64_t seed = 42;
    int dead = 0;                        // experts per layer that no input can route to
    bool specialists = false;            // plant one expert per layer per text kind
    int image_experts = 0;               // experts per layer that only image tokens reach (needs mmproj)
    int audio_experts = 0;               // experts per layer that only audio reaches; the projector then encodes audio too
    std::filesystem::path mmproj;        // also write a projector that libmtmd loads, for images
    std::filesystem::path vocab;         // defaults to the pinned llama.cpp's Qwen2 vocabulary
    // Cut the vocabulary to its first N ordinary tokens (0: keep all), plus one token per
    // character it has a token for and the special tokens: the same tokenizer with a smaller
    // output layer, for tests that need speed more than long merges.
    int vocab_first = 0;
    std::filesystem::path output;
};

struct SynthResult {
    std::vector<std::filesystem::path> files;  // the model's shards
    std::filesystem::path mmproj;              // the projector, when asked for
    // {"dead": {"L": [ids]}, "specialists": {"L": {"ID": "kind"}}, "kinds": [...]}, and with a
    // projector "image": {"L": [ids]}, and with audio experts "audio": {"L": [ids]}
    nlohmann::json planted;
    uint64_t bytes = 0;
};

ggml_type parse_ggml_type(const std::string & name);  // "q4_K", "f16", ... as ggml names them

SynthResult synthesize(const SynthOptions & opt);

} // namespace moeprune
