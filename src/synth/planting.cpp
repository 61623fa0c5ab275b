// The planted truth: which experts of each layer are dead, specialists, or reached only by
// images or audio, and the embedding coordinates that mark them; and its JSON record.
#include "synth/internal.h"
#include "synth/vocabulary.h"
#include "core/errors.h"

namespace moeprune::synth_impl {

namespace fs = std::filesystem;
using nlohmann::json;

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

} // namespace moeprune::synth_impl
