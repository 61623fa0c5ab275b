#include "cli/commands.h"
#include "synth/synth.h"

#include <chrono>
#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_synth(CLI::App & app, Action & action) {
    auto opt = std::make_shared<SynthOptions>();
    auto type = std::make_shared<std::string>("f32");
    auto json_out = std::make_shared<bool>(false);
    CLI::App * sub = app.add_subcommand("synth", "Build a small real-format MoE model through llama.cpp");
    sub->add_option("--arch", opt->arch, "llama.cpp architecture name (every MoE one of the pinned release; "
                                         "docs/architectures.md lists them)")
        ->capture_default_str();
    sub->add_option("--layers", opt->n_layer, "Transformer blocks")->capture_default_str();
    sub->add_option("--experts", opt->n_expert, "Routed experts per layer")->capture_default_str();
    sub->add_option("--used", opt->n_expert_used, "Experts used per token (top-k)")->capture_default_str();
    sub->add_option("--embd", opt->n_embd, "Embedding width (multiple of 32)")->capture_default_str();
    sub->add_option("--ff", opt->n_ff, "Routed-expert FFN width")->capture_default_str();
    sub->add_option("--type", *type, "ggml type of routed-expert tensors (f32, f16, q8_0, q4_K, iq4_nl, ...)")
        ->capture_default_str();
    sub->add_flag("--gate-up", opt->gate_up, "Merged ffn_gate_up_exps tensors (qwen4exp)");
    sub->add_flag("--expert-scales", opt->expert_scales, "Per-expert ffn_*_exps.scale and .input_scale tensors");
    sub->add_option("--groups", opt->groups, "Expert groups; a token uses the best half of them (DeepSeek-V3 style)");
    sub->add_flag("--mtp", opt->mtp, "Make the last layer a nextn (multi-token prediction) layer");
    sub->add_option("--dense-leading", opt->dense_leading,
                    "Dense FFN layers before the MoE ones (default: one when a MoE layer is left)");
    sub->add_option("--split", opt->split, "Write N shards in gguf-split layout")->capture_default_str();
    sub->add_option("--seed", opt->seed, "Random seed")->capture_default_str();
    sub->add_option("--dead", opt->dead, "Plant N experts per layer that no input can route to")->capture_default_str();
    sub->add_flag("--specialists", opt->specialists, "Plant one expert per layer for CJK text and one for source code");
    sub->add_option("--mmproj", opt->mmproj,
                    "Also write a projector GGUF (llava-style mlp) that llama.cpp's libmtmd loads for images");
    sub->add_option("--image-experts", opt->image_experts, "Plant N experts per layer that only image tokens reach (needs --mmproj)")
        ->capture_default_str();
    sub->add_option("--audio-experts", opt->audio_experts, "Plant N experts per layer that only audio reaches; the projector then encodes audio too (needs --mmproj)")
        ->capture_default_str();
    sub->add_option("--vocab", opt->vocab, "GGUF whose tokenizer to copy (default: the pinned llama.cpp's Qwen2 vocabulary)");
    sub->add_option("--vocab-first", opt->vocab_first,
                    "Cut the vocabulary to its first N ordinary tokens, one token per character and the special tokens (0: all)")
        ->capture_default_str();
    sub->add_option("-o,--output", opt->output, "Output .gguf (shards are NAME-0000i-of-0000N.gguf)")->required();
    sub->add_flag("--json", *json_out, "Print what was planted and written as JSON");
    sub->callback([=, &action] {
        action = [=] {
            opt->expert_type = parse_ggml_type(*type);
            const auto t0 = std::chrono::steady_clock::now();
            const SynthResult r = synthesize(*opt);
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (*json_out) {
                nlohmann::json j = r.planted;
                std::vector<std::string> files;
                for (const auto & f : r.files) {
                    files.push_back(f.string());
                }
                j["files"] = files;
                if (!r.mmproj.empty()) {
                    j["mmproj"] = r.mmproj.string();
                }
                j["bytes"] = r.bytes;
                j["seconds"] = secs;
                std::printf("%s\n", j.dump(1).c_str());
            } else {
                for (const auto & f : r.files) {
                    std::printf("wrote %s\n", f.c_str());
                }
                if (!r.mmproj.empty()) {
                    std::printf("wrote %s (projector)\n", r.mmproj.c_str());
                }
                std::printf("%.1f MiB in %.2f s\n", double(r.bytes) / (1 << 20), secs);
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
