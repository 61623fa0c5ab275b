// synth's options checked against the architecture and llama.cpp's limits before any
// work, and the defaults that depend on the architecture resolved.
#include "synth/internal.h"
#include "synth/vocabulary.h"
#include "core/errors.h"

#include <fmt/format.h>

namespace moeprune {

ggml_type parse_ggml_type(const std::string & name) {
    std::string want = name;
    std::transform(want.begin(), want.end(), want.begin(), ::tolower);
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name(ggml_type(t));
        if (!tn || ggml_blck_size(ggml_type(t)) == 0) {
            continue;
        }
        std::string have = tn;
        std::transform(have.begin(), have.end(), have.begin(), ::tolower);
        if (have == want) {
            return ggml_type(t);
        }
    }
    throw Error("unknown tensor type '" + name + "' (use a ggml type name such as f32, f16, q8_0, q4_K, iq4_nl)");
}

namespace synth_impl {

namespace {

const ArchTraits & supported_arch(const SynthOptions & o) {
    const ArchTraits * traits = find_arch(o.arch);
    if (!traits) {
        std::string names;
        for (const auto & t : arch_table()) {
            if (t.refused.empty()) {
                names += (names.empty() ? "" : ", ") + t.name;
            }
        }
        throw Error("synth: unsupported --arch " + o.arch + " (supported: " + names + ")");
    }
    if (!traits->refused.empty()) {
        throw Error("synth: --arch " + o.arch + " is not supported: " + traits->refused);
    }
    return *traits;
}

void check_shape(const SynthOptions & o, const ArchTraits & traits) {
    // llama.cpp asserts instead of refusing past its fixed limits (LLAMA_MAX_LAYERS and
    // LLAMA_MAX_EXPERTS in src/llama-hparams.h of the pinned release).
    constexpr int kMaxLayers = 512, kMaxExperts = 1024;
    if (o.n_layer < 1 || o.n_layer > kMaxLayers) {
        throw Error(fmt::format("synth: --layers must be from 1 to {} (got {})", kMaxLayers, o.n_layer));
    }
    if (o.n_layer < traits.min_layers) {
        throw Error(fmt::format("synth: {} needs --layers >= {} (llama.cpp builds its layer pattern from that many)",
                                o.arch, traits.min_layers));
    }
    if (o.n_expert < 2 || o.n_expert > kMaxExperts) {
        throw Error(fmt::format("synth: --experts must be from 2 to {} (got {})", kMaxExperts, o.n_expert));
    }
    if (o.n_expert_used < 1 || o.n_expert_used > o.n_expert) {
        throw Error(fmt::format("synth: --used must be from 1 to --experts {} (got {})", o.n_expert, o.n_expert_used));
    }
    if (o.n_embd < traits.head_dim || o.n_embd % traits.head_dim != 0) {
        throw Error(fmt::format("synth: --embd must be a multiple of {} for {} (got {})", traits.head_dim, o.arch, o.n_embd));
    }
    if (o.n_ff < 1) {
        throw Error(fmt::format("synth: --ff must be at least 1 (got {})", o.n_ff));
    }
    const int64_t blck = ggml_blck_size(o.expert_type);
    if (o.n_embd % blck != 0 || o.n_ff % blck != 0) {
        throw Error(fmt::format("synth: type {} packs {} values per block, so --embd ({}) and --ff ({}) must be multiples of it",
                                ggml_type_name(o.expert_type), blck, o.n_embd, o.n_ff));
    }
    if (ggml_quantize_requires_imatrix(o.expert_type)) {
        throw Error(fmt::format("synth: type {} needs an importance matrix to quantize; use another type (e.g. iq4_nl)",
                                ggml_type_name(o.expert_type)));
    }
}

void check_layout(const SynthOptions & o, const ArchTraits & traits) {
    if (o.gate_up && !traits.gate_up) {
        throw Error("synth: --gate-up: llama.cpp does not load merged ffn_gate_up_exps for " + o.arch);
    }
    if (o.mtp && !traits.mtp) {
        throw Error("synth: --mtp: " + (traits.no_mtp_reason.empty()
                                            ? "llama.cpp builds no nextn (multi-token prediction) layers for " + o.arch
                                            : traits.no_mtp_reason));
    }
    if (o.mtp && o.n_layer < 2) {
        throw Error("synth: --mtp takes the last layer as the nextn layer, so it needs --layers >= 2");
    }
    if (o.groups != 0) {
        if (o.groups < 2 || o.n_expert % o.groups != 0 || o.groups >= o.n_expert) {
            throw Error(fmt::format("synth: --groups must divide --experts {} into at least 2 groups (got {})", o.n_expert,
                                    o.groups));
        }
        if (o.n_expert_used > (o.groups / 2) * (o.n_expert / o.groups)) {
            throw Error(fmt::format("synth: --used {} is more than the {} experts of the {} groups a token may use",
                                    o.n_expert_used, (o.groups / 2) * (o.n_expert / o.groups), o.groups / 2));
        }
    }
    if (o.dense_leading > o.n_layer - int(o.mtp) - 1) {
        throw Error(fmt::format("synth: --dense-leading {} leaves no MoE layer among {} layers", o.dense_leading,
                                o.n_layer - int(o.mtp)));
    }
    if (o.split < 1 || o.split > 99) {
        throw Error("synth: --split must be between 1 and 99");
    }
}

// Planted experts must leave enough ordinary ones, and image and audio experts need the projector.
void check_planting(const SynthOptions & o, const ArchTraits & traits) {
    if (o.image_experts < 0) {
        throw Error("synth: --image-experts must be >= 0");
    }
    if (o.image_experts > 0 && o.mmproj.empty()) {
        throw Error("synth: --image-experts plants experts only images reach, so it needs --mmproj to write the projector");
    }
    if (o.audio_experts < 0) {
        throw Error("synth: --audio-experts must be >= 0");
    }
    if (o.audio_experts > 0 && o.mmproj.empty()) {
        throw Error("synth: --audio-experts plants experts only audio reaches, so it needs --mmproj to write the projector");
    }
    if (!o.mmproj.empty() && o.mmproj.extension() != ".gguf") {
        throw Error("synth: --mmproj must name a .gguf file");
    }
    const int planted = o.dead + (o.specialists ? int(specialist_kinds().size()) : 0) + o.image_experts + o.audio_experts;
    if (o.n_expert - planted < o.n_expert_used) {
        throw Error(fmt::format("synth: {} planted experts leave {} ordinary experts, fewer than --used {}", planted,
                                o.n_expert - planted, o.n_expert_used));
    }
    const bool plants = o.dead > 0 || o.specialists || o.image_experts > 0 || o.audio_experts > 0;
    if (plants && !traits.planting_refused.empty()) {
        throw Error("synth: --dead, --specialists and --image-experts cannot be planted in " + o.arch + ": " +
                    traits.planting_refused);
    }
    if (plants && o.groups > 0) {
        throw Error("synth: --dead, --specialists and --image-experts are not planted with --groups: group-limited "
                    "routing picks groups "
                    "by their best experts, which the planted rows do not account for");
    }
}

} // namespace

const ArchTraits & check_options(const SynthOptions & o) {
    const ArchTraits & traits = supported_arch(o);
    check_shape(o, traits);
    check_layout(o, traits);
    if (o.dead < 0) {
        throw Error("synth: --dead must be >= 0");
    }
    if (o.vocab_first != 0 && o.vocab_first < 256) {
        throw Error("synth: --vocab-first must be 0 (the whole vocabulary) or at least 256, the byte tokens every text falls back to");
    }
    check_planting(o, traits);
    if (o.output.empty() || o.output.extension() != ".gguf") {
        throw Error("synth: -o must name a .gguf file");
    }
    return traits;
}

// One leading dense layer when at least one MoE layer is left after it, as the
// DeepSeek-V3 family ships (three there); none for a one-layer trunk.
SynthOptions resolve_defaults(SynthOptions o) {
    const ArchTraits * traits = find_arch(o.arch);
    if (traits && traits->tuned) {
        const int fixed = traits->dense_leading;
        if (o.dense_leading >= 0 && o.dense_leading != fixed) {
            throw Error(fmt::format("synth: --dense-leading: {} always has {} dense leading layers", o.arch, fixed));
        }
        o.dense_leading = fixed;
    } else if (o.dense_leading < 0) {
        o.dense_leading = o.n_layer - int(o.mtp) >= 2 ? 1 : 0;
    }
    return o;
}

} // namespace synth_impl

} // namespace moeprune
