// collect --imatrix against llama-imatrix on the same model, tokens, window and batch:
// the same file byte for byte, and usable as llama-imatrix's is (slice, llama-quantize).
#include "collect/collect.h"
#include "core/errors.h"
#include "formats/stats.h"
#include "slice/slice_support.h"
#include "support/test_support.h"
#include "synth/synth.h"

#include "ggml.h"
#include "gguf.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>

namespace moeprune {
namespace {

namespace fs = std::filesystem;

struct Imatrix {
    std::map<std::string, std::vector<float>> tensors;
    uint32_t chunk_count = 0, chunk_size = 0;
};

Imatrix read_imatrix(const fs::path & path) {
    ggml_context * data = nullptr;
    gguf_context * g = gguf_init_from_file(path.c_str(), {false, &data});
    EXPECT_NE(g, nullptr) << path;
    Imatrix m;
    if (!g) {
        return m;
    }
    m.chunk_count = gguf_get_val_u32(g, gguf_find_key(g, "imatrix.chunk_count"));
    m.chunk_size = gguf_get_val_u32(g, gguf_find_key(g, "imatrix.chunk_size"));
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const ggml_tensor * t = ggml_get_tensor(data, gguf_get_tensor_name(g, i));
        const float * v = static_cast<const float *>(t->data);
        m.tensors[t->name] = std::vector<float>(v, v + ggml_nelements(t));
    }
    gguf_free(g);
    ggml_free(data);
    return m;
}

// llama-imatrix's tokens: the whole file, whole windows only, no parsing of special text.
CollectOptions imatrix_options(const fs::path & model, const fs::path & text, const fs::path & dir, int64_t chunks) {
    CollectOptions o;
    o.model = model;
    o.corpus = text;
    o.output = dir / "stats.json";
    o.imatrix = dir / "ours.gguf";
    o.ctx = o.batch = o.ubatch = 64;
    o.threads = 2;
    o.parse_special = false;
    o.chunks = chunks;
    return o;
}

class CollectImatrix : public ::testing::TestWithParam<std::string> {};

// Every graph variant synth builds: routed experts only (qwen3moe, also with a trace
// watched beside the imatrix), a shared expert with its own gate (qwen2moe), a dense
// leading layer and sigmoid routing (dots1).
TEST_P(CollectImatrix, EqualsLlamaImatrixOnTheSameTokens) {
    test::TempDir dir;
    SynthOptions so = test::synth_options();
    so.arch = GetParam();
    so.n_layer = 3;
    so.n_expert = 8;
    so.n_expert_used = 2;
    so.n_embd = so.n_ff = 64;
    so.output = dir / "m.gguf";
    const fs::path model = synthesize(so).files.front();
    test::write_text(dir / "text.txt", test::mixed_text() + test::mixed_text());
    const auto ref = test::run_command(fmt::format("{} -m {} -f {} -c 64 -b 64 -t 2 --no-ppl -o {}",
                                                   test::bin("llama-imatrix").string(), model.string(),
                                                   (dir / "text.txt").string(), (dir / "ref.gguf").string()));
    ASSERT_EQ(ref.exit_code, 0) << ref.output;
    const Imatrix want = read_imatrix(dir / "ref.gguf");
    ASSERT_GE(want.chunk_count, 2u);

    CollectOptions o = imatrix_options(model, dir / "text.txt", dir.path(), want.chunk_count);
    if (so.arch == "qwen3moe") {
        o.trace = dir / "t.trace";
    }
    const CollectResult r = collect(o);
    EXPECT_EQ(r.tokens, uint64_t(want.chunk_count) * 64);
    EXPECT_TRUE(r.head_skipped) << "the imatrix leaves the output head out, so collect still skips it";
    const Imatrix got = read_imatrix(dir / "ours.gguf");
    EXPECT_EQ(got.chunk_count, want.chunk_count);
    EXPECT_EQ(got.chunk_size, want.chunk_size);
    ASSERT_EQ(got.tensors.size(), want.tensors.size());
    size_t expert_entries = 0;
    for (const auto & [name, w] : want.tensors) {
        ASSERT_TRUE(got.tensors.count(name)) << name;
        const std::vector<float> & g = got.tensors.at(name);
        ASSERT_EQ(g.size(), w.size()) << name;
        expert_entries += name.find("_exps.weight.counts") != std::string::npos;
        for (size_t i = 0; i < w.size(); ++i) {
            if (name.size() > 7 && name.compare(name.size() - 7, 7, ".counts") == 0) {
                ASSERT_EQ(g[i], w[i]) << name << "[" << i << "]";
            } else {
                ASSERT_LE(std::fabs(g[i] - w[i]), 1e-5 * std::fabs(w[i])) << name << "[" << i << "]";
            }
        }
    }
    EXPECT_GE(expert_entries, 3u * 2u) << "gate/up/down of every MoE layer";
    // Same accumulation order, same writer: the very same bytes.
    EXPECT_EQ(test::read_bytes(dir / "ours.gguf"), test::read_bytes(dir / "ref.gguf"));
    EXPECT_EQ(read_stats(dir / "stats.json").settings["imatrix"], (dir / "ours.gguf").string());
}

INSTANTIATE_TEST_SUITE_P(Archs, CollectImatrix, ::testing::Values("qwen3moe", "qwen2moe", "dots1"));

// The imatrix slices with the model and llama-quantize takes it for the pruned model.
TEST(CollectImatrixUse, SlicesWithTheModelAndQuantizes) {
    test::TempDir dir;
    SynthOptions so = test::synth_options();
    so.n_layer = 2;
    so.n_expert = 8;
    so.n_expert_used = 2;
    so.n_embd = so.n_ff = 256;
    so.output = dir / "m.gguf";
    const fs::path model = synthesize(so).files.front();
    test::write_text(dir / "text.txt", test::mixed_text());
    collect(imatrix_options(model, dir / "text.txt", dir.path(), -1));
    const KeepMap km = test::keep_all_but(8, {{0, {1, 5}}, {1, {2, 3}}}, 2);
    test::write_keep(dir / "keep.json", km);
    auto r = test::run_command(fmt::format("{} slice -m {} --keep {} -o {} --imatrix {} --imatrix-out {}",
                                           test::bin("moeprune").string(), model.string(), (dir / "keep.json").string(),
                                           (dir / "s.gguf").string(), (dir / "ours.gguf").string(),
                                           (dir / "s-imat.gguf").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const Imatrix sliced = read_imatrix(dir / "s-imat.gguf");
    EXPECT_EQ(sliced.tensors.at("blk.0.ffn_down_exps.weight.counts").size(), 6u);
    r = test::run_command(fmt::format("{} --allow-requantize --imatrix {} {} {} Q4_K_M 2", test::bin("llama-quantize").string(),
                                      (dir / "s-imat.gguf").string(), (dir / "s.gguf").string(), (dir / "q.gguf").string()));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("loaded {} importance matrix entries", sliced.tensors.size() / 2)), std::string::npos)
        << r.output;
}

TEST(CollectImatrixUse, RefusesCheckpointsAndClashes) {
    test::TempDir dir;
    CollectOptions o = imatrix_options(dir / "m.gguf", dir / "text.txt", dir.path(), -1);
    o.save_every = 1;
    EXPECT_THROW(collect(o), Error);
    SynthOptions so = test::synth_options();
    so.n_layer = 1;
    so.n_expert = 4;
    so.n_expert_used = 2;
    so.output = dir / "m.gguf";
    synthesize(so);
    test::write_text(dir / "text.txt", test::mixed_text());
    o = imatrix_options(dir / "m.gguf", dir / "text.txt", dir.path(), -1);
    o.imatrix = dir / "m.gguf";
    try {
        collect(o);
        FAIL() << "an imatrix over the model itself must be refused";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("m.gguf"), std::string::npos) << e.what();
    }
}

} // namespace
} // namespace moeprune
