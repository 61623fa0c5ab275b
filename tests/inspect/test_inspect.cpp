#include "core/errors.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "synth/synth.h"
#include "support/test_support.h"

#include "gguf.h"

#include <gtest/gtest.h>

#include <functional>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

fs::path make_model(const test::TempDir & dir, int split = 1) {
    SynthOptions o = test::synth_options();
    o.n_layer = 2;
    o.n_expert = 8;
    o.n_expert_used = 2;
    o.split = split;
    o.output = dir / "m.gguf";
    return synthesize(o).files.front();
}

// Copies a single-file GGUF, letting `edit` change metadata and the tensor list,
// the way other tools produce inconsistent files.
void rewrite(const fs::path & src, const fs::path & dst,
             const std::function<void(gguf_context *, ggml_context *, std::vector<ggml_tensor *> &)> & edit) {
    ggml_context * data = nullptr;
    gguf_init_params p{false, &data};
    gguf_context * in = gguf_init_from_file(src.c_str(), p);
    ASSERT_NE(in, nullptr);
    gguf_context * out = gguf_init_empty();
    gguf_set_kv(out, in);
    std::vector<ggml_tensor *> tensors;
    for (int64_t i = 0; i < gguf_get_n_tensors(in); ++i) {
        tensors.push_back(ggml_get_tensor(data, gguf_get_tensor_name(in, i)));
    }
    ggml_init_params ip{ggml_tensor_overhead() * 8 + (1 << 20), nullptr, false};
    ggml_context * extra = ggml_init(ip);
    edit(out, extra, tensors);
    for (auto * t : tensors) {
        gguf_add_tensor(out, t);
    }
    ASSERT_TRUE(gguf_write_to_file(out, dst.c_str(), false));
    gguf_free(out);
    gguf_free(in);
    ggml_free(data);
    ggml_free(extra);
}

} // namespace

TEST(Inspect, SizeAtKScalesOnlyThePerExpertTensors) {
    test::TempDir dir;
    const GgufModel m = GgufModel::open(make_model(dir));
    const InspectReport r = inspect_model(m, {8, 4});
    EXPECT_EQ(r.size_at_k.at(8), r.file_bytes);
    uint64_t one = 0;
    for (const auto & L : r.layers) {
        for (const auto & t : L.tensors) {
            one += t.bytes_per_expert;
        }
    }
    EXPECT_EQ(r.size_at_k.at(8) - r.size_at_k.at(4), 4 * one);
    uint64_t tensor_bytes = 0;
    for (const auto & t : m.tensors()) {
        tensor_bytes += t.nbytes;
    }
    EXPECT_EQ(r.routed_expert_bytes + r.other_bytes, tensor_bytes);
    EXPECT_EQ(r.routed_expert_bytes, 2u * 8u * 3u * 64u * 64u * 4u);  // 2 layers x 8 experts x gate/up/down, f32
    EXPECT_GT(r.expert_bytes_max, 0u);
}

TEST(Inspect, ReportsExpertCountMetadataThatDisagreesWithTensors) {
    test::TempDir dir;
    rewrite(make_model(dir), dir / "bad.gguf", [](gguf_context * meta, ggml_context *, std::vector<ggml_tensor *> &) {
        gguf_set_val_u32(meta, "qwen3moe.expert_count", 6);
    });
    const InspectReport r = inspect_model(GgufModel::open(dir / "bad.gguf"), {});
    ASSERT_FALSE(r.problems.empty());
    EXPECT_NE(r.problems.front().find("expert axis has 8 experts but qwen3moe.expert_count says 6"), std::string::npos)
        << r.problems.front();
}

TEST(Inspect, ReportsPerExpertTensorsThatDisagree) {
    test::TempDir dir;
    rewrite(make_model(dir), dir / "bad.gguf", [](gguf_context *, ggml_context * extra, std::vector<ggml_tensor *> & ts) {
        for (auto *& t : ts) {
            if (std::string(t->name) == "blk.1.ffn_gate_inp.weight") {
                ggml_tensor * cut = ggml_new_tensor_2d(extra, GGML_TYPE_F32, t->ne[0], 5);
                ggml_set_name(cut, t->name);
                t = cut;
            }
        }
    });
    const InspectReport r = inspect_model(GgufModel::open(dir / "bad.gguf"), {});
    bool disagree = false, named = false;
    for (const auto & p : r.problems) {
        disagree |= p.find("disagree on the number of experts: 5, 8") != std::string::npos;
        named |= p.find("blk.1.ffn_gate_inp.weight") != std::string::npos;
    }
    EXPECT_TRUE(disagree);
    EXPECT_TRUE(named);
}

TEST(Inspect, NamesAMissingShard) {
    test::TempDir dir;
    const fs::path first = make_model(dir, 3);
    fs::remove(dir / "m-00003-of-00003.gguf");
    try {
        GgufModel::open(first);
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("m-00003-of-00003.gguf: missing shard 3 of 3"), std::string::npos) << e.what();
    }
}

TEST(Inspect, ReadsEveryShardFromTheFirst) {
    test::TempDir dir;
    const GgufModel one = GgufModel::open(make_model(dir, 1));
    test::TempDir dir3;
    const GgufModel three = GgufModel::open(make_model(dir3, 3));
    EXPECT_EQ(three.shard_paths().size(), 3u);
    EXPECT_EQ(three.tensors().size(), one.tensors().size());
    EXPECT_THROW(GgufModel::open(dir3 / "m-00002-of-00003.gguf"), Error);
}

TEST(Inspect, RefusesAModelThatIsNotMoE) {
    test::TempDir dir;
    gguf_context * ctx = gguf_init_empty();
    gguf_set_val_str(ctx, "general.architecture", "llama");
    ggml_init_params ip{1 << 20, nullptr, false};
    ggml_context * g = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_2d(g, GGML_TYPE_F32, 8, 8);
    ggml_set_name(t, "blk.0.ffn_up.weight");
    gguf_add_tensor(ctx, t);
    ASSERT_TRUE(gguf_write_to_file(ctx, (dir / "dense.gguf").c_str(), false));
    gguf_free(ctx);
    ggml_free(g);
    try {
        inspect_model(GgufModel::open(dir / "dense.gguf"), {});
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("not a MoE model"), std::string::npos) << e.what();
    }
}

TEST(Inspect, RejectsFilesThatAreNotGguf) {
    test::TempDir dir;
    test::write_text(dir / "junk.gguf", "this is not a gguf file");
    try {
        GgufModel::open(dir / "junk.gguf");
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("junk.gguf: not a valid GGUF"), std::string::npos) << e.what();
    }
}

TEST(Inspect, ClassifiesTensorsByName) {
    EXPECT_EQ(classify_tensor("blk.3.ffn_gate_exps.weight").role, TensorRole::Expert);
    EXPECT_EQ(classify_tensor("blk.3.ffn_gate_up_exps.weight").role, TensorRole::Expert);
    EXPECT_EQ(classify_tensor("blk.3.ffn_down_exps.bias").role, TensorRole::Expert);
    EXPECT_EQ(classify_tensor("blk.3.ffn_up_exps.scale").role, TensorRole::Expert);
    EXPECT_EQ(classify_tensor("blk.3.ffn_down_exps.input_scale").role, TensorRole::Expert);
    EXPECT_EQ(classify_tensor("blk.3.ffn_norm_exps.weight").role, TensorRole::Other);
    EXPECT_EQ(classify_tensor("blk.3.exp_probs_b_vl.bias").role, TensorRole::SelectionBias);
    EXPECT_EQ(classify_tensor("blk.3.ffn_gate_inp.weight").role, TensorRole::Router);
    EXPECT_EQ(classify_tensor("blk.3.ffn_gate_inp.bias").role, TensorRole::Router);
    EXPECT_EQ(classify_tensor("blk.3.exp_probs_b.bias").role, TensorRole::SelectionBias);
    EXPECT_EQ(classify_tensor("blk.3.ffn_gate_inp_shexp.weight").role, TensorRole::Shared);
    EXPECT_EQ(classify_tensor("blk.3.ffn_up_shexp.weight").role, TensorRole::Shared);
    EXPECT_EQ(classify_tensor("blk.3.attn_q.weight").role, TensorRole::Other);
    EXPECT_EQ(classify_tensor("token_embd.weight").layer, -1);
    EXPECT_EQ(classify_tensor("blk.47.ffn_down_exps.weight").layer, 47);
}
