#pragma once
// What synth must tell llama.cpp to build each MoE architecture of the pinned release,
// learned from the metadata its tests/test-llama-archs.cpp gives every architecture.
#include <gguf.h>

#include <string>
#include <vector>

namespace moeprune {

struct SynthOptions;

struct ArchTraits {
    std::string name;
    int min_layers = 1;            // llama.cpp hard-codes a layer pattern of this length
    int head_dim = 32;
    bool mla = false;              // DeepSeek-style latent attention with fixed key/value widths
    bool recurrent_layer_1 = false;  // hybrid: per-layer head counts, layer 1 without attention
    bool swa_pattern_per_layer = false;
    bool ssm_inner_256 = false;
    bool mtp = false;              // llama.cpp builds nextn (multi-token prediction) layers
    std::string no_mtp_reason;     // why --mtp is refused, when the architecture has them
    bool groups = false;           // llama.cpp reads expert groups for this architecture
    bool gate_up = false;          // llama.cpp loads merged ffn_gate_up_exps
    bool tuned = false;            // one of the first four architectures, with hand-set metadata
    int dense_leading = 0;         // tuned: the dense layers before the MoE ones its metadata fixes
    std::string planting_refused;  // why --dead / --specialists cannot be guaranteed, if so
    std::string refused;           // why synth refuses the architecture altogether, if so
};

const std::vector<ArchTraits> & arch_table();
const ArchTraits * find_arch(const std::string & name);

// Writes every key the architecture reads; keys it does not read are ignored by llama.cpp.
void add_arch_metadata(gguf_context * meta, const SynthOptions & o, const ArchTraits & traits);

} // namespace moeprune
