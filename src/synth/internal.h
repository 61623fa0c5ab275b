#pragma once
// Private to synth: the plan of what is planted, the tensors as filled, and the phases
// synthesize chains. Other code includes synth/synth.h.
#include "synth/synth.h"
#include "synth/architectures.h"

#include "ggml.h"
#include "gguf.h"

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace moeprune::synth_impl {

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

inline uint64_t tensor_seed(uint64_t seed, const char * name) { return XXH64(name, std::strlen(name), seed); }

inline bool ends_with(const std::string & s, const std::string & suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The options checked against the architecture and llama.cpp's limits, and their
// defaults resolved (options.cpp).
SynthOptions resolve_defaults(SynthOptions o);
const ArchTraits & check_options(const SynthOptions & o);

// Which experts of each layer are planted, and the report of them (planting.cpp).
Plan make_plan(const SynthOptions & o, const ArchTraits & traits, const gguf_context * vocab,
               const std::filesystem::path & vocab_path);
nlohmann::json planted_json(const Plan & p, const std::set<int> & router_layers);

// llama.cpp's callback for every tensor it creates; `ud` is the Filling (tensor_fill.cpp).
void fill_tensor(ggml_tensor * t, void * ud);

// The projector GGUF for libmtmd (projector.cpp).
void write_projector(const Plan & plan, int64_t n_embd_inp, const std::filesystem::path & path);

} // namespace moeprune::synth_impl
