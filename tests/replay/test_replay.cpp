#include "core/errors.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "replay/reference_policy.h"
#include "replay/replay.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

// Candidates of one token: [n_layer][top_m] expert ids, best first.
struct TokenRow {
    TraceTokenMeta meta;
    std::vector<uint16_t> ids;
};

struct TraceSpec {
    uint32_t n_layer = 2, n_expert = 16, top_m = 6;
    std::vector<TokenRow> tokens;
};

// Logits fall by 0.25 per rank: exact in f16, and the trace order is the rank order.
void write_trace(const fs::path & path, const TraceSpec & s, const nlohmann::json & meta = nlohmann::json::object()) {
    TraceHeader h;
    h.n_layer = s.n_layer;
    h.n_expert = s.n_expert;
    h.top_m = s.top_m;
    h.domains = {"all"};
    h.meta = meta;
    TraceWriter w(path, h, 64);
    std::vector<float> logits(size_t(s.n_layer) * s.top_m);
    for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] = 4.0f - 0.25f * float(i % s.top_m);
    }
    for (const TokenRow & t : s.tokens) {
        w.append(t.meta, t.ids.data(), logits.data());
    }
    w.close();
}

// Skewed popularity, a few sequences, prefill then decode in each.
TraceSpec random_trace(uint32_t seed, uint32_t n_layer, uint32_t n_expert, uint32_t top_m, size_t n_tokens) {
    std::mt19937 rng(seed);
    TraceSpec s{n_layer, n_expert, top_m, {}};
    std::vector<double> weight(n_expert);
    for (uint32_t e = 0; e < n_expert; ++e) {
        weight[e] = 1.0 / std::pow(double(e + 1), 0.8);
    }
    for (size_t t = 0; t < n_tokens; ++t) {
        TokenRow row;
        row.meta.seq = int32_t(t / 97);
        row.meta.pos = int32_t(t % 97);
        row.meta.phase = t % 97 < 60 ? TracePhase::Prefill : TracePhase::Decode;
        for (uint32_t l = 0; l < n_layer; ++l) {
            std::vector<double> w = weight;
            std::shuffle(w.begin(), w.begin() + 3, rng);  // a little churn at the top
            for (uint32_t m = 0; m < top_m; ++m) {
                std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
                const uint32_t e = (pick(rng) + l * 5) % n_expert;
                row.ids.push_back(uint16_t(e));
                w[(e + n_expert - (l * 5) % n_expert) % n_expert] = 0.0;
            }
        }
        s.tokens.push_back(std::move(row));
    }
    return s;
}

// What replay should report, computed the obvious way: per layer, the first k
// survivors of the keep map in rank order, misses from the reference policies.
struct Expected {
    uint64_t tokens = 0, picks = 0, misses = 0, forced = 0;
};
Expected expected(const TraceSpec & s, const std::string & policy, int cache, int k, uint64_t warmup, bool reset,
                  const KeepMap * km, const PolicyParams & p) {
    Expected x;
    std::vector<char> reset_before(s.tokens.size(), 0);
    for (size_t t = 1; t < s.tokens.size(); ++t) {
        reset_before[t] = reset && s.tokens[t].meta.seq != s.tokens[t - 1].meta.seq;
    }
    int n_expert = int(s.n_expert);
    for (uint32_t l = 0; l < s.n_layer; ++l) {
        const std::vector<int32_t> * keep = km ? &std::next(km->layers.begin(), l)->second : nullptr;
        if (keep) {
            n_expert = int(keep->size());
        }
        std::vector<std::vector<int32_t>> chosen;
        std::vector<int> forced;
        for (const TokenRow & row : s.tokens) {
            std::vector<int32_t> c;
            for (uint32_t m = 0; m < s.top_m && int(c.size()) < k; ++m) {
                const int32_t id = row.ids[l * s.top_m + m];
                if (!keep) {
                    c.push_back(id);
                } else if (auto it = std::find(keep->begin(), keep->end(), id); it != keep->end()) {
                    c.push_back(int32_t(it - keep->begin()));
                }
            }
            forced.push_back(k - int(c.size()));
            chosen.push_back(c);
        }
        const std::vector<int> misses = test::reference_misses(policy, n_expert, cache, p, chosen, reset_before);
        for (size_t t = warmup; t < s.tokens.size(); ++t) {
            x.picks += uint64_t(k);
            x.misses += uint64_t(misses[t]);
            x.forced += uint64_t(forced[t]);
        }
    }
    x.tokens = s.tokens.size() - warmup;
    return x;
}

const ReplayRecord & record(const ReplayReport & r, const std::string & policy, int cache) {
    for (const ReplayRecord & rec : r.records) {
        if (rec.policy == policy && rec.cache == cache) {
            return rec;
        }
    }
    throw Error("no record " + policy);
}

const std::vector<std::string> kPolicies = {"lru", "lfu", "ema", "belady", "sieve"};

ReplayOptions options(const fs::path & trace, std::vector<std::string> policies, std::vector<int> caches, int k) {
    ReplayOptions o;
    o.trace = trace;
    o.policies = std::move(policies);
    o.caches = std::move(caches);
    o.k = k;
    return o;
}

} // namespace

// Five tokens of one expert each through a 2-expert cache, worked by hand.
TEST(Replay, HandWorkedSequence) {
    test::TempDir dir;
    TraceSpec s{1, 4, 2, {}};
    for (uint16_t e : {0, 1, 0, 2, 1}) {
        s.tokens.push_back({{}, {e, uint16_t((e + 3) % 4)}});
    }
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", kPolicies, {2}, 1);
    const ReplayReport r = run_replay(o);
    // lru: 0 1 (0 hit) 2 evicts 1, 1 evicts 0 -> 4. lfu: 2 evicts 1 (count 1 < 2), 1 evicts 2 -> 4.
    // belady: 2 evicts 0 (never used again), 1 hits -> 3. sieve: 0 is visited, so 2 evicts 1 -> 4.
    EXPECT_EQ(record(r, "lru", 2).total().misses, 4u);
    EXPECT_EQ(record(r, "lfu", 2).total().misses, 4u);
    EXPECT_EQ(record(r, "ema", 2).total().misses, 4u);
    EXPECT_EQ(record(r, "belady", 2).total().misses, 3u);
    EXPECT_EQ(record(r, "sieve", 2).total().misses, 4u);
    EXPECT_EQ(record(r, "lru", 2).total().picks, 5u);
}

// The engine (lazy decay, keyed caches, layers in parallel, all configurations in one
// pass) equals the reference (eager decay, full scans, one configuration) exactly.
TEST(Replay, EngineEqualsReferenceOnRandomTraces) {
    test::TempDir dir;
    int checked = 0;
    for (uint32_t seed = 1; seed <= 6; ++seed) {
        const uint32_t n_expert = 8 + seed * 5, top_m = 4 + seed % 3;
        const TraceSpec s = random_trace(seed, 3, n_expert, top_m, 300 + seed * 40);
        const fs::path path = dir / fmt::format("r{}.trace", seed);
        write_trace(path, s);
        const int k = 1 + int(seed % 3);
        KeepMap km;
        const bool with_keep = seed % 2 == 0;
        if (with_keep) {
            km.n_expert = n_expert;
            km.k = int64_t(n_expert) - 3;
            for (int l = 0; l < 3; ++l) {
                std::vector<int32_t> ids(n_expert);
                std::iota(ids.begin(), ids.end(), 0);
                ids.erase(ids.begin() + l, ids.begin() + l + 3);  // drop three popular experts per layer
                km.layers[l] = ids;
            }
            test::write_text(dir / "keep.json", keep_map_to_json(km).dump());
        }
        ReplayOptions o = options(path, kPolicies, {k, k + 1, k + 3, int(n_expert) / 2}, k);
        o.keep = with_keep ? dir / "keep.json" : fs::path();
        o.warmup = seed * 7;
        o.reset_on_session = seed % 3 == 0;
        o.params.ema_decay = 0.8 + 0.02 * seed;
        const ReplayReport r = run_replay(o);
        for (const std::string & p : kPolicies) {
            for (int c : o.caches) {
                const Expected x = expected(s, p, c, k, o.warmup, o.reset_on_session, with_keep ? &km : nullptr, o.params);
                const PhaseCounts got = record(r, p, c).total();
                EXPECT_EQ(got.misses, x.misses) << p << " cache " << c << " seed " << seed;
                EXPECT_EQ(got.forced_misses, x.forced) << p << " cache " << c << " seed " << seed;
                EXPECT_EQ(got.picks, x.picks) << p;
                EXPECT_EQ(got.tokens, x.tokens) << p;
                ++checked;
            }
        }
    }
    EXPECT_EQ(checked, 6 * 5 * 4);
}

// Adversarial: a cyclic scan one wider than the cache defeats LRU and SIEVE completely,
// while Belady keeps most of the cycle.
TEST(Replay, CyclicScanAgreesWithReferenceAndBeladyWins) {
    test::TempDir dir;
    TraceSpec s{1, 8, 1, {}};
    for (int t = 0; t < 200; ++t) {
        s.tokens.push_back({{}, {uint16_t(t % 5)}});
    }
    write_trace(dir / "scan.trace", s);
    ReplayOptions o = options(dir / "scan.trace", kPolicies, {4}, 1);
    const ReplayReport r = run_replay(o);
    EXPECT_EQ(record(r, "lru", 4).total().misses, 200u);
    EXPECT_LT(record(r, "belady", 4).total().misses, 60u);
    for (const std::string & p : kPolicies) {
        EXPECT_EQ(record(r, p, 4).total().misses, expected(s, p, 4, 1, 0, false, nullptr, o.params).misses) << p;
    }
}

TEST(Replay, BeladyIsNeverBeatenByAnOnlinePolicy) {
    test::TempDir dir;
    const TraceSpec s = random_trace(42, 4, 32, 8, 800);
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", kPolicies, {4, 8, 12, 20}, 4);
    const ReplayReport r = run_replay(o);
    for (int c : o.caches) {
        const uint64_t best = record(r, "belady", c).total().misses;
        for (const std::string & p : {"lru", "lfu", "ema", "sieve"}) {
            EXPECT_LE(best, record(r, p, c).total().misses) << p << " cache " << c;
        }
    }
}

TEST(Replay, SplitsPhasesAndCountsOnlyAfterWarmup) {
    test::TempDir dir;
    const TraceSpec s = random_trace(3, 2, 16, 4, 300);
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", {"lru"}, {6}, 2);
    o.warmup = 50;
    const ReplayRecord rec = run_replay(o).records.at(0);
    uint64_t prefill = 0, decode = 0;
    for (size_t t = 50; t < s.tokens.size(); ++t) {
        (s.tokens[t].meta.phase == TracePhase::Decode ? decode : prefill)++;
    }
    EXPECT_EQ(rec.prefill.tokens, prefill);
    EXPECT_EQ(rec.decode.tokens, decode);
    EXPECT_EQ(rec.prefill.picks, prefill * 2 * 2);  // k per layer, two layers
    EXPECT_GT(rec.decode.misses, 0u);
}

TEST(Replay, Q4rtTracesReplayLikeTheirMoepruneTwin) {
    test::TempDir dir;
    const TraceSpec s = random_trace(9, 3, 20, 5, 250);
    write_trace(dir / "t.trace", s);
    test::write_q4rt(dir / "t.q4rt", s.n_layer, s.n_expert, s.top_m, s.tokens.size(), uint32_t(s.tokens.size()),
                     [&](uint64_t t, std::vector<uint16_t> & ids, std::vector<float> & logits) {
                         ids = s.tokens[t].ids;
                         logits.assign(ids.size(), 0.0f);
                         for (size_t i = 0; i < logits.size(); ++i) {
                             logits[i] = 4.0f - 0.25f * float(i % s.top_m);
                         }
                     });
    ReplayOptions o = options(dir / "t.trace", kPolicies, {5, 9}, 3);
    const ReplayReport a = run_replay(o);
    o.trace = dir / "t.q4rt";
    const ReplayReport b = run_replay(o);
    ASSERT_EQ(a.records.size(), b.records.size());
    for (size_t i = 0; i < a.records.size(); ++i) {
        EXPECT_EQ(a.records[i].total().misses, b.records[i].total().misses) << a.records[i].policy;
        EXPECT_GT(a.records[i].total().misses, 0u);
    }
}

TEST(Replay, GuardsAgainstMeaninglessConfigurations) {
    test::TempDir dir;
    TraceSpec s = random_trace(5, 2, 16, 4, 40);
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", {"lru"}, {1}, 2);
    EXPECT_THROW(
        {
            try {
                run_replay(o);
            } catch (const Error & e) {
                EXPECT_NE(std::string(e.what()).find("smaller than k = 2"), std::string::npos) << e.what();
                throw;
            }
        },
        Error);
    o.caches = {4};
    o.warmup = 40;
    try {
        run_replay(o);
        ADD_FAILURE() << "a warm-up covering the whole trace was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("has 40 tokens, not more than the warm-up of 40"), std::string::npos) << e.what();
    }
    o.warmup = 0;
    o.k = 0;
    try {
        run_replay(o);
        ADD_FAILURE() << "k was guessed";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("give --k"), std::string::npos) << e.what();
    }
    write_trace(dir / "meta.trace", s, {{"n_expert_used", 2}});
    o.trace = dir / "meta.trace";
    EXPECT_EQ(run_replay(o).k, 2);
    o.policies = {"fifo-of-dreams"};
    EXPECT_THROW(run_replay(o), Error);
    o.policies = {"lru"};
    test::write_text(dir / "keep.json", R"({"0": [0, 1, 2, 99], "1": [0, 1, 2, 3]})");
    o.keep = dir / "keep.json";
    try {
        run_replay(o);
        ADD_FAILURE() << "a keep map naming expert 99 of 16 was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("layer 0: expert id 99 is not below n_expert 16"), std::string::npos) << e.what();
    }
}

TEST(Replay, RefusesNanLogitsNamingTokenAndLayer) {
    test::TempDir dir;
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 8;
    h.top_m = 2;
    h.domains = {"all"};
    {
        TraceWriter w(dir / "nan.trace", h);
        const uint16_t ids[4] = {0, 1, 2, 3};
        const float good[4] = {1, 0, 1, 0};
        const float bad[4] = {1, 0, std::nanf(""), 0};
        for (int t = 0; t < 5; ++t) {
            w.append({}, ids, t == 3 ? bad : good);
        }
        w.close();
    }
    ReplayOptions o = options(dir / "nan.trace", {"lru"}, {2}, 1);
    try {
        run_replay(o);
        ADD_FAILURE() << "NaN accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("NaN logit at token 3 layer 1"), std::string::npos) << e.what();
    }
}

TEST(Replay, CommandWritesJsonRecords) {
    test::TempDir dir;
    const TraceSpec s = random_trace(11, 2, 16, 4, 120);
    write_trace(dir / "t.trace", s, {{"n_expert_used", 2}});
    const auto r = test::run_command(fmt::format("{} replay --trace {} --policy lru,belady --cache 3,6 --json {}",
                                                 test::bin("moeprune").string(), (dir / "t.trace").string(),
                                                 (dir / "out.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("belady"), std::string::npos) << r.output;
    const auto j = nlohmann::json::parse(test::read_bytes(dir / "out.json"));
    ASSERT_EQ(j["records"].size(), 4u);
    const ReplayOptions o = options(dir / "t.trace", {"lru", "belady"}, {3, 6}, 0);
    const ReplayReport lib = run_replay(o);
    for (size_t i = 0; i < 4; ++i) {
        EXPECT_EQ(j["records"][i]["policy"], lib.records[i].policy);
        EXPECT_EQ(j["records"][i]["misses"].get<uint64_t>(), lib.records[i].total().misses);
        EXPECT_EQ(j["records"][i]["tokens"].get<uint64_t>(), 120u);
    }
    EXPECT_EQ(j["inputs"]["k"], 2);
}
