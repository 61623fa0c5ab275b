#include "core/errors.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "synth/synth.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include "gguf.h"
#include "llama.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <tuple>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

SynthOptions small(const std::string & arch, const fs::path & out) {
    SynthOptions o = test::synth_options();
    o.arch = arch;
    o.n_layer = 2;
    o.n_expert = 8;
    o.n_expert_used = 2;
    o.output = out;
    return o;
}

fs::path first_file(const SynthResult & r) { return r.files.front(); }

void expect_perplexity_runs(const fs::path & model, const fs::path & dir) {
    const fs::path text = dir / "text.txt";
    test::write_text(text, test::mixed_text());
    const auto r = test::run_command(fmt::format("{} -m {} -f {} -c 128 -b 128 -t 2", test::bin("llama-perplexity").string(),
                                                 model.string(), text.string()));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("Final estimate: PPL"), std::string::npos) << r.output;
}

using Case = std::tuple<std::string, std::string, int>;  // arch, expert type, shards

class SynthLoads : public ::testing::TestWithParam<Case> {};

} // namespace

// llama.cpp's own perplexity tool loads and runs every architecture, type and layout synth makes,
// and inspect reports exactly what synth was asked for.
TEST_P(SynthLoads, ByLlamaPerplexityAndInspectAgrees) {
    const auto & [arch, type_name, shards] = GetParam();
    test::TempDir dir;
    SynthOptions o = small(arch, dir / "m.gguf");
    o.expert_type = parse_ggml_type(type_name);
    // K-quants pack 256 values per block.
    o.n_embd = o.n_ff = ggml_blck_size(o.expert_type) > 32 ? 256 : 64;
    o.split = shards;
    const SynthResult r = synthesize(o);
    ASSERT_EQ(int(r.files.size()), shards);
    if (shards > 1) {
        EXPECT_EQ(r.files[0].filename().string(), fmt::format("m-00001-of-{:05d}.gguf", shards));
        EXPECT_EQ(r.files[1].filename().string(), fmt::format("m-00002-of-{:05d}.gguf", shards));
    }

    const InspectReport rep = inspect_model(GgufModel::open(first_file(r)), {4});
    EXPECT_TRUE(rep.problems.empty());
    EXPECT_EQ(rep.arch, arch);
    EXPECT_EQ(rep.n_layer, 2);
    EXPECT_EQ(rep.n_expert, 8);
    EXPECT_EQ(rep.n_expert_used, 2);
    EXPECT_EQ(int(rep.shards.size()), shards);
    EXPECT_EQ(rep.has_shared_expert_tensors, arch != "qwen3moe");
    ASSERT_EQ(rep.layers.size(), 2u);
    for (const auto & L : rep.layers) {
        int experts_seen = 0;
        uint64_t want_expert_bytes = 0;
        for (const auto & t : L.tensors) {
            EXPECT_EQ(t.n_expert, 8) << t.name;
            if (t.role != TensorRole::Expert) {
                continue;
            }
            ++experts_seen;
            EXPECT_EQ(t.type, o.expert_type) << t.name;
            // gate/up rows run along the embedding, down rows along the expert FFN width
            const bool down = t.name.find("ffn_down_exps") != std::string::npos;
            const uint64_t per = ggml_row_size(o.expert_type, down ? o.n_ff : o.n_embd) * uint64_t(down ? o.n_embd : o.n_ff);
            EXPECT_EQ(t.bytes_per_expert, per) << t.name;
            want_expert_bytes += per;
        }
        EXPECT_EQ(experts_seen, 3) << "gate, up and down in layer " << L.layer;
        EXPECT_EQ(L.expert_bytes, want_expert_bytes);
    }
    expect_perplexity_runs(first_file(r), dir.path());
}

INSTANTIATE_TEST_SUITE_P(
    AllArchitecturesTypesAndLayouts, SynthLoads,
    ::testing::Combine(::testing::Values("qwen3moe", "qwen2moe", "qwen4exp"),
                       ::testing::Values("f32", "f16", "q8_0", "q4_K", "iq4_nl"), ::testing::Values(1, 2)),
    [](const auto & info) {
        return std::get<0>(info.param) + "_" + std::get<1>(info.param) + "_split" + std::to_string(std::get<2>(info.param));
    });

TEST(Synth, SameFlagsGiveTheSameBytes) {
    test::TempDir dir;
    SynthOptions a = small("qwen3moe", dir / "a.gguf");
    a.dead = 1;
    a.specialists = true;
    SynthOptions b = a;
    b.output = dir / "b.gguf";
    SynthOptions c = a;
    c.output = dir / "c.gguf";
    c.seed = 7;
    synthesize(a);
    synthesize(b);
    synthesize(c);
    const std::string bytes_a = test::read_bytes(dir / "a.gguf");
    EXPECT_EQ(bytes_a, test::read_bytes(dir / "b.gguf"));
    EXPECT_NE(bytes_a, test::read_bytes(dir / "c.gguf"));
}

// dots1: a dense first layer, then sigmoid routers with a selection bias and a shared
// expert (the DeepSeek-V3 style of gating), loadable by llama.cpp.
TEST(Synth, Dots1HasADenseFirstLayerAndASigmoidRouter) {
    test::TempDir dir;
    SynthOptions o = small("dots1", dir / "m.gguf");
    o.n_layer = 3;
    const SynthResult r = synthesize(o);
    const InspectReport rep = inspect_model(GgufModel::open(first_file(r)), {});
    EXPECT_TRUE(rep.problems.empty());
    EXPECT_EQ(rep.gating_func, "sigmoid");
    ASSERT_EQ(rep.layers.size(), 2u);
    EXPECT_EQ(rep.layers[0].layer, 1);
    bool bias = false;
    for (const auto & t : rep.layers[0].tensors) {
        bias = bias || t.role == TensorRole::SelectionBias;
    }
    EXPECT_TRUE(bias) << "exp_probs_b.bias must be there";
    expect_perplexity_runs(first_file(r), dir.path());
}

TEST(Synth, MergedGateUpAndExpertScalesLoad) {
    test::TempDir dir;
    SynthOptions o = small("qwen4exp", dir / "m.gguf");
    o.gate_up = true;
    o.expert_scales = true;
    const SynthResult r = synthesize(o);
    const GgufModel m = GgufModel::open(first_file(r));
    int gate_up = 0, gate = 0, scales = 0;
    for (const auto & t : m.tensors()) {
        gate_up += t.name.find("ffn_gate_up_exps.weight") != std::string::npos;
        gate += t.name.find("ffn_gate_exps.weight") != std::string::npos;
        if (t.name.find("_exps.scale") != std::string::npos) {
            ++scales;
            EXPECT_EQ(t.cls.role, TensorRole::Expert);
            EXPECT_EQ(t.outer_dim(), 8);
        }
    }
    EXPECT_EQ(gate_up, 2);
    EXPECT_EQ(gate, 0);
    EXPECT_GT(scales, 0);
    expect_perplexity_runs(first_file(r), dir.path());
}

TEST(Synth, WithoutFlagsThereAreNoScalesAndNoMergedGateUp) {
    test::TempDir dir;
    const SynthResult r = synthesize(small("qwen4exp", dir / "m.gguf"));
    const GgufModel m = GgufModel::open(first_file(r));
    for (const auto & t : m.tensors()) {
        EXPECT_EQ(t.name.find(".scale"), std::string::npos) << t.name;
        EXPECT_EQ(t.name.find("gate_up"), std::string::npos) << t.name;
    }
}

TEST(Synth, RecordsItsSettingsAndTheRealTokenizer) {
    test::TempDir dir;
    const SynthResult r = synthesize(small("qwen2moe", dir / "m.gguf"));
    const GgufModel m = GgufModel::open(first_file(r));
    const auto settings = nlohmann::json::parse(m.get_string("moeprune.synth.settings").value());
    EXPECT_EQ(settings["arch"], "qwen2moe");
    EXPECT_EQ(settings["experts"], 8);
    EXPECT_EQ(m.get_string("tokenizer.ggml.model").value_or(""), "gpt2");
    EXPECT_EQ(m.get_string("tokenizer.ggml.pre").value_or(""), "qwen2");
}

namespace {

struct VocabOnly {
    std::unique_ptr<llama_model, decltype(&llama_model_free)> model{nullptr, llama_model_free};
    const llama_vocab * vocab = nullptr;

    explicit VocabOnly(const fs::path & path) {
        llama_backend_init();
        llama_model_params mp = llama_model_default_params();
        mp.vocab_only = true;
        model.reset(llama_model_load_from_file(path.c_str(), mp));
        vocab = model ? llama_model_get_vocab(model.get()) : nullptr;
    }
    std::vector<llama_token> tokens(const std::string & text) const {
        std::vector<llama_token> out(text.size() + 8);
        out.resize(size_t(llama_tokenize(vocab, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), false, true)));
        return out;
    }
    std::string text(llama_token t) const {
        char buf[256];
        const int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, true);
        return std::string(buf, size_t(std::max(n, 0)));
    }
};

} // namespace

TEST(Synth, ACutVocabularyTokenizesEveryTextAndKeepsItsSpecialTokens) {
    test::TempDir dir;
    SynthOptions o = small("qwen3moe", dir / "cut.gguf");
    o.vocab_first = 600;
    synthesize(o);
    o.output = dir / "full.gguf";
    o.vocab_first = 0;
    synthesize(o);
    const VocabOnly cut(dir / "cut.gguf"), full(dir / "full.gguf");
    ASSERT_TRUE(cut.vocab && full.vocab);
    const int n_cut = llama_vocab_n_tokens(cut.vocab);
    EXPECT_GT(n_cut, 600 + 290 + 3) << "the first 600, every character and the special tokens";
    EXPECT_LT(n_cut, llama_vocab_n_tokens(full.vocab) / 4);
    const std::string text = test::mixed_text();
    const auto ids = cut.tokens(text);
    std::string back;
    for (const llama_token t : ids) {
        ASSERT_GE(t, 0);
        ASSERT_LT(t, n_cut);
        back += cut.text(t);
    }
    EXPECT_EQ(back, text);
    const auto full_ids = full.tokens(text);
    EXPECT_GT(ids.size(), full_ids.size()) << "fewer merges, so more tokens for the same text";
    const auto one_character = [](const std::string & piece) {
        return piece.size() > 1 && std::count_if(piece.begin(), piece.end(), [](char c) { return (uint8_t(c) & 0xC0) != 0x80; }) == 1;
    };
    std::set<std::string> cut_pieces, characters;
    for (const llama_token t : ids) {
        cut_pieces.insert(cut.text(t));
    }
    for (const llama_token t : full_ids) {
        if (one_character(full.text(t))) {
            characters.insert(full.text(t));
        }
    }
    ASSERT_GT(characters.size(), 10u) << "the text holds CJK characters the vocabulary has tokens for";
    for (const auto & c : characters) {
        EXPECT_TRUE(cut_pieces.count(c)) << c << " is still one token";
    }
    for (llama_token t = 0; t < 600; ++t) {
        ASSERT_EQ(cut.text(t), full.text(t)) << "ordinary token " << t << " kept its id";
    }

    const auto chat = cut.tokens("<|im_start|>user\nhi<|im_end|>");
    ASSERT_GE(chat.size(), 3u);
    EXPECT_EQ(cut.text(chat.front()), "<|im_start|>");
    EXPECT_EQ(cut.text(chat.back()), "<|im_end|>");
    EXPECT_EQ(cut.text(llama_vocab_eos(cut.vocab)), full.text(llama_vocab_eos(full.vocab)));
    EXPECT_GE(llama_vocab_eos(cut.vocab), 600);

    o.vocab_first = 255;
    try {
        synthesize(o);
        FAIL() << "a vocabulary without its byte tokens";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("--vocab-first must be 0"), std::string::npos) << e.what();
    }
    o.vocab_first = 200000;
    try {
        synthesize(o);
        FAIL() << "more tokens than the vocabulary has";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("fewer than --vocab-first 200000"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("ggml-vocab-qwen2.gguf"), std::string::npos) << e.what();
    }
}

// A vocabulary is a user's file: arrays read by token id are checked before they are indexed.
TEST(Synth, ACutRefusesAVocabularyWhoseArraysDoNotMatchItsTokens) {
    test::TempDir dir;
    std::vector<std::string> names;
    for (int i = 0; i < 300; ++i) {
        names.push_back("t" + std::to_string(i));
    }
    std::vector<const char *> texts;
    for (const auto & t : names) {
        texts.push_back(t.c_str());
    }
    const std::vector<int32_t> types(names.size(), 1);
    const std::vector<float> short_scores(names.size() - 1, 0.0f);
    GgufPtr v(gguf_init_empty());
    gguf_set_val_str(v.get(), "tokenizer.ggml.model", "llama");
    gguf_set_arr_str(v.get(), "tokenizer.ggml.tokens", texts.data(), texts.size());
    gguf_set_arr_data(v.get(), "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types.data(), types.size());
    gguf_set_arr_data(v.get(), "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, short_scores.data(), short_scores.size());
    ASSERT_TRUE(gguf_write_to_file(v.get(), (dir / "v.gguf").c_str(), true));

    SynthOptions o = small("qwen3moe", dir / "m.gguf");
    o.vocab = dir / "v.gguf";
    o.vocab_first = 256;
    try {
        synthesize(o);
        FAIL() << "299 scores for 300 tokens";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("v.gguf: has tokenizer.ggml.scores that is not one float32 per token"),
                  std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "m.gguf"));
}

TEST(Synth, RefusesWhatLlamaCppCannotLoad) {
    test::TempDir dir;
    SynthOptions o = small("qwen3moe", dir / "m.gguf");
    o.gate_up = true;
    EXPECT_THROW(synthesize(o), Error);
    o = small("qwen3moe", dir / "m.gguf");
    o.expert_type = GGML_TYPE_Q4_K;  // 64 wide rows do not fill a 256-value block
    try {
        synthesize(o);
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("multiples"), std::string::npos) << e.what();
    }
    o = small("qwen3moe", dir / "m.gguf");
    o.expert_type = GGML_TYPE_IQ2_XXS;
    EXPECT_THROW(synthesize(o), Error);
    o = small("qwen3moe", dir / "m.gguf");
    o.dead = 7;  // leaves one ordinary expert for top-2
    EXPECT_THROW(synthesize(o), Error);
    o = small("qwen4exp", dir / "m.gguf");
    o.dead = 1;  // hyper-connections mix the planted coordinates
    EXPECT_THROW(synthesize(o), Error);
    o = small("qwen3moe", dir / "m.gguf");
    o.mtp = true;  // llama.cpp builds no nextn layer for qwen3moe
    EXPECT_THROW(synthesize(o), Error);
    o = small("deepseek2", dir / "m.gguf");
    o.groups = 3;  // does not divide 8 experts
    EXPECT_THROW(synthesize(o), Error);
    o = small("nosucharch", dir / "m.gguf");
    EXPECT_THROW(synthesize(o), Error);
    EXPECT_THROW(parse_ggml_type("q9_Z"), Error);
    EXPECT_FALSE(fs::exists(dir / "m.gguf"));
}
