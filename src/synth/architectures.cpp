#include "synth/architectures.h"
#include "synth/synth.h"

#include <algorithm>
#include <cstdint>

namespace moeprune {

namespace {

ArchTraits tuned(const char * name) {
    ArchTraits t;
    t.name = name;
    t.tuned = true;
    return t;
}

ArchTraits arch(const char * name) {
    ArchTraits t;
    t.name = name;
    return t;
}

template <typename F>
ArchTraits with(ArchTraits t, F && f) {
    f(t);
    return t;
}

} // namespace

const std::vector<ArchTraits> & arch_table() {
    static const std::vector<ArchTraits> table = [] {
        std::vector<ArchTraits> v;
        v.push_back(tuned("qwen3moe"));
        v.push_back(tuned("qwen2moe"));
        v.push_back(with(tuned("qwen4exp"), [](ArchTraits & t) {
            t.gate_up = true;
            t.planting_refused = "qwen4exp's hyper-connections mix the residual streams, so the planted coordinates are "
                                 "not guaranteed there";
        }));
        v.push_back(with(tuned("dots1"), [](ArchTraits & t) {
        t.min_layers = 2;
        t.dense_leading = 1;
    }));
        const auto mla = [](ArchTraits & t) {
            t.mla = true;
            t.head_dim = 64;
        };
        for (const char * name : {"llama", "refact", "minicpm", "granite", "granitemoe", "mistral3", "llama4", "cohere2moe",
                                  "grok", "qwen3next", "qwen3vlmoe", "qwen35moe", "phimoe", "dbrx", "olmoe", "arctic",
                                  "deepseek", "deepseek2", "deepseek32", "dots3note", "glm4moe", "glm-dsa", "exaone-moe",
                                  "bailingmoe", "bailingmoe2", "bailingmoe3", "afmoe", "ernie4_5", "ernie4_5-moe",
                                  "hunyuan-moe", "hy_v3", "gpt-oss", "lfm2moe", "smallthinker", "llada-moe", "grovemoe",
                                  "minimax-01", "minimax-m2", "minimax-m3", "rnd1", "paddleocr", "mimo2", "kimi-linear",
                                  "kimi-k3", "step35", "mistral4", "mellum", "laguna", "nemotron_h_moe", "deepseek4"}) {
            v.push_back(arch(name));
        }
        const auto set = [&](const std::string & name, auto && f) {
            for (auto & t : v) {
                if (t.name == name) {
                    f(t);
                }
            }
        };
        for (const char * n : {"deepseek2", "deepseek32", "glm-dsa", "dots3note", "kimi-linear", "bailingmoe3", "kimi-k3",
                               "mistral4"}) {
            set(n, mla);
        }
        for (const char * n : {"lfm2moe", "kimi-linear", "bailingmoe3", "kimi-k3", "nemotron_h_moe"}) {
            set(n, [](ArchTraits & t) {
                t.recurrent_layer_1 = true;
                t.min_layers = std::max(t.min_layers, 2);
            });
        }
        for (const char * n : {"cohere2moe", "mimo2", "step35", "dots3note"}) {
            set(n, [](ArchTraits & t) { t.swa_pattern_per_layer = true; });
        }
        for (const char * n : {"qwen3next", "qwen35moe"}) {
            set(n, [](ArchTraits & t) { t.ssm_inner_256 = true; });
        }
        for (const char * n : {"deepseek2", "deepseek32", "glm4moe", "glm-dsa", "qwen3next", "qwen35moe", "step35",
                               "bailingmoe3", "cohere2moe", "nemotron_h_moe"}) {
            set(n, [](ArchTraits & t) { t.mtp = true; });
        }
        // DeepSeek-V3 routes within the best groups of experts; synth can build groups for
        // any architecture, and the matrix checks them where real models use them.
        set("deepseek2", [](ArchTraits & t) { t.groups = true; });
        for (const char * n : {"ernie4_5", "paddleocr"}) {
            set(n, [](ArchTraits & t) {
                t.refused = "llama.cpp builds no experts for " + t.name + " (src/models/ernie4-5.cpp creates them only "
                            "for ernie4_5-moe)";
            });
        }
        for (const char * n : {"refact", "minicpm"}) {
            set(n, [](ArchTraits & t) {
                t.refused = "llama.cpp creates its expert tensors, but its graph (src/models/" + t.name +
                            ".cpp) never routes through them: every token takes the dense FFN path";
            });
        }
        set("llama4", [](ArchTraits & t) { t.min_layers = 4; });
        set("nemotron_h_moe", [](ArchTraits & t) { t.min_layers = 3; });
        set("deepseek4", [](ArchTraits & t) {
            t.no_mtp_reason = "deepseek4 decides it has a nextn layer by finding its tensors in the file, and a model "
                              "built from metadata has none yet, so llama.cpp would build one more trunk layer instead";
            t.min_layers = 4;
            t.head_dim = 64;
        });
        return v;
    }();
    return table;
}

const ArchTraits * find_arch(const std::string & name) {
    const auto & t = arch_table();
    const auto it = std::find_if(t.begin(), t.end(), [&](const ArchTraits & a) { return a.name == name; });
    return it == t.end() ? nullptr : &*it;
}

namespace {

struct Writer {
    gguf_context * meta;
    std::string a;
    void u32(const std::string & key, uint32_t v) const { gguf_set_val_u32(meta, (a + "." + key).c_str(), v); }
    void f32(const std::string & key, float v) const { gguf_set_val_f32(meta, (a + "." + key).c_str(), v); }
    void flag(const std::string & key, bool v) const { gguf_set_val_bool(meta, (a + "." + key).c_str(), v); }
    void u32s(const std::string & key, const std::vector<uint32_t> & v) const {
        gguf_set_arr_data(meta, (a + "." + key).c_str(), GGUF_TYPE_UINT32, v.data(), v.size());
    }
    void f32s(const std::string & key, const std::vector<float> & v) const {
        gguf_set_arr_data(meta, (a + "." + key).c_str(), GGUF_TYPE_FLOAT32, v.data(), v.size());
    }
};

uint32_t head_count(const SynthOptions & o, const ArchTraits & t) { return uint32_t(o.n_embd) / uint32_t(t.head_dim); }

void add_tuned_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const std::string & a = w.a;
    const uint32_t head_dim = uint32_t(t.head_dim);
    const uint32_t n_head = head_count(o, t);
    w.u32("context_length", 4096);
    w.u32("embedding_length", uint32_t(o.n_embd));
    w.u32("block_count", uint32_t(o.n_layer));
    w.u32("feed_forward_length", uint32_t(o.n_ff));
    w.u32("attention.head_count", n_head);
    // dots1 creates its K and V projections as wide as Q (no grouped-query attention).
    w.u32("attention.head_count_kv", a == "dots1" ? n_head : std::max(1u, n_head / 2));
    w.f32("attention.layer_norm_rms_epsilon", 1e-6f);
    w.f32("rope.freq_base", 1000000.0f);
    w.u32("expert_count", uint32_t(o.n_expert));
    w.u32("expert_used_count", uint32_t(o.n_expert_used));
    w.u32("expert_feed_forward_length", uint32_t(o.n_ff));
    if (a == "qwen2moe" || a == "qwen4exp") {
        w.u32("expert_shared_feed_forward_length", uint32_t(o.n_ff));
    }
    if (a == "dots1") {
        // A dense first layer, then MoE layers with a shared expert and a sigmoid router
        // whose selection is biased by exp_probs_b and whose gates are renormalized and
        // scaled: the DeepSeek-V3 style of gating.
        w.u32("leading_dense_block_count", uint32_t(t.dense_leading));
        w.u32("expert_shared_count", 1);
        w.f32("expert_weights_scale", 2.5f);
        w.flag("expert_weights_norm", true);
        w.u32("expert_gating_func", 2);  // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    }
    if (a == "qwen4exp") {
        // The geometry llama.cpp's own test-llama-archs uses for this architecture.
        w.u32("ssm.conv_kernel", 4);
        w.u32("ssm.state_size", 128);
        w.u32("ssm.time_step_rank", n_head);
        w.u32("ssm.group_count", 2);
        w.u32("ssm.inner_size", 128 * n_head);
        w.u32("hyper_connection.count", 4);
        w.u32("hyper_connection.low_rank", 8);
        w.u32("attention.indexer.head_count", 4);
        w.u32("attention.indexer.key_length", head_dim);
        w.u32("attention.indexer.top_k", 8);
        w.u32("full_attention_interval", 2);
        w.u32s("rope.dimension_sections", {head_dim / 4, head_dim / 4, head_dim / 4, head_dim / 4});
        w.u32s("attention.compress_ratios", std::vector<uint32_t>(size_t(o.n_layer), 4));
    }
}

void add_trunk_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const uint32_t n_layer = uint32_t(o.n_layer);
    w.u32("context_length", 4096);
    w.u32("embedding_length", uint32_t(o.n_embd));
    w.u32("features_length", uint32_t(o.n_embd));
    w.u32("block_count", n_layer);
    w.u32("leading_dense_block_count", uint32_t(o.dense_leading));
    if (t.name == "nemotron_h_moe") {
        std::vector<uint32_t> ff(n_layer, uint32_t(o.n_ff));
        ff[0] = ff[1] = 0;  // the hybrid's first layers are recurrent and attention blocks without an FFN
        w.u32s("feed_forward_length", ff);
    } else {
        w.u32("feed_forward_length", uint32_t(o.n_ff));
    }
    w.flag("use_parallel_residual", false);
    w.f32("logit_scale", 1.0f);
    w.u32("time_mix_extra_dim", 64);
    w.u32("time_decay_extra_dim", 128);
    w.u32("full_attention_interval", 2);
}

void add_attention_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const uint32_t n_layer = uint32_t(o.n_layer);
    const uint32_t head_dim = uint32_t(t.head_dim);
    const uint32_t n_head = head_count(o, t);
    if (t.recurrent_layer_1) {
        std::vector<uint32_t> heads(n_layer, n_head);
        heads[1] = 0;
        w.u32s("attention.head_count", heads);
        w.u32s("attention.head_count_kv", heads);
    } else {
        w.u32("attention.head_count", n_head);
        w.u32("attention.head_count_kv", t.name == "deepseek4" ? 1 : n_head);
    }
    w.f32("attention.max_alibi_bias", 8.0f);
    if (t.name == "deepseek4") {
        w.u32("attention.key_length", head_dim);
        w.u32("attention.value_length", head_dim);
        w.u32("rope.dimension_count", head_dim / 2);
    } else if (t.mla) {
        w.u32("attention.key_length", 576);
        w.u32("attention.value_length", 512);
        w.u32("rope.dimension_count", 64);
        w.u32("attention.key_length_mla", 192);
        w.u32("attention.value_length_mla", 128);
        if (t.name == "dots3note") {
            w.u32("attention.kv_lora_rank_swa", 512);
            w.u32("attention.key_length_swa", 576);
            w.u32("attention.value_length_swa", 512);
            w.u32("attention.key_length_mla_swa", 192);
            w.u32("attention.value_length_mla_swa", 128);
            w.f32("rope.freq_base_swa", 10000.0f);
            std::vector<uint32_t> indexer(n_layer);
            for (uint32_t il = 0; il < n_layer; ++il) {
                indexer[il] = il % 2 ? 0 : 1;
            }
            w.u32s("attention.indexer.types", indexer);
        }
    } else if (t.name == "minimax-m3") {
        w.u32("rope.dimension_count", head_dim);  // rotary width may not pass the indexer's key width
    }
    w.f32("attention.clamp_kqv", 8.0f);
    w.f32("attention.layer_norm_epsilon", 1e-5f);
    w.f32("attention.layer_norm_rms_epsilon", 1e-6f);
    w.f32("attention.group_norm_epsilon", 1e-5f);
    w.u32("attention.group_norm_groups", 8);
    w.u32("attention.q_lora_rank", t.name == "deepseek4" ? 64 : 512);
    w.u32("attention.kv_lora_rank", 512);
    w.u32("attention.relative_buckets_count", 8);
    w.u32("attention.sliding_window", 32);
}

void add_window_and_rope_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const uint32_t n_layer = uint32_t(o.n_layer);
    const uint32_t head_dim = uint32_t(t.head_dim);
    const uint32_t n_head = head_count(o, t);
    if (t.swa_pattern_per_layer) {
        // step35 reads one entry per layer, the others none for the nextn layer
        std::vector<uint32_t> pattern(t.name == "step35" ? n_layer : n_layer - uint32_t(o.mtp));
        for (uint32_t il = 0; il < pattern.size(); ++il) {
            pattern[il] = il % 2;
        }
        w.u32s("attention.sliding_window_pattern", pattern);
    } else {
        w.u32("attention.sliding_window_pattern", 2);
    }
    w.u32("attention.indexer.head_count", t.name == "minimax-m3" ? n_head : 64);
    w.u32("attention.indexer.key_length", 128);
    w.u32("attention.indexer.top_k", 8);
    w.u32("attention.indexer.block_size", 4);
    w.u32("attention.indexer.local_blocks", 1);
    // With sections glm4moe is GLM-4.xV's multimodal RoPE, which its trunk applies but its MTP
    // graph does not (it calls ggml_rope_ext in M-RoPE mode, which aborts): an MTP model is
    // GLM-4.5's text-only layout, as real ones are.
    if (!(t.name == "glm4moe" && o.mtp)) {
        w.u32s("rope.dimension_sections", {head_dim / 4, head_dim / 4, head_dim / 4, head_dim / 4});
    }
    w.f32("rope.freq_base", 1000000.0f);
}

// DeepSeek-V4's grouped output, compressed attention and hyper-connections.
void add_deepseek4_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const uint32_t n_layer = uint32_t(o.n_layer);
    const uint32_t n_head = head_count(o, t);
    w.u32("attention.output_group_count", std::min(8u, n_head));  // heads split evenly over the groups
    w.u32("attention.output_lora_rank", 32);
    std::vector<uint32_t> ratios(n_layer);  // uncompressed, uncompressed, 4x, 128x, repeated
    for (uint32_t il = 0; il < n_layer; ++il) {
        ratios[il] = std::vector<uint32_t>{0, 0, 4, 128}[il % 4];
    }
    w.u32s("attention.compress_ratios", ratios);
    w.f32("attention.compress_rope_freq_base", 160000.0f);
    w.u32("hyper_connection.count", 4);
    w.u32("hyper_connection.sinkhorn_iterations", 2);
    w.f32("hyper_connection.epsilon", 1e-6f);
    w.u32("hash_layer_count", 0);
    w.f32("swiglu_clamp_exp", 10.0f);
}

void add_expert_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    w.u32("expert_feed_forward_length", uint32_t(o.n_ff));
    w.u32("expert_shared_feed_forward_length", uint32_t(o.n_ff));
    w.u32("expert_latent_length", uint32_t(o.n_ff));
    // Llama 4 Maverick interleaves MoE and dense layers; ERNIE 4.5 creates experts in every
    // layer but routes only through every step-th, so there the step must be 1.
    w.u32("interleave_moe_layer_step", t.name == "ernie4_5-moe" ? 1 : 2);
    w.u32("expert_count", uint32_t(o.n_expert));
    w.u32("expert_used_count", uint32_t(o.n_expert_used));
    w.u32("expert_shared_count", 1);
    // sigmoid routing, as DeepSeek-V3 and GLM-4.5 ship it (sqrt-softplus for DeepSeek-V4)
    w.u32("expert_gating_func", t.name == "deepseek4" ? 4 : 2);
    w.f32("expert_weights_scale", 1.0f);
    w.flag("expert_weights_norm", true);
    w.f32("expert_group_scale", 1.0f);
    w.u32("experts_per_group", 1);
    if (o.mtp) {
        w.u32("nextn_predict_layers", 1);
    }
}

void add_recurrent_and_family_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    const uint32_t n_layer = uint32_t(o.n_layer);
    const uint32_t head_dim = uint32_t(t.head_dim);
    const uint32_t n_head = head_count(o, t);
    w.u32("ssm.inner_size", t.ssm_inner_256 ? 256 : uint32_t(2 * o.n_embd));
    w.u32("ssm.conv_kernel", 4);
    w.u32("ssm.state_size", 128);
    w.u32("ssm.time_step_rank", n_head);
    w.u32("ssm.group_count", 2);
    w.u32("kda.head_dim", 128);
    if (t.name != "bailingmoe3") {
        w.flag("kda.safe_gate", true);
    }
    w.f32("kda.gate_lower_bound", -5.0f);
    if (t.name == "bailingmoe3") {
        // per layer; the leading layer unclamped
        std::vector<float> exp(n_layer, 4.0f), shexp(n_layer, 5.0f);
        exp[0] = shexp[0] = 0.0f;
        w.f32s("swiglu_clamp_exp", exp);
        w.f32s("swiglu_clamp_shexp", shexp);
    }
    w.u32("wkv.head_size", head_dim);
    w.u32("shortconv.l_cache", 3);
    w.f32("residual_scale", 3.5565588200778455f);
    w.u32("attn_res.block_size", 12);
    w.f32("activation.situ_beta", 4.0f);
    w.f32("activation.situ_linear_beta", 25.0f);
}

// The union of what llama.cpp's architectures read, in the geometry its own
// architecture test instantiates on CPU; each architecture picks what it needs.
void add_general_metadata(const Writer & w, const SynthOptions & o, const ArchTraits & t) {
    add_trunk_metadata(w, o, t);
    add_attention_metadata(w, o, t);
    add_window_and_rope_metadata(w, o, t);
    if (t.name == "deepseek4") {
        add_deepseek4_metadata(w, o, t);
    }
    add_expert_metadata(w, o, t);
    add_recurrent_and_family_metadata(w, o, t);
}

} // namespace

void add_arch_metadata(gguf_context * meta, const SynthOptions & o, const ArchTraits & traits) {
    const Writer w{meta, traits.name};
    gguf_set_val_str(meta, "general.architecture", traits.name.c_str());
    gguf_set_val_str(meta, "general.name", ("moeprune-synth-" + traits.name).c_str());
    if (traits.tuned) {
        add_tuned_metadata(w, o, traits);
    } else {
        add_general_metadata(w, o, traits);
    }
    // llama.cpp reads expert groups for every architecture (llama_model_base::load_hparams).
    if (o.groups > 0) {
        w.u32("expert_group_count", uint32_t(o.groups));
        w.u32("expert_group_used_count", uint32_t(std::max(1, o.groups / 2)));
    }
}

} // namespace moeprune
