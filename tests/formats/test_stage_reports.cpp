#include "core/atomic_file.h"
#include "core/errors.h"
#include "formats/measure_report.h"
#include "formats/stage_reports.h"
#include "formats/verify_summary.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

using namespace moeprune;
using nlohmann::json;

namespace {

json eval_doc() {
    return {{"format", "moeprune-eval"},
            {"base", {{"model", "m.gguf"}, {"digest", "abc"}, {"n_expert", 16}}},
            {"candidates",
             {{{"kind", "base"}, {"name", "m.gguf"}},
              {{"kind", "keep"},
               {"name", "freq-k8"},
               {"source", "keep/freq-k8.json"},
               {"all", {{"kld_mean", 0.25}, {"kld_p99", 1.5}, {"same_top1", 0.75}, {"tokens", 400}}},
               {"domains",
                {{"prose", {{"kld_mean", 0.5}, {"kld_p99", nullptr}, {"same_top1", 0.5}, {"tokens", 100}}},
                 {"code", {{"kld_mean", 0.125}, {"kld_p99", 0.75}, {"same_top1", 1.0}, {"tokens", 300}}}}}},
              {{"kind", "closed-loop"},
               {"keep", "keep/reap-k12.json"},
               {"policy", "lru"},
               {"cache", 10},
               {"lambda", 0.5},
               {"all",
                {{"kld_mean", 0.0625},
                 {"same_top1", 0.875},
                 {"tokens", 400},
                 {"misses_per_token", 3.5},
                 {"open_loop_misses_per_token", 4.0},
                 {"tok_per_s", nullptr},
                 {"open_loop_tok_per_s", 12.0}}}}}}};
}

json replay_doc() {
    return {{"format", "moeprune-replay"},
            {"inputs",
             {{"trace_meta", {{"model", {{"digest", "abc"}, {"n_expert", 16}}}}},
              {"n_layer", 2},
              {"n_expert", 16},
              {"keep", "keep/freq-k8.json"},
              {"n_expert_after_keep", 8},
              {"cache_scope", "global"},
              {"throughput", {{"ssd_gbps", 3.5}}}}},
            {"records",
             {{{"policy", "lru"},
               {"slots", {6}},
               {"cache", 6},
               {"lambda", 0},
               {"misses_per_token", 2.5},
               {"misses_per_token_by_layer", {1.0, 1.5}},
               {"read_rounds_per_token", 2.0},
               {"hit_rate", 0.75},
               {"tokens_per_s", 30.0},
               {"cliff", true}},
              {{"policy", "belady"}, {"slots", {6, 7}}, {"misses_per_token", 1.0}, {"hit_rate", 0.9}}}}};
}

std::filesystem::path write(const test::TempDir & dir, const std::string & name, const json & doc) {
    const auto path = dir / name;
    write_file_atomic(path, doc.dump());
    return path;
}


} // namespace

TEST(StageReports, EvalCandidatesAreTypedWithTheirDomainsByNameAndNullsAsUnknown) {
    test::TempDir dir;
    const EvalFile r = read_eval_report(write(dir, "eval.json", eval_doc()));
    EXPECT_EQ(r.base.digest, "abc");
    EXPECT_EQ(r.base.n_expert, 16);
    EXPECT_EQ(r.base.where(), r.path + ": base");
    EXPECT_FALSE(r.base_mtp.has_value());
    json with_mtp = eval_doc();
    with_mtp["base"]["mtp"] = {{"acceptance", 0.625}, {"tokens_per_step", 1.5}};
    const EvalFile m = read_eval_report(write(dir, "mtp.json", with_mtp));
    ASSERT_TRUE(m.base_mtp.has_value());
    EXPECT_EQ(m.base_mtp->acceptance, 0.625);
    EXPECT_EQ(m.base_mtp->tokens_per_step, 1.5);
    with_mtp["base"]["mtp"]["acceptance"] = 2;
    test::expect_read_refused(read_eval_report, write(dir, "bad-mtp.json", with_mtp), "base.mtp.acceptance: is 2");
    ASSERT_EQ(r.candidates.size(), 3u);
    EXPECT_EQ(r.candidates[0].kind, "base");
    const EvalFileCandidate & keep = r.candidates[1];
    EXPECT_EQ(keep.kind, "keep");
    EXPECT_EQ(keep.name, "freq-k8");
    EXPECT_EQ(keep.source, "keep/freq-k8.json");
    EXPECT_EQ(keep.all.kld_mean, 0.25);
    EXPECT_EQ(keep.all.kld_p99, 1.5);
    EXPECT_EQ(keep.all.tokens, 400);
    ASSERT_EQ(keep.domains.size(), 2u);
    EXPECT_EQ(keep.domains[0].first, "code");
    EXPECT_EQ(keep.domains[0].second.same_top1, 1.0);
    EXPECT_EQ(keep.domains[1].first, "prose");
    EXPECT_FALSE(keep.domains[1].second.kld_p99.has_value());
    const EvalFileCandidate & loop = r.candidates[2];
    EXPECT_EQ(loop.keep, "keep/reap-k12.json");
    EXPECT_EQ(loop.policy, "lru");
    EXPECT_EQ(loop.cache, 10);
    EXPECT_EQ(loop.lambda, 0.5);
    EXPECT_EQ(loop.loop.misses_per_token, 3.5);
    EXPECT_EQ(loop.loop.open_loop_misses_per_token, 4.0);
    EXPECT_FALSE(loop.loop.tok_per_s.has_value());
    EXPECT_EQ(loop.loop.open_loop_tok_per_s, 12.0);
}

TEST(StageReports, ReplayRecordsAreTypedWithTheirOptionalFields) {
    test::TempDir dir;
    const ReplayFile r = read_replay_report(write(dir, "replay.json", replay_doc()));
    ASSERT_TRUE(r.trace_model.has_value());
    EXPECT_EQ(r.trace_model->digest, "abc");
    EXPECT_EQ(r.n_layer, 2);
    EXPECT_EQ(r.n_expert, 16);
    EXPECT_EQ(r.keep, "keep/freq-k8.json");
    EXPECT_EQ(r.n_expert_after_keep, 8);
    EXPECT_TRUE(r.global);
    EXPECT_EQ(r.throughput.at("ssd_gbps"), 3.5);
    ASSERT_EQ(r.records.size(), 2u);
    const ReplayRecordFigures & a = r.records[0];
    EXPECT_EQ(a.policy, "lru");
    EXPECT_EQ(a.slots, (std::vector<int64_t>{6}));
    EXPECT_EQ(a.cache, 6);
    EXPECT_TRUE(a.cliff);
    EXPECT_EQ(a.misses_per_token_by_layer, (std::vector<double>{1.0, 1.5}));
    EXPECT_EQ(a.read_rounds_per_token, 2.0);
    EXPECT_EQ(a.tokens_per_s, 30.0);
    const ReplayRecordFigures & b = r.records[1];
    EXPECT_EQ(b.slots, (std::vector<int64_t>{6, 7}));
    EXPECT_FALSE(b.cache.has_value());
    EXPECT_EQ(b.lambda, 0.0);
    EXPECT_FALSE(b.cliff);
    EXPECT_FALSE(b.misses_per_token_by_layer.has_value());
    EXPECT_FALSE(b.tokens_per_s.has_value());
}

TEST(StageReports, ImpossibleValuesAreRefusedByFileAndField) {
    test::TempDir dir;
    json e = eval_doc();
    e["format"] = "moeprune-replay";
    test::expect_read_refused(read_eval_report, write(dir, "a.json", e), "is not a moeprune-eval report");
    e = eval_doc();
    e["candidates"][1]["all"]["kld_mean"] = -1;
    test::expect_read_refused(read_eval_report, write(dir, "b.json", e), "candidates[1].all.kld_mean: is -1");
    e = eval_doc();
    e["candidates"][2]["cache"] = 0;
    test::expect_read_refused(read_eval_report, write(dir, "c.json", e), "candidates[2].cache: is 0");
    e = eval_doc();
    e["candidates"][1]["domains"]["code"]["same_top1"] = 2;
    test::expect_read_refused(read_eval_report, write(dir, "d.json", e), "candidates[1].domains.code.same_top1: is 2");
    // Task answers: an accuracy its counts do not make, more base answers kept than right.
    const json task_figures = {{"tasks", 10}, {"correct", 6}, {"accuracy", 0.6}, {"stderr", 0.15},
                               {"kept_base_correct", 5}, {"new_correct", 1}, {"answers", "0123012301"}};
    e = eval_doc();
    e["tasks"] = {{"format", "hellaswag"}, {"file", "t.txt"}, {"base", task_figures}};
    e["candidates"][1]["tasks"] = task_figures;
    const EvalFile with_tasks = read_eval_report(write(dir, "d2.json", e));
    ASSERT_TRUE(with_tasks.base_tasks && with_tasks.candidates[1].tasks);
    EXPECT_EQ(with_tasks.candidates[1].tasks->kept_base_correct, 5);
    EXPECT_EQ(with_tasks.task_format, "hellaswag");
    e["candidates"][1]["tasks"]["accuracy"] = 0.7;
    test::expect_read_refused(read_eval_report, write(dir, "d3.json", e), "candidates[1].tasks.accuracy: is 0.7, but 6 of 10");
    e["candidates"][1]["tasks"] = task_figures;
    e["tasks"]["base"]["kept_base_correct"] = 7;
    test::expect_read_refused(read_eval_report, write(dir, "d4.json", e), "tasks.base.kept_base_correct: is 7");

    json r = replay_doc();
    r["records"][1]["slots"] = {4, -1};
    test::expect_read_refused(read_replay_report, write(dir, "e.json", r), "records[1].slots[1]: is -1");
    r = replay_doc();
    r["inputs"]["n_layer"] = 0;
    test::expect_read_refused(read_replay_report, write(dir, "f.json", r), "inputs.n_layer: is 0");
    r = replay_doc();
    r["records"][0].erase("misses_per_token");
    test::expect_read_refused(read_replay_report, write(dir, "g.json", r), "records[0].misses_per_token: is missing");

    // A record refuses later what only its reader can judge, by the same file and field.
    const ReplayFile ok = read_replay_report(write(dir, "h.json", replay_doc()));
    try {
        ok.records[1].place.fail("slots[1]", "is 7, more than the map keeps");
        FAIL();
    } catch (const Error & err) {
        EXPECT_NE(std::string(err.what()).find((dir / "h.json").string() + ": records[1].slots[1]: is 7"),
                  std::string::npos)
            << err.what();
    }
}

TEST(StageReports, SelectLayersCarryTheirHeldOutShareAndScreenWhereTheReportHasThem) {
    test::TempDir dir;
    const json doc = {
        {"format", "moeprune-select"},
        {"results",
         {{{"metric", "reap"},
           {"k", 6},
           {"layers",
            {{{"layer", 1}, {"reap_share", 0.75}, {"count_share", 0.5}, {"heldout", {{"reap_share", 0.625}}}},
             {{"layer", 3}, {"reap_share", 1.0}, {"count_share", 1.0}}}},
           {"screen", {{"layers", {{{"layer", 3}, {"replaced_share", 0.25}, {"moved_mass", 0.125}}}}}}},
          {{"metric", "freq"}, {"k", 4}, {"layers", json::array()}}}}};
    const SelectFile s = read_select_report(write(dir, "select.json", doc));
    ASSERT_EQ(s.results.size(), 2u);
    EXPECT_EQ(s.results[0].criterion, "reap");
    EXPECT_EQ(s.results[0].k, 6);
    ASSERT_EQ(s.results[0].layers.size(), 2u);
    const SelectLayerFigures & a = s.results[0].layers[0];
    EXPECT_EQ(a.layer, 1);
    EXPECT_EQ(a.reap_share, 0.75);
    EXPECT_EQ(a.heldout_reap_share, 0.625);
    EXPECT_FALSE(a.replaced_share.has_value()) << "the screen names layer 3 only";
    const SelectLayerFigures & b = s.results[0].layers[1];
    EXPECT_FALSE(b.heldout_reap_share.has_value());
    EXPECT_EQ(b.replaced_share, 0.25);
    EXPECT_EQ(b.moved_mass, 0.125);
    EXPECT_EQ(s.results[1].criterion, "freq");

    json bad = doc;
    bad["results"][0]["layers"][1]["reap_share"] = 1.5;
    test::expect_read_refused(read_select_report, write(dir, "bad.json", bad), "results[0].layers[1].reap_share: is 1.5");
    bad = doc;
    bad["format"] = "moeprune-eval";
    test::expect_read_refused(read_select_report, write(dir, "other.json", bad), "is not a moeprune-select report");
}

TEST(StageReports, PlanOptionsAndItsRecommendationAreTypedAndIndicesMustNameAnOption) {
    test::TempDir dir;
    const json option_a = {{"k", 8},  {"criterion", "reap"}, {"policy", "lru"}, {"cache_experts", 4},
                           {"resident_bytes", 2e9}, {"tok_per_s", 12.5}, {"kld_mean", 0.1}};
    const json option_b = {{"k", 16}, {"criterion", "none"}, {"policy", "all-resident"}, {"cache_experts", nullptr},
                           {"resident_bytes", nullptr}, {"tok_per_s", nullptr}};
    const json doc = {{"format", "moeprune-plan"},
                      {"inputs", {{"geometry", {{"experts", 16}}}, {"budget_bytes", 3e9}}},
                      {"options", {option_a, option_b}},
                      {"pareto", {1, 0}},
                      {"recommended", 0},
                      {"why", "fastest under the KLD bound"}};
    const PlanFile p = read_plan_report(write(dir, "plan.json", doc));
    EXPECT_EQ(p.n_expert, 16);
    EXPECT_EQ(p.inputs.at("budget_bytes"), 3e9);
    ASSERT_EQ(p.options.size(), 2u);
    EXPECT_EQ(p.options[0].kld_mean, 0.1);
    EXPECT_EQ(p.options[0].runs_on, kRunsOnExpertCache) << "a plan written before runs_on: from the policy";
    EXPECT_EQ(p.options[0].cache_experts, 4);
    EXPECT_EQ(p.options[0].tok_per_s, 12.5);
    EXPECT_FALSE(p.options[1].cache_experts.has_value());
    EXPECT_FALSE(p.options[1].tok_per_s.has_value());
    EXPECT_EQ(p.pareto, (std::vector<size_t>{1, 0}));
    ASSERT_NE(p.recommendation(), nullptr);
    EXPECT_EQ(p.recommendation()->criterion, "reap");
    EXPECT_EQ(p.why, "fastest under the KLD bound");

    json none = doc;
    none["recommended"] = nullptr;
    EXPECT_EQ(read_plan_report(write(dir, "none.json", none)).recommendation(), nullptr);
    json bad = doc;
    bad["recommended"] = 2;
    test::expect_read_refused(read_plan_report, write(dir, "bad.json", bad), "recommended: is 2");
    bad = doc;
    bad["pareto"] = {0, 5};
    test::expect_read_refused(read_plan_report, write(dir, "bad2.json", bad), "pareto[1]: is 5");
    bad = doc;
    bad["options"][1]["k"] = 0;
    test::expect_read_refused(read_plan_report, write(dir, "bad3.json", bad), "options[1].k: is 0");
}

TEST(StageReports, APlanOptionAndItsCommandsSurviveTheRoundTripWithEveryFieldSet) {
    PlanOption o;
    o.k = 12;
    o.criterion = "freq";
    o.cache_experts = 6;
    o.cache_scope = "global";
    o.policy = "page-cache";
    o.lambda = 0.5;
    o.routed_bytes = 3e9;
    o.resident_bytes = 2e9;
    o.misses_per_token = 4.5;
    o.read_bytes_per_token = 7e6;
    o.tok_per_s = 21.5;
    o.source = "measured";
    o.note = "a note";
    o.runs_on = kRunsOnLlamaCpp;
    o.runs_on_note = "runs";
    o.keep_map = "maps/freq-k12.json";
    o.read_ahead_kb = 128;
    o.measured = PlanMeasuredFigures{"25%", 1.5e9, 3.25, 20.0};
    o.bound = true;
    o.kld_mean = 0.02;
    o.kld_measured = false;
    o.kld_loop = "closed";
    o.kld_note = "interpolated";
    o.mtp_draft = PlanDraft{0.75, "eval", 1.75, 1e6, 2.5e9, false, 40.0, 30.0, 1.4, "drafted"};
    const json written = to_json(o);
    const json again = to_json(read_plan_option(JsonFields(written, "plan.json", "options[0]")));
    EXPECT_EQ(again, written);
    for (const char * key : {"runs_on", "keep_map", "read_ahead_kb", "measured_limit_bytes", "kld_note", "note", "runs_on_note"}) {
        EXPECT_TRUE(written.contains(key)) << key;
    }

    PlanCommands c;
    c.model = "slice/freq-k12.gguf";
    c.slice = {"moeprune", "slice", "-m", "m.gguf", "--keep", "maps/freq-k12.json", "-o", c.model};
    c.memory_limit = {"systemd-run", "--scope", "-p", "MemoryMax=1000", "--"};
    c.llama_completion = {"llama-completion", "-m", c.model, "--no-repack"};
    c.llama_server = {"llama-server", "-m", c.model};
    c.lines = {"a line"};
    c.notes = {"a note"};
    const json cw = to_json(c);
    EXPECT_EQ(to_json(read_plan_commands(JsonFields(cw, "plan.json", "commands"))), cw);
    json bad = cw;
    bad["llama_completion"] = json::array();
    EXPECT_THROW(read_plan_commands(JsonFields(bad, "plan.json", "commands")), Error);
    EXPECT_EQ(shell_line({"llama-completion", "-m", "my model.gguf", "-p", "it's"}),
              "llama-completion -m 'my model.gguf' -p 'it'\\''s'");
    // A first word with `=` is quoted: unquoted, the shell would take it for an assignment.
    EXPECT_EQ(shell_line({"a=b/llama-completion", "-m", "x=y.gguf"}), "'a=b/llama-completion' -m x=y.gguf");
    const auto sh = test::run_command("sh -c \"" + shell_line({"a=b/missing", "-m"}) + "\" 2>&1");
    EXPECT_NE(sh.output.find("a=b/missing"), std::string::npos) << "the shell runs the program it names\n" << sh.output;
}

namespace {

// A report as measure writes one: every field set, so that a field the reader or the
// writer forgets shows as a difference after the round trip.
MeasureReport full_measure_report() {
    MeasureReport r;
    r.model = {{"digest", "xxh3:0123456789abcdef"}, {"n_expert", 16}};
    r.text = {{"path", "t.txt"}};
    r.settings = {{"tokens", 4}};
    r.system = {{"page_size", 4096}};
    r.routed_expert_bytes = 64 << 20;
    r.resident_weight_bytes = 8 << 20;
    r.process_bytes = 24 << 20;
    r.resident_need_bytes = r.resident_weight_bytes + r.process_bytes;
    const auto decode = [](double ms) {
        DecodeFigures d;
        d.tokens = 4;
        d.ms_mean = ms;
        d.tokens_per_second = 1000 / ms;
        d.ms_median = ms * 0.9;
        d.ms_p90 = ms * 1.5;
        d.major_faults_per_token = ms / 4;
        d.read_bytes_per_token = ms * 4096;
        return d;
    };
    r.resident.ram = "resident";
    r.resident.cache_bytes = r.routed_expert_bytes;
    r.resident.peak_bytes = 90 << 20;
    r.resident.decode = decode(4);
    DecodeDetail detail;
    detail.load_seconds = 0.5;
    detail.load_read_bytes = 1 << 20;
    detail.load_major_faults = 12;
    detail.passes = 2;
    detail.timed_seconds = 0.016;
    detail.wall_us = {4000, 4000, 4000, 4000};
    detail.read_bytes = {4096, 0, 8192, 0};
    detail.major_faults = {1, 0, 2, 0};
    detail.minor_faults = {3, 3, 3, 3};
    detail.read_bytes_counted = true;
    detail.residency = std::vector<ResidencySample>{{1, {0, 3}}, {3, {}}};
    detail.process = {{"RssAnon", 1 << 20}, {"VmPTE", 4096}};
    r.resident.detail = detail;
    r.resident.llama_bench = {{"tokens_per_second", 250.0}, {"difference", 0.0}};
    r.probed = true;
    r.probe = {.limit_bytes = 40 << 20, .experts = 8, .bytes_needed = 1 << 20, .bytes_read = 2 << 20,
               .major_faults = 32, .threads = 2, .seconds = 0.5, .effective_gbps = double(1 << 20) / 0.5 / 1e9,
               .read_gbps = double(2 << 20) / 0.5 / 1e9, .readahead_amplification = 2, .fault_latency_us = 150,
               .expert_ms_median = 1.5, .expert_ms_p90 = 3};
    MeasuredRun limited;
    limited.ram = "50%";
    limited.limit_bytes = r.resident_need_bytes + (32 << 20);
    limited.cache_bytes = 32 << 20;
    limited.peak_bytes = limited.limit_bytes - 4096;
    limited.decode = decode(8);
    limited.predicted = true;
    limited.prediction = {.page_cache_bytes = 40 << 20, .tokens_per_second = 110, .ms_per_token = 9.1,
                          .read_bytes_per_token = 5e5, .expert_read_bytes_per_token = 4e5,
                          .other_read_bytes_per_token = 1e5, .faults_per_token = 3, .expert_faults_per_token = 2,
                          .outside_model = "a read-around window over half the page cache"};
    limited.error = 0.12;
    limited.residency = {{"agreement", 0.9}};
    r.runs = {limited};
    r.calibration = {.compute_ms = 4, .read_gbps = 0.004, .process_bytes = r.process_bytes, .page_bytes = 4096,
                     .readaround_bytes = 128 << 10};
    r.median_error = r.max_error = 0.12;
    r.trace = "m.mptrace";
    return r;
}

} // namespace

TEST(StageReports, AMeasureReportReadsBackAsWrittenAndItsFiguresMustAgree) {
    test::TempDir dir;
    const MeasureReport written = full_measure_report();
    const json doc = to_json(written);
    const auto path = write(dir, "measure.json", doc);
    const MeasureFile read = read_measure_report(path);
    EXPECT_EQ(to_json(read.report), doc);
    EXPECT_EQ(read.path, path.string());
    EXPECT_EQ(read.digest.rfind("xxh64:", 0), 0u) << read.digest;
    EXPECT_EQ(read.report.runs.at(0).prediction.tokens_per_second, 110);
    EXPECT_EQ(all_runs(read.report).size(), 2u);

    // A busy machine's report is a report: refusing it is plan's policy, not the format's.
    json busy = doc;
    busy["busy"] = "another job was using the CPUs";
    EXPECT_EQ(read_measure_report(write(dir, "busy.json", busy)).report.busy, "another job was using the CPUs");

    json bad = doc;
    bad["runs"][0]["decode"]["tokens_per_second"] = 500.0;
    test::expect_read_refused(read_measure_report, write(dir, "speed.json", bad), "runs[0].decode.tokens_per_second: is 500");
    bad = doc;
    bad["resident_need_bytes"] = 1;
    test::expect_read_refused(read_measure_report, write(dir, "need.json", bad), "resident_need_bytes: is 1");
    bad = doc;
    bad["runs"][0]["limit_bytes"] = 1024;
    test::expect_read_refused(read_measure_report, write(dir, "limit.json", bad), "runs[0].limit_bytes: is 1024");
    bad = doc;
    bad["probe"]["seconds"] = 5.0;
    test::expect_read_refused(read_measure_report, write(dir, "probe.json", bad), "probe.effective_gbps");
    bad = doc;
    bad["version"] = 2;
    test::expect_read_refused(read_measure_report, write(dir, "version.json", bad), "version: is not 1");
    // The worker's detail is a record too: its speed must be its tokens' times, its series
    // one value per timed token, its residency samples after a timed token.
    bad = doc;
    bad["resident"]["detail"]["per_token"]["wall_us"] = {2000, 2000, 2000, 2000};
    test::expect_read_refused(read_measure_report, write(dir, "wall.json", bad),
                              "resident.decode.tokens_per_second: is 250, but its 4 tokens took 8000 us");
    bad = doc;
    bad["resident"]["detail"]["per_token"]["major_faults"] = {1, 0};
    test::expect_read_refused(read_measure_report, write(dir, "series.json", bad),
                              "resident.detail.per_token.major_faults: has 2 tokens, wall_us 4");
    bad = doc;
    bad["resident"]["detail"]["residency"][0]["token"] = 9;
    test::expect_read_refused(read_measure_report, write(dir, "sample.json", bad), "resident.detail.residency[0].token");
    bad = doc;
    bad["resident"]["detail"]["process"]["RssAnon"] = -1;
    test::expect_read_refused(read_measure_report, write(dir, "process.json", bad), "resident.detail.process.RssAnon");
}

TEST(StageReports, AVerifySummaryReadsBackAsWritten) {
    test::TempDir dir;
    VerifySummary v;
    v.plan = "plan.json";
    v.option = {{"k", 12}, {"criterion", "reap"}};
    v.model = "slice/reap-k12.gguf";
    v.ram = "8G";
    v.predicted_tok_per_s = 12;
    v.measured_tok_per_s = 10;
    v.measured_major_faults_per_token = 3;
    v.measure = "verify/verify.json";
    const json doc = to_json(v);
    EXPECT_DOUBLE_EQ(doc.at("error").get<double>(), 0.2);
    EXPECT_TRUE(doc.at("measured_read_bytes_per_token").is_null());
    EXPECT_TRUE(doc.at("drift").is_null());
    EXPECT_EQ(to_json(read_verify_summary(write(dir, "summary.json", doc))), doc);
    // The same model resident, now and when the shortlist measured it: 20% slower now.
    v.resident_tok_per_s = 800;
    v.shortlist_resident_tok_per_s = 1000;
    EXPECT_DOUBLE_EQ(to_json(v).at("drift").get<double>(), -0.2);
    EXPECT_EQ(to_json(read_verify_summary(write(dir, "drift.json", to_json(v)))), to_json(v));
    json bad = doc;
    bad["measured_tok_per_s"] = -1;
    test::expect_read_refused(read_verify_summary, write(dir, "bad.json", bad), "measured_tok_per_s");
}

TEST(StageReports, APlansInputsAreTypedForTheReportAndTheirFieldsRequired) {
    test::TempDir dir;
    const json throughput = {{"ssd_gbps", 6.8},   {"read_latency_us", 80.0}, {"queue_depth", 32},
                             {"compute_ms", 20.0}, {"sync_us", 0.0},         {"model", "t = compute + ..."}};
    const json doc = {{"format", "moeprune-plan"},
                      {"inputs",
                       {{"geometry",
                         {{"source", "m.gguf"},
                          {"moe_layers", 2},
                          {"experts", 16},
                          {"used", 4},
                          {"expert_bytes", {1.5e6, 1.5e6}},
                          {"other_bytes", nullptr},
                          {"mtp_layers", 1}}},
                        {"budget_bytes", 3e9},
                        {"throughput", throughput},
                        {"measured", {{"median_error", 0.25}, {"max_error", 0.5}}}}},
                      {"options",
                       {{{"k", 8},
                         {"criterion", "reap"},
                         {"policy", "lru"},
                         {"mtp_draft", {{"acceptance", 0.75}, {"tok_per_s", nullptr}}}}}},
                      {"pareto", {0}},
                      {"why", "the only option"}};
    const PlanFile p = read_plan_report(write(dir, "plan.json", doc));
    const PlanInputFigures in = read_plan_inputs(p);
    EXPECT_EQ(in.source, "m.gguf");
    EXPECT_EQ(in.moe_layers, 2);
    EXPECT_EQ(in.mtp_layers, 1);
    EXPECT_EQ(in.expert_bytes, (std::vector<double>{1.5e6, 1.5e6}));
    EXPECT_FALSE(in.other_bytes.has_value());
    EXPECT_EQ(in.budget_bytes, 3e9);
    EXPECT_EQ(in.throughput.queue_depth, 32);
    EXPECT_EQ(in.throughput.compute_ms, 20.0);
    EXPECT_EQ(in.throughput_model, "t = compute + ...");
    EXPECT_TRUE(in.measured);
    EXPECT_EQ(in.measured_median_error, 0.25);
    ASSERT_TRUE(p.options.at(0).mtp_draft.has_value());
    EXPECT_EQ(p.options[0].mtp_draft->acceptance, 0.75);
    EXPECT_FALSE(p.options[0].mtp_draft->tok_per_s.has_value());

    json bad = doc;
    bad["inputs"]["geometry"].erase("source");
    test::expect_read_refused([](const std::filesystem::path & f) { return read_plan_inputs(read_plan_report(f)); },
                   write(dir, "bad.json", bad), "inputs.geometry.source: is missing");
    bad = doc;
    bad["inputs"]["throughput"]["queue_depth"] = 0;
    test::expect_read_refused([](const std::filesystem::path & f) { return read_plan_inputs(read_plan_report(f)); },
                   write(dir, "bad2.json", bad), "inputs.throughput.queue_depth: is 0");
}
