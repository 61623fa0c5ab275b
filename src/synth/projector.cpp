// The projector GGUF beside a model with image or audio experts: the smallest encoders
// libmtmd loads, whose embeddings carry the planted coordinates exactly.
#include "synth/internal.h"
#include "core/errors.h"
#include "model/model_file.h"

#include <memory>

namespace moeprune::synth_impl {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The projector: llama.cpp's llava "mlp" type with no vision blocks (patch convolution,
// position embeddings, then up, GELU, down), the smallest libmtmd encodes images with. It
// pairs with any text model whose input width it matches. Its last op is a biased linear
// layer whose rows for the planted coordinates are zero, so every image embedding carries
// coordinate 0's constant (dead experts stay dead) and the image coordinate exactly, and
// none of the text kinds.
constexpr int kImageSize = 64, kPatchSize = 16, kVisionWidth = 32, kProjectorHidden = 64;
// The audio encoder, with audio experts: llama.cpp's qwen2a type (Qwen2-Audio's Whisper
// encoder: two 1-D convolutions over 128 mel bins, one transformer block, average pooling,
// one linear layer), 750 embeddings per 30-second chunk libmtmd cuts audio into.
constexpr int kAudioWidth = 32, kMelBins = 128, kAudioPositions = 1500;
constexpr int kPatches = (kImageSize / kPatchSize) * (kImageSize / kPatchSize);

struct Spec {
    std::string name;
    std::vector<int64_t> ne;
    float sigma;  // > 0: normal; 0: zeros; < 0: the constant -sigma (norm gains)
};

std::vector<Spec> projector_specs(int64_t n_embd_inp, bool audio) {
    std::vector<Spec> specs = {
        {"v.patch_embd.weight", {kPatchSize, kPatchSize, 3, kVisionWidth}, 0.02f},
        {"v.position_embd.weight", {kVisionWidth, kPatches}, 0.02f},
        {"mm.0.weight", {kVisionWidth, kProjectorHidden}, 0.1f},
        {"mm.0.bias", {kProjectorHidden}, 0.0f},
        {"mm.2.weight", {kProjectorHidden, n_embd_inp}, 0.1f},
        {"mm.2.bias", {n_embd_inp}, 0.0f},
    };
    if (audio) {
        const int64_t w = kAudioWidth;
        const std::vector<Spec> a = {
            {"a.conv1d.1.weight", {3, kMelBins, w}, 0.02f}, {"a.conv1d.1.bias", {1, w}, 0.0f},
            {"a.conv1d.2.weight", {3, w, w}, 0.02f},        {"a.conv1d.2.bias", {1, w}, 0.0f},
            {"a.position_embd.weight", {w, kAudioPositions}, 0.02f},
            {"a.blk.0.ln1.weight", {w}, -1.0f},              {"a.blk.0.ln1.bias", {w}, 0.0f},
            {"a.blk.0.attn_q.weight", {w, w}, 0.02f},        {"a.blk.0.attn_q.bias", {w}, 0.0f},
            {"a.blk.0.attn_k.weight", {w, w}, 0.02f},
            {"a.blk.0.attn_v.weight", {w, w}, 0.02f},        {"a.blk.0.attn_v.bias", {w}, 0.0f},
            {"a.blk.0.attn_out.weight", {w, w}, 0.02f},      {"a.blk.0.attn_out.bias", {w}, 0.0f},
            {"a.blk.0.ln2.weight", {w}, -1.0f},              {"a.blk.0.ln2.bias", {w}, 0.0f},
            {"a.blk.0.ffn_up.weight", {w, w}, 0.02f},        {"a.blk.0.ffn_up.bias", {w}, 0.0f},
            {"a.blk.0.ffn_down.weight", {w, w}, 0.02f},      {"a.blk.0.ffn_down.bias", {w}, 0.0f},
            {"mm.a.fc.weight", {w, n_embd_inp}, 0.1f},       {"mm.a.fc.bias", {n_embd_inp}, 0.0f},
        };
        specs.insert(specs.end(), a.begin(), a.end());
    }
    return specs;
}

void add_projector_metadata(gguf_context * g, const Plan & plan, int64_t n_embd_inp, bool audio) {
    gguf_set_val_str(g, "general.architecture", "clip");
    gguf_set_val_str(g, "general.name", "moeprune-synth-projector");
    gguf_set_val_bool(g, "clip.has_vision_encoder", true);
    // One projector type for a vision-only file; one per modality when it encodes audio too.
    gguf_set_val_str(g, audio ? "clip.vision.projector_type" : "clip.projector_type", "mlp");
    if (audio) {
        gguf_set_val_bool(g, "clip.has_audio_encoder", true);
        gguf_set_val_str(g, "clip.audio.projector_type", "qwen2a");
        gguf_set_val_u32(g, "clip.audio.embedding_length", kAudioWidth);
        gguf_set_val_u32(g, "clip.audio.feed_forward_length", kAudioWidth);
        gguf_set_val_u32(g, "clip.audio.attention.head_count", 1);
        gguf_set_val_u32(g, "clip.audio.block_count", 1);
        gguf_set_val_u32(g, "clip.audio.projection_dim", uint32_t(n_embd_inp));
        gguf_set_val_f32(g, "clip.audio.attention.layer_norm_epsilon", 1e-5f);
        gguf_set_val_u32(g, "clip.audio.num_mel_bins", kMelBins);
    }
    gguf_set_val_u32(g, "clip.vision.embedding_length", kVisionWidth);
    gguf_set_val_u32(g, "clip.vision.feed_forward_length", kVisionWidth);
    gguf_set_val_u32(g, "clip.vision.attention.head_count", 1);
    gguf_set_val_u32(g, "clip.vision.block_count", 0);
    gguf_set_val_u32(g, "clip.vision.projection_dim", uint32_t(n_embd_inp));
    gguf_set_val_f32(g, "clip.vision.attention.layer_norm_epsilon", 1e-6f);
    gguf_set_val_u32(g, "clip.vision.image_size", kImageSize);
    gguf_set_val_u32(g, "clip.vision.patch_size", kPatchSize);
    const float half[3] = {0.5f, 0.5f, 0.5f};
    gguf_set_arr_data(g, "clip.vision.image_mean", GGUF_TYPE_FLOAT32, half, 3);
    gguf_set_arr_data(g, "clip.vision.image_std", GGUF_TYPE_FLOAT32, half, 3);
    const json settings = {{"type", "mlp"},           {"image_size", kImageSize}, {"patch_size", kPatchSize},
                           {"tokens_per_image", kPatches}, {"image_coordinate", plan.image_coord}, {"seed", plan.opt.seed},
                           {"audio", audio ? json{{"type", "qwen2a"}, {"tokens_per_30s", kAudioPositions / 2},
                                                  {"audio_coordinate", plan.audio_coord}}
                                           : json(nullptr)}};
    gguf_set_val_str(g, "moeprune.synth.projector", settings.dump().c_str());
}

} // namespace

void write_projector(const Plan & plan, int64_t n_embd_inp, const fs::path & path) {
    const bool audio = plan.audio_coord > 0;
    const std::vector<Spec> specs = projector_specs(n_embd_inp, audio);
    ggml_init_params ip{ggml_tensor_overhead() * specs.size(), nullptr, /*no_alloc=*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
    GgufPtr g(gguf_init_empty());
    add_projector_metadata(g.get(), plan, n_embd_inp, audio);

    std::vector<std::vector<float>> data;
    data.reserve(specs.size());
    for (const Spec & sp : specs) {
        ggml_tensor * t = ggml_new_tensor(ctx.get(), GGML_TYPE_F32, int(sp.ne.size()), sp.ne.data());
        ggml_set_name(t, sp.name.c_str());
        std::vector<float> & v = data.emplace_back(size_t(ggml_nelements(t)), sp.sigma < 0 ? -sp.sigma : 0.0f);
        std::mt19937_64 rng(tensor_seed(plan.opt.seed, sp.name.c_str()));
        Normal d(0.0f, sp.sigma > 0 ? sp.sigma : 1.0f);
        if (sp.sigma > 0) {
            for (float & x : v) {
                x = d(rng);
            }
        }
        // Each encoder's last layer writes the constant and its modality's coordinate
        // exactly, and nothing else into the planted coordinates.
        if (sp.name == "mm.2.weight" || sp.name == "mm.a.fc.weight") {
            std::fill_n(v.begin(), size_t(plan.last_coord() + 1) * size_t(sp.ne[0]), 0.0f);
        }
        if (sp.name == "mm.2.bias" || sp.name == "mm.a.fc.bias") {
            v[0] = 1.0f;
            v[size_t(sp.name == "mm.2.bias" ? plan.image_coord : plan.audio_coord)] = 1.0f;
        }
        t->data = v.data();
        gguf_add_tensor(g.get(), t);
    }
    if (!gguf_write_to_file(g.get(), path.c_str(), false)) {
        fail_file(path.string(), "writing the projector failed");
    }
}

} // namespace moeprune::synth_impl
