// eval's closed loop: cache-aware routing written into llama.cpp's forward pass. At
// lambda 0 it is the base model exactly and its misses are replay's on the base pass's
// trace; at lambda > 0 the experts the gate read are the ones the replay rules pick,
// recomputed here independently from what the pass saw.
#include "eval/eval.h"
#include "formats/trace.h"
#include "replay/policy.h"
#include "replay/replay.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string moeprune_cmd(const std::string & args) { return test::bin("moeprune").string() + " " + args; }

void synth(const std::string & args, const fs::path & out) {
    const auto r = test::run_command(moeprune_cmd(fmt::format("synth {} -o {}", args, out.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
}

const EvalCandidate & named(const EvalReport & r, const std::string & name) {
    for (const EvalCandidate & c : r.candidates) {
        if (c.name == name) {
            return c;
        }
    }
    throw std::runtime_error("no candidate " + name);
}

EvalOptions closed_loop_options(const fs::path & dir) {
    EvalOptions opt;
    opt.model = dir / "m.gguf";
    opt.corpus = dir / "text.txt";
    opt.ctx = 96;
    opt.ubatch = 32;  // several micro-batches per window: the cache carries across them
    opt.threads = 2;
    opt.progress = false;
    opt.top_tokens = 0;
    return opt;
}

} // namespace

TEST(ClosedLoop, AtLambdaZeroItIsTheBaseAndItsMissesAreReplaysOnTheBaseTrace) {
    test::TempDir dir;
    synth("--arch qwen3moe --layers 3 --experts 16 --used 4 --dead 2", dir / "m.gguf");
    test::write_text(dir / "text.txt", test::mixed_text());
    EvalOptions opt = closed_loop_options(dir.path());
    for (const std::string & p : policy_names()) {
        if (!policy_reads_future(p)) {
            opt.cache_policies.push_back(p);
        }
    }
    opt.caches = {6};
    opt.lambdas = {0.0};
    opt.trace_out = dir / "base.mptrace";
    opt.record_routing = true;
    const EvalReport rep = run_eval(opt);
    ASSERT_EQ(rep.candidates.size(), opt.cache_policies.size());

    const TraceReader trace = TraceReader::open(dir / "base.mptrace");
    ASSERT_GT(trace.n_tokens(), 0u);
    for (const EvalCandidate & c : rep.candidates) {
        SCOPED_TRACE(c.name);
        EXPECT_EQ(c.kind, "closed-loop");
        EXPECT_EQ(c.all.kld_max, 0.0);
        EXPECT_EQ(c.all.same_top1, 1.0);
        ASSERT_TRUE(c.closed.has_value());
        EXPECT_EQ(c.closed->swap_rate, 0.0);
        ReplayOptions ro;
        ro.trace = dir / "base.mptrace";
        ro.policies = {c.config["policy"].get<std::string>()};
        ro.caches = {c.config["cache"].get<int>()};
        const ReplayReport open = run_replay(ro);
        ASSERT_EQ(open.records.size(), 1u);
        const PhaseCounts o = open.records[0].total();
        EXPECT_EQ(o.tokens, trace.n_tokens());
        EXPECT_DOUBLE_EQ(c.closed->misses_per_token, double(o.misses) / double(o.tokens));
        EXPECT_DOUBLE_EQ(c.closed->open_loop_misses_per_token, c.closed->misses_per_token);
        // Every request the closed loop made is the trace's, token for token.
        ASSERT_EQ(c.routing.size(), trace.n_tokens() * trace.header().n_layer);
    }
    // The rows the closed loop ranked are the trace's rows (same order of tokens and layers).
    const EvalCandidate & lru = named(rep, "lru-c6-l0");
    std::vector<TraceTokenMeta> meta = trace.token_meta();
    for (uint32_t l = 0; l < trace.header().n_layer; ++l) {
        std::vector<uint16_t> ids;
        std::vector<float> logits;
        trace.read_layer(l, ids, logits);
        const uint32_t m = trace.header().top_m;
        std::vector<const RoutedRow *> rows;
        for (const RoutedRow & r : lru.routing) {
            if (r.layer == int(l)) {
                rows.push_back(&r);
            }
        }
        ASSERT_EQ(rows.size(), trace.n_tokens());
        for (uint64_t t = 0; t < trace.n_tokens(); ++t) {
            const RoutedRow & r = *rows[t];
            ASSERT_EQ(r.pos, meta[t].pos);
            ASSERT_EQ(int32_t(r.window), meta[t].seq);
            ASSERT_EQ(r.ranked.size(), m);
            for (uint32_t i = 0; i < m; ++i) {
                ASSERT_EQ(r.ranked[i], ids[t * m + i]) << "layer " << l << " token " << t << " rank " << i;
                ASSERT_EQ(r.logits[i], logits[t * m + i]);
            }
        }
    }
}
