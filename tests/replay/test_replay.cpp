#include "core/errors.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "sim/moce.h"
#include "replay/reference_replay.h"
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

int n_policies() { return int(policy_names().size()); }

// Candidates of one token: [n_layer][top_m] expert ids, best first, and their logits
// (default: falling by 0.25 per rank).
struct TokenRow {
    TraceTokenMeta meta;
    std::vector<uint16_t> ids;
    std::vector<float> logits;
};

struct TraceSpec {
    uint32_t n_layer = 2, n_expert = 16, top_m = 6;
    std::vector<TokenRow> tokens;
};

float default_logit(uint32_t rank) { return 4.0f - 0.25f * float(rank); }

void write_trace(const fs::path & path, const TraceSpec & s, const nlohmann::json & meta = nlohmann::json::object()) {
    TraceHeader h;
    h.n_layer = s.n_layer;
    h.n_expert = s.n_expert;
    h.top_m = s.top_m;
    h.domains = {"all"};
    h.meta = meta;
    TraceWriter w(path, h, 64);
    std::vector<float> fallback(size_t(s.n_layer) * s.top_m);
    for (size_t i = 0; i < fallback.size(); ++i) {
        fallback[i] = default_logit(uint32_t(i % s.top_m));
    }
    for (const TokenRow & t : s.tokens) {
        w.append(t.meta, t.ids.data(), t.logits.empty() ? fallback.data() : t.logits.data());
    }
    w.close();
}

// Skewed popularity with some locality, a few sequences, prefill then decode in each;
// logits fall by random multiples of 1/64 (exact in f16) and sometimes tie.
TraceSpec random_trace(uint32_t seed, uint32_t n_layer, uint32_t n_expert, uint32_t top_m, size_t n_tokens) {
    std::mt19937 rng(seed);
    TraceSpec s{n_layer, n_expert, top_m, {}};
    std::vector<double> weight(n_expert);
    for (uint32_t e = 0; e < n_expert; ++e) {
        weight[e] = 1.0 / std::pow(double(e + 1), 0.8);
    }
    std::uniform_int_distribution<int> step(0, 24);
    for (size_t t = 0; t < n_tokens; ++t) {
        TokenRow row;
        row.meta.seq = int32_t(t / 97);
        row.meta.pos = int32_t(t % 97);
        row.meta.phase = t % 97 < 60 ? TracePhase::Prefill : TracePhase::Decode;
        if (t % 50 == 0) {
            std::shuffle(weight.begin(), weight.begin() + std::min<long>(6, long(n_expert)), rng);  // topic change
        }
        for (uint32_t l = 0; l < n_layer; ++l) {
            std::vector<double> w = weight;
            std::shuffle(w.begin(), w.begin() + 3, rng);  // a little churn at the top
            float z = 3.0f;
            for (uint32_t m = 0; m < top_m; ++m) {
                std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
                const uint32_t e = (pick(rng) + l * 5) % n_expert;
                row.ids.push_back(uint16_t(e));
                row.logits.push_back(z);
                z -= float(step(rng)) / 64.0f;
                w[(e + n_expert - (l * 5) % n_expert) % n_expert] = 0.0;
            }
        }
        s.tokens.push_back(std::move(row));
    }
    return s;
}

// The trace as the reference takes it: survivors of the keep map in rank order,
// renumbered as in the sliced model.
test::RefTrace to_reference(const TraceSpec & s, int k, const KeepMap * km) {
    test::RefTrace r;
    r.n_layer = int(s.n_layer);
    r.n_expert = km ? int(km->k) : int(s.n_expert);
    r.k = k;
    for (const TokenRow & row : s.tokens) {
        r.ranked.emplace_back(s.n_layer);
        r.logits.emplace_back(s.n_layer);
        for (uint32_t l = 0; l < s.n_layer; ++l) {
            const std::vector<int32_t> * keep = km ? &std::next(km->layers.begin(), l)->second : nullptr;
            for (uint32_t m = 0; m < s.top_m; ++m) {
                int32_t id = row.ids[l * s.top_m + m];
                if (keep) {
                    const auto it = std::find(keep->begin(), keep->end(), id);
                    id = it == keep->end() ? -1 : int32_t(it - keep->begin());
                }
                if (id >= 0) {
                    r.ranked.back()[l].push_back(id);
                    r.logits.back()[l].push_back(row.logits.empty() ? default_logit(m) : row.logits[l * s.top_m + m]);
                }
            }
        }
        r.seq.push_back(row.meta.seq);
        r.decode.push_back(row.meta.phase == TracePhase::Decode);
    }
    return r;
}

void expect_phase_equal(const PhaseCounts & got, const test::RefCounts & want, const std::vector<double> & bytes,
                        const std::string & what) {
    EXPECT_EQ(got.misses, want.misses) << what;
    EXPECT_EQ(got.forced_misses, want.forced) << what;
    EXPECT_EQ(got.picks, want.picks) << what;
    EXPECT_EQ(got.tokens, want.tokens) << what;
    EXPECT_EQ(got.swaps, want.swaps) << what;
    EXPECT_NEAR(got.moved_mass, want.moved_mass, 1e-9 * (1 + want.moved_mass)) << what;
    EXPECT_EQ(got.predicted, want.predicted) << what;
    EXPECT_EQ(got.predicted_chosen, want.predicted_chosen) << what;
    EXPECT_EQ(got.hidden, want.hidden) << what;
    EXPECT_EQ(got.prefetch_loads, want.prefetch_loads) << what;
    EXPECT_EQ(got.rounds, want.rounds) << what;
    if (!bytes.empty()) {
        double exposed = 0;
        for (size_t l = 0; l < bytes.size(); ++l) {
            exposed += double(want.exposed_per_layer.at(l)) * bytes[l];
        }
        EXPECT_NEAR(got.exposed_bytes, exposed, 1e-6 * (1 + exposed)) << what;
    }
}

// Every record of an engine run against the reference run of that one configuration.
// Returns the number of configurations compared.
int expect_equals_reference(const ReplayReport & r, const ReplayOptions & o, const test::RefTrace & ref,
                            const std::vector<double> & bytes = {}) {
    int compared = 0;
    for (const ReplayRecord & rec : r.records) {
        test::RefConfig c;
        c.policy = rec.policy;
        c.capacity = rec.slots;
        c.global = o.global;
        c.lambda = rec.lambda;
        c.j = moce_j(o.j, ref.k);
        c.moce = o.moce;
        c.warmup = o.warmup;
        c.reset_on_session = o.reset_on_session;
        c.prefill_union = o.prefill_union;
        c.prefetch_n = o.prefetch ? (o.prefetch_n > 0 ? o.prefetch_n : ref.k) : 0;
        c.prefetch_train = o.prefetch_train;
        c.queue_depth = o.throughput.queue_depth;
        c.params = o.params;
        c.params.requests_per_token = o.global ? ref.n_layer : 1;
        const test::RefResult want = test::reference_replay(ref, c);
        const std::string what = fmt::format("{} slots {} lambda {}", rec.policy, rec.slots.front(), rec.lambda);
        expect_phase_equal(rec.prefill, want.prefill, bytes, what + " prefill");
        expect_phase_equal(rec.decode, want.decode, bytes, what + " decode");
        ++compared;
    }
    return compared;
}

const ReplayRecord & record(const ReplayReport & r, const std::string & policy, int cache, double lambda = 0) {
    for (const ReplayRecord & rec : r.records) {
        if (rec.policy == policy && rec.cache == cache && rec.lambda == lambda) {
            return rec;
        }
    }
    throw Error(fmt::format("no record {} {} {}", policy, cache, lambda));
}

ReplayOptions options(const fs::path & trace, std::vector<std::string> policies, std::vector<int> caches, int k) {
    ReplayOptions o;
    o.trace = trace;
    o.policies = std::move(policies);
    o.caches = std::move(caches);
    o.k = k;
    return o;
}

KeepMap drop_three_per_layer(uint32_t n_layer, uint32_t n_expert) {
    KeepMap km;
    km.n_expert = n_expert;
    km.k = int64_t(n_expert) - 3;
    for (uint32_t l = 0; l < n_layer; ++l) {
        std::vector<int32_t> ids(n_expert);
        std::iota(ids.begin(), ids.end(), 0);
        ids.erase(ids.begin() + l, ids.begin() + l + 3);  // three popular experts
        km.layers[int(l)] = ids;
    }
    return km;
}

} // namespace

// Sequences worked by hand from docs/replay.md (the working for arc, slru and s3fifo
// is in tests/replay/reference_replay.cpp's history: each step names the list moves).
TEST(Replay, HandWorkedSequencesOfEveryPolicy) {
    test::TempDir dir;
    struct Case {
        std::string policy;
        int cache, k;
        std::vector<std::vector<uint16_t>> requests;
        uint64_t misses;
        PolicyParams params;
    };
    const auto singles = [](std::initializer_list<uint16_t> ids) {
        std::vector<std::vector<uint16_t>> out;
        for (uint16_t e : ids) {
            out.push_back({e});
        }
        return out;
    };
    PolicyParams half_protected, half_small;
    half_protected.slru_protected = 0.5;
    half_small.s3fifo_small = 0.5;
    // 0 1 0 2 1 through 2 slots: lru/lfu/ema 4 (2 evicts 1, 1 evicts 0 or 2), belady 3
    // (2 evicts 0, never used again), sieve 4 (0 is visited, so 2 evicts 1).
    const std::vector<Case> cases = {
        {"lru", 2, 1, singles({0, 1, 0, 2, 1}), 4, {}},
        {"lfu", 2, 1, singles({0, 1, 0, 2, 1}), 4, {}},
        {"ema", 2, 1, singles({0, 1, 0, 2, 1}), 4, {}},
        {"belady", 2, 1, singles({0, 1, 0, 2, 1}), 3, {}},
        {"sieve", 2, 1, singles({0, 1, 0, 2, 1}), 4, {}},
        // lfu ties: 0 0 1 2 1 2 0 -> 1 0 1 1 1 1 1.
        {"lfu", 2, 1, singles({0, 0, 1, 2, 1, 2, 0}), 6, {}},
        // arc: 0 0 1 2 0 1 0 2 0 -> 1 0 1 1 0 1 1 1 0 (2 replaces T1's 1 into B1, so 0 hits).
        {"arc", 2, 1, singles({0, 0, 1, 2, 0, 1, 0, 2, 0}), 6, {}},
        // arc through |T1| = C, the 2C drop from B2 and a B2 hit replacing from T1.
        {"arc", 2, 1, singles({0, 1, 2, 0, 0, 1, 2, 0, 1, 3, 2, 1, 3, 2, 0, 4, 3, 0}), 15, {}},
        // arc, two experts a token: REPLACE passes over a chosen expert -> 2 1 1 1 2 1 1 1 1.
        {"arc", 3, 2, {{0, 1}, {1, 2}, {0, 3}, {2, 3}, {1, 4}, {0, 3}, {1, 4}, {2, 3}, {1, 4}}, 11, {}},
        // slru, one protected slot: a promotion demotes 0 -> 1 1 0 1 0 1 1 0 1.
        {"slru", 3, 1, singles({0, 1, 0, 2, 1, 3, 2, 1, 0}), 6, half_protected},
        // s3fifo, two small slots: moves to M, ghost hits and drops, reinsertion with f-1.
        {"s3fifo", 4, 1, singles({0, 1, 0, 2, 3, 4, 1, 0, 1, 1, 5, 6, 3, 6, 7, 6, 4, 0, 1}), 12, half_small},
        // sieve: 0's bit saves it twice -> 1 1 1 0 1 1 1 0.
        {"sieve", 3, 1, singles({0, 1, 2, 0, 3, 1, 4, 0}), 6, {}},
        // page-cache: 2's fault rotates 0 and 1 (accessed once: referenced) and evicts 0;
        // 3's rotates 2 and activates 1 (accessed and referenced), evicting 2; 2 refaults
        // within the active list's size, comes back active, deactivates 1 and evicts it
        // -> 1 1 1 0 1 0 1.
        {"page-cache", 2, 1, singles({0, 1, 2, 1, 3, 1, 2}), 5, {}},
        // 0 1 0 2 1: 0, accessed twice, has no referenced flag before the first scan -> 1 1 0 1 0.
        {"page-cache", 2, 1, singles({0, 1, 0, 2, 1}), 3, {}},
    };
    int i = 0;
    for (const Case & c : cases) {
        TraceSpec s{1, 8, uint32_t(c.k), {}};
        for (const auto & r : c.requests) {
            s.tokens.push_back({{}, r, {}});
        }
        const fs::path path = dir / fmt::format("hand{}.trace", i++);
        write_trace(path, s);
        ReplayOptions o = options(path, {c.policy}, {c.cache}, c.k);
        o.params = c.params;
        const ReplayReport r = run_replay(o);
        EXPECT_EQ(r.records.at(0).total().misses, c.misses) << c.policy << " case " << i;
        EXPECT_EQ(expect_equals_reference(r, o, to_reference(s, c.k, nullptr)), 1);
    }
}

// The engine (lazy decay, heaps and lists, layers in parallel, every configuration in
// one pass) equals the reference (eager decay, full scans, one configuration) on every
// counter, for every policy, cache size, lambda, MoCE mode and keep map.
TEST(Replay, EngineEqualsReferenceOnRandomTraces) {
    test::TempDir dir;
    int compared = 0;
    for (uint32_t seed = 1; seed <= 6; ++seed) {
        const uint32_t n_expert = 8 + seed * 5, top_m = 5 + seed % 3, n_layer = 3;
        const TraceSpec s = random_trace(seed, n_layer, n_expert, top_m, 300 + seed * 40);
        const fs::path path = dir / fmt::format("r{}.trace", seed);
        write_trace(path, s);
        const int k = 1 + int(seed % 3);
        const bool with_keep = seed % 2 == 0;
        const KeepMap km = drop_three_per_layer(n_layer, n_expert);
        if (with_keep) {
            test::write_text(dir / "keep.json", keep_map_to_json(km).dump());
        }
        ReplayOptions o = options(path, policy_names(), {k, k + 1, k + 3, int(n_expert) / 2}, k);
        o.keep = with_keep ? dir / "keep.json" : fs::path();
        o.lambdas = {0.0, 0.4, 1.5};
        o.moce = seed % 2 ? "prior" : "topk-gap";
        o.j = int(seed % 3);
        o.warmup = seed * 7;
        o.reset_on_session = seed % 3 == 0;
        o.params.ema_decay = 0.8 + 0.02 * seed;
        o.params.near_pick = 2 + int(seed);
        o.params.lfru_half_life = 4.0 * seed;
        o.params.slru_protected = 0.1 * seed;
        o.params.s3fifo_small = 0.05 * seed;
        const ReplayReport r = run_replay(o);
        compared += expect_equals_reference(r, o, to_reference(s, k, with_keep ? &km : nullptr));
    }
    EXPECT_EQ(compared, 6 * (n_policies() * 4 * 3 - 2 * 4));  // belady runs at lambda 0 only
}

TEST(Replay, LazyDecayEqualsEagerDecayOnLongTraces) {
    test::TempDir dir;
    const TraceSpec s = random_trace(77, 2, 24, 8, 3000);
    write_trace(dir / "t.trace", s);
    for (double decay : {0.99, 0.9, 0.5}) {
        ReplayOptions o = options(dir / "t.trace", {"ema", "near-pick-ema", "inverse-router-ema", "lfru"}, {3, 6, 12}, 3);
        o.params.ema_decay = decay;
        o.params.lfru_half_life = -1.0 / std::log2(decay);
        EXPECT_EQ(expect_equals_reference(run_replay(o), o, to_reference(s, 3, nullptr)), 12) << decay;
    }
}

TEST(Replay, GlobalCachePrefillUnionsAndPrefetchEqualTheReference) {
    test::TempDir dir;
    const uint32_t n_layer = 3, n_expert = 12;
    const TraceSpec s = random_trace(5, n_layer, n_expert, 7, 400);
    write_trace(dir / "t.trace", s);
    const KeepMap km = drop_three_per_layer(n_layer, n_expert);
    test::write_text(dir / "keep.json", keep_map_to_json(km).dump());
    int compared = 0;
    for (int variant = 0; variant < 4; ++variant) {
        const bool global = variant % 2 == 1, keep = variant >= 2;
        ReplayOptions o = options(dir / "t.trace", policy_names(), global ? std::vector<int>{2, 7, 20} : std::vector<int>{2, 5}, 2);
        o.global = global;
        o.keep = keep ? dir / "keep.json" : fs::path();
        o.lambdas = {0.0, 0.7};
        o.j = 1;
        o.prefill_union = 8;
        o.prefetch = true;
        o.prefetch_n = 3;
        o.warmup = 13;
        o.reset_on_session = variant == 1;
        o.prefetch_train = variant == 2 ? 150 : 0;
        o.expert_mb = 1.5;
        o.throughput.queue_depth = 2;
        const ReplayReport r = run_replay(o);
        compared += expect_equals_reference(r, o, to_reference(s, 2, keep ? &km : nullptr),
                                            std::vector<double>(n_layer, 1.5e6));
        if (global) {
            EXPECT_TRUE(record(r, "lru", 2).cliff);
            EXPECT_FALSE(record(r, "lru", 7).cliff);  // 3 layers x k = 2 fit in 7
        }
        EXPECT_GT(record(r, "lru", 2).total().predicted, 0u);
        EXPECT_GT(record(r, "lru", 2).total().hidden, 0u);
    }
    EXPECT_EQ(compared, 2 * (n_policies() * 2 * 2 - 2) + 2 * (n_policies() * 3 * 2 - 3));
}

// Traces built to break caches and routing: a cyclic scan one wider than the cache
// (defeats LRU-like policies, Belady keeps most of it), one expert set forever, every
// logit equal (MoCE ties everywhere), and a keep map that leaves fewer survivors than k.
TEST(Replay, AdversarialTracesEqualTheReference) {
    test::TempDir dir;
    TraceSpec scan{1, 8, 2, {}};
    for (int t = 0; t < 300; ++t) {
        scan.tokens.push_back({{}, {uint16_t(t % 5), uint16_t((t + 2) % 5)}, {1.0f, 1.0f}});
    }
    TraceSpec same{2, 6, 3, {}};
    for (int t = 0; t < 200; ++t) {
        same.tokens.push_back({{}, {1, 2, 3, 4, 5, 0}, {}});
    }
    TraceSpec flat = random_trace(3, 2, 12, 6, 300);
    for (TokenRow & row : flat.tokens) {
        std::fill(row.logits.begin(), row.logits.end(), 0.5f);
    }
    const std::vector<std::pair<std::string, TraceSpec>> traces = {{"scan", scan}, {"same", same}, {"flat", flat}};
    int compared = 0;
    for (const auto & [name, s] : traces) {
        write_trace(dir / (name + ".trace"), s);
        ReplayOptions o = options(dir / (name + ".trace"), policy_names(), {1, 2, 4, int(s.n_expert)}, 1);
        o.lambdas = {0.0, 2.0};
        o.j = 0;
        compared += expect_equals_reference(run_replay(o), o, to_reference(s, 1, nullptr));
    }
    EXPECT_EQ(compared, 3 * (n_policies() * 4 * 2 - 4));
    ReplayOptions o = options(dir / "scan.trace", {"lru", "sieve", "belady"}, {4}, 1);
    const ReplayReport r = run_replay(o);
    EXPECT_EQ(record(r, "lru", 4).total().misses, 300u);
    EXPECT_LT(record(r, "belady", 4).total().misses, 90u);
    // Keep experts 0..2 of 12 with k = 2: most tokens' top-6 hold fewer than two of them.
    KeepMap km;
    km.n_expert = 12;
    km.k = 3;
    km.layers = {{0, {0, 1, 2}}, {1, {0, 1, 2}}};
    test::write_text(dir / "keep.json", keep_map_to_json(km).dump());
    ReplayOptions ok = options(dir / "flat.trace", policy_names(), {2, 3}, 2);
    ok.keep = dir / "keep.json";
    ok.lambdas = {0.0, 1.0};
    ok.j = 1;
    const ReplayReport rk = run_replay(ok);
    EXPECT_GT(record(rk, "lru", 2).total().forced_misses, 0u);
    EXPECT_EQ(expect_equals_reference(rk, ok, to_reference(flat, 2, &km)), n_policies() * 2 * 2 - 2);
}

TEST(Replay, BeladyIsNeverBeatenByAnOnlinePolicy) {
    test::TempDir dir;
    const TraceSpec s = random_trace(42, 4, 32, 8, 800);
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", policy_names(), {4, 8, 12, 20}, 4);
    const ReplayReport r = run_replay(o);
    for (int c : o.caches) {
        const uint64_t best = record(r, "belady", c).total().misses;
        for (const std::string & p : policy_names()) {
            EXPECT_LE(best, record(r, p, c).total().misses) << p << " cache " << c;
        }
    }
}

// The seed pipeline's check on its sweep: with cache-aware routing, misses do not grow
// with lambda, and routing moves away from the unbiased top-k only when lambda > 0.
TEST(Replay, MoceMissesDoNotIncreaseWithLambda) {
    test::TempDir dir;
    const TraceSpec s = random_trace(8, 4, 64, 16, 1500);
    write_trace(dir / "t.trace", s);
    for (const std::string mode : {"prior", "topk-gap"}) {
        for (int j : {2, 3}) {
            ReplayOptions o = options(dir / "t.trace", {"lru", "near-pick-ema", "inverse-router-ema"}, {12}, 4);
            o.lambdas = {0.0, 0.05, 0.09, 0.12, 0.5};
            o.moce = mode;
            o.j = j;
            const ReplayReport r = run_replay(o);
            for (const std::string & p : o.policies) {
                EXPECT_EQ(record(r, p, 12, 0.0).total().swaps, 0u);
                EXPECT_GT(record(r, p, 12, 0.5).total().swaps, 0u) << p;
                for (size_t i = 1; i < o.lambdas.size(); ++i) {
                    EXPECT_LE(record(r, p, 12, o.lambdas[i]).total().misses,
                              record(r, p, 12, o.lambdas[i - 1]).total().misses)
                        << p << " " << mode << " j " << j << " lambda " << o.lambdas[i];
                }
            }
        }
    }
}

// Rerouting's moved gate mass is a sum of doubles over layers: the same at any thread count.
TEST(Replay, MovedMassIsTheSameAtEveryThreadCount) {
    test::TempDir dir;
    const TraceSpec s = random_trace(11, 6, 64, 16, 800);
    write_trace(dir / "t.trace", s);
    std::vector<ReplayReport> reports;
    for (const int threads : {1, 2, 3}) {
        ReplayOptions o = options(dir / "t.trace", {"lru", "near-pick-ema"}, {12}, 4);
        o.lambdas = {0.3};
        o.threads = threads;
        reports.push_back(run_replay(o));
    }
    for (const std::string p : {"lru", "near-pick-ema"}) {
        const double moved = record(reports[0], p, 12, 0.3).total().moved_mass;
        EXPECT_GT(moved, 0) << p;
        for (size_t i = 1; i < reports.size(); ++i) {
            EXPECT_EQ(record(reports[i], p, 12, 0.3).total().moved_mass, moved) << p << ", run " << i;
        }
    }
}

// Bytes of an expert from the model's GGUF, budgets in MiB, and the throughput model
// computed by hand from the printed inputs.
TEST(Replay, BudgetsAndThroughputUseTheModelsExpertBytes) {
    test::TempDir dir;
    const auto synth = test::run_command(fmt::format("{} synth --layers 2 --experts 8 --used 2 -o {}",
                                                     test::bin("moeprune").string(), (dir / "m.gguf").string()));
    ASSERT_EQ(synth.exit_code, 0) << synth.output;
    const auto inspect = test::run_command(
        fmt::format("{} inspect --json {}", test::bin("moeprune").string(), (dir / "m.gguf").string()));
    ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
    const auto info = nlohmann::json::parse(inspect.output);
    std::vector<double> bytes;
    for (const auto & l : info["layers"]) {
        bytes.push_back(l["expert_bytes"].get<double>());
    }
    ASSERT_EQ(bytes.size(), 2u);
    const TraceSpec s = random_trace(4, 2, 8, 4, 200);
    write_trace(dir / "t.trace", s);
    ReplayOptions o = options(dir / "t.trace", {"lru"}, {}, 2);
    o.model = dir / "m.gguf";
    const double mib = 5.5 * bytes[0] / 1048576.0;  // five and a half experts of layer 0
    o.cache_mib = {mib};
    o.throughput = {3.9, 50, 4, 2.0, 10};
    const ReplayReport r = run_replay(o);
    const ReplayRecord & rec = r.records.at(0);
    EXPECT_EQ(rec.slots, (std::vector<int>{int(5.5 * bytes[0] / bytes[0]), int(std::floor(5.5 * bytes[0] / bytes[1]))}));
    EXPECT_EQ(expect_equals_reference(r, o, to_reference(s, 2, nullptr), bytes), 1);
    const PhaseCounts c = rec.total();
    const double tokens = double(c.tokens);
    const double t_token = 2.0e-3 + 2 * 10e-6 + (c.exposed_bytes / 3.9e9 + double(c.rounds) * 50e-6) / tokens;
    EXPECT_NEAR(tokens_per_second(c, 2, o.throughput), 1.0 / t_token, 1e-9 / t_token);
    EXPECT_GT(c.exposed_bytes, 0);
    const nlohmann::json j = to_json(r);
    EXPECT_EQ(j["inputs"]["throughput"]["ssd_gbps"], 3.9);
    EXPECT_EQ(j["inputs"]["expert_bytes"][1].get<double>(), bytes[1]);
    EXPECT_NEAR(j["records"][0]["tokens_per_s"].get<double>(), 1.0 / t_token, 1e-9 / t_token);
    // Budgets and sizes of the keyed policies in one pass per layer (policy.h's StackPolicy).
    ReplayOptions several = o;
    several.policies = {"lfu", "ema", "belady"};
    several.caches = {2, 4};
    several.cache_mib = {mib, 0.75 * mib};
    EXPECT_EQ(expect_equals_reference(run_replay(several), several, to_reference(s, 2, nullptr), bytes), 12);
    o.cache_mib = {1.5 * bytes[0] / 1048576.0};
    try {
        run_replay(o);
        ADD_FAILURE() << "a budget of one and a half experts was accepted for k = 2";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("holds 1 experts of layer 0, fewer than k = 2"), std::string::npos) << e.what();
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
                         logits = s.tokens[t].logits;
                     });
    ReplayOptions o = options(dir / "t.trace", policy_names(), {5, 9}, 3);
    o.lambdas = {0.0, 0.3};
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
    o.policies = {"lru", "belady"};
    o.lambdas = {0.0, 0.2};
    o.j = 2;
    try {
        run_replay(o);
        ADD_FAILURE() << "--j 2 with k = 2 was accepted: every chosen expert gets the bonus, MoCE changes nothing";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("give --j below 2"), std::string::npos) << e.what();
    }
    o.j.reset();  // the default J is below k: 2, or k - 1 for k <= 2
    const ReplayReport skipped = run_replay(o);
    EXPECT_EQ(to_json(skipped)["inputs"]["moce"]["j"], 1);
    EXPECT_EQ(skipped.records.size(), 3u);  // no belady at lambda 0.2
    EXPECT_EQ(skipped.inputs["skipped"].size(), 1u);
    o.lambdas = {0.0};
    o.policies = {"lru"};
    o.cache_mib = {64};
    try {
        run_replay(o);
        ADD_FAILURE() << "a budget without the bytes of an expert was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("give --model or --expert-mb"), std::string::npos) << e.what();
    }
    o.cache_mib.clear();
    o.moce = "hope";
    EXPECT_THROW(run_replay(o), Error);
    o.moce = "prior";
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
    const auto r = test::run_command(fmt::format("{} replay --trace {} --policy lru,belady --cache 3,6 --json {} --csv {} "
                                                 "--expert-mb 2 --ssd 3.9",
                                                 test::bin("moeprune").string(), (dir / "t.trace").string(),
                                                 (dir / "out.json").string(), (dir / "out.csv").string()));
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
        for (const char * field : {"cache", "lambda", "j", "picks", "forced_misses", "misses_per_token", "hit_rate",
                                   "swap_rate", "tokens_per_s"}) {
            EXPECT_TRUE(j["records"][i].contains(field)) << field;
        }
    }
    EXPECT_EQ(j["inputs"]["k"], 2);
    EXPECT_EQ(j["inputs"]["throughput"]["ssd_gbps"], 3.9);
    const std::string csv = test::read_bytes(dir / "out.csv");
    EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 4 * 3);  // header, then all/prefill/decode per record
    EXPECT_NE(csv.find(fmt::format("belady,6,,0,1,all,120,{},{}", 120 * 2 * 2, lib.records[3].total().misses)),
              std::string::npos)
        << csv;
}

// A storage-cache workload (issue 20): one layer, one candidate per request, thousands
// of objects with skewed popularity: every policy equals the reference there too.
TEST(Replay, ManyObjectsOneCandidateEqualTheReference) {
    test::TempDir dir;
    const uint32_t n_objects = 3000;
    TraceSpec s{1, n_objects, 1, {}};
    std::mt19937 rng(11);
    std::vector<double> weight(n_objects);
    for (uint32_t e = 0; e < n_objects; ++e) {
        weight[e] = 1.0 / std::pow(double(e + 1), 0.8);
    }
    std::discrete_distribution<uint32_t> pick(weight.begin(), weight.end());
    for (size_t t = 0; t < 8000; ++t) {
        TokenRow row;
        row.meta.pos = int32_t(t);
        row.meta.phase = TracePhase::Decode;
        row.ids = {uint16_t((pick(rng) * 7919u) % n_objects)};  // popularity spread over the id range
        s.tokens.push_back(std::move(row));
    }
    write_trace(dir / "objects.trace", s);
    const ReplayOptions o = options(dir / "objects.trace", policy_names(), {100, 1000}, 1);
    EXPECT_EQ(expect_equals_reference(run_replay(o), o, to_reference(s, 1, nullptr)), n_policies() * 2);
}

// The all-sizes form of each stack algorithm against one cache per size, request by
// request: the chosen experts at least as deep as C are exactly the misses of the cache
// of C slots, through credited candidates (near-pick, inverse-router), resets, requests
// with fewer than k experts (a keep map's few survivors), caches of exactly k slots and
// of every expert, and a stack cut below the number of experts. For lfu, the ema
// family and belady the caches share the stack's key code (keyed_cache.h); the tests'
// reference checks the keys (EngineEqualsReferenceOnRandomTraces).
TEST(Replay, StackDepthsAreEveryCacheSizesMisses) {
    const int n_expert = 40, k = 4;
    std::mt19937 rng(5);
    std::vector<double> weight(n_expert);
    for (int e = 0; e < n_expert; ++e) {
        weight[size_t(e)] = 1.0 / std::pow(double(e + 1), 0.9);
    }
    std::discrete_distribution<int> pick(weight.begin(), weight.end());
    struct Step {
        std::vector<int32_t> chosen, ranked;
        std::vector<float> logits;
        bool reset = false;
    };
    std::vector<Step> steps(3000);
    AccessSequence future;
    for (size_t t = 0; t < steps.size(); ++t) {
        Step & s = steps[t];
        while (s.ranked.size() < size_t(k) + 6) {
            const int e = pick(rng);
            if (std::find(s.ranked.begin(), s.ranked.end(), e) == s.ranked.end()) {
                s.ranked.push_back(e);
                s.logits.push_back(3.0f - 0.25f * float(s.ranked.size()) - float(rng() % 4) / 8.0f);
            }
        }
        std::sort(s.logits.rbegin(), s.logits.rend());
        s.chosen.assign(s.ranked.begin(), s.ranked.begin() + (t % 7 == 3 ? k - 2 : k));
        std::sort(s.chosen.begin(), s.chosen.end());
        s.reset = t == 1700;
        future.push(s.chosen);
    }
    future.index_next_uses(n_expert);
    for (const auto & [policy, largest] : std::vector<std::pair<std::string, int>>{
             {"lru", 30}, {"lru", n_expert}, {"lfu", 30}, {"ema", n_expert}, {"near-pick-ema", 30},
             {"inverse-router-ema", n_expert}, {"lfru", 30}, {"belady", 30}, {"belady", n_expert}}) {
        const std::vector<int> sizes = {k, k + 1, 9, 16, 29, largest};
        PolicyParams p;
        p.ema_decay = 0.85;
        p.near_pick = 7;
        const auto stack = make_stack_policy(policy, n_expert, largest, p, &future);
        ASSERT_TRUE(stack) << policy;
        std::vector<std::unique_ptr<CachePolicy>> caches;
        for (int c : sizes) {
            caches.push_back(make_policy(policy, n_expert, c, p, &future));
        }
        std::vector<int32_t> depth(static_cast<size_t>(k));
        const auto depths = std::span<int32_t>(depth);
        uint64_t misses_seen = 0;
        for (size_t t = 0; t < steps.size(); ++t) {
            const Step & s = steps[t];
            if (s.reset) {
                stack->reset();
                for (auto & c : caches) {
                    c->reset();
                }
            }
            const Request r{s.chosen, s.ranked, s.logits};
            const std::span<int32_t> d = depths.first(s.chosen.size());
            stack->depths(r, d);
            for (size_t i = 0; i < sizes.size(); ++i) {
                const int want = caches[i]->access(r);
                const int got = int(std::count_if(d.begin(), d.end(), [&](int32_t x) { return x >= sizes[i]; }));
                ASSERT_EQ(got, want) << policy << " request " << t << " cache " << sizes[i];
                misses_seen += uint64_t(want);
            }
        }
        EXPECT_GT(misses_seen, 1000u) << policy;  // the sizes are small enough to miss
    }
    // The list-based policies keep no order of all experts: not stack algorithms.
    for (const std::string & policy : policy_names()) {
        const bool listed = policy == "slru" || policy == "arc" || policy == "s3fifo" || policy == "sieve" ||
                            policy == "page-cache";
        EXPECT_EQ(policy_is_stack_algorithm(policy), !listed) << policy;
        if (listed) {
            EXPECT_EQ(make_stack_policy(policy, n_expert, n_expert, {}), nullptr) << policy;
        }
    }
}
