#include "core/errors.h"
#include "formats/stats.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <random>

using namespace moeprune;

namespace {

// Statistics of a token stream where every token contributes known values.
SaliencyStats collect(uint64_t first_token, uint64_t n_tokens, int n_layer, int n_expert) {
    SaliencyStats s = SaliencyStats::empty(n_layer, n_expert, 2);
    s.model = {{"digest", "xxh3:0123456789abcdef"}, {"name", "synthetic"}, {"n_expert", n_expert}};
    s.n_tokens = n_tokens;
    for (uint64_t t = first_token; t < first_token + n_tokens; ++t) {
        std::mt19937 rng{uint32_t(t)};
        for (int l = 0; l < n_layer; ++l) {
            for (int slot = 0; slot < 2; ++slot) {
                const int e = int(rng() % uint32_t(n_expert));
                const double g = 0.25 + double(rng() % 100) / 200.0;
                const double norm = 1.0 + double(rng() % 50) / 10.0;
                auto & L = s.layers[size_t(l)];
                L.count[size_t(e)] += 1;
                L.prob_sum[size_t(e)] += g;
                L.reap_sum[size_t(e)] += g * norm;
                L.reap_sq_sum[size_t(e)] += g * norm * g * norm;
                L.ean_sum[size_t(e)] += norm;
                L.max_act[size_t(e)] = std::max(L.max_act[size_t(e)], norm * 2);
            }
        }
    }
    return s;
}

} // namespace

TEST(Stats, RoundTripsThroughFile) {
    test::TempDir dir;
    SaliencyStats s = collect(0, 50, 3, 8);
    s.nonfinite_drops = 2;
    s.settings = {{"ctx", 512}};
    s.domains["code"] = DomainStats{20, collect(0, 20, 3, 8).layers};
    write_stats(dir / "s.json", s);
    const SaliencyStats b = read_stats(dir / "s.json");
    EXPECT_EQ(stats_to_json(b), stats_to_json(s));
    EXPECT_EQ(b.domains.at("code").n_tokens, 20u);
}

TEST(Stats, MergeOfDisjointRunsEqualsOneRun) {
    const SaliencyStats whole = collect(0, 300, 4, 16);
    SaliencyStats a = collect(0, 120, 4, 16);
    const SaliencyStats b = collect(120, 180, 4, 16);
    merge_stats(a, b, "a.json", "b.json");
    EXPECT_EQ(a.n_tokens, 300u);
    for (size_t l = 0; l < 4; ++l) {
        EXPECT_EQ(a.layers[l].count, whole.layers[l].count);
        EXPECT_EQ(a.layers[l].max_act, whole.layers[l].max_act);
        for (size_t e = 0; e < 16; ++e) {
            EXPECT_NEAR(a.layers[l].reap_sum[e], whole.layers[l].reap_sum[e], 1e-9);
            EXPECT_NEAR(a.layers[l].reap_sq_sum[e], whole.layers[l].reap_sq_sum[e], 1e-9);
            EXPECT_NEAR(a.layers[l].prob_sum[e], whole.layers[l].prob_sum[e], 1e-9);
            EXPECT_NEAR(a.layers[l].ean_sum[e], whole.layers[l].ean_sum[e], 1e-9);
        }
    }
}

TEST(Stats, MergeAddsDomains) {
    SaliencyStats a = collect(0, 10, 2, 4);
    SaliencyStats b = collect(10, 10, 2, 4);
    a.domains["ja"] = DomainStats{10, a.layers};
    b.domains["ja"] = DomainStats{10, b.layers};
    b.domains["code"] = DomainStats{10, b.layers};
    merge_stats(a, b, "a", "b");
    EXPECT_EQ(a.domains.at("ja").n_tokens, 20u);
    EXPECT_EQ(a.domains.at("code").n_tokens, 10u);
    EXPECT_EQ(a.domains.at("ja").layers[0].count, collect(0, 20, 2, 4).layers[0].count);
}

TEST(Stats, MergeRefusesOtherModels) {
    SaliencyStats a = collect(0, 10, 2, 4);
    SaliencyStats shape = collect(0, 10, 2, 8);
    EXPECT_THROW(merge_stats(a, shape, "a", "b"), Error);
    SaliencyStats other = collect(0, 10, 2, 4);
    other.model["name"] = "another";
    try {
        merge_stats(a, other, "a.json", "b.json");
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("different models"), std::string::npos);
    }
    // Another model of the same shape and name: only the content digest tells.
    SaliencyStats twin = collect(0, 10, 2, 4);
    twin.model["digest"] = "xxh3:fedcba9876543210";
    EXPECT_THROW(merge_stats(a, twin, "a.json", "b.json"), Error);
}

TEST(Stats, MalformedInputsNameTheProblem) {
    const auto expect_error = [](const std::string & text, const std::string & needle) {
        try {
            parse_stats(text, "s.json");
            FAIL() << text;
        } catch (const Error & e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("s.json"), std::string::npos) << msg;
            EXPECT_NE(msg.find(needle), std::string::npos) << msg;
        }
    };
    nlohmann::json good = stats_to_json(collect(0, 5, 2, 3));
    expect_error("{", "not valid JSON");
    expect_error(R"({"format": "x"})", "not a moeprune-stats file");
    auto j = good;
    j["version"] = 7;
    expect_error(j.dump(), "version");
    j = good;
    j.erase("n_tokens");
    expect_error(j.dump(), "n_tokens");
    j = good;
    j["layers"][1]["reap_sum"] = {1, 2};
    expect_error(j.dump(), "layer 1: \"reap_sum\" must be an array of 3");
    j = good;
    j["layers"][0]["count"][2] = -4;
    expect_error(j.dump(), "count[2]");
    j = good;
    j["layers"].erase(1);
    expect_error(j.dump(), "array of 2 layers");
}
