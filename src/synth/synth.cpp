// synthesize: the options checked, the model's metadata chosen, llama.cpp building the model
// through the tensor filler, and the chosen tensors written as shards (and the projector).
#include "synth/synth.h"
#include "synth/internal.h"
#include "synth/architectures.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "model/model_file.h"

#include "llama.h"

#include <fmt/format.h>

#include <memory>
#include <regex>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace synth_impl;

namespace {

void add_type_override(gguf_context * ctx, const std::string & name, ggml_type type) {
    ggml_tensor t;
    std::memset(&t, 0, sizeof(t));
    t.type = type;
    ggml_set_name(&t, name.c_str());
    gguf_add_tensor(ctx, &t);
}

fs::path default_vocab() { return fs::path(MOEPRUNE_LLAMA_DIR) / "models" / "ggml-vocab-qwen2.gguf"; }

// The model's shards (one path without --split), in order.
std::vector<fs::path> shard_paths(const SynthOptions & o) {
    fs::path prefix = o.output;
    prefix.replace_extension();
    std::vector<fs::path> paths;
    for (int s = 0; s < o.split; ++s) {
        paths.push_back(o.split == 1 ? o.output : split_shard_path(prefix, s + 1, o.split));
    }
    return paths;
}

// The vocabulary's keys, the architecture's, and the tensor types llama.cpp is to create.
GgufPtr model_metadata(const SynthOptions & o, const ArchTraits & traits, const gguf_context * vocab) {
    GgufPtr meta(gguf_init_empty());
    gguf_set_kv(meta.get(), vocab);
    add_arch_metadata(meta.get(), o, traits);
    for (int il = 0; il < o.n_layer; ++il) {
        for (const char * base : {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"}) {
            add_type_override(meta.get(), fmt::format("blk.{}.{}.weight", il, base), o.expert_type);
        }
    }
    // The vocabulary matrices dominate a small model; q8_0 keeps them small and loadable everywhere.
    add_type_override(meta.get(), "token_embd.weight", GGML_TYPE_Q8_0);
    add_type_override(meta.get(), "output.weight", GGML_TYPE_Q8_0);
    return meta;
}

// llama.cpp builds the model from the metadata, calling fill_tensor for every tensor;
// returns its input embedding width, which a projector must match.
int64_t build_model(const SynthOptions & o, gguf_context * meta, Filling & filling) {
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
    llama_model * model = llama_model_init_from_user(meta, fill_tensor, &filling, mp);
    if (!model) {
        throw Error("synth: llama.cpp could not build a " + o.arch + " model from these settings");
    }
    const int64_t n_embd_inp = llama_model_n_embd_inp(model);
    llama_model_free(model);
    if (filling.router_layers.empty()) {
        throw Error("synth: llama.cpp built no expert router (ffn_gate_inp) for " + o.arch + ": not a MoE model as built");
    }
    return n_embd_inp;
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

// The tensors the shards hold, in order, over the filled bytes and the halves split from merged gate_up.
struct OutputTensors {
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx{nullptr, ggml_free};
    std::vector<HalfTensor> halves;
    std::vector<const ggml_tensor *> tensors;
};

OutputTensors output_tensors(const SynthOptions & o, std::vector<FilledTensor> & filled_tensors) {
    OutputTensors out;
    // Tensors over the kept bytes, and room for the halves of split gate_up slabs.
    ggml_init_params ip{ggml_tensor_overhead() * (2 * filled_tensors.size() + 1), nullptr, /*no_alloc=*/true};
    out.ctx.reset(ggml_init(ip));
    std::vector<const ggml_tensor *> filled;
    for (auto & f : filled_tensors) {
        ggml_tensor * t = ggml_new_tensor(out.ctx.get(), f.type, GGML_MAX_DIMS, f.ne);
        ggml_set_name(t, f.name.c_str());
        t->data = f.bytes.data();
        filled.push_back(t);
    }
    const std::vector<OutTensor> chosen = choose_tensors(o, filled);
    out.halves.reserve(chosen.size());
    for (const auto & c : chosen) {
        if (c.half < 0) {
            out.tensors.push_back(c.src);
            continue;
        }
        const int64_t n_ff = c.src->ne[1] / 2;
        ggml_tensor * h = ggml_new_tensor_3d(out.ctx.get(), c.src->type, c.src->ne[0], n_ff, c.src->ne[2]);
        ggml_set_name(h, c.name.c_str());
        const size_t row = ggml_row_size(c.src->type, c.src->ne[0]);
        HalfTensor ht{h, std::vector<uint8_t>(ggml_nbytes(h))};
        for (int64_t e = 0; e < c.src->ne[2]; ++e) {
            const auto * src = static_cast<const uint8_t *>(c.src->data) + e * c.src->nb[2] + c.half * n_ff * row;
            std::memcpy(ht.bytes.data() + e * n_ff * row, src, n_ff * row);
        }
        h->data = ht.bytes.data();
        out.halves.push_back(std::move(ht));
        out.tensors.push_back(h);
    }
    return out;
}

// What made the model, recorded in it; dense_leading as built, the first layer with a router.
json settings_json(const SynthOptions & o, const Filling & filling) {
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
    return settings;
}

// Every shard written to its temporary file, none committed: the caller commits them together.
std::vector<std::unique_ptr<AtomicOutput>> write_shards(const SynthOptions & o, const gguf_context * meta,
                                                        const json & settings, const json & planted,
                                                        const std::vector<const ggml_tensor *> & tensors) {
    const int n_split = o.split;
    const std::vector<fs::path> paths = shard_paths(o);
    std::vector<std::unique_ptr<AtomicOutput>> outputs;
    for (int s = 0; s < n_split; ++s) {
        const fs::path & path = paths[size_t(s)];
        GgufPtr out(gguf_init_empty());
        if (s == 0) {
            gguf_set_kv(out.get(), meta);
            if (gguf_find_key(out.get(), "tokenizer.chat_template") < 0) {
                // The Qwen2 vocabulary file has no template; Qwen
                // models speak ChatML, which llama.cpp recognizes by its markers.
                gguf_set_val_str(out.get(), "tokenizer.chat_template",
                                 "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
            }
            gguf_set_val_str(out.get(), "moeprune.synth.settings", settings.dump().c_str());
            gguf_set_val_str(out.get(), "moeprune.synth.planted", planted.dump().c_str());
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
    return outputs;
}

} // namespace

SynthResult synthesize(const SynthOptions & requested) {
    const SynthOptions o = resolve_defaults(requested);
    const ArchTraits & traits = check_options(o);
    const fs::path vocab_path = o.vocab.empty() ? default_vocab() : o.vocab;
    std::vector<fs::path> planned = shard_paths(o);
    if (!o.mmproj.empty()) {
        planned.push_back(o.mmproj);
    }
    refuse_output_clashes(planned, {vocab_path});
    GgufPtr vocab = open_gguf_metadata(vocab_path);
    if (o.vocab_first > 0) {
        vocab = cut_vocabulary(vocab.get(), o.vocab_first, vocab_path);
    }
    Plan plan = make_plan(o, traits, vocab.get(), vocab_path);
    GgufPtr meta = model_metadata(o, traits, vocab.get());
    Filling filling{std::move(plan), {}, {}, {}};
    const int64_t n_embd_inp = build_model(o, meta.get(), filling);
    const OutputTensors tensors = output_tensors(o, filling.tensors);

    SynthResult result;
    result.planted = planted_json(filling.plan, filling.router_layers);
    std::vector<std::unique_ptr<AtomicOutput>> outputs =
        write_shards(o, meta.get(), settings_json(o, filling), result.planted, tensors.tensors);
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
