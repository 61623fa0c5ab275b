// Replay sweep speed, engine against the reference of the tests, on a trace shaped
// like the seed pipeline's sweep. Prints the miss counts of both (they must agree)
// and, last, "replay: speedup=S mreq_per_s=R".
#include "formats/trace.h"
#include "replay/reference_replay.h"
#include "replay/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <utility>

using namespace moeprune;
namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

namespace {

// Router-like candidates: a per-layer popularity (Zipf over a layer-specific order)
// that drifts slowly, so caches have something to learn and something to miss.
void write_trace(const fs::path & path, uint32_t n_tokens, uint32_t n_layer, uint32_t n_expert, uint32_t top_m, int k) {
    TraceHeader h;
    h.n_layer = n_layer;
    h.n_expert = n_expert;
    h.top_m = top_m;
    h.domains = {"bench"};
    h.meta = {{"n_expert_used", k}, {"source", "bench/replay_bench"}};
    TraceWriter w(path, h, 256);
    std::mt19937_64 rng(7);
    std::vector<std::vector<uint16_t>> order(n_layer, std::vector<uint16_t>(n_expert));
    for (auto & o : order) {
        for (uint32_t e = 0; e < n_expert; ++e) {
            o[e] = uint16_t(e);
        }
        std::shuffle(o.begin(), o.end(), rng);
    }
    // rank r with probability ~ 1/(r+1): n^U - 1 for uniform U, tabulated
    std::vector<uint16_t> rank_of(4096);
    for (size_t i = 0; i < rank_of.size(); ++i) {
        rank_of[i] = uint16_t(std::min<double>(n_expert - 1, std::floor(std::pow(double(n_expert), double(i) / 4096.0)) - 1));
    }
    std::vector<uint16_t> ids(size_t(n_layer) * top_m);
    std::vector<float> logits(ids.size());
    std::vector<char> taken(n_expert);
    std::vector<uint32_t> ranks(top_m);
    for (uint32_t t = 0; t < n_tokens; ++t) {
        for (uint32_t l = 0; l < n_layer; ++l) {
            if (t % 64 == 0) {  // drift: neighbours in popularity swap places now and then
                const size_t i = rng() % (n_expert - 1);
                std::swap(order[l][i], order[l][i + 1]);
            }
            for (uint32_t m = 0; m < top_m; ++m) {
                uint32_t r;
                do {
                    r = rank_of[rng() % rank_of.size()];
                } while (taken[r]);
                taken[r] = 1;
                ranks[m] = r;
                ids[l * top_m + m] = order[l][r];
                logits[l * top_m + m] = 8.0f - 0.125f * float(m);
            }
            for (uint32_t r : ranks) {
                taken[r] = 0;
            }
        }
        w.append({int32_t(t), int32_t(t), 0, 0, TracePhase::Decode}, ids.data(), logits.data());
    }
    w.close();
}

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// One configuration's wall time on one thread.
// The best of three runs: every policy is timed alike, and a stray spike of load on the
// machine does not decide a ratio.
double time_policy(ReplayOptions o, const std::string & policy) {
    o.policies = {policy};
    o.threads = 1;
    double best = std::numeric_limits<double>::infinity();
    for (int run = 0; run < 3; ++run) {
        const auto t0 = clock_type::now();
        run_replay(o);
        best = std::min(best, seconds_since(t0));
    }
    return best;
}

// Issue 20's two settings: a global cache over a seed-geometry trace (48 layers x 512
// experts = 24,576 ids) and a storage-style trace of ~49k objects with one request per
// token; every policy timed against LRU on the same trace, cache and thread count.
int policies(const fs::path & dir) {
    fs::create_directories(dir);
    const fs::path seed = dir / "policies-seed.trace", objects = dir / "policies-objects.trace";
    if (!fs::exists(seed)) {
        write_trace(seed, 7486, 48, 512, 64, 10);
    }
    if (!fs::exists(objects)) {
        write_trace(objects, 113872, 1, 48974, 1, 1);
    }
    ReplayOptions global;
    global.trace = seed;
    global.global = true;
    global.caches = {3072};
    ReplayOptions storage;
    storage.trace = objects;
    storage.caches = {1000, 4000};
    std::string slowest;
    double worst = 0;
    for (const auto & [name, o] : {std::pair{"global 48x512, 3072 slots", global}, std::pair{"49k objects, 1000 and 4000 slots", storage}}) {
        const double lru = time_policy(o, "lru");
        std::printf("%s: lru %.3f s\n", name, lru);
        for (const std::string & p : policy_names()) {
            if (p == "lru") {
                continue;
            }
            const double t = time_policy(o, p);
            std::printf("  %-20s %.3f s  %.2fx lru\n", p.c_str(), t, t / lru);
            if (t / lru > worst) {
                worst = t / lru;
                slowest = p;
            }
        }
    }
    std::printf("replay-policies: slowest=%s ratio_to_lru=%.2f\n", slowest.c_str(), worst);
    return 0;
}

} // namespace

int main(int argc, char ** argv) {
    // replay_bench write-trace PATH TOKENS LAYERS: a trace for the memory check
    if (argc == 5 && std::string(argv[1]) == "write-trace") {
        write_trace(argv[2], uint32_t(std::stoul(argv[3])), uint32_t(std::stoul(argv[4])), 512, 64, 10);
        return 0;
    }
    // replay_bench policies DIR: every policy's time against LRU's where users run them
    if (argc == 3 && std::string(argv[1]) == "policies") {
        return policies(argv[2]);
    }
    // replay_bench sweep DIR [TOKENS]
    if (argc < 3 || std::string(argv[1]) != "sweep") {
        std::fprintf(stderr, "usage: replay_bench sweep DIR [TOKENS] | replay_bench policies DIR | "
                             "replay_bench write-trace PATH TOKENS LAYERS\n");
        return 2;
    }
    const fs::path dir = argv[2];
    const uint32_t n_tokens = argc > 3 ? uint32_t(std::stoul(argv[3])) : 16384;
    const uint32_t n_layer = 48, n_expert = 512, top_m = 64;
    const int k = 10;
    fs::create_directories(dir);
    const fs::path trace = dir / fmt::format("sweep-{}.trace", n_tokens);
    if (!fs::exists(trace)) {
        std::fprintf(stderr, "writing %s\n", trace.c_str());
        write_trace(trace, n_tokens, n_layer, n_expert, top_m, k);
    }

    ReplayOptions o;
    o.trace = trace;
    o.policies = {"lru", "lfu", "ema", "belady", "sieve"};
    for (int c = 16; c <= 384; c += 16) {
        o.caches.push_back(c);  // 24 sizes x 5 policies = 120 configurations
    }
    o.threads = 1;  // per-core rate
    auto t0 = clock_type::now();
    const ReplayReport engine = run_replay(o);
    const double engine_s = seconds_since(t0);
    const double requests = double(n_tokens) * n_layer * k * double(engine.records.size());

    // The reference, one configuration at a time, as a user of the old scripts would run them.
    const TraceReader reader = TraceReader::open(trace);
    t0 = clock_type::now();
    test::RefTrace ref;
    ref.n_layer = int(n_layer);
    ref.n_expert = int(n_expert);
    ref.k = k;
    ref.ranked.assign(n_tokens, std::vector<std::vector<int32_t>>(n_layer));
    ref.logits.assign(n_tokens, std::vector<std::vector<float>>(n_layer));
    for (uint32_t l = 0; l < n_layer; ++l) {
        std::vector<uint16_t> ids;
        std::vector<float> logits;
        reader.read_layer(l, ids, logits);
        for (uint32_t t = 0; t < n_tokens; ++t) {
            ref.ranked[t][l].assign(ids.begin() + long(t) * top_m, ids.begin() + long(t) * top_m + k);
            ref.logits[t][l].assign(logits.begin() + long(t) * top_m, logits.begin() + long(t) * top_m + k);
        }
    }
    for (const TraceTokenMeta & m : reader.token_meta()) {
        ref.seq.push_back(m.seq);
        ref.decode.push_back(m.phase == TracePhase::Decode);
    }
    std::vector<uint64_t> ref_misses(engine.records.size(), 0);
    for (size_t c = 0; c < engine.records.size(); ++c) {
        test::RefConfig rc;
        rc.policy = engine.records[c].policy;
        rc.capacity = engine.records[c].slots;
        rc.params = o.params;
        const test::RefResult r = test::reference_replay(ref, rc);
        ref_misses[c] = r.prefill.misses + r.decode.misses;
    }
    const double reference_s = seconds_since(t0);

    int disagreements = 0;
    std::printf("%-8s %6s %14s %14s\n", "policy", "cache", "engine misses", "reference");
    for (size_t c = 0; c < engine.records.size(); ++c) {
        const uint64_t got = engine.records[c].total().misses;
        disagreements += got != ref_misses[c];
        if (c % 6 == 0 || got != ref_misses[c]) {
            std::printf("%-8s %6d %14llu %14llu%s\n", engine.records[c].policy.c_str(), *engine.records[c].cache,
                        (unsigned long long) got, (unsigned long long) ref_misses[c], got != ref_misses[c] ? "  DIFFERENT" : "");
        }
    }
    std::printf("%u tokens x %u layers x k=%d, %zu configurations: engine %.2f s (1 thread), reference %.2f s\n", n_tokens,
                n_layer, k, engine.records.size(), engine_s, reference_s);
    std::printf("configurations where engine and reference disagree: %d\n", disagreements);
    std::printf("replay: speedup=%.1f mreq_per_s=%.1f\n", reference_s / engine_s, requests / engine_s / 1e6);
    return disagreements == 0 ? 0 : 1;
}
