#include "synth/synth.h"
#include "synth/architectures.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "model/model_file.h"

#include "ggml-backend.h"
#include "gguf.h"
#include "llama.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

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

namespace {

// std::normal_distribution<float> over std::mt19937_64 as libstdc++ computes it
// (Marsaglia's polar method over generate_canonical<float, 24>), draw for draw and bit
// for bit, so every model keeps its bytes; libstdc++ takes a long-double logarithm on
// every uniform draw, which was most of synth's time. It also makes the bytes the same
// under any standard library.
class Normal {
public:
    Normal(float mean, float stddev) : mean_(mean), stddev_(stddev) {}

    float operator()(std::mt19937_64 & rng) {
        float r;
        if (saved_) {
            r = *saved_;
            saved_.reset();
        } else {
            float x, y, r2;
            do {
                // The subtraction is in double, as libstdc++ writes it.
                x = float(2.0f * uniform(rng) - 1.0);
                y = float(2.0f * uniform(rng) - 1.0);
                r2 = x * x + y * y;
            } while (r2 > 1.0f || r2 == 0.0f);
            const float mult = std::sqrt(-2 * std::log(r2) / r2);
            saved_ = x * mult;
            r = y * mult;
        }
        return r * stddev_ + mean_;
    }

private:
    // generate_canonical<float, 24>: one 64-bit draw, rounded to float, over 2^64.
    static float uniform(std::mt19937_64 & rng) {
        const float u = float(rng()) * 0x1p-64f;
        return u >= 1.0f ? std::nextafter(1.0f, 0.0f) : u;
    }

    float mean_, stddev_;
    std::optional<float> saved_;
};

struct Plan {
    SynthOptions opt;
    std::vector<int> token_kind;                    // per vocab entry: index into specialist_kinds() or -1
    std::map<int, std::vector<int>> dead;           // layer -> ids
    std::map<int, std::map<int, int>> specialists;  // layer -> id -> kind
    int n_kind_coords = 0;                          // embedding coordinates 1..n_kind_coords mark text kinds
    std::map<int, std::vector<int>> image;          // layer -> ids only image tokens reach
    int image_coord = 0;                            // the coordinate that marks image tokens; 0: none
    std::map<int, std::vector<int>> audio;          // layer -> ids only audio reaches
    int audio_coord = 0;                            // the coordinate that marks audio rows; 0: none
    // Where image experts write what the text after an image reads (0: no such channel),
    // and the attention head width the channel's planted query and key dimensions live in.
    int image_signal_coord = 0;
    int head_dim = 0;
    // The planted coordinates are 0..last_coord(): no layer may write into them.
    int last_coord() const { return std::max({n_kind_coords, image_coord, image_signal_coord, audio_coord}); }
};

// A tensor as llama.cpp created it and synth filled it. llama.cpp's own model saver
// refuses several architectures (those whose metadata it cannot write back), so synth
// keeps what it filled and writes the file itself from the metadata it chose.
struct FilledTensor {
    std::string name;
    ggml_type type;
    int64_t ne[GGML_MAX_DIMS];
    std::vector<uint8_t> bytes;
};

struct Filling {
    Plan plan;
    std::vector<FilledTensor> tensors;  // in llama.cpp's creation order, each name once
    std::set<std::string> names;
    std::set<int> router_layers;        // layers llama.cpp gave a router: where planting lands
};

uint64_t tensor_seed(uint64_t seed, const char * name) { return XXH64(name, std::strlen(name), seed); }

int layer_of(const std::string & name) {
    static const std::regex re(R"(^blk\.(\d+)\.)");
    std::smatch m;
    return std::regex_search(name, m, re) ? std::stoi(m[1].str()) : -1;
}

bool ends_with(const std::string & s, const std::string & suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
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

// Fills every tensor llama.cpp creates. Planting works through the residual stream:
// embedding coordinate 0 is a constant 1 for every token and coordinate 1+k marks tokens
// of text kind k; a projector's image embeddings carry the constant too, and the image
// coordinate instead of a kind. No layer writes into those coordinates, so they reach every
// layer's router unchanged, and router rows that weigh them strongly decide who can reach the top-k.
void fill_tensor(ggml_tensor * t, void * ud) {
    auto & filling = *static_cast<Filling *>(ud);
    const Plan & plan = filling.plan;
    const std::string name = t->name;
    const int64_t n = ggml_nelements(t);
    const int64_t row = t->ne[0];
    std::mt19937_64 rng(tensor_seed(plan.opt.seed, t->name));
    std::vector<float> v(size_t(n), 0.0f);
    const auto normal = [&](float sigma) {
        Normal d(0.0f, sigma);
        for (auto & x : v) {
            x = d(rng);
        }
    };

    // An MTP block's own embedding is planted as the trunk's.
    if (name == "token_embd.weight" || ends_with(name, "nextn.embed_tokens.weight")) {
        normal(0.1f);
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

    if (plan.image_signal_coord > 0) {
        plant_image_channel(name, t, v, plan, rng);
    }

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

void add_type_override(gguf_context * ctx, const std::string & name, ggml_type type) {
    ggml_tensor t;
    std::memset(&t, 0, sizeof(t));
    t.type = type;
    ggml_set_name(&t, name.c_str());
    gguf_add_tensor(ctx, &t);
}

fs::path default_vocab() { return fs::path(MOEPRUNE_LLAMA_DIR) / "models" / "ggml-vocab-qwen2.gguf"; }

const ArchTraits & check_options(const SynthOptions & o) {
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
    // llama.cpp asserts instead of refusing past its fixed limits (LLAMA_MAX_LAYERS and
    // LLAMA_MAX_EXPERTS in src/llama-hparams.h of the pinned release).
    constexpr int kMaxLayers = 512, kMaxExperts = 1024;
    if (o.n_layer < 1 || o.n_layer > kMaxLayers) {
        throw Error(fmt::format("synth: --layers must be from 1 to {} (got {})", kMaxLayers, o.n_layer));
    }
    if (o.n_layer < traits->min_layers) {
        throw Error(fmt::format("synth: {} needs --layers >= {} (llama.cpp builds its layer pattern from that many)",
                                o.arch, traits->min_layers));
    }
    if (o.n_expert < 2 || o.n_expert > kMaxExperts) {
        throw Error(fmt::format("synth: --experts must be from 2 to {} (got {})", kMaxExperts, o.n_expert));
    }
    if (o.n_expert_used < 1 || o.n_expert_used > o.n_expert) {
        throw Error(fmt::format("synth: --used must be from 1 to --experts {} (got {})", o.n_expert, o.n_expert_used));
    }
    if (o.n_embd < traits->head_dim || o.n_embd % traits->head_dim != 0) {
        throw Error(fmt::format("synth: --embd must be a multiple of {} for {} (got {})", traits->head_dim, o.arch, o.n_embd));
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
    if (o.gate_up && !traits->gate_up) {
        throw Error("synth: --gate-up: llama.cpp does not load merged ffn_gate_up_exps for " + o.arch);
    }
    if (o.mtp && !traits->mtp) {
        throw Error("synth: --mtp: " + (traits->no_mtp_reason.empty()
                                            ? "llama.cpp builds no nextn (multi-token prediction) layers for " + o.arch
                                            : traits->no_mtp_reason));
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
    if (o.dead < 0) {
        throw Error("synth: --dead must be >= 0");
    }
    if (o.vocab_first != 0 && o.vocab_first < 256) {
        throw Error("synth: --vocab-first must be 0 (the whole vocabulary) or at least 256, the byte tokens every text falls back to");
    }
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
    if (plants && !traits->planting_refused.empty()) {
        throw Error("synth: --dead, --specialists and --image-experts cannot be planted in " + o.arch + ": " +
                    traits->planting_refused);
    }
    if (plants && o.groups > 0) {
        throw Error("synth: --dead, --specialists and --image-experts are not planted with --groups: group-limited "
                    "routing picks groups "
                    "by their best experts, which the planted rows do not account for");
    }
    if (o.output.empty() || o.output.extension() != ".gguf") {
        throw Error("synth: -o must name a .gguf file");
    }
    return *traits;
}

// One leading dense layer when at least one MoE layer is left after it, as the
// DeepSeek-V3 family ships (three there); none for a one-layer trunk.
SynthOptions resolve_defaults(SynthOptions o) {
    const ArchTraits * traits = find_arch(o.arch);
    if (traits && traits->tuned) {
        const int fixed = o.arch == "dots1" ? 1 : 0;
        if (o.dense_leading >= 0 && o.dense_leading != fixed) {
            throw Error(fmt::format("synth: --dense-leading: {} always has {} dense leading layers", o.arch, fixed));
        }
        o.dense_leading = fixed;
    } else if (o.dense_leading < 0) {
        o.dense_leading = o.n_layer - int(o.mtp) >= 2 ? 1 : 0;
    }
    return o;
}

Plan make_plan(const SynthOptions & o, const ArchTraits & traits, const gguf_context * vocab, const fs::path & vocab_path) {
    Plan p;
    p.opt = o;
    if (o.specialists) {
        p.n_kind_coords = int(specialist_kinds().size());
        const int64_t id = gguf_find_key(vocab, "tokenizer.ggml.tokens");
        if (id < 0) {
            fail_file(vocab_path.string(), "has no tokenizer.ggml.tokens");
        }
        const size_t n = gguf_get_arr_n(vocab, id);
        p.token_kind.assign(n, -1);
        for (size_t i = 0; i < n; ++i) {
            p.token_kind[i] = classify_token_text(decode_byte_level(gguf_get_arr_str(vocab, id, i)));
        }
    }
    std::mt19937_64 rng(o.seed ^ 0x5eedULL);
    for (int layer = 0; layer < o.n_layer; ++layer) {
        std::vector<int> ids(size_t(o.n_expert));
        for (int e = 0; e < o.n_expert; ++e) {
            ids[size_t(e)] = e;
        }
        std::shuffle(ids.begin(), ids.end(), rng);
        size_t next = 0;
        if (o.dead > 0) {
            std::vector<int> dead(ids.begin(), ids.begin() + o.dead);
            std::sort(dead.begin(), dead.end());
            p.dead[layer] = dead;
            next = size_t(o.dead);
        }
        if (o.specialists) {
            for (int k = 0; k < p.n_kind_coords; ++k) {
                p.specialists[layer][ids[next++]] = k;
            }
        }
        if (o.image_experts > 0) {
            std::vector<int> image(ids.begin() + ptrdiff_t(next), ids.begin() + ptrdiff_t(next) + o.image_experts);
            std::sort(image.begin(), image.end());
            p.image[layer] = image;
            next += size_t(o.image_experts);
        }
        if (o.audio_experts > 0) {
            std::vector<int> audio(ids.begin() + ptrdiff_t(next), ids.begin() + ptrdiff_t(next) + o.audio_experts);
            std::sort(audio.begin(), audio.end());
            p.audio[layer] = audio;
        }
    }
    if (!o.mmproj.empty()) {
        p.image_coord = p.n_kind_coords + 1;
    }
    if (o.image_experts > 0 && !traits.mla && !traits.recurrent_layer_1) {
        p.image_signal_coord = p.image_coord + 1;
        p.head_dim = traits.head_dim;
    }
    if (o.audio_experts > 0) {
        p.audio_coord = std::max(p.image_coord, p.image_signal_coord) + 1;
    }
    return p;
}

// The planted truth of the layers that route (dense leading layers have no experts).
json planted_json(const Plan & p, const std::set<int> & router_layers) {
    json dead = json::object(), spec = json::object();
    for (const auto & [layer, ids] : p.dead) {
        if (router_layers.count(layer)) {
            dead[std::to_string(layer)] = ids;
        }
    }
    for (const auto & [layer, m] : p.specialists) {
        if (!router_layers.count(layer)) {
            continue;
        }
        json l = json::object();
        for (const auto & [id, kind] : m) {
            l[std::to_string(id)] = specialist_kinds()[size_t(kind)];
        }
        spec[std::to_string(layer)] = l;
    }
    size_t kind_tokens = 0;
    for (int k : p.token_kind) {
        kind_tokens += k >= 0;
    }
    json planted = {{"dead", dead}, {"specialists", spec},
                    {"kinds", p.opt.specialists ? specialist_kinds() : std::vector<std::string>{}},
                    {"kind_tokens", kind_tokens}};
    if (!p.opt.mmproj.empty()) {
        json image = json::object();
        for (const auto & [layer, ids] : p.image) {
            if (router_layers.count(layer)) {
                image[std::to_string(layer)] = ids;
            }
        }
        planted["image"] = image;
        planted["image_coordinate"] = p.image_coord;
        planted["image_signal_coordinate"] = p.image_signal_coord;
        if (p.audio_coord > 0) {
            json audio = json::object();
            for (const auto & [layer, ids] : p.audio) {
                if (router_layers.count(layer)) {
                    audio[std::to_string(layer)] = ids;
                }
            }
            planted["audio"] = audio;
            planted["audio_coordinate"] = p.audio_coord;
        }
    }
    return planted;
}

// Which of llama.cpp's tensors the output keeps, and how merged gate_up is split when
// the user did not ask for it. llama.cpp creates every optional tensor when a model
// is built from metadata (all .scale tensors, merged gate_up), so the requested layout
// is carved out of what it created.
struct OutTensor {
    std::string name;
    const ggml_tensor * src;   // copied as is, or split from when half >= 0
    int half = -1;             // 0 = gate rows, 1 = up rows of a merged gate_up slab
};

std::vector<OutTensor> choose_tensors(const SynthOptions & o, const std::vector<const ggml_tensor *> & filled) {
    // llama.cpp creates every optional .scale / .input_scale tensor in this mode; only the
    // per-expert ones asked for with --expert-scales stay.
    static const std::regex expert_scale_re(R"(ffn_[a-z_]+_exps\.(input_)?scale$)");
    std::vector<OutTensor> out;
    for (const ggml_tensor * t : filled) {
        const std::string name = t->name;
        if ((ends_with(name, ".scale") || ends_with(name, ".input_scale")) &&
            !(o.expert_scales && std::regex_search(name, expert_scale_re))) {
            continue;
        }
        if (!o.gate_up && name.find("ffn_gate_up_exps.weight") != std::string::npos) {
            const std::string prefix = name.substr(0, name.find("ffn_gate_up_exps"));
            out.push_back({prefix + "ffn_gate_exps.weight", t, 0});
            out.push_back({prefix + "ffn_up_exps.weight", t, 1});
            continue;
        }
        out.push_back({name, t, -1});
    }
    return out;
}

// A tensor of the output that owns its bytes (the halves of a split gate_up).
struct HalfTensor {
    ggml_tensor * tensor;
    std::vector<uint8_t> bytes;
};

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

void write_projector(const Plan & plan, int64_t n_embd_inp, const fs::path & path) {
    constexpr int n_patches = (kImageSize / kPatchSize) * (kImageSize / kPatchSize);
    struct Spec {
        std::string name;
        std::vector<int64_t> ne;
        float sigma;  // > 0: normal; 0: zeros; < 0: the constant -sigma (norm gains)
    };
    std::vector<Spec> specs = {
        {"v.patch_embd.weight", {kPatchSize, kPatchSize, 3, kVisionWidth}, 0.02f},
        {"v.position_embd.weight", {kVisionWidth, n_patches}, 0.02f},
        {"mm.0.weight", {kVisionWidth, kProjectorHidden}, 0.1f},
        {"mm.0.bias", {kProjectorHidden}, 0.0f},
        {"mm.2.weight", {kProjectorHidden, n_embd_inp}, 0.1f},
        {"mm.2.bias", {n_embd_inp}, 0.0f},
    };
    const bool audio = plan.audio_coord > 0;
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
    ggml_init_params ip{ggml_tensor_overhead() * specs.size(), nullptr, /*no_alloc=*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(ip), ggml_free);
    GgufPtr g(gguf_init_empty());
    gguf_set_val_str(g.get(), "general.architecture", "clip");
    gguf_set_val_str(g.get(), "general.name", "moeprune-synth-projector");
    gguf_set_val_bool(g.get(), "clip.has_vision_encoder", true);
    // One projector type for a vision-only file; one per modality when it encodes audio too.
    gguf_set_val_str(g.get(), audio ? "clip.vision.projector_type" : "clip.projector_type", "mlp");
    if (audio) {
        gguf_set_val_bool(g.get(), "clip.has_audio_encoder", true);
        gguf_set_val_str(g.get(), "clip.audio.projector_type", "qwen2a");
        gguf_set_val_u32(g.get(), "clip.audio.embedding_length", kAudioWidth);
        gguf_set_val_u32(g.get(), "clip.audio.feed_forward_length", kAudioWidth);
        gguf_set_val_u32(g.get(), "clip.audio.attention.head_count", 1);
        gguf_set_val_u32(g.get(), "clip.audio.block_count", 1);
        gguf_set_val_u32(g.get(), "clip.audio.projection_dim", uint32_t(n_embd_inp));
        gguf_set_val_f32(g.get(), "clip.audio.attention.layer_norm_epsilon", 1e-5f);
        gguf_set_val_u32(g.get(), "clip.audio.num_mel_bins", kMelBins);
    }
    gguf_set_val_u32(g.get(), "clip.vision.embedding_length", kVisionWidth);
    gguf_set_val_u32(g.get(), "clip.vision.feed_forward_length", kVisionWidth);
    gguf_set_val_u32(g.get(), "clip.vision.attention.head_count", 1);
    gguf_set_val_u32(g.get(), "clip.vision.block_count", 0);
    gguf_set_val_u32(g.get(), "clip.vision.projection_dim", uint32_t(n_embd_inp));
    gguf_set_val_f32(g.get(), "clip.vision.attention.layer_norm_epsilon", 1e-6f);
    gguf_set_val_u32(g.get(), "clip.vision.image_size", kImageSize);
    gguf_set_val_u32(g.get(), "clip.vision.patch_size", kPatchSize);
    const float half[3] = {0.5f, 0.5f, 0.5f};
    gguf_set_arr_data(g.get(), "clip.vision.image_mean", GGUF_TYPE_FLOAT32, half, 3);
    gguf_set_arr_data(g.get(), "clip.vision.image_std", GGUF_TYPE_FLOAT32, half, 3);
    const json settings = {{"type", "mlp"},           {"image_size", kImageSize}, {"patch_size", kPatchSize},
                           {"tokens_per_image", n_patches}, {"image_coordinate", plan.image_coord}, {"seed", plan.opt.seed},
                           {"audio", audio ? json{{"type", "qwen2a"}, {"tokens_per_30s", kAudioPositions / 2},
                                                  {"audio_coordinate", plan.audio_coord}}
                                           : json(nullptr)}};
    gguf_set_val_str(g.get(), "moeprune.synth.projector", settings.dump().c_str());

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

} // namespace

SynthResult synthesize(const SynthOptions & requested) {
    const SynthOptions o = resolve_defaults(requested);
    const ArchTraits & traits = check_options(o);
    const fs::path vocab_path = o.vocab.empty() ? default_vocab() : o.vocab;
    {
        fs::path prefix = o.output;
        prefix.replace_extension();
        std::vector<fs::path> planned;
        for (int s = 0; s < o.split; ++s) {
            planned.push_back(o.split == 1 ? o.output : split_shard_path(prefix, s + 1, o.split));
        }
        if (!o.mmproj.empty()) {
            planned.push_back(o.mmproj);
        }
        refuse_output_clashes(planned, {vocab_path});
    }
    GgufPtr vocab = open_gguf_metadata(vocab_path);
    if (o.vocab_first > 0) {
        vocab = cut_vocabulary(vocab.get(), o.vocab_first, vocab_path);
    }
    Plan plan = make_plan(o, traits, vocab.get(), vocab_path);

    GgufPtr meta(gguf_init_empty());
    gguf_set_kv(meta.get(), vocab.get());
    add_arch_metadata(meta.get(), o, traits);
    for (int il = 0; il < o.n_layer; ++il) {
        for (const char * base : {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"}) {
            add_type_override(meta.get(), fmt::format("blk.{}.{}.weight", il, base), o.expert_type);
        }
    }
    // The vocabulary matrices dominate a small model; q8_0 keeps them small and loadable everywhere.
    add_type_override(meta.get(), "token_embd.weight", GGML_TYPE_Q8_0);
    add_type_override(meta.get(), "output.weight", GGML_TYPE_Q8_0);

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            std::fputs(text, stderr);
        }
    }, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp = true;  // otherwise llama.cpp creates no nextn tensors
    // Repacked buffer types (chosen by the CPU's features) would reorder the tensors it
    // hands over, and synth writes them in that order: same flags, same bytes, on any host.
    mp.use_extra_bufts = false;
    Filling filling{std::move(plan), {}, {}, {}};
    llama_model * model = llama_model_init_from_user(meta.get(), fill_tensor, &filling, mp);
    if (!model) {
        throw Error("synth: llama.cpp could not build a " + o.arch + " model from these settings");
    }
    const int64_t n_embd_inp = llama_model_n_embd_inp(model);
    llama_model_free(model);
    if (filling.router_layers.empty()) {
        throw Error("synth: llama.cpp built no expert router (ffn_gate_inp) for " + o.arch + ": not a MoE model as built");
    }

    // Tensors over the kept bytes, and room for the halves of split gate_up slabs.
    ggml_init_params ip{ggml_tensor_overhead() * (2 * filling.tensors.size() + 1), nullptr, /*no_alloc=*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> tensor_ctx(ggml_init(ip), ggml_free);
    std::vector<const ggml_tensor *> filled;
    for (auto & f : filling.tensors) {
        ggml_tensor * t = ggml_new_tensor(tensor_ctx.get(), f.type, GGML_MAX_DIMS, f.ne);
        ggml_set_name(t, f.name.c_str());
        t->data = f.bytes.data();
        filled.push_back(t);
    }

    SynthResult result;
    result.planted = planted_json(filling.plan, filling.router_layers);
    json settings = {{"arch", o.arch}, {"layers", o.n_layer}, {"experts", o.n_expert}, {"used", o.n_expert_used},
                           {"embd", o.n_embd}, {"ff", o.n_ff}, {"type", ggml_type_name(o.expert_type)},
                           {"gate_up", o.gate_up}, {"expert_scales", o.expert_scales}, {"groups", o.groups}, {"mtp", o.mtp},
                           {"dense_leading", *filling.router_layers.begin()}, {"split", o.split},
                           {"seed", o.seed}, {"dead", o.dead}, {"vocab_first", o.vocab_first}, {"specialists", o.specialists}};
    if (!o.mmproj.empty()) {
        settings["image_experts"] = o.image_experts;
        settings["audio_experts"] = o.audio_experts;
        settings["mmproj"] = o.mmproj.string();
    }

    const std::vector<OutTensor> chosen = choose_tensors(o, filled);
    std::vector<HalfTensor> halves;
    halves.reserve(chosen.size());
    std::vector<const ggml_tensor *> tensors;
    for (const auto & c : chosen) {
        if (c.half < 0) {
            tensors.push_back(c.src);
            continue;
        }
        const int64_t n_ff = c.src->ne[1] / 2;
        ggml_tensor * h = ggml_new_tensor_3d(tensor_ctx.get(), c.src->type, c.src->ne[0], n_ff, c.src->ne[2]);
        ggml_set_name(h, c.name.c_str());
        const size_t row = ggml_row_size(c.src->type, c.src->ne[0]);
        HalfTensor ht{h, std::vector<uint8_t>(ggml_nbytes(h))};
        for (int64_t e = 0; e < c.src->ne[2]; ++e) {
            const auto * src = static_cast<const uint8_t *>(c.src->data) + e * c.src->nb[2] + c.half * n_ff * row;
            std::memcpy(ht.bytes.data() + e * n_ff * row, src, n_ff * row);
        }
        h->data = ht.bytes.data();
        halves.push_back(std::move(ht));
        tensors.push_back(h);
    }

    const int n_split = o.split;
    fs::path prefix = o.output;
    prefix.replace_extension();
    std::vector<std::unique_ptr<AtomicOutput>> outputs;
    for (int s = 0; s < n_split; ++s) {
        const fs::path path = n_split == 1 ? o.output : split_shard_path(prefix, s + 1, n_split);
        GgufPtr out(gguf_init_empty());
        if (s == 0) {
            gguf_set_kv(out.get(), meta.get());
            if (gguf_find_key(out.get(), "tokenizer.chat_template") < 0) {
                // The Qwen2 vocabulary file has no template; Qwen
                // models speak ChatML, which llama.cpp recognizes by its markers.
                gguf_set_val_str(out.get(), "tokenizer.chat_template",
                                 "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
            }
            gguf_set_val_str(out.get(), "moeprune.synth.settings", settings.dump().c_str());
            gguf_set_val_str(out.get(), "moeprune.synth.planted", result.planted.dump().c_str());
        }
        if (n_split > 1) {
            gguf_set_val_u16(out.get(), "split.no", uint16_t(s));
            gguf_set_val_u16(out.get(), "split.count", uint16_t(n_split));
            gguf_set_val_i32(out.get(), "split.tensors.count", int32_t(tensors.size()));
        }
        const size_t begin = tensors.size() * size_t(s) / size_t(n_split);
        const size_t end = tensors.size() * size_t(s + 1) / size_t(n_split);
        for (size_t i = begin; i < end; ++i) {
            gguf_add_tensor(out.get(), tensors[i]);
        }
        outputs.push_back(std::make_unique<AtomicOutput>(path));
        if (!gguf_write_to_file(out.get(), outputs.back()->temp_path().c_str(), false)) {
            fail_file(outputs.back()->temp_path().string(), "writing the model failed");
        }
    }
    // Written before anything is committed, so a projector that cannot be written leaves no model either.
    std::optional<AtomicOutput> projector;
    if (!o.mmproj.empty()) {
        write_projector(filling.plan, n_embd_inp, projector.emplace(o.mmproj).temp_path());
    }
    for (auto & out : outputs) {
        out->commit();
        std::error_code ec;
        result.bytes += fs::file_size(out->final_path(), ec);
        result.files.push_back(out->final_path());
    }
    if (projector) {
        projector->commit();
        result.mmproj = projector->final_path();
    }
    return result;
}

} // namespace moeprune
