// eval's closed loop: cache-aware routing written into llama.cpp's forward pass. At
// lambda 0 it is the base model exactly and its misses are replay's on the base pass's
// trace; at lambda > 0 the experts the gate read are the ones the replay rules pick,
// recomputed here independently from what the pass saw.
#include "eval/eval.h"
#include "formats/trace.h"
#include "sim/policy.h"
#include "replay/replay.h"
#include "replay/reference_replay.h"
#include "slice/slice_support.h"
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

using test::moeprune_cmd;
using test::synth;

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

namespace {

// The closed loop's rows as a reference trace: tokens in (window, position) order.
test::RefTrace ref_trace_of(const EvalCandidate & c, int n_layer, int n_expert, int k) {
    std::map<std::pair<uint32_t, int32_t>, std::map<int, const RoutedRow *>> by_token;
    for (const RoutedRow & r : c.routing) {
        by_token[{r.window, r.pos}][r.layer] = &r;
    }
    test::RefTrace t;
    t.n_layer = n_layer;
    t.n_expert = n_expert;
    t.k = k;
    for (const auto & [key, layers] : by_token) {
        std::vector<std::vector<int32_t>> ranked;
        std::vector<std::vector<float>> logits;
        for (const auto & [layer, row] : layers) {
            ranked.push_back(row->ranked);
            logits.push_back(row->logits);
        }
        t.ranked.push_back(ranked);
        t.logits.push_back(logits);
        t.seq.push_back(int32_t(key.first));
        t.decode.push_back(0);
    }
    return t;
}

} // namespace

TEST(ClosedLoop, TheGateReadsTheExpertsTheReplayRulesPickAndMissesFallAsLambdaGrows) {
    test::TempDir dir;
    synth("--arch qwen3moe --layers 3 --experts 16 --used 4 --dead 2 --specialists", dir / "m.gguf");
    test::write_text(dir / "text.txt", test::mixed_text());
    EvalOptions opt = closed_loop_options(dir.path());
    opt.cache_policies = {"lru", "near-pick-ema"};
    opt.caches = {6};
    opt.lambdas = {0.0, 0.5, 2.0};
    opt.record_routing = true;
    const EvalReport rep = run_eval(opt);
    const int n_layer = 3, n_expert = 16, k = 4;

    for (const EvalCandidate & c : rep.candidates) {
        SCOPED_TRACE(c.name);
        const double lambda = c.config["lambda"].get<double>();
        // Independently: one LRU per layer, re-routed by the MoCE prior, over the rows the
        // pass ranked; the experts the gate read must be the ones it picks.
        if (c.config["policy"] == "lru") {
            std::map<int, std::vector<int32_t>> lru;       // layer -> residents, least recent first
            std::map<int, std::pair<double, uint64_t>> gap;  // layer -> running sum and count of z0 - z_{k-1}
            std::map<std::pair<uint32_t, int32_t>, std::map<int, const RoutedRow *>> by_token;
            for (const RoutedRow & r : c.routing) {
                by_token[{r.window, r.pos}][r.layer] = &r;
            }
            uint64_t misses = 0, tokens = 0;
            for (const auto & [key, layers] : by_token) {
                ++tokens;
                for (const auto & [layer, row] : layers) {
                    std::vector<int32_t> & cache = lru[layer];
                    auto & [sum, n] = gap[layer];
                    sum += double(row->logits[0]) - double(row->logits[size_t(k - 1)]);
                    ++n;
                    const double bonus = lambda * sum / double(n);
                    std::vector<std::pair<double, int>> score;  // (biased logit, rank)
                    for (size_t i = 0; i < row->ranked.size(); ++i) {
                        const bool cached = std::find(cache.begin(), cache.end(), row->ranked[i]) != cache.end();
                        score.push_back({double(row->logits[i]) + (i < 2 || cached ? bonus : 0.0), int(i)});
                    }
                    std::stable_sort(score.begin(), score.end(),
                                     [](const auto & a, const auto & b) { return a.first > b.first; });
                    std::set<int32_t> want;
                    for (int i = 0; i < k; ++i) {
                        want.insert(row->ranked[size_t(score[size_t(i)].second)]);
                    }
                    const std::set<int32_t> used(row->used.begin(), row->used.end());
                    ASSERT_EQ(used, want) << "window " << key.first << " pos " << key.second << " layer " << layer;
                    // Loads in ascending id order; a full cache drops its least recent non-chosen expert.
                    std::vector<int32_t> rest;
                    for (int32_t v : cache) {
                        if (!want.count(v)) {
                            rest.push_back(v);
                        }
                    }
                    const size_t chosen_resident = cache.size() - rest.size();
                    size_t loaded = 0;
                    for (int32_t e : want) {
                        if (std::find(cache.begin(), cache.end(), e) == cache.end()) {
                            ++misses;
                            if (rest.size() + chosen_resident + loaded >= 6) {
                                rest.erase(rest.begin());
                            }
                            ++loaded;
                        }
                    }
                    cache = rest;
                    cache.insert(cache.end(), want.begin(), want.end());
                }
            }
            EXPECT_DOUBLE_EQ(c.closed->misses_per_token, double(misses) / double(tokens));
        }
        // The reference replay over the same rows counts what the closed loop counted.
        test::RefConfig cfg;
        cfg.policy = c.config["policy"].get<std::string>();
        cfg.capacity.assign(size_t(n_layer), 6);
        cfg.lambda = lambda;
        cfg.j = 2;
        cfg.moce = "prior";
        const test::RefResult ref = test::reference_replay(ref_trace_of(c, n_layer, n_expert, k), cfg);
        ASSERT_GT(ref.prefill.tokens, 0u);
        EXPECT_DOUBLE_EQ(c.closed->misses_per_token, double(ref.prefill.misses) / double(ref.prefill.tokens));
        EXPECT_DOUBLE_EQ(c.closed->swap_rate, double(ref.prefill.swaps) / double(ref.prefill.picks));
        EXPECT_NEAR(c.closed->moved_gate_mass, ref.prefill.moved_mass / double(ref.prefill.tokens * n_layer), 1e-12);
    }
    // On the planted model: fewer misses and a larger quality cost as lambda grows.
    for (const std::string policy : {"lru", "near-pick-ema"}) {
        SCOPED_TRACE(policy);
        const EvalCandidate & l0 = named(rep, policy + "-c6-l0");
        const EvalCandidate & l05 = named(rep, policy + "-c6-l0.5");
        const EvalCandidate & l2 = named(rep, policy + "-c6-l2");
        EXPECT_GT(l0.closed->misses_per_token, l05.closed->misses_per_token);
        EXPECT_GT(l05.closed->misses_per_token, l2.closed->misses_per_token);
        EXPECT_EQ(l0.all.kld_mean, 0.0);
        EXPECT_GT(l05.all.kld_mean, 0.0);
        EXPECT_GT(l2.all.kld_mean, l05.all.kld_mean);
        EXPECT_GT(l2.closed->swap_rate, l05.closed->swap_rate);
        EXPECT_GT(l2.closed->tok_per_s, l0.closed->tok_per_s);
    }
}

namespace {

Continuation said(const std::string & text, std::vector<int32_t> tokens, bool terminated) {
    Continuation c;
    c.text = text;
    c.tokens = std::move(tokens);
    c.terminated = terminated;
    return c;
}

} // namespace

// Hand-made transcripts with known answers.
TEST(Behaviour, ChecksOnTranscriptsWithKnownAnswers) {
    // Tool calls: same function and parsed JSON, or not.
    const std::string call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    EXPECT_EQ(tool_call_names(call), std::vector<std::string>{"get_weather"});
    EXPECT_EQ(tool_call_names("no calls"), std::vector<std::string>{});
    EXPECT_FALSE(tool_call_names("<tool_call>{\"name\": \"get_weather\", \"arguments\": {</tool_call>").has_value());
    EXPECT_FALSE(tool_call_names("<tool_call>{\"name\": \"get_weather\"}").has_value());  // never closed
    EXPECT_FALSE(tool_call_names("<tool_call>{\"arguments\": {}}</tool_call>").has_value());
    // <think> blocks.
    EXPECT_EQ(think_closed("<think>plan</think>answer", false), true);
    EXPECT_EQ(think_closed("plan</think>answer", true), true);
    EXPECT_EQ(think_closed("<think>plan and never stop", false), false);
    EXPECT_EQ(think_closed("</think>answer", false), false);
    EXPECT_FALSE(think_closed("plain answer", false).has_value());
    // Repetition: 8 tokens, 5 four-grams, the last two repeat the first two.
    EXPECT_DOUBLE_EQ(repeated_4gram_share({1, 2, 3, 4, 5, 1, 2, 3}), 0.0);
    EXPECT_DOUBLE_EQ(repeated_4gram_share({1, 2, 3, 1, 2, 3, 1, 2}), 2.0 / 5.0);
    // Draft steps over a continuation's accept pattern: accepted at 0 (2 tokens, on to 2),
    // accepted at 2 (2 tokens, on to 4), rejected at 4 (1 token): 5 tokens in 3 steps.
    const DraftWalk w = draft_walk({1, 0, 1, 1, 0});
    EXPECT_EQ(w.steps, 3u);
    EXPECT_EQ(w.tokens, 5u);
    EXPECT_EQ(draft_walk({0, 0, 0}).steps, 3u);
    EXPECT_EQ(draft_walk({}).steps, 0u);

    const Continuation base_call = said(call, {10, 11, 12, 99}, true);
    const Continuation same_call = said(call, {10, 11, 12, 99}, true);
    const Continuation other_tool = said("<tool_call>{\"name\": \"get_time\"}</tool_call>", {10, 11, 13, 99}, true);
    const Continuation broken = said("<tool_call>{\"name\": \"get_weather\", </tool_call>", {10, 14, 15}, false);
    const Continuation base_text = said("<think>ok</think>Paris is sunny.", {20, 21, 22, 99}, true);
    const Continuation open_think = said("<think>ok and on and on", {20, 21, 23, 24}, false);
    const Continuation closed_think = said("<think>ok</think>Paris.", {20, 25, 99}, true);
    const Continuation unclosed_but_stopped = said("<think>ok Paris.", {20, 26, 99}, true);
    const BehaviourStats s = behaviour_stats({{&base_call, &same_call, false},
                                              {&base_call, &other_tool, false},
                                              {&base_call, &broken, false},
                                              {&base_text, &open_think, false},
                                              {&base_text, &closed_think, false},
                                              {&base_text, &unclosed_but_stopped, false}});
    EXPECT_EQ(s.prompts, 6u);
    EXPECT_DOUBLE_EQ(s.exact_match, 1.0 / 6.0);
    // Divergence: 4 (equal), 2, 1, 2, 1, 1.
    EXPECT_DOUBLE_EQ(s.divergence_mean, 11.0 / 6.0);
    EXPECT_DOUBLE_EQ(s.divergence_median, 1.5);
    // Every base terminated; the broken call and the endless think did not.
    ASSERT_TRUE(s.clean_termination.has_value());
    EXPECT_DOUBLE_EQ(*s.clean_termination, 4.0 / 6.0);
    // Three prompts where the base called a tool: only the identical call is right.
    ASSERT_TRUE(s.tool_call_ok.has_value());
    EXPECT_DOUBLE_EQ(*s.tool_call_ok, 1.0 / 3.0);
    // Terminated candidates with think tags: closed_think yes, unclosed_but_stopped no.
    ASSERT_TRUE(s.think_balanced.has_value());
    EXPECT_DOUBLE_EQ(*s.think_balanced, 0.5);
    // Ending at once, with the end token alone, is no clean stop where the base answered;
    // where the base said nothing either, it is.
    const Continuation silent = said("", {99}, true);
    EXPECT_DOUBLE_EQ(*behaviour_stats({{&base_text, &silent, false}, {&base_text, &closed_think, false}}).clean_termination, 0.5);
    EXPECT_DOUBLE_EQ(*behaviour_stats({{&silent, &silent, false}}).clean_termination, 1.0);
    // No base called a tool and none terminated: those measures do not apply.
    const BehaviourStats none = behaviour_stats({{&open_think, &open_think, false}});
    EXPECT_FALSE(none.clean_termination.has_value());
    EXPECT_FALSE(none.tool_call_ok.has_value());
    EXPECT_DOUBLE_EQ(none.exact_match, 1.0);
    // Draft steps pool over prompts: 5 tokens in 3 steps and 2 in 2 are 7 in 5; without a
    // head there is no figure.
    EXPECT_FALSE(s.mtp_tokens_per_step.has_value());
    Continuation drafted = said("a", {1, 2, 3, 4, 5, 6}, false), undrafted = said("b", {7, 8, 9}, false);
    drafted.mtp_accept = {1, 0, 1, 1, 0};
    undrafted.mtp_accept = {0, 0};
    const BehaviourStats d = behaviour_stats({{&base_text, &drafted, false}, {&base_text, &undrafted, false}});
    ASSERT_TRUE(d.mtp_tokens_per_step.has_value());
    EXPECT_DOUBLE_EQ(*d.mtp_tokens_per_step, 7.0 / 5.0);
}

TEST(Behaviour, DeadExpertsChangeNoGeneratedTokenLiveOnesPartEarlier) {
    test::TempDir dir;
    const auto s = test::run_command(moeprune_cmd(fmt::format(
        "synth --arch qwen3moe --layers 3 --experts 12 --used 2 --dead 2 --specialists --json -o {}",
        (dir / "m.gguf").string())));
    ASSERT_EQ(s.exit_code, 0) << s.output;
    const json planted = json::parse(s.output.substr(s.output.find('{')));
    KeepMap dead, live;
    dead.n_expert = live.n_expert = 12;
    dead.k = 10;
    live.k = 5;
    for (int l = 0; l < 3; ++l) {
        const auto d = planted["dead"][std::to_string(l)].get<std::vector<int>>();
        for (int32_t e = 0; e < 12; ++e) {
            if (std::find(d.begin(), d.end(), e) == d.end()) {
                dead.layers[l].push_back(e);
                if (live.layers[l].size() < 5) {
                    live.layers[l].push_back(e);
                }
            }
        }
    }
    test::write_keep(dir / "dead.json", dead);
    test::write_keep(dir / "live.json", live);
    std::string chat;
    for (const std::string q : {"What does an expert cache keep?", "Write a function that adds two numbers.",
                                "用中文解释专家混合模型。", "List three colors.", "def route(tokens, k):",
                                "什么是缓存？"}) {
        chat += json{{"messages", {{{"role", "user"}, {"content", q}}}}, {"domain", "d"}}.dump() + "\n";
    }
    test::write_text(dir / "chat.jsonl", chat);
    EvalOptions opt = closed_loop_options(dir.path());
    opt.corpus = dir / "chat.jsonl";
    opt.keeps = {dir / "dead.json", dir / "live.json"};
    opt.cache_policies = {"lru"};
    opt.caches = {4};
    opt.lambdas = {0.0};
    opt.generate = 16;
    const EvalReport rep = run_eval(opt);
    const EvalCandidate & d = named(rep, "dead");
    const EvalCandidate & l = named(rep, "live");
    const EvalCandidate & base_routed = named(rep, "lru-c4-l0");
    ASSERT_TRUE(d.behaviour && l.behaviour && base_routed.behaviour);
    EXPECT_EQ(d.behaviour->prompts, 6u);
    EXPECT_DOUBLE_EQ(d.behaviour->exact_match, 1.0);
    EXPECT_DOUBLE_EQ(d.behaviour->divergence_mean, 16.0);
    EXPECT_TRUE(d.behaviour_worst.empty());
    EXPECT_DOUBLE_EQ(base_routed.behaviour->exact_match, 1.0);  // lambda 0 routes as the base does
    EXPECT_LT(l.behaviour->divergence_mean, d.behaviour->divergence_mean);
    EXPECT_LT(l.behaviour->exact_match, 1.0);
    EXPECT_FALSE(l.behaviour_worst.empty());
    // The documented keys (docs/formats.md, moeprune-eval).
    const json j = to_json(rep);
    for (const json & c : j["candidates"]) {
        for (const char * key : {"gen_exact_match", "gen_divergence_mean", "gen_divergence_median", "gen_clean_termination",
                                 "gen_tool_call_ok", "gen_think_balanced", "gen_repeat_4gram"}) {
            EXPECT_TRUE(c["all"].contains(key)) << key;
            EXPECT_TRUE(c["domains"]["d"].contains(key)) << key;
        }
        if (c["kind"] == "closed-loop") {
            for (const char * key : {"policy", "cache", "lambda", "j", "moce"}) {
                EXPECT_TRUE(c.contains(key)) << key;
            }
            for (const char * key : {"misses_per_token", "hit_rate", "swap_rate", "moved_gate_mass", "tok_per_s",
                                     "open_loop_misses_per_token"}) {
                EXPECT_TRUE(c["all"].contains(key)) << key;
            }
        }
    }
    EXPECT_EQ(j["generation"]["prompts"], 6);
    // The closed loop's cache counts only the scored windows, not the generation after them.
    EXPECT_DOUBLE_EQ(base_routed.closed->misses_per_token, base_routed.closed->open_loop_misses_per_token);
    // On a keep map at lambda 0 the closed loop is the masked keep map. Without the dead
    // experts nothing changes, so its misses are replay --keep's on the base pass's trace;
    // without live ones the pruned model routes differently from that trace (open loop).
    const EvalCandidate & live_routed = named(rep, "live+lru-c4-l0");
    ASSERT_EQ(live_routed.tokens.size(), l.tokens.size());
    for (size_t i = 0; i < l.tokens.size(); ++i) {
        ASSERT_EQ(live_routed.tokens[i].kld, l.tokens[i].kld) << i;
    }
    EXPECT_GT(live_routed.all.kld_mean, 0.0);
    EXPECT_EQ(live_routed.behaviour->exact_match, l.behaviour->exact_match);
    const EvalCandidate & dead_routed = named(rep, "dead+lru-c4-l0");
    EXPECT_EQ(dead_routed.all.kld_max, 0.0);
    EXPECT_DOUBLE_EQ(dead_routed.closed->misses_per_token, dead_routed.closed->open_loop_misses_per_token);
}

TEST(ClosedLoop, ArchitecturesWhoseGateDoesNotFollowTheWrittenIdsAreRefusedByName) {
    MaskFacts facts;
    facts.arch = "grovemoe";
    facts.n_expert = 16;
    facts.n_expert_used = 4;
    facts.moe_layers = {0, 1};
    const ClosedLoopConfig config{"lru", 8, 0.5, 2, true, {}, 32};
    try {
        RouterTap tap(facts, 16, &config, nullptr, nullptr, {});
        FAIL() << "grovemoe accepted";
    } catch (const std::exception & e) {
        EXPECT_NE(std::string(e.what()).find("grovemoe"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("ffn_moe_topk"), std::string::npos) << e.what();
    }
    facts.arch = "qwen3moe";
    const ClosedLoopConfig belady{"belady", 8, 0.0, 2, true, {}, 32};
    EXPECT_THROW(RouterTap(facts, 16, &belady, nullptr, nullptr, {}), std::exception);
    const ClosedLoopConfig tiny{"lru", 3, 0.0, 2, true, {}, 32};
    EXPECT_THROW(RouterTap(facts, 16, &tiny, nullptr, nullptr, {}), std::exception);
}

TEST(ClosedLoop, CommandLineTableJsonAndRefusals) {
    test::TempDir dir;
    synth("--arch qwen2moe --layers 2 --experts 8 --used 2", dir / "m.gguf");
    test::write_text(dir / "text.txt", test::mixed_text());
    const std::string common =
        fmt::format("eval -m {} -f {} -c 64 -t 2", (dir / "m.gguf").string(), (dir / "text.txt").string());
    const auto r = test::run_command(moeprune_cmd(common + fmt::format(" --cache-policy lru --cache 4 --lambda 0,1 --j 0 --json {}",
                                                                       (dir / "r.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("closed loop"), std::string::npos) << r.output;
    const json rep = json::parse(test::read_bytes(dir / "r.json"));
    ASSERT_EQ(rep["candidates"].size(), 2u);
    EXPECT_EQ(rep["candidates"][1]["name"], "lru-c4-l1");
    EXPECT_EQ(rep["candidates"][1]["kind"], "closed-loop");
    EXPECT_EQ(rep["candidates"][1]["j"], 0);
    EXPECT_GT(rep["candidates"][1]["all"]["swap_rate"].get<double>(), 0.0);
    EXPECT_EQ(rep["inputs"]["closed_loop"]["policies"], json::array({"lru"}));

    const auto no_policy = test::run_command(moeprune_cmd(common + " --cache 4"));
    EXPECT_NE(no_policy.exit_code, 0);
    EXPECT_NE(no_policy.output.find("--cache-policy"), std::string::npos) << no_policy.output;
    const auto small = test::run_command(moeprune_cmd(common + " --cache-policy lru --cache 1"));
    EXPECT_NE(small.exit_code, 0);
    EXPECT_NE(small.output.find("cache of 1"), std::string::npos) << small.output;
    const auto inert = test::run_command(moeprune_cmd(common + " --cache-policy lru --cache 4 --lambda 0,1 --j 2"));
    EXPECT_NE(inert.exit_code, 0);
    EXPECT_NE(inert.output.find("give --j below 2"), std::string::npos) << inert.output;
    const auto future = test::run_command(moeprune_cmd(common + " --cache-policy belady --cache 4"));
    EXPECT_NE(future.exit_code, 0);
    EXPECT_NE(future.output.find("belady"), std::string::npos) << future.output;
    const auto no_chat = test::run_command(moeprune_cmd(common + " --cache-policy lru --cache 4 --generate 8"));
    EXPECT_NE(no_chat.exit_code, 0);
    EXPECT_NE(no_chat.output.find("messages"), std::string::npos) << no_chat.output;
}
