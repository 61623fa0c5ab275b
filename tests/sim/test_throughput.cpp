// The one time model of a token (sim/throughput.h), on numbers worked by hand.
#include "sim/throughput.h"

#include <gtest/gtest.h>

using namespace moeprune;

TEST(Throughput, TokenSecondsAddsComputeSyncReadsAndRounds) {
    ThroughputParams p;
    p.ssd_gbps = 2;           // 2e9 bytes/s
    p.read_latency_us = 100;
    p.compute_ms = 10;
    p.sync_us = 50;
    // 10 ms + 4 layers x 50 us + 4e7 bytes / 2e9 + 3 rounds x 100 us = 10 + 0.2 + 20 + 0.3 ms
    EXPECT_NEAR(token_seconds({4e7, 3, 0}, 4, p), 30.5e-3, 1e-12);
    // Nothing read: compute and sync alone.
    EXPECT_NEAR(token_seconds({}, 4, p), 10.2e-3, 1e-12);
}

TEST(Throughput, PrefetchPaysOnlyWhatOutlastsCompute) {
    ThroughputParams p;
    p.ssd_gbps = 1;
    p.read_latency_us = 0;
    p.compute_ms = 5;
    // 4e6 bytes staged take 4 ms, hidden behind 5 ms of compute.
    EXPECT_NEAR(token_seconds({0, 0, 4e6}, 1, p), 5e-3, 1e-12);
    // 8e6 bytes take 8 ms: 3 ms show.
    EXPECT_NEAR(token_seconds({0, 0, 8e6}, 1, p), 8e-3, 1e-12);
}

TEST(Throughput, RecordsEverySetting) {
    ThroughputParams p;
    p.ssd_gbps = 3.9;
    p.queue_depth = 7;
    const nlohmann::json j = to_json(p);
    EXPECT_EQ(j["ssd_gbps"], 3.9);
    EXPECT_EQ(j["queue_depth"], 7);
    for (const char * key : {"read_latency_us", "compute_ms", "sync_us"}) {
        EXPECT_TRUE(j.contains(key)) << key;
    }
}

// Speculative decoding with one draft token (sim/throughput.h), on numbers worked by hand.
TEST(Throughput, ADraftStepEmitsOnePlusTheAcceptedAtItsStatedCost) {
    EXPECT_DOUBLE_EQ(tokens_per_step(0.7, 1), 1.7);
    EXPECT_DOUBLE_EQ(tokens_per_step(0.5, 3), 1.875);   // 1 + 0.5 + 0.25 + 0.125
    EXPECT_DOUBLE_EQ(tokens_per_step(0.0, 1), 1.0);
    ThroughputParams p;
    p.ssd_gbps = 1;
    p.read_latency_us = 100;
    p.compute_ms = 10;
    p.sync_us = 0;
    // Everything resident, 4 trunk layers and 1 MTP layer: the step computes 10 ms x (1 + 1/4)
    // and emits 1.7 tokens: 1.7 / 12.5 ms = 136 tokens/s, against 100 without the draft.
    const DraftStep resident{0.7, 1, 1, {}};
    EXPECT_NEAR(speculative_step_seconds({}, 4, resident, p), 12.5e-3, 1e-12);
    EXPECT_NEAR(speculative_tokens_per_second({}, 4, resident, p), 136.0, 1e-9);
    // Streaming: the trunk reads 2e6 bytes in 1 round per position, the head 1e6 in 1 round
    // per token it runs on. A step reads the trunk's 2 positions (4e6, 2 rounds) and the
    // head's 1.7 tokens (1.7e6, 1.7 rounds): 12.5 + 5.7 + 0.37 = 18.57 ms for 1.7 tokens.
    const DraftStep streaming{0.7, 1, 1, {1e6, 1, 0}};
    EXPECT_NEAR(speculative_step_seconds({2e6, 1, 0}, 4, streaming, p), 18.57e-3, 1e-12);
    EXPECT_NEAR(speculative_tokens_per_second({2e6, 1, 0}, 4, streaming, p), 1.7 / 18.57e-3, 1e-9);
    // Without a draft the same trunk takes 10 + 2 + 0.1 = 12.1 ms a token: at acceptance 0
    // the draft only costs.
    EXPECT_NEAR(token_seconds({2e6, 1, 0}, 4, p), 12.1e-3, 1e-12);
    EXPECT_LT(speculative_tokens_per_second({2e6, 1, 0}, 4, {0.0, 1, 1, {1e6, 1, 0}}, p), 1 / 12.1e-3);
}
