// moeprune plan: the seed's arithmetic, the throughput formula, feasibility against a RAM
// budget, KLD measured or interpolated (and marked), the Pareto front and the
// recommendation; refusals name what is wrong.
#include "core/sizes.h"
#include "core/errors.h"
#include "formats/verify_summary.h"
#include "plan/plan.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The model every measurement below was made on (planned by hand, they must agree).
constexpr const char * kModelDigest = "xxh3:00000000000000aa";

PlanOptions seed_geometry() {
    PlanOptions o;
    o.expert_mb = 1.3824;
    o.layers = 48;
    o.experts = 512;
    o.used = 10;
    return o;
}

// A replay result as `moeprune replay --json` writes it, for a keep map named by select.
json replay_result(const std::string & keep, int64_t k, const std::vector<std::tuple<std::string, int, double>> & records) {
    json recs = json::array();
    for (const auto & [policy, cache, misses] : records) {
        recs.push_back({{"policy", policy}, {"cache", cache}, {"slots", {cache}}, {"lambda", 0.0}, {"misses_per_token", misses}});
    }
    return {{"format", "moeprune-replay"},
            {"version", 2},
            {"inputs", {{"n_layer", 48}, {"n_expert", 512}, {"keep", keep}, {"n_expert_after_keep", k}, {"cache_scope", "per-layer"},
                        {"trace_meta", {{"model", {{"digest", kModelDigest}}}}}}},
            {"records", recs}};
}

json eval_report(const std::vector<std::tuple<std::string, double>> & maps) {
    json c = json::array();
    for (const auto & [name, kld] : maps) {
        c.push_back({{"name", name}, {"kind", "keep"}, {"source", "maps/" + name + ".json"}, {"all", {{"kld_mean", kld}}}});
    }
    return {{"format", "moeprune-eval"}, {"version", 1}, {"base", {{"digest", kModelDigest}, {"n_expert", 512}}}, {"candidates", c}};
}

} // namespace

TEST(Plan, ReproducesTheSeedSizesAndThroughputFormula) {
    PlanOptions o = seed_geometry();
    o.ks = {224, 256, 320};
    o.throughput.ssd_gbps = 6.8;
    o.throughput.compute_ms = 12;
    o.throughput.read_latency_us = 0;
    o.misses_per_token = {30};
    const json p = make_plan(o);
    bool seen224 = false;
    for (const json & opt : p["options"]) {
        if (opt["k"] == 224) {
            // 224 experts x 48 layers x 1.3824 MB = 14.86 GB (the seed audit: 14.9 GB, not 16.5).
            EXPECT_NEAR(opt["routed_bytes"].get<double>() / 1e9, 14.864, 0.001);
            seen224 = true;
        }
        if (opt["policy"] == "given") {
            // The seed's formula: tok/s = 1 / (misses x 1.3824 MB / BW + 12 ms).
            EXPECT_NEAR(opt["tok_per_s"].get<double>(), 1.0 / (30 * 1.3824e6 / 6.8e9 + 0.012), 1e-9);
            EXPECT_TRUE(opt["kld_mean"].is_null()) << "no eval: KLD unknown, never invented";
            EXPECT_TRUE(opt["resident_bytes"].is_null()) << "no cache size given";
        }
    }
    EXPECT_TRUE(seen224);
    EXPECT_TRUE(p["pareto"].empty());
    EXPECT_TRUE(p["inputs"]["geometry"]["other_bytes"].is_null());
}

TEST(Plan, ParetoFrontAndRecommendationFromMeasurements) {
    test::TempDir dir;
    test::write_text(dir / "r224.json", replay_result("maps/reap-k224.json", 224, {{"lru", 64, 60}, {"lru", 128, 30}, {"belady", 64, 20}}).dump());
    test::write_text(dir / "r320.json", replay_result("maps/reap-k320.json", 320, {{"lru", 64, 70}, {"lru", 128, 40}}).dump());
    test::write_text(dir / "r256.json", replay_result("maps/reap-k256.json", 256, {{"lru", 128, 35}}).dump());
    test::write_text(dir / "eval.json", eval_report({{"reap-k224", 0.30}, {"reap-k320", 0.10}}).dump());
    PlanOptions o = seed_geometry();
    o.other_gb = 3.0;
    o.ram_bytes = 20e9;
    o.reserve_bytes = 2e9;
    o.throughput.ssd_gbps = 6.8;
    o.throughput.compute_ms = 12;
    o.replays = {dir / "r224.json", dir / "r320.json", dir / "r256.json"};
    o.evals = {dir / "eval.json"};
    const json p = make_plan(o);
    const json & opts = p["options"];
    for (const json & x : opts) {
        EXPECT_LE(x["resident_bytes"].get<double>(), 18e9) << "only feasible options are listed";
        const int64_t k = x["k"].get<int64_t>();
        if (k == 256) {
            EXPECT_NEAR(x["kld_mean"].get<double>(), 0.30 + (0.10 - 0.30) * 32.0 / 96.0, 1e-12);
            EXPECT_FALSE(x["kld_measured"].get<bool>()) << "interpolated KLD is marked";
        } else {
            EXPECT_TRUE(x["kld_measured"].get<bool>());
        }
        if (x["policy"] == "lru" && x["cache_experts"] == 128) {
            // Resident bytes: other weights + 128 experts in each of 48 layers.
            EXPECT_NEAR(x["resident_bytes"].get<double>(), 3e9 + 128 * 48 * 1.3824e6, 1);
        }
    }
    // All-resident K 224 and 320 need 3 + 14.9 / 21.2 GB: 224 fits, 320 does not.
    EXPECT_GT(p["infeasible"].get<int>(), 0);
    // The front: faster options have higher KLD, every option off it is dominated.
    double last_speed = 1e300, last_kld = 1e300;
    for (const json & i : p["pareto"]) {
        const json & x = opts[i.get<size_t>()];
        EXPECT_LE(x["tok_per_s"].get<double>(), last_speed);
        EXPECT_LT(x["kld_mean"].get<double>(), last_kld);
        last_speed = x["tok_per_s"].get<double>();
        last_kld = x["kld_mean"].get<double>();
    }
    for (size_t i = 0; i < opts.size(); ++i) {
        bool dominated = false;
        for (size_t j = 0; j < opts.size(); ++j) {
            const double sj = opts[j]["tok_per_s"].get<double>(), si = opts[i]["tok_per_s"].get<double>();
            const double kj = opts[j]["kld_mean"].get<double>(), ki = opts[i]["kld_mean"].get<double>();
            dominated = dominated || (sj >= si && kj <= ki && (sj > si || kj < ki));
        }
        const bool on_front = std::find(p["pareto"].begin(), p["pareto"].end(), json(i)) != p["pareto"].end();
        EXPECT_EQ(on_front, !dominated) << opts[i].dump();
    }
    // Recommendation: with --max-kld 0.2 the fastest option within it, the simulated
    // caches included.
    o.max_kld = 0.2;
    o.runs_on = RunsOn::Any;
    const json q = make_plan(o);
    const json & r = q["options"][q["recommended"].get<size_t>()];
    EXPECT_LE(r["kld_mean"].get<double>(), 0.2);
    for (const json & x : q["options"]) {
        if (x["kld_mean"].get<double>() <= 0.2) {
            EXPECT_LE(x["tok_per_s"].get<double>(), r["tok_per_s"].get<double>());
        }
    }
    EXPECT_NE(q["why"].get<std::string>().find("max-kld"), std::string::npos);
}

// --min-accuracy R: only options whose keep map keeps R of the base's task accuracy are
// eligible, as --max-kld keeps those within a KLD; without task accuracy it is refused.
TEST(Plan, MinAccuracyLeavesOutMapsThatLoseTheBasesAnswers) {
    test::TempDir dir;
    test::write_text(dir / "r224.json", replay_result("maps/reap-k224.json", 224, {{"lru", 64, 60}, {"lru", 128, 30}}).dump());
    test::write_text(dir / "r320.json", replay_result("maps/reap-k320.json", 320, {{"lru", 64, 70}, {"lru", 128, 40}}).dump());
    json eval = eval_report({{"reap-k224", 0.30}, {"reap-k320", 0.10}});
    test::write_text(dir / "plain.json", eval.dump());
    const auto figures = [](int correct) {
        return json{{"tasks", 100}, {"correct", correct}, {"accuracy", correct / 100.0}, {"stderr", 0.04},
                    {"kept_base_correct", correct}, {"new_correct", 0}};
    };
    eval["tasks"] = {{"format", "hellaswag"}, {"file", "tasks.txt"}, {"base", figures(80)}};
    eval["candidates"][0]["tasks"] = figures(60);   // K 224: 75% of the base's
    eval["candidates"][1]["tasks"] = figures(78);   // K 320: 97.5%
    test::write_text(dir / "eval.json", eval.dump());
    PlanOptions o = seed_geometry();
    o.other_gb = 3.0;
    o.ram_bytes = 20e9;
    o.reserve_bytes = 2e9;
    o.throughput.ssd_gbps = 6.8;
    o.throughput.compute_ms = 12;
    o.runs_on = RunsOn::Any;
    o.replays = {dir / "r224.json", dir / "r320.json"};
    o.evals = {dir / "eval.json"};
    o.max_kld = 0.5;
    const json all = make_plan(o);
    ASSERT_FALSE(all["recommended"].is_null());
    EXPECT_EQ(all["options"][all["recommended"].get<size_t>()]["k"], 224) << "the fastest within the KLD";
    std::map<int64_t, double> accuracy;
    for (const json & x : all["options"]) {
        accuracy[x["k"].get<int64_t>()] = x["task_accuracy"].get<double>();
    }
    EXPECT_EQ(accuracy[224], 0.60);
    EXPECT_EQ(accuracy[320], 0.78);

    o.min_accuracy = 0.95;
    const json kept = make_plan(o);
    ASSERT_FALSE(kept["recommended"].is_null()) << kept["why"];
    EXPECT_EQ(kept["options"][kept["recommended"].get<size_t>()]["k"], 320);
    EXPECT_EQ(kept["inputs"]["min_accuracy"], 0.95);
    EXPECT_NE(kept["why"].get<std::string>().find("task accuracy at least 0.95"), std::string::npos) << kept["why"];
    for (const json & i : kept["pareto_runs_on"]) {
        EXPECT_NE(kept["options"][i.get<size_t>()]["k"], 224);
    }

    o.evals = {dir / "plain.json"};
    try {
        make_plan(o);
        ADD_FAILURE() << "--min-accuracy without task accuracy was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("--min-accuracy"), std::string::npos) << e.what();
    }
}

TEST(Plan, RecommendsWhatStockLlamaCppRunsUnlessAskedForAnyAndSaysHowToRunIt) {
    test::TempDir dir;
    test::write_text(dir / "r224.json", replay_result("maps/reap-k224.json", 224, {{"lru", 64, 60}, {"lru", 128, 30}}).dump());
    test::write_text(dir / "eval.json", eval_report({{"reap-k224", 0.30}, {"reap-k320", 0.10}}).dump());
    PlanOptions o = seed_geometry();
    o.other_gb = 3.0;
    o.reserve_bytes = 2e9;
    o.throughput.ssd_gbps = 6.8;
    o.throughput.compute_ms = 12;
    o.replays = {dir / "r224.json"};
    o.evals = {dir / "eval.json"};
    o.sliced_dir = dir / "sliced";
    o.llama_bin = "/opt/llama/bin";
    o.threads = 8;
    o.ctx = 4096;
    const auto runs_on = [](const json & p, size_t i) { return p["options"][i]["runs_on"].get<std::string>(); };

    // 13 GB: K 224 resident (17.9 GB) does not fit, its LRU caches do; nothing that stock
    // llama.cpp runs fits.
    o.ram_bytes = 15e9;
    const json cached_only = make_plan(o);
    EXPECT_TRUE(cached_only["recommended"].is_null());
    EXPECT_TRUE(cached_only["commands"].is_null());
    EXPECT_NE(cached_only["why"].get<std::string>().find("--runs-on any"), std::string::npos) << cached_only["why"];
    EXPECT_TRUE(cached_only["pareto_runs_on"].empty());
    EXPECT_FALSE(cached_only["pareto"].empty()) << "the front of every option is still there";
    // A sliced K 224 streamed from disk under the limit runs in llama.cpp: priced by the
    // page-cache predictor, it is what is recommended, once its prediction is within what
    // the predictor models.
    StreamedSlice streamed{"reap", 224, "maps/reap-k224.json", "15GB", 15e9, {}};
    streamed.prediction.tokens_per_second = 21.5;
    streamed.prediction.read_bytes_per_token = 3e8;
    streamed.prediction.outside_model = "a window over half the cache";
    o.streamed = {streamed};
    const json unanswered = make_plan(o);
    EXPECT_TRUE(unanswered["recommended"].is_null()) << unanswered["why"];
    EXPECT_NE(unanswered["why"].get<std::string>().find("1 predicted option outside what measure's predictor models "
                                                        "left out"),
              std::string::npos)
        << unanswered["why"];
    const auto page_cache = std::find_if(unanswered["options"].begin(), unanswered["options"].end(),
                                         [](const json & x) { return x["policy"] == "page-cache"; });
    ASSERT_NE(page_cache, unanswered["options"].end());
    EXPECT_EQ((*page_cache)["outside_model"], "a window over half the cache");
    EXPECT_NE((*page_cache)["note"].get<std::string>().find("not an answer: a window over half the cache"),
              std::string::npos);
    streamed.prediction.outside_model.clear();
    o.streamed = {streamed};
    const json with_streamed = make_plan(o);
    ASSERT_FALSE(with_streamed["recommended"].is_null()) << with_streamed["why"];
    const json & s = with_streamed["options"][with_streamed["recommended"].get<size_t>()];
    EXPECT_EQ(s["policy"], "page-cache");
    EXPECT_EQ(s["runs_on"], "llama.cpp");
    EXPECT_EQ(s["k"], 224);
    EXPECT_EQ(s["tok_per_s"], 21.5);
    EXPECT_EQ(s["keep_map"], "maps/reap-k224.json");
    EXPECT_FALSE(s.contains("outside_model"));
    EXPECT_NE(with_streamed["why"].get<std::string>().find("sliced and mapped from disk"), std::string::npos);
    // The commands name it absolute, so that they run from any folder.
    EXPECT_EQ(with_streamed["commands"]["slice"][5], fs::absolute("maps/reap-k224.json").lexically_normal().string());
    EXPECT_FALSE(s.contains("read_ahead_kb")) << "priced at the device's own read-ahead";
    // The same slice priced at each read-ahead measure calibrated: the faster setting is
    // recommended with it, and the two are apart as options.
    StreamedSlice at_128 = streamed;
    at_128.read_ahead_kb = 128;
    at_128.prediction.tokens_per_second = 30;
    o.streamed = {streamed, at_128};
    const json by_read_ahead = make_plan(o);
    ASSERT_FALSE(by_read_ahead["recommended"].is_null()) << by_read_ahead["why"];
    const json & fast = by_read_ahead["options"][by_read_ahead["recommended"].get<size_t>()];
    EXPECT_EQ(fast["read_ahead_kb"], 128);
    EXPECT_EQ(fast["tok_per_s"], 30);
    EXPECT_NE(fast["source"].get<std::string>().find("read-ahead of 128 KB"), std::string::npos) << fast["source"];
    EXPECT_NE(by_read_ahead["why"].get<std::string>().find("read-ahead of 128 KB"), std::string::npos) << by_read_ahead["why"];
    size_t k224_streamed = 0;
    for (const json & x : by_read_ahead["options"]) {
        k224_streamed += x["k"] == 224 && x["policy"] == "page-cache";
    }
    EXPECT_EQ(k224_streamed, 2u);
    o.streamed.clear();
    o.runs_on = RunsOn::Any;
    const json any = make_plan(o);
    ASSERT_FALSE(any["recommended"].is_null());
    const size_t cached = any["recommended"].get<size_t>();
    EXPECT_EQ(runs_on(any, cached), "expert-cache runtime");
    EXPECT_EQ(any["options"][cached]["policy"], "lru");
    EXPECT_NE(any["options"][cached]["runs_on_note"].get<std::string>().find("simulated"), std::string::npos);
    EXPECT_NE(any["why"].get<std::string>().find("simulated"), std::string::npos);

    // 18 GB: K 224 resident fits, and is what llama.cpp runs.
    o.ram_bytes = 20e9;
    o.runs_on = RunsOn::LlamaCpp;
    const json p = make_plan(o);
    ASSERT_FALSE(p["recommended"].is_null()) << p["why"];
    const size_t r = p["recommended"].get<size_t>();
    EXPECT_EQ(runs_on(p, r), "llama.cpp");
    EXPECT_EQ(p["options"][r]["policy"], "resident");
    EXPECT_EQ(p["options"][r]["k"], 224);
    for (const json & i : p["pareto_runs_on"]) {
        EXPECT_EQ(runs_on(p, i.get<size_t>()), "llama.cpp");
    }
    EXPECT_EQ(p["inputs"]["runs_on"], "llama.cpp");
    // The commands: slice the keep map eval measured, then run the sliced model under the RAM given.
    const json & c = p["commands"];
    const std::string sliced = (dir / "sliced" / "reap-k224.gguf").string();
    EXPECT_EQ(c["model"], sliced);
    EXPECT_EQ(c["slice"], json({"moeprune", "slice", "-m", "MODEL.gguf", "--keep",
                                fs::absolute("maps/reap-k224.json").lexically_normal().string(), "-o", sliced}));
    EXPECT_EQ(c["llama_completion"], json({"/opt/llama/bin/llama-completion", "-m", sliced, "-t", "8", "-c", "4096"}));
    EXPECT_EQ(c["llama_server"][0], "llama-server") << "no llama-server in --llama-bin: the PATH's";
    EXPECT_EQ(c["memory_limit"], json({"moeprune", "limit", "--ram", "20000000000", "--"}));
    ASSERT_EQ(c["lines"].size(), 3u);
    EXPECT_EQ(c["lines"][1].get<std::string>().rfind("moeprune limit --ram 20000000000 -- /opt/llama/bin/llama-completion -m ", 0), 0u)
        << c["lines"][1];
}

// The shortlist: what llama.cpp measured replaces what was predicted, and ranks.
TEST(Plan, AShortlistsMeasuredSpeedsReplaceThePredictedOnesInTheRanking) {
    test::TempDir dir;
    test::write_text(dir / "eval.json", eval_report({{"reap-k224", 0.30}, {"reap-k320", 0.10}}).dump());
    PlanOptions o = seed_geometry();
    o.other_gb = 3.0;
    o.ram_bytes = 40e9;
    o.reserve_bytes = 2e9;
    o.throughput.compute_ms = 12;
    o.evals = {dir / "eval.json"};
    const json predicted = make_plan(o);
    // Both resident: the same predicted speed, so the lower KLD (K 320) is recommended.
    ASSERT_FALSE(predicted["recommended"].is_null());
    EXPECT_EQ(predicted["options"][predicted["recommended"].get<size_t>()]["k"], 320);
    const auto summary = [&](int64_t k, double measured) {
        for (const json & opt : predicted["options"]) {
            if (opt["k"] == k && opt["policy"] == "resident") {
                VerifySummary v;
                v.plan = "predicted.json";
                v.option = opt;
                v.model = fmt::format("reap-k{}.gguf", k);
                v.ram = "40GB";
                v.predicted_tok_per_s = opt["tok_per_s"].get<double>();
                v.measured_tok_per_s = measured;
                v.measure = fmt::format("reap-k{}.measure.json", k);
                const fs::path path = dir / fmt::format("k{}.json", k);
                test::write_text(path, to_json(v).dump());
                return path;
            }
        }
        throw std::runtime_error("no resident option");
    };
    // Measured, K 320 runs at 50 tokens/s and K 224 at 80: K 320 is no longer within 90%
    // of the fastest, and K 224 is recommended, at its measured speed.
    o.shortlist = {summary(224, 80), summary(320, 50)};
    const json p = make_plan(o);
    ASSERT_FALSE(p["recommended"].is_null()) << p["why"];
    const json & r = p["options"][p["recommended"].get<size_t>()];
    EXPECT_EQ(r["k"], 224);
    EXPECT_EQ(r["tok_per_s"], 80.0);
    EXPECT_NEAR(r["shortlist"]["predicted_tok_per_s"].get<double>(), 1 / 0.012, 1e-9);
    EXPECT_NEAR(r["shortlist"]["error"].get<double>(), (1 / 0.012 - 80) / 80, 1e-9);
    const std::string why = p["why"].get<std::string>();
    EXPECT_NE(why.find("80.00 tokens/s measured by llama.cpp under 40GB"), std::string::npos) << why;
    EXPECT_NE(why.find("predicted 83.33 tokens/s before it was measured (error 4%)"), std::string::npos) << why;
    EXPECT_EQ(p["inputs"]["shortlist"].size(), 2u);

    // A summary of an option this plan does not have is refused by file.
    o.shortlist = {summary(224, 80)};
    o.ram_bytes = 15e9;   // K 224 resident no longer fits
    try {
        make_plan(o);
        FAIL() << "a measurement of an option the plan does not have";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("k224.json: measured K 224 by reap"), std::string::npos) << e.what();
    }
    // The same option of another keep map is refused too, not taken for this one.
    o.ram_bytes = 40e9;
    json other = json::parse(test::read_bytes(summary(224, 80)));
    other["option"]["keep_map"] = "maps/other-k224.json";
    test::write_text(dir / "other.json", other.dump());
    o.shortlist = {dir / "other.json"};
    try {
        make_plan(o);
        FAIL() << "a measurement of another keep map";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("another model or keep map"), std::string::npos) << e.what();
    }
}

TEST(Plan, RefusesWhatCannotBePlanned) {
    PlanOptions o = seed_geometry();
    o.ks = {224};
    o.other_gb = 5.0;
    o.ram_bytes = 6e9;
    o.reserve_bytes = 2e9;
    try {
        make_plan(o);
        FAIL() << "a RAM budget below the non-expert weights must be refused";
    } catch (const std::exception & e) {
        EXPECT_NE(std::string(e.what()).find("less than the 5.00 GB of weights that are not routed experts"), std::string::npos)
            << e.what();
    }
    o.ram_bytes = 0;
    o.ks = {4};
    EXPECT_THROW(make_plan(o), std::exception) << "K below the experts used per token";
    EXPECT_DOUBLE_EQ(parse_size("24G", "--ram"), 24.0 * (1ull << 30));
    EXPECT_DOUBLE_EQ(parse_size("24GB", "--ram"), 24e9);
    EXPECT_DOUBLE_EQ(parse_size("1.5T", "--ram"), 1.5 * double(1ull << 40));
    EXPECT_THROW(parse_size("24 bananas", "--ram"), std::exception);
    // One parser for both conventions: a bare G is 10^9 only where llama-gguf-split's is.
    EXPECT_DOUBLE_EQ(parse_size("2G", "--split-max-size", SizeUnits::decimal), 2e9);
    EXPECT_DOUBLE_EQ(parse_size("500M", "--split-max-size", SizeUnits::decimal), 500e6);
    EXPECT_DOUBLE_EQ(parse_size("2GiB", "--split-max-size", SizeUnits::decimal), 2.0 * (1ull << 30));
    EXPECT_DOUBLE_EQ(parse_size("1048576", "--split-max-size", SizeUnits::decimal), 1048576.0);

    test::TempDir dir;
    test::write_text(dir / "bad.json", R"({"format": "moeprune-replay", "inputs": {"n_layer": "x"}, "records": []})");
    PlanOptions b = seed_geometry();
    b.replays = {dir / "bad.json"};
    try {
        make_plan(b);
        FAIL();
    } catch (const std::exception & e) {
        EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
    }
}

TEST(Plan, GeometryFromAModelFile) {
    test::TempDir dir;
    const auto r = test::run_command(fmt::format("{} synth --arch qwen3moe --layers 3 --experts 8 --used 2 -o {}",
                                                 test::bin("moeprune").string(), (dir / "m.gguf").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    PlanOptions o;
    o.model = dir / "m.gguf";
    o.ks = {4, 8};
    const json p = make_plan(o);
    const json & g = p["inputs"]["geometry"];
    EXPECT_EQ(g["moe_layers"].get<int>(), 3);
    EXPECT_EQ(g["experts"].get<int>(), 8);
    EXPECT_GT(g["other_bytes"].get<double>(), 0);
    // K = all experts is the base itself: KLD 0, measured by definition.
    for (const json & x : p["options"]) {
        if (x["k"] == 8) {
            EXPECT_EQ(x["kld_mean"].get<double>(), 0.0);
        }
    }
    const auto cli = test::run_command(fmt::format("{} plan -m {} -k 4 --ram 8G --json {}", test::bin("moeprune").string(),
                                                   (dir / "m.gguf").string(), (dir / "m.gguf").string()));
    EXPECT_NE(cli.exit_code, 0) << "the plan may not overwrite its model";
    EXPECT_NE(cli.output.find("m.gguf"), std::string::npos) << cli.output;
}

namespace {

// A moeprune-measure report as `measure --json` writes it, of the model kModelDigest names.
json measure_report(const std::string & digest) {
    return {{"format", "moeprune-measure"},
            {"version", 1},
            {"model", {{"digest", digest}, {"n_expert", 512}, {"routed_layer_expert_bytes", std::vector<double>(48, 1.3824e6)}}},
            {"process_bytes", 1e9},
            {"resident_weight_bytes", 5e9},
            {"resident_need_bytes", 6e9},
            {"resident", {{"decode", {{"tokens_per_second", 50.0}, {"ms_per_token", {{"mean", 20.0}}}}}}},
            {"probe",
             {{"effective_gbps", 0.5}, {"read_gbps", 2.0}, {"readahead_amplification", 4.0}, {"fault_latency_us", 300.0}}},
            {"runs",
             {{{"ram", "25%"},
               {"limit_bytes", 20e9},
               {"decode", {{"tokens_per_second", 3.0}, {"ms_per_token", {{"mean", 1000.0 / 3}}}, {"major_faults_per_token", 50.0},
                           {"read_bytes_per_token", 1e8}}},
               {"predicted", {{"tokens_per_second", 3.3}}},
               {"error", 0.1}}}},
            {"median_error", 0.1},
            {"max_error", 0.1}};
}

} // namespace

TEST(Plan, CalibratedByAMeasurement) {
    test::TempDir dir;
    const fs::path measured = dir / "measure.json";
    test::write_text(measured, measure_report(kModelDigest).dump());
    test::write_text(dir / "replay.json", replay_result("", 512, {{"lru", 64, 30.0}}).dump());
    PlanOptions o = seed_geometry();
    o.ks = {512};
    o.ram_bytes = 40e9;
    o.replays = {dir / "replay.json"};
    o.measured = measured;
    const json p = make_plan(o);
    const json & t = p["inputs"]["throughput"];
    EXPECT_EQ(t["compute_ms"].get<double>(), 20.0);
    EXPECT_EQ(t["ssd_gbps"].get<double>(), 0.5);
    EXPECT_EQ(t["read_latency_us"].get<double>(), 0.0) << "fault latency is inside the probe's bandwidth";
    EXPECT_EQ(p["inputs"]["reserve_bytes"].get<double>(), 1e9) << "the process's memory, as measured";
    EXPECT_EQ(p["inputs"]["measured"]["from_measurement"].size(), 4u);
    bool replayed = false, measured_option = false;
    for (const json & x : p["options"]) {
        if (x["policy"] == "lru") {
            EXPECT_NEAR(x["tok_per_s"].get<double>(), 1.0 / (0.020 + 30 * 1.3824e6 / 0.5e9), 1e-9);
            replayed = true;
        }
        if (x["policy"] == "page-cache") {
            EXPECT_EQ(x["tok_per_s"].get<double>(), 3.0) << "a measured limit is an option as measured";
            EXPECT_EQ(x["resident_bytes"].get<double>(), 19e9);
            EXPECT_EQ(x["measured_ram"], "25%");
            measured_option = true;
        }
    }
    EXPECT_TRUE(replayed);
    EXPECT_TRUE(measured_option);
    const std::string why = p["why"].get<std::string>();
    EXPECT_NE(why.find("measured by " + measured.string()), std::string::npos) << why;
    EXPECT_NE(why.find("compute 20 ms"), std::string::npos) << why;

    // With measure --repeats, compute is the median of the resident decodes at the device's
    // read-ahead (the calibration's), and the printed commands run llama.cpp at the threads
    // it was measured with.
    {
        json repeated = measure_report(kModelDigest);
        repeated["settings"] = {{"threads", 3}};
        repeated["calibration"] = {{"read_ahead_kb", nullptr}, {"compute_ms", 18.0}, {"compute_ms_repeats", {20.0, 18.0, 17.0}},
                                   {"read_gbps", 1.0}, {"process_bytes", 1e9}, {"page_bytes", 4096}, {"readaround_bytes", 0}};
        test::write_text(measured, repeated.dump());
        const json median = make_plan(o);
        EXPECT_EQ(median["inputs"]["throughput"]["compute_ms"].get<double>(), 18.0);
        EXPECT_NE(median["why"].get<std::string>().find("compute 18 ms per token (the median of 3 resident decodes)"),
                  std::string::npos) << median["why"];
        ASSERT_TRUE(median["commands"].is_object()) << median["why"];
        const auto argv = median["commands"]["llama_completion"].get<std::vector<std::string>>();
        const auto t = std::find(argv.begin(), argv.end(), "-t");
        ASSERT_NE(t, argv.end()) << median["commands"];
        EXPECT_EQ(*std::next(t), "3");
        test::write_text(measured, measure_report(kModelDigest).dump());
    }

    // A guess given by hand stays, and the plan says which.
    o.by_hand = {"--ssd"};
    o.throughput.ssd_gbps = 6.8;
    const json hand = make_plan(o);
    EXPECT_EQ(hand["inputs"]["throughput"]["ssd_gbps"].get<double>(), 6.8);
    EXPECT_NE(hand["why"].get<std::string>().find("given by hand: --ssd"), std::string::npos) << hand["why"];

    // Nothing measured: the plan says its tokens/s are guesses.
    o.measured.clear();
    EXPECT_NE(make_plan(o)["why"].get<std::string>().find("guesses"), std::string::npos);

    // A measurement of another model, or one without a storage probe, is refused by name.
    o.measured = measured;
    test::write_text(measured, measure_report("xxh3:00000000000000bb").dump());
    EXPECT_THROW(
        {
            try {
                make_plan(o);
            } catch (const std::exception & e) {
                EXPECT_NE(std::string(e.what()).find("measure.json"), std::string::npos) << e.what();
                throw;
            }
        },
        std::exception);
    // Figures each in range but impossible together, an unknown version, a busy machine,
    // and a model of another geometry when the plan's is given by hand: refused by name.
    using Forgery = std::function<void(json &)>;
    for (const auto & [forge, message] : std::vector<std::pair<Forgery, std::string>>{
             {[](json & m) { m["runs"][0]["decode"]["tokens_per_second"] = 1e308; }, "runs[0].decode.tokens_per_second"},
             {[](json & m) { m["runs"][0]["decode"]["tokens_per_second"] = 9.0; }, "the mean of 333.33"},
             {[](json & m) { m["runs"][0]["limit_bytes"] = 1; }, "below the 6000000000 bytes"},
             {[](json & m) { m["resident"]["decode"]["ms_per_token"]["mean"] = 1e308; }, "resident.decode.ms_per_token.mean"},
             {[](json & m) { m["probe"]["effective_gbps"] = 1e-300; }, "under 1 kB/s"},
             {[](json & m) { m["version"] = 7; }, "version: is not 1"},
             {[](json & m) { m["busy"] = "the resident run took 344 ms"; }, "measure again on a quiet machine"},
             {[](json & m) { m["runs"][0]["ram"] = "\x1b[2J25%"; }, "is not a limit as measure --ram reads one"},
             {[](json & m) { m["process_bytes"] = 1e308; }, "process_bytes"},
             {[](json & m) { m["settings"] = {{"threads", 100000}}; }, "settings.threads"},
             {[](json & m) { m["model"]["routed_layer_expert_bytes"] = std::vector<double>(2, 8e9); }, "another model than --expert-mb"},
         }) {
        json forged = measure_report(kModelDigest);
        forge(forged);
        test::write_text(measured, forged.dump());
        try {
            make_plan(o);
            ADD_FAILURE() << "accepted: " << message;
        } catch (const Error & e) {
            EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(measured.string()), std::string::npos) << e.what();
        }
    }
    json unprobed = measure_report(kModelDigest);
    unprobed["probe"] = nullptr;
    test::write_text(measured, unprobed.dump());
    EXPECT_THROW(
        {
            try {
                make_plan(o);
            } catch (const std::exception & e) {
                EXPECT_NE(std::string(e.what()).find("probe"), std::string::npos) << e.what();
                throw;
            }
        },
        std::exception);
}
