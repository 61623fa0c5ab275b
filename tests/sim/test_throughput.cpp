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
