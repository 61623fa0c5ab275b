// The router-graph facts every observer shares (route/router_graph.h).
#include "route/router_graph.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>

using namespace moeprune;

TEST(RouterGraph, ParsesRouterNodeNamesOnly) {
    const RouterNode a = parse_router_node("ffn_moe_logits-12");
    EXPECT_EQ(a.name, "ffn_moe_logits");
    EXPECT_EQ(a.layer, 12);
    EXPECT_EQ(parse_router_node("ffn_moe_probs_biased-0").name, "ffn_moe_probs_biased");
    for (const char * other : {"ffn_moe_topk-3 (reshaped)", "attn_norm-3", "ffn_moe_topk-", "ffn_moe_topk", "result_norm"}) {
        EXPECT_EQ(parse_router_node(other).layer, -1) << other;
    }
}

TEST(RouterGraph, RanksChosenExpertsFirstThenBySelectionThenByLowestId) {
    // Expert 5 is chosen although it scores lowest; 1 and 3 tie and go by id.
    const std::vector<float> selection = {0.1f, 0.7f, 0.2f, 0.7f, 0.9f, 0.0f};
    std::vector<char> chosen(6, 0);
    chosen[5] = 1;
    chosen[4] = 1;
    std::vector<int32_t> order(6);
    std::iota(order.begin(), order.end(), 0);
    rank_candidates(order, 6, 4, chosen, selection.data());
    EXPECT_EQ(std::vector<int32_t>(order.begin(), order.begin() + 4), (std::vector<int32_t>{4, 5, 1, 3}));
    // Only the first n_cand entries are candidates (a keep map's survivors).
    std::vector<int32_t> survivors = {0, 2, 3, 5, -1, -1};
    rank_candidates(survivors, 4, 4, chosen, selection.data());
    EXPECT_EQ(std::vector<int32_t>(survivors.begin(), survivors.begin() + 4), (std::vector<int32_t>{5, 3, 2, 0}));
}

TEST(RouterGraph, GatingNamesAreThoseStatisticsRecord) {
    EXPECT_STREQ(gating_name(Gating::Softmax), "softmax");
    EXPECT_STREQ(gating_name(Gating::Sigmoid), "sigmoid");
    EXPECT_STREQ(gating_name(Gating::SoftmaxWeight), "softmax-over-selected");
    EXPECT_STREQ(gating_name(Gating::SqrtSoftplus), "sqrt-softplus");
    EXPECT_STREQ(gating_name(Gating::Unknown), "unknown");
}

namespace {
struct Thrower : GraphObserverFailure {
    bool run(bool fail) {
        return guarded([&] {
            if (fail) {
                throw std::runtime_error("node went wrong");
            }
            return true;
        });
    }
};
} // namespace

TEST(RouterGraph, AnObserversFailureStopsTheGraphAndIsRethrownOnce) {
    Thrower t;
    EXPECT_TRUE(t.run(false));
    EXPECT_FALSE(t.failed());
    EXPECT_FALSE(t.run(true)) << "a failure must stop the graph";
    EXPECT_TRUE(t.failed());
    EXPECT_FALSE(t.run(true));  // the first failure is the one reported
    EXPECT_THROW(t.rethrow_failure(), std::runtime_error);
    EXPECT_FALSE(t.failed());
    EXPECT_NO_THROW(t.rethrow_failure());
}
