// Runs synthesized models through llama.cpp and watches the router, to check that
// the ground truth synth reports is what the model really does.
#include "synth/synth.h"
#include "support/test_support.h"

#include "ggml-backend.h"
#include "llama.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

using namespace moeprune;

namespace {

struct RouterWatch {
    int n_layer;
    int n_expert;
    std::vector<int> token_kind;                          // per batch position
    std::vector<std::vector<uint64_t>> picks;             // [layer][expert]
    std::vector<std::vector<std::vector<uint64_t>>> picks_by_kind;  // [layer][kind+1][expert]
};

bool watch_topk(ggml_tensor * t, bool ask, void * ud) {
    auto & w = *static_cast<RouterWatch *>(ud);
    const std::string name = t->name;
    if (name.rfind("ffn_moe_topk-", 0) != 0) {
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    const int layer = std::stoi(name.substr(std::strlen("ffn_moe_topk-")));
    std::vector<uint8_t> buf(ggml_nbytes(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
    for (int64_t row = 0; row < t->ne[1]; ++row) {
        for (int64_t slot = 0; slot < t->ne[0]; ++slot) {
            int32_t e;
            std::memcpy(&e, buf.data() + row * t->nb[1] + slot * t->nb[0], sizeof(e));
            w.picks[size_t(layer)][size_t(e)]++;
            w.picks_by_kind[size_t(layer)][size_t(w.token_kind[size_t(row)] + 1)][size_t(e)]++;
        }
    }
    return true;
}

class Planted : public ::testing::TestWithParam<std::string> {};

} // namespace

TEST_P(Planted, DeadExpertsAreNeverChosenAndSpecialistsOnlyForTheirKind) {
    test::TempDir dir;
    SynthOptions o = test::synth_options();
    o.arch = GetParam();
    o.n_layer = 4;
    o.n_expert = 16;
    o.n_expert_used = 4;
    o.dead = 3;
    o.specialists = true;
    o.output = dir / "m.gguf";
    const SynthResult r = synthesize(o);

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(r.files.front().c_str(), mp);
    ASSERT_NE(model, nullptr);
    const llama_vocab * vocab = llama_model_get_vocab(model);

    const std::string text = "<|im_start|>user\n" + test::mixed_text() + "<|im_end|>\n";
    std::vector<llama_token> tokens(text.size() + 16);
    const int n = llama_tokenize(vocab, text.c_str(), int32_t(text.size()), tokens.data(), int32_t(tokens.size()), true, true);
    ASSERT_GT(n, 200);
    tokens.resize(size_t(n));
    EXPECT_STREQ(llama_vocab_get_text(vocab, tokens[0]), "<|im_start|>") << "<|im_start|> must parse as the special token";

    RouterWatch w{o.n_layer, o.n_expert, {}, {}, {}};
    w.picks.assign(size_t(o.n_layer), std::vector<uint64_t>(size_t(o.n_expert), 0));
    w.picks_by_kind.assign(size_t(o.n_layer), std::vector<std::vector<uint64_t>>(specialist_kinds().size() + 1,
                                                                                 std::vector<uint64_t>(size_t(o.n_expert), 0)));
    std::map<int, uint64_t> tokens_of_kind;
    for (llama_token tok : tokens) {
        char piece[256];
        const int len = llama_token_to_piece(vocab, tok, piece, sizeof(piece), 0, false);
        const int kind = len > 0 ? classify_token_text(std::string(piece, size_t(len))) : -1;
        w.token_kind.push_back(kind);
        tokens_of_kind[kind]++;
    }
    ASSERT_GT(tokens_of_kind[0], 20u) << "the text must hold CJK tokens";
    ASSERT_GT(tokens_of_kind[1], 20u) << "the text must hold code tokens";

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t((n + 255) / 256 * 256);  // one batch of every token
    cp.cb_eval = watch_topk;
    cp.cb_eval_user_data = &w;
    llama_context * ctx = llama_init_from_model(model, cp);
    ASSERT_NE(ctx, nullptr);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = tokens[size_t(i)];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;  // every row through the last layer
    }
    batch.n_tokens = n;
    ASSERT_EQ(llama_decode(ctx, batch), 0);

    const auto & planted = r.planted;
    for (int layer = 0; layer < o.n_layer; ++layer) {
        const auto & picks = w.picks[size_t(layer)];
        uint64_t total = 0;
        for (auto c : picks) {
            total += c;
        }
        EXPECT_EQ(total, uint64_t(n) * uint64_t(o.n_expert_used)) << "layer " << layer;
        const auto dead = planted["dead"][std::to_string(layer)].get<std::vector<int>>();
        ASSERT_EQ(dead.size(), 3u);
        for (int e : dead) {
            EXPECT_EQ(picks[size_t(e)], 0u) << "dead expert " << e << " chosen in layer " << layer;
        }
        for (const auto & [id, kind_name] : planted["specialists"][std::to_string(layer)].items()) {
            const int e = std::stoi(id);
            const int kind = kind_name == "cjk" ? 0 : 1;
            const uint64_t own = w.picks_by_kind[size_t(layer)][size_t(kind + 1)][size_t(e)];
            // Chosen for (almost) every token of its kind, and (almost) never otherwise.
            EXPECT_GE(double(own), 0.9 * double(tokens_of_kind[kind])) << kind_name << " expert " << e << " layer " << layer;
            EXPECT_LE(double(picks[size_t(e)] - own), 0.02 * double(picks[size_t(e)]) + 1)
                << kind_name << " expert " << e << " layer " << layer;
        }
        // The ordinary experts all see traffic: routing is not degenerate.
        int used = 0;
        for (auto c : picks) {
            used += c > 0;
        }
        EXPECT_GE(used, o.n_expert - 3) << "layer " << layer;
    }

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
}

INSTANTIATE_TEST_SUITE_P(Architectures, Planted, ::testing::Values("qwen3moe", "qwen2moe"));
