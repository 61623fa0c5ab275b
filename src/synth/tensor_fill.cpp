// The weights of every tensor llama.cpp creates: random by role, with the planted truth
// written into the embeddings, routers and attention, and the planted coordinates kept clear.
#include "synth/internal.h"

#include "ggml-backend.h"

#include <regex>

namespace moeprune::synth_impl {

namespace {

int layer_of(const std::string & name) {
    static const std::regex re(R"(^blk\.(\d+)\.)");
    std::smatch m;
    return std::regex_search(name, m, re) ? std::stoi(m[1].str()) : -1;
}

// Norm gains are ones (and their biases zeros): a random gain would scale the planted
// coordinates by chance. Some architectures name them ffn_norm_exps, post_attention_norm...
bool is_norm_weight(const ggml_tensor * t) {
    const std::string name = t->name;
    return ends_with(name, "norm.weight") || (name.find("norm") != std::string::npos && ends_with(name, ".weight") &&
                                              ggml_n_dims(t) == 1);
}

bool planting(const Plan & p) { return !p.dead.empty() || !p.specialists.empty() || !p.image.empty() || !p.audio.empty(); }

// On random weights the text after an image hardly depends on the image: attention is
// near uniform and what image experts add to an image row is noise among noise. So a
// model with image experts gets a planted channel through which it does depend on them.
// The image experts of every layer write into the signal coordinate of the image rows;
// in every layer each query head's last dimension reads the constant coordinate 0 and
// each key head's the image coordinate, so every position attends mostly to the image
// rows before it; and the first dimensions of each value head read the signal. A keep
// map without the image experts then changes what the text after an image sees. The
// last dimension of a head is in the slowest rotating pair under both of llama.cpp's
// rope layouts, so the channel holds at any distance a small model is run over.
constexpr float kChannelQueryKey = 4.0f, kChannelValue = 4.0f, kImageSignal = 4.0f;
constexpr int kChannelValueDims = 8;

void plant_image_channel(const std::string & name, const ggml_tensor * t, std::vector<float> & v, const Plan & plan,
                         std::mt19937_64 & rng) {
    const int64_t row = t->ne[0];
    const int64_t hd = plan.head_dim;
    const int layer = layer_of(name);
    const bool query = ends_with(name, ".attn_q.weight"), key = ends_with(name, ".attn_k.weight");
    if ((query || key || ends_with(name, ".attn_v.weight")) && row == plan.opt.n_embd && t->ne[1] % hd == 0) {
        for (int64_t h = 0; h < t->ne[1] / hd; ++h) {
            if (query || key) {
                float * r = &v[size_t((h * hd + hd - 1) * row)];
                std::fill_n(r, row, 0.0f);
                r[query ? 0 : plan.image_coord] = kChannelQueryKey;
            } else {
                for (int64_t d = 0; d < kChannelValueDims && d < hd; ++d) {
                    v[size_t((h * hd + d) * row + plan.image_signal_coord)] = kChannelValue;
                }
            }
        }
    }
    const auto il = plan.image.find(layer);
    if (ends_with(name, ".ffn_down_exps.weight") && il != plan.image.end() && t->ne[1] == plan.opt.n_embd) {
        Normal d(0.0f, kImageSignal / std::sqrt(float(row)));
        for (int e : il->second) {
            float * r = &v[size_t((int64_t(e) * t->ne[1] + plan.image_signal_coord) * row)];
            for (int64_t j = 0; j < row; ++j) {
                r[j] = d(rng);
            }
        }
    }
}

// Each token's row: the constant, its text kind's mark, and nothing else in the planted coordinates.
void plant_embedding_rows(const ggml_tensor * t, std::vector<float> & v, const Plan & plan) {
    const int64_t row = t->ne[0];
    for (int64_t tok = 0; tok < t->ne[1]; ++tok) {
        float * r = &v[size_t(tok * row)];
        for (int c = 0; c <= plan.last_coord(); ++c) {
            r[c] = 0.0f;
        }
        r[0] = 1.0f;
        const int kind = tok < int64_t(plan.token_kind.size()) ? plan.token_kind[size_t(tok)] : -1;
        if (kind >= 0 && plan.n_kind_coords > 0) {
            r[1 + kind] = 1.0f;
        }
    }
}

// The router rows of planted experts: a low weight on the constant, and a high one on their
// own coordinate (none for dead experts).
void plant_router_rows(const ggml_tensor * t, std::vector<float> & v, const Plan & plan, int layer) {
    const int64_t row = t->ne[0];
    for (int64_t e = 0; e < t->ne[1]; ++e) {
        float * r = &v[size_t(e * row)];
        for (int c = 0; c <= plan.last_coord(); ++c) {
            r[c] = 0.0f;
        }
        const auto dl = plan.dead.find(layer);
        const bool is_dead = dl != plan.dead.end() && std::count(dl->second.begin(), dl->second.end(), int(e));
        const auto sl = plan.specialists.find(layer);
        const bool is_spec = sl != plan.specialists.end() && sl->second.count(int(e));
        const auto il = plan.image.find(layer);
        const bool is_image = il != plan.image.end() && std::count(il->second.begin(), il->second.end(), int(e));
        const auto al = plan.audio.find(layer);
        const bool is_audio = al != plan.audio.end() && std::count(al->second.begin(), al->second.end(), int(e));
        if (is_dead || is_spec || is_image || is_audio) {
            std::fill(r, r + row, 0.0f);
            // A dead expert's logit sits so far below the rest that its softmax
            // probability underflows to exactly 0: removing it then changes no sum,
            // and a sliced model computes bit for bit what the original does.
            r[0] = is_dead ? -40.0f : -3.0f;
        }
        if (is_spec) {
            r[1 + sl->second.at(int(e))] = 6.0f;
        }
        if (is_image) {
            r[plan.image_coord] = 6.0f;
        }
        if (is_audio) {
            r[plan.audio_coord] = 6.0f;
        }
    }
}

// The values a tensor starts from, by its role.
void fill_by_role(const ggml_tensor * t, std::vector<float> & v, Filling & filling, std::mt19937_64 & rng) {
    const Plan & plan = filling.plan;
    const std::string name = t->name;
    const auto normal = [&](float sigma) {
        Normal d(0.0f, sigma);
        for (auto & x : v) {
            x = d(rng);
        }
    };

    // An MTP block's own embedding is planted as the trunk's.
    if (name == "token_embd.weight" || ends_with(name, "nextn.embed_tokens.weight")) {
        normal(0.1f);
        plant_embedding_rows(t, v, plan);
    } else if (is_norm_weight(t) || ends_with(name, ".scale") || ends_with(name, ".input_scale")) {
        std::fill(v.begin(), v.end(), 1.0f);
        static const std::regex expert_scale_re(R"(ffn_[a-z_]+_exps\.(input_)?scale$)");
        if (plan.opt.expert_scales && std::regex_search(name, expert_scale_re)) {
            std::uniform_real_distribution<float> d(0.5f, 1.5f);
            for (auto & x : v) {
                x = d(rng);
            }
        }
    } else if (ends_with(name, "ffn_gate_inp.weight")) {
        normal(0.5f);
        const int layer = layer_of(name);
        filling.router_layers.insert(layer);
        plant_router_rows(t, v, plan, layer);
    } else if (ends_with(name, "norm.bias")) {
        std::fill(v.begin(), v.end(), 0.0f);
    } else if (ends_with(name, "ssm_a") || ends_with(name, "ssm_dt.bias") || ends_with(name, "exp_probs_b.bias")) {
        std::fill(v.begin(), v.end(), ends_with(name, "ssm_a") ? -1.0f : 0.0f);
    } else if (name == "output.weight") {
        normal(0.1f);
    } else if (name.find("_exps") != std::string::npos) {
        normal(0.05f);
    } else {
        normal(0.02f);
    }
}

void keep_planted_coordinates_clear(const ggml_tensor * t, std::vector<float> & v, const Plan & plan) {
    const std::string name = t->name;
    const int64_t n = ggml_nelements(t);
    const int64_t row = t->ne[0];
    // An MTP block starts from a projection of the token's embedding and the trunk's
    // state: it carries the embedding's planted coordinates through unchanged, so the
    // block's router sees them as a trunk layer's does.
    if (planting(plan) && ends_with(name, "nextn.eh_proj.weight")) {
        for (int64_t r = 0; r <= plan.last_coord() && r < n / row; ++r) {
            std::fill_n(&v[size_t(r * row)], row, 0.0f);
            v[size_t(r * row + r)] = 1.0f;
        }
    }
    // Nothing may write into the planted coordinates of the residual stream: at width
    // 256, a few layers of random updates would otherwise drown them, and dead experts
    // would start to win the top-k in deeper layers. A writer is any projection back to
    // the embedding width (attention and SSM outputs, every kind of down projection) and
    // its bias.
    static const std::regex residual_writer_re(
        R"((attn_output|attn_out|ssm_out|ffn_down[a-z_]*|time_mix_output|channel_mix_value|shortconv\.out_proj)\.(weight|bias)$)");
    if (planting(plan) && std::regex_search(name, residual_writer_re)) {
        const int64_t n_embd = plan.opt.n_embd;
        if (ends_with(name, ".bias") && row == n_embd) {
            for (int64_t i = 0; i < n; ++i) {
                if (i % row <= plan.last_coord()) {
                    v[size_t(i)] = 0.0f;
                }
            }
        } else if (t->ne[1] == n_embd) {
            for (int64_t r = 0; r < n / row; ++r) {
                if (r % t->ne[1] <= plan.last_coord()) {
                    std::fill_n(&v[size_t(r * row)], row, 0.0f);
                }
            }
        }
    }
}

// The values in the tensor's type, handed to llama.cpp and kept for the writer.
void store(ggml_tensor * t, const std::vector<float> & v, Filling & filling) {
    const std::string name = t->name;
    const int64_t n = ggml_nelements(t);
    const int64_t row = t->ne[0];
    std::vector<uint8_t> data(ggml_nbytes(t));
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(data.data(), v.data(), data.size());
    } else if (t->type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(v.data(), reinterpret_cast<ggml_fp16_t *>(data.data()), n);
    } else {
        ggml_quantize_chunk(t->type, v.data(), data.data(), 0, n / row, row, nullptr);
    }
    ggml_backend_tensor_set(t, data.data(), 0, data.size());
    // A tied output matrix is created a second time under the embedding's name.
    if (filling.names.insert(name).second) {
        FilledTensor f{name, t->type, {}, std::move(data)};
        std::copy(t->ne, t->ne + GGML_MAX_DIMS, f.ne);
        filling.tensors.push_back(std::move(f));
    }
}

} // namespace

// Fills every tensor llama.cpp creates. Planting works through the residual stream:
// embedding coordinate 0 is a constant 1 for every token and coordinate 1+k marks tokens
// of text kind k; a projector's image embeddings carry the constant too, and the image
// coordinate instead of a kind. No layer writes into those coordinates, so they reach every
// layer's router unchanged, and router rows that weigh them strongly decide who can reach the top-k.
void fill_tensor(ggml_tensor * t, void * ud) {
    auto & filling = *static_cast<Filling *>(ud);
    const Plan & plan = filling.plan;
    std::mt19937_64 rng(tensor_seed(plan.opt.seed, t->name));
    std::vector<float> v(size_t(ggml_nelements(t)), 0.0f);
    fill_by_role(t, v, filling, rng);
    keep_planted_coordinates_clear(t, v, plan);
    if (plan.image_signal_coord > 0) {
        plant_image_channel(t->name, t, v, plan, rng);
    }
    store(t, v, filling);
}

} // namespace moeprune::synth_impl
