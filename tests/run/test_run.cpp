// moeprune run end to end on a small synthesized model: every stage writes its outputs
// and a manifest; a second run does no work; changing -k reruns select and what follows
// but not collect; a kill -9 mid-collect resumes to the statistics of an uninterrupted
// run; a hand-edited output is named; the HTML report renders every chart in headless
// Chromium with no error.
#include "core/errors.h"
#include "measure/cgroup.h"
#include "run/run.h"
#include "support/html_scripts.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <random>
#include <thread>

#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;
using test::read_json;

class RunTest : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        dir_ = new test::TempDir();
        const fs::path d = dir_->path();
        // Experts of 400 KB: measure's 75% limit then leaves megabytes of experts above what
        // stays resident, more than the process's own memory varies under the sanitizers.
        auto r = test::run_command(moeprune_cmd(fmt::format(
            "synth --arch qwen3moe --layers 3 --experts 12 --used 2 --ff 512 --dead 2 --specialists -o {}", (d / "m.gguf").string())));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        std::mt19937_64 rng(1);
        static const char * syll[] = {"ka", "lo", "mi", "ne", "ru", "ta", "vo", "xe", "zi", "pu"};
        fs::create_directories(d / "src" / "prose");
        fs::create_directories(d / "src" / "code");
        fs::create_directories(d / "src" / "zh");
        for (int i = 0; i < 24; ++i) {
            std::string prose, code, zh;
            for (int w = 0; w < 120; ++w) {
                prose += std::string(syll[rng() % 10]) + syll[rng() % 10] + (w % 12 == 11 ? ".\n" : " ");
            }
            for (int l = 0; l < 12; ++l) {
                code += fmt::format("int {}{}(int x) {{ return x * {}; }}\n", syll[rng() % 10], l, rng() % 100);
            }
            for (int c = 0; c < 80; ++c) {
                const uint32_t cp = 0x4E00 + uint32_t(rng() % 1500);
                zh += fmt::format("{}{}{}", char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F)));
            }
            test::write_text(d / "src" / "prose" / fmt::format("p{}.md", i), prose);
            test::write_text(d / "src" / "code" / fmt::format("c{}.cpp", i), code);
            test::write_text(d / "src" / "zh" / fmt::format("z{}.txt", i), zh);
        }
        // Few choice tasks: every run test scores them for every map; one test checks them.
        test::write_text(d / "corpus.toml", R"([corpus]
seed = 2
tasks_per_domain = 6
[[source]]
path = "src/prose"
domain = "prose"
[[source]]
path = "src/code"
domain = "code"
[[source]]
path = "src/zh"
domain = "zh"
)");
    }
    static void TearDownTestSuite() { delete dir_; }
    static fs::path d() { return dir_->path(); }
    static std::string base_args() {
        return fmt::format("run -m {} --corpus {} --criteria reap,freq --ram 0.2GB --reserve 0 --compute-ms 5 -c 128 -t 2",
                           (d() / "m.gguf").string(), (d() / "corpus.toml").string());
    }
    static test::TempDir * dir_;
    test::TempDir tmp_;
};
test::TempDir * RunTest::dir_ = nullptr;

int count(const std::string & text, const std::string & what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
        ++n;
    }
    return n;
}

} // namespace

TEST_F(RunTest, RunsEveryStageSkipsWhatIsUnchangedAndRendersTheReport) {
    const fs::path run = tmp_ / "run";
    auto r = test::run_command(moeprune_cmd(base_args() + " -k 6,8 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "running"), 8) << r.output;
    EXPECT_NE(r.output.find("recommended:"), std::string::npos);
    for (const char * f : {"run.toml", "corpus/calib.jsonl", "collect/stats.json", "heldout/router.trace", "select/maps/reap-k6.json",
                           "select/maps/freq-k8.json", "eval/eval.json", "replay/none.json", "replay/reap-k8.json",
                           "plan/plan.json", "report.html", "report.json", "report/kld.csv", "report/plan.csv"}) {
        EXPECT_TRUE(fs::exists(run / f)) << f;
    }
    const json report = read_json(run / "report.json");
    EXPECT_EQ(report["kld"].size() > 0, true);
    std::set<std::string> maps;
    for (const json & row : report["kld"]) {
        if (row["domain"] == "all") {
            maps.insert(fmt::format("{}-k{}", row["criterion"].get<std::string>(), row["k"].get<int>()));
        }
    }
    EXPECT_EQ(maps, (std::set<std::string>{"reap-k6", "reap-k8", "freq-k6", "freq-k8"}));
    const json plan = read_json(run / "plan" / "plan.json");
    ASSERT_FALSE(plan["recommended"].is_null()) << plan["why"];
    EXPECT_FALSE(plan["pareto"].empty());

    // Nothing changed: no work, within 5 s.
    const auto t0 = std::chrono::steady_clock::now();
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,8 -o " + run.string()));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "unchanged, skipped"), 8) << r.output;
    EXPECT_LE(seconds, 5.0);

    // Only -k changed: select and everything after it, not corpus or collect.
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,10 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const char * skipped : {"corpus   unchanged", "collect  unchanged", "heldout  unchanged"}) {
        EXPECT_NE(r.output.find(skipped), std::string::npos) << skipped << "\n" << r.output;
    }
    for (const char * rerun : {"select   running", "eval     running", "replay   running", "plan     running", "report   running"}) {
        EXPECT_NE(r.output.find(rerun), std::string::npos) << rerun << "\n" << r.output;
    }
    EXPECT_FALSE(fs::exists(run / "select" / "maps" / "reap-k8.json")) << "maps of a K no longer asked for are gone";

    // A stage output edited by hand is named, with the way out.
    test::write_text(run / "select" / "select.json", test::read_bytes(run / "select" / "select.json") + " ");
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,10 -o " + run.string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("select/select.json: changed since stage select wrote it"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--from select"), std::string::npos) << r.output;
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,10 --from select -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;

    // A stage another moeprune build wrote is redone by this one, and said so.
    json manifest = read_json(run / "corpus" / "stage.json");
    EXPECT_TRUE(manifest["build"].is_string()) << manifest.dump();
    manifest["build"] = "xxh3:0000000000000000";
    test::write_text(run / "corpus" / "stage.json", manifest.dump(1));
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,10 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("corpus   was written by another moeprune build (xxh3:0000000): redone by this one"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("corpus   running"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("collect  unchanged"), std::string::npos) << "its outputs are the same bytes\n" << r.output;

    // --slice best: the recommended keep map sliced out, a model llama.cpp's reader accepts.
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,10 --slice best -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("[9/9] slice    running"), std::string::npos) << r.output;
    const json best = read_json(run / "plan" / "plan.json");
    const json & chosen = best["options"][best["recommended"].get<size_t>()];
    if (chosen["criterion"] != "none") {
        const fs::path sliced = run / "slice" / fmt::format("{}-k{}.gguf", chosen["criterion"].get<std::string>(), chosen["k"].get<int>());
        ASSERT_TRUE(fs::exists(sliced)) << r.output;
        const auto info = test::run_command(moeprune_cmd("inspect " + sliced.string()));
        EXPECT_EQ(info.exit_code, 0) << info.output;
        EXPECT_NE(info.output.find(fmt::format("experts      {} routed", chosen["k"].get<int>())), std::string::npos) << info.output;
    }

    // The report in a real browser: every chart rendered as SVG, no error, a screenshot kept.
    const std::string url = "file://" + fs::absolute(run / "report.html").string();
    const std::string chromium = "chromium --headless --no-sandbox --disable-gpu --virtual-time-budget=30000";
    const auto dom = test::run_command(chromium + " --dump-dom " + url + " 2>/dev/null");
    ASSERT_EQ(dom.exit_code, 0) << "headless Chromium (Debian package chromium, installed by scripts/install-deps.sh)";
    const json charts = report["charts"];
    EXPECT_NE(dom.output.find(fmt::format("data-rendered=\"{}\"", charts.size())), std::string::npos)
        << "every chart rendered";
    EXPECT_NE(dom.output.find("<pre id=\"errors\"></pre>"), std::string::npos) << "no script or chart error";
    EXPECT_GE(count(dom.output, "class=\"marks\""), int(charts.size()));
    const std::string html = test::read_bytes(run / "report.html");
    EXPECT_EQ(html.find("<script src="), std::string::npos) << "the report opens offline: every script inlined";
    const fs::path shots = fs::path(MOEPRUNE_BIN_DIR).parent_path() / "test-artifacts";
    fs::create_directories(shots);
    const auto shot = test::run_command(chromium + " --window-size=1200,4200 --screenshot=" + (shots / "report.png").string() +
                                        " " + url + " 2>/dev/null");
    EXPECT_EQ(shot.exit_code, 0);
    EXPECT_GT(fs::file_size(shots / "report.png"), 10000u);
}

// Domain names are whoever supplied the corpus's: names that close the charts' <script> or
// open an element are data in report.html, as a browser parses it, and every chart renders.
TEST_F(RunTest, HostileDomainNamesCannotScriptTheReport) {
    const std::string closes_script = "</script><script>document.title='PWNED'</script><!--";
    const std::string opens_img = "\\\"><img src=x onerror=alert(1)></td>\u2028";
    test::write_text(tmp_ / "corpus.toml", fmt::format(R"([corpus]
seed = 2
tasks_per_domain = 6
[[source]]
path = "{}"
domain = "{}"
[[source]]
path = "{}"
domain = "{}"
)", (d() / "src" / "prose").string(), closes_script, (d() / "src" / "code").string(), opens_img));
    const fs::path run = tmp_ / "run";
    auto r = test::run_command(moeprune_cmd(fmt::format(
        "run -m {} --corpus {} --criteria freq --ram 0.2GB --reserve 0 --compute-ms 5 -c 128 -t 2 -k 8 -o {}",
        (d() / "m.gguf").string(), (tmp_ / "corpus.toml").string(), run.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string html = test::read_bytes(run / "report.html");
    const test::HtmlScripts page = test::html_scripts(html);
    EXPECT_TRUE(page.handlers.empty()) << fmt::format("{}", fmt::join(page.handlers, ", "));
    // The chart libraries, three, then the page's own script with the specs.
    ASSERT_EQ(page.scripts.size(), 4u);
    for (const std::string & script : page.scripts) {
        EXPECT_EQ(script.find("PWNED'</script"), std::string::npos);
    }
    const std::string & own = page.scripts.back();
    const std::string prefix = "\nconst specs = ";
    ASSERT_EQ(own.rfind(prefix, 0), 0u) << own.substr(0, 80);
    const size_t end = own.find(";\n", prefix.size());
    const json specs = json::parse(own.substr(prefix.size(), end - prefix.size()));
    const std::string all = specs.dump();
    EXPECT_NE(all.find(closes_script), std::string::npos) << "the domain is in the charts' data, as it was written";
    EXPECT_NE(all.find("><img src=x onerror=alert(1)></td>\u2028"), std::string::npos);

    const std::string url = "file://" + fs::absolute(run / "report.html").string();
    const auto dom = test::run_command("chromium --headless --no-sandbox --disable-gpu --virtual-time-budget=30000 --dump-dom " +
                                       url + " 2>/dev/null");
    ASSERT_EQ(dom.exit_code, 0);
    EXPECT_NE(dom.output.find(fmt::format("data-rendered=\"{}\"", specs.size())), std::string::npos) << "every chart rendered";
    EXPECT_EQ(dom.output.find("<title>PWNED"), std::string::npos);
}

// λ > 0 asked for: every map's rerouted options are measured in the closed loop, the plan
// gives them that KLD (never the open-loop one of their map), the report shows both loops.
// A task file given to run is scored by its eval stage for the base and every keep map, and
// the report shows the accuracies beside KLD.
TEST_F(RunTest, ATaskFileIsScoredForEveryKeepMapAndReported) {
    std::string tasks;
    static const char * words[] = {"ka lo", "mi ne", "ru ta", "vo xe", "zi pu"};
    for (int t = 0; t < 8; ++t) {
        tasks += fmt::format("{} {} {}\n{}\n", words[t % 5], words[(t + 1) % 5], words[(t + 2) % 5], t % 4);
        for (int e = 0; e < 4; ++e) tasks += fmt::format("{} {}\n", words[(t + e) % 5], words[(t + 2 * e) % 5]);
    }
    test::write_text(tmp_ / "tasks.txt", tasks);
    const fs::path run = tmp_ / "run";
    const std::string args = base_args() + fmt::format(" -k 8 --hellaswag {} --tasks 6 -o {}", (tmp_ / "tasks.txt").string(),
                                                       run.string());
    auto r = test::run_command(moeprune_cmd(args));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json eval = read_json(run / "eval" / "eval.json");
    ASSERT_TRUE(eval.contains("tasks")) << eval.dump().substr(0, 400);
    EXPECT_EQ(eval["tasks"]["format"], "hellaswag");
    EXPECT_EQ(eval["tasks"]["tasks"], 6);
    size_t keep_maps = 0;
    for (const json & c : eval["candidates"]) {
        if (c["kind"] == "keep") {
            EXPECT_EQ(c["tasks"]["tasks"], 6) << c["name"];
            ++keep_maps;
        }
    }
    EXPECT_EQ(keep_maps, 2u);
    const json report = read_json(run / "report.json");
    ASSERT_EQ(report["tasks"]["rows"].size(), 1 + keep_maps) << report["tasks"];
    EXPECT_EQ(report["tasks"]["rows"][0]["map"], "base");
    EXPECT_EQ(report["tasks"]["rows"][0]["correct"], eval["tasks"]["base"]["correct"]);
    EXPECT_TRUE(fs::exists(run / "report" / "tasks.csv"));
    EXPECT_NE(test::read_bytes(run / "report.html").find("Task accuracy"), std::string::npos);
    EXPECT_NE(test::read_bytes(run / "run.toml").find("hellaswag = "), std::string::npos);
    // Another draw of tasks is another eval.
    r = test::run_command(moeprune_cmd(base_args() + fmt::format(" -k 8 --hellaswag {} --tasks 5 -o {}",
                                                                 (tmp_ / "tasks.txt").string(), run.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("eval     running"), std::string::npos) << r.output;
    EXPECT_EQ(read_json(run / "eval" / "eval.json")["tasks"]["tasks"], 5);
}

// Without a task file, the eval stage scores the choice tasks corpus made from the held-out
// side, per domain; the report shows them beside KLD, with a chart; plan --min-accuracy
// leaves out the maps that lose more of the base's accuracy than it allows.
TEST_F(RunTest, WithoutATaskFileTheHeldOutChoiceTasksAreScoredPerDomain) {
    const fs::path run = tmp_ / "run";
    auto r = test::run_command(moeprune_cmd(base_args() + " -k 6,8 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json set = read_json(run / "corpus" / "tasks.json");
    const json eval = read_json(run / "eval" / "eval.json");
    ASSERT_TRUE(eval.contains("tasks")) << eval.dump().substr(0, 400);
    EXPECT_EQ(eval["tasks"]["file"], (run / "corpus" / "tasks.txt").string());
    EXPECT_EQ(eval["tasks"]["tasks"], set["tasks"]) << "every generated task";
    std::map<std::string, int> per_domain;
    for (const json & d : set["domains"]) {
        if (d["tasks"].get<int>() > 0) {
            per_domain[d["domain"].get<std::string>()] = d["tasks"].get<int>();
        }
    }
    // The run tests' held-out side is small: a domain of one document, or without a
    // sentence or line start after a full context, makes none and says why.
    ASSERT_GE(per_domain.size(), 1u) << set.dump();
    for (const json & d : set["domains"]) {
        EXPECT_EQ(d["tasks"].get<int>() == 0, d.contains("skipped")) << d;
    }
    const json & base = eval["tasks"]["base"];
    ASSERT_EQ(base["domains"].size(), per_domain.size());
    int correct = 0;
    for (const json & d : base["domains"]) {
        EXPECT_EQ(d["tasks"].get<int>(), per_domain[d["domain"].get<std::string>()]) << d;
        correct += d["correct"].get<int>();
    }
    EXPECT_EQ(correct, base["correct"].get<int>());

    const json report = read_json(run / "report.json");
    size_t maps = 0, domain_rows = 0;
    for (const json & row : report["tasks"]["rows"]) {
        maps += row["domain"] == "all";
        domain_rows += row["domain"] != "all";
    }
    EXPECT_EQ(maps, 1u + 4u) << "the base and reap and freq at K 6 and 8";
    EXPECT_EQ(domain_rows, maps * per_domain.size());
    const std::string html = test::read_bytes(run / "report.html");
    EXPECT_NE(html.find("Per domain of the held-out text"), std::string::npos);
    EXPECT_NE(html.find("accuracy_vs_k"), std::string::npos);
    EXPECT_NE(test::read_bytes(run / "report" / "tasks.csv").find("domain"), std::string::npos);

    // --min-accuracy 1: only options whose map answers as well as the base are eligible.
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,8 --min-accuracy 1 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json plan = read_json(run / "plan" / "plan.json");
    EXPECT_EQ(plan["inputs"]["min_accuracy"], 1.0);
    const double base_accuracy = base["accuracy"].get<double>();
    for (const int i : plan["pareto_runs_on"].get<std::vector<int>>()) {
        const json & o = plan["options"][size_t(i)];
        ASSERT_FALSE(o["task_accuracy"].is_null()) << o.dump();
        EXPECT_GE(o["task_accuracy"].get<double>(), base_accuracy) << o.dump();
    }
    if (!plan["recommended"].is_null()) {
        EXPECT_GE(plan["options"][plan["recommended"].get<size_t>()]["task_accuracy"].get<double>(), base_accuracy);
    }

    // --tasks-per-domain overrides the manifest's 6: the corpus is made again, with fewer.
    r = test::run_command(moeprune_cmd(base_args() + " -k 6,8 --tasks-per-domain 2 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json fewer = read_json(run / "corpus" / "tasks.json");
    EXPECT_EQ(fewer["settings"]["tasks_per_domain"], 2);
    for (const json & d : fewer["domains"]) {
        EXPECT_EQ(d["tasks"].get<int>(), std::min(2, per_domain[d["domain"].get<std::string>()])) << d;
    }
    EXPECT_NE(test::read_bytes(run / "run.toml").find("\ntasks_per_domain = 2\n"), std::string::npos);
}

TEST_F(RunTest, ReroutingIsMeasuredInTheClosedLoop) {
    const fs::path run = tmp_ / "run";
    auto r = test::run_command(moeprune_cmd(base_args() + " -k 6 --policies lru,belady --cache-shares 0.5 "
                                            "--lambda 0,0.5 -o " + run.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const char * f : {"eval/closed-none.json", "eval/closed-reap-k6.json", "eval/closed-freq-k6.json", "report/closed_loop.csv"}) {
        EXPECT_TRUE(fs::exists(run / f)) << f;
    }
    std::map<std::pair<std::string, int>, double> closed;  // (criterion, cache) -> closed-loop KLD at λ 0.5
    for (const char * f : {"eval/closed-none.json", "eval/closed-reap-k6.json", "eval/closed-freq-k6.json"}) {
        const json e = read_json(run / f);
        for (const json & c : e["candidates"]) {
            if (c["kind"] == "closed-loop") {
                EXPECT_EQ(c["policy"], "lru") << "belady reads the future: no closed loop";
                EXPECT_EQ(c["lambda"].get<double>(), 0.5);
                const std::string map = c["keep"].is_null() ? "none" : fs::path(c["keep"].get<std::string>()).stem().string();
                closed[{map.substr(0, map.rfind("-k")), c["cache"].get<int>()}] = c["all"]["kld_mean"].get<double>();
            }
        }
    }
    EXPECT_EQ(closed.size(), 3u);
    int rerouted = 0;
    const json plan = read_json(run / "plan" / "plan.json");
    for (const json & o : plan["options"]) {
        if (o["lambda"].get<double>() > 0 && o["policy"] == "lru") {
            ++rerouted;
            const auto it = closed.find({o["criterion"].get<std::string>(), o["cache_experts"].get<int>()});
            ASSERT_NE(it, closed.end()) << o.dump();
            EXPECT_DOUBLE_EQ(o["kld_mean"].get<double>(), it->second) << o.dump();
            EXPECT_EQ(o["kld_loop"], "closed");
        }
    }
    EXPECT_EQ(rerouted, 3);
    const json report = read_json(run / "report.json");
    ASSERT_TRUE(report["closed_loop"].is_array());
    EXPECT_EQ(report["closed_loop"].size(), 3u);
    EXPECT_EQ(test::read_bytes(run / "report.html").find("Not measured in this run"), std::string::npos);

    // A stage manifest whose digest is not a string is named by file and field.
    json manifest = read_json(run / "eval" / "stage.json");
    const std::string first = manifest["outputs"].begin().key();
    manifest["outputs"][first] = 5;
    test::write_text(run / "eval" / "stage.json", manifest.dump());
    r = test::run_command(moeprune_cmd(base_args() + " -k 6 --policies lru,belady --cache-shares 0.5 "
                                       "--lambda 0,0.5 -o " + run.string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("eval/stage.json: outputs." + first + ": is 5, not a string"), std::string::npos) << r.output;
    // -o naming a file.
    test::write_text(tmp_ / "afile", "x");
    r = test::run_command(moeprune_cmd(base_args() + " -k 6 -o " + (tmp_ / "afile").string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("afile: exists and is not a folder"), std::string::npos) << r.output;
    EXPECT_EQ(test::read_bytes(tmp_ / "afile"), "x");
}

TEST_F(RunTest, KilledCollectResumesToTheSameStatistics) {
    const std::string args = base_args() + " -k 6 --config " + (tmp_ / "run.toml").string();
    test::write_text(tmp_ / "run.toml", "save_every = 1\n");
    // Uninterrupted.
    auto r = test::run_command(moeprune_cmd(args + " -o " + (tmp_ / "a").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // Killed with SIGKILL once collect has written a checkpoint, then run again.
    const fs::path b = tmp_ / "b";
    const pid_t pid = fork();
    if (pid == 0) {
        const std::string cmd = moeprune_cmd(args + " -o " + b.string()) + " >/dev/null 2>&1";
        execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
        _exit(127);
    }
    bool killed = false;
    for (int i = 0; i < 2000 && !killed; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::error_code ec;
        if (fs::exists(b / "collect" / "stats.json.checkpoint", ec)) {
            kill(pid, SIGKILL);
            killed = true;
        }
    }
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(killed) << "collect wrote no checkpoint to kill after";
    ASSERT_TRUE(WIFSIGNALED(status)) << "the run finished before the kill";
    EXPECT_FALSE(fs::exists(b / "collect" / "stage.json")) << "a killed stage has no manifest";
    EXPECT_FALSE(fs::exists(b / "collect" / "stats.json")) << "a checkpoint is never under the statistics' name";
    r = test::run_command(moeprune_cmd(args + " -o " + b.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json sa = read_json(tmp_ / "a" / "collect" / "stats.json"), sb = read_json(b / "collect" / "stats.json");
    EXPECT_TRUE(sa["layers"] == sb["layers"]) << "statistics differ from the uninterrupted run's";
    EXPECT_EQ(sa["n_tokens"], sb["n_tokens"]);
    EXPECT_FALSE(fs::exists(b / "collect" / "stats.json.checkpoint")) << "the resumed run left its checkpoint";
    const json ha = read_json(tmp_ / "a" / "heldout" / "stats.json"), hb = read_json(b / "heldout" / "stats.json");
    EXPECT_TRUE(ha["layers"] == hb["layers"]) << "held-out statistics differ";
    EXPECT_EQ(fs::file_size(tmp_ / "a" / "heldout" / "router.trace"), fs::file_size(b / "heldout" / "router.trace"));
}

TEST_F(RunTest, BadConfigIsNamedByFileAndKey) {
    test::write_text(tmp_ / "run.toml", "k = [6]\nram = \"1G\"\ncriterias = [\"reap\"]\n");
    auto r = test::run_command(moeprune_cmd("run --config " + (tmp_ / "run.toml").string() + " -o " + (tmp_ / "o").string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("run.toml:3:1: unknown key \"criterias\""), std::string::npos) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} -k 6 --ram 1MB -o {}", (d() / "m.gguf").string(),
                                                   (d() / "corpus.toml").string(), (tmp_ / "o").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("less than the"), std::string::npos) << r.output;
    test::write_text(tmp_ / "repeats.toml", "measure_repeats = 0\n");
    r = test::run_command(moeprune_cmd(fmt::format("run --config {} -m {} --corpus {} -k 6 --ram 4GB -o {}",
                                                   (tmp_ / "repeats.toml").string(), (d() / "m.gguf").string(),
                                                   (d() / "corpus.toml").string(), (tmp_ / "o").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("measure_repeats 0 must be from 1 to 100"), std::string::npos) << r.output;
    // A flag says the same of its value; --corpus entries are not split at a comma, which a
    // path may hold.
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus prose=/nonexistent/a,b.jsonl -k 6 --measure-repeats 0 "
                                                   "-o {}", (d() / "m.gguf").string(), (tmp_ / "o").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("--measure-repeats: 0 must be from 1 to 100"), std::string::npos) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus prose=/nonexistent/a,b.jsonl -k 6 -o {}",
                                                   (d() / "m.gguf").string(), (tmp_ / "o").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("source \"/nonexistent/a,b.jsonl\" matches no file"), std::string::npos) << r.output;

    // A media source without the projector is refused by name before any stage runs.
    test::write_text(tmp_ / "media.toml", "[[source]]\npath = \"" + (d() / "src" / "prose").string() +
                                              "\"\ndomain = \"photos\"\nmedia = \"image\"\n");
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} -k 6 --ram 4GB --reserve 0 -o {}", (d() / "m.gguf").string(),
                                                   (tmp_ / "media.toml").string(), (tmp_ / "media-run").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("source \"" + (d() / "src" / "prose").string() + "\" is image files: give the model's projector with --mmproj FILE"),
              std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(tmp_ / "media-run" / "corpus" / "calib.jsonl"));
}

// A refused run changes nothing: the finished run's run.toml stays as it was, and every
// setting is checked before any stage runs (issue 47).
TEST_F(RunTest, RefusedRunKeepsTheRecordAndRelativePathsReadBack) {
    const fs::path run = tmp_ / "run";
    fs::create_directories(run);
    const std::string record = "# a finished run's record\nk = [6]\n";
    test::write_text(run / "run.toml", record);
    test::write_text(tmp_ / "edited.toml", fmt::format("model = \"{}\"\ncorpus = [\"{}\"]\nk = [0]\n",
                                                       (d() / "m.gguf").string(), (d() / "corpus.toml").string()));
    const std::string model = (d() / "m.gguf").string(), corpus = (d() / "corpus.toml").string();
    for (const auto & [args, message] : std::vector<std::pair<std::string, std::string>>{
             {fmt::format("-m {} --corpus {}/missing.toml -k 6", model, tmp_.path().string()), "missing.toml"},
             {fmt::format("-m {} --corpus {} -k 0", model, corpus), "-k 0: the experts kept per layer are between the 2"},
             {fmt::format("-m {} --corpus {} -k 6 --measure abc", model, corpus), "--measure \"abc\" is not a size"},
             {fmt::format("-m {} --corpus {} -k 6 --policies lru,nope", model, corpus), "--policies nope: not a cache policy"},
             {fmt::format("--config {}", (tmp_ / "edited.toml").string()), "-k 0: the experts kept"},
             {fmt::format("-m {} --corpus {} -k 6 --ram 1MB", model, corpus), "minus the reserve of 2G leaves"},
         }) {
        const auto r = test::run_command(moeprune_cmd(fmt::format("run {} -o {}", args, run.string())));
        EXPECT_NE(r.exit_code, 0) << args;
        EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
        EXPECT_EQ(r.output.find("running"), std::string::npos) << "a stage ran before the refusal: " << r.output;
        EXPECT_EQ(test::read_bytes(run / "run.toml"), record) << args;
    }

    // Relative paths on the command line are the working directory's: run.toml names
    // them absolutely, and reading it back (through a relative path) and writing it again
    // changes nothing. The run is stopped as soon as it has recorded its settings.
    const std::string script = fmt::format(
        "(cd {d} && exec {moeprune} run -m m.gguf --corpus corpus.toml -k 6 --ram 4GB -c 128 -t 2 -o r2 >/dev/null 2>&1) & m=$!; "
        "for i in $(seq 400); do [ -f {d}/r2/run.toml ] && break; sleep 0.05; done; kill -9 $m; wait $m; "
        "(cd {d} && exec {moeprune} run --config r2/run.toml -k 7 -o r3 >/dev/null 2>&1) & m=$!; "
        "for i in $(seq 400); do [ -f {d}/r3/run.toml ] && break; sleep 0.05; done; kill -9 $m; wait $m; true",
        fmt::arg("d", d().string()), fmt::arg("moeprune", test::bin("moeprune").string()));
    test::write_text(tmp_ / "rel.sh", script);
    test::run_command("bash " + (tmp_ / "rel.sh").string());
    for (const char * dir : {"r2", "r3"}) {
        const RunConfig c = read_run_config(d() / dir / "run.toml");
        EXPECT_EQ(c.model, d() / "m.gguf") << dir;
        ASSERT_EQ(c.corpus.size(), 1u);
        EXPECT_EQ(c.corpus[0], (d() / "corpus.toml").string()) << dir;
        EXPECT_EQ(run_config_toml(c), test::read_bytes(d() / dir / "run.toml")) << dir;
        fs::remove_all(d() / dir);
    }
}

// --measure: llama.cpp's decode under memory limits calibrates replay and plan, and the
// report sets predicted beside measured; --verify measures the recommendation for real.
TEST_F(RunTest, MeasuredRunCalibratesThePlanAndVerifiesTheRecommendation) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    const fs::path run = tmp_ / "run";
    // One thread: ctest runs another test beside this one on two cores, and ggml's threads
    // spinning for a busy core would make measure call the machine busy, as it should.
    const std::string args = fmt::format("run -m {} --corpus {} --criteria reap,freq -c 128 -t 1 -k 6,8 --ram 0.3GB "
                                         "--measure 75%,150% --measure-tokens 16 --verify -o {}",
                                         (d() / "m.gguf").string(), (d() / "corpus.toml").string(), run.string());
    auto r = test::run_command(moeprune_cmd(args));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "running"), 11) << r.output;
    const json measure = read_json(run / "measure" / "measure.json");
    const json plan = read_json(run / "plan" / "plan.json");
    const json & timing = plan["inputs"]["throughput"];
    EXPECT_EQ(timing["compute_ms"].get<double>(), measure["resident"]["decode"]["ms_per_token"]["mean"].get<double>());
    EXPECT_EQ(timing["ssd_gbps"].get<double>(), measure["probe"]["effective_gbps"].get<double>());
    EXPECT_EQ(plan["inputs"]["reserve_bytes"].get<double>(), measure["process_bytes"].get<double>());
    EXPECT_NE(plan["why"].get<std::string>().find("measured by"), std::string::npos) << plan["why"];
    // The replay prices its records with the same timing.
    EXPECT_EQ(read_json(run / "replay" / "none.json")["inputs"]["throughput"]["ssd_gbps"], timing["ssd_gbps"]);

    const json report = read_json(run / "report.json");
    ASSERT_EQ(report["measured"].size(), 2u) << report["measured"];
    for (size_t i = 0; i < 2; ++i) {
        const json & row = report["measured"][i];
        const json & m = measure["runs"][i];
        EXPECT_EQ(row["measured_tok_per_s"], m["decode"]["tokens_per_second"]);
        EXPECT_EQ(row["predicted_tok_per_s"], m["predicted"]["tokens_per_second"]);
        EXPECT_EQ(row["error"], m["error"]);
    }
    EXPECT_NE(test::read_bytes(run / "report.html").find("Predicted vs measured"), std::string::npos);
    EXPECT_TRUE(fs::exists(run / "report" / "measured.csv"));

    ASSERT_FALSE(plan["recommended"].is_null()) << plan["why"];
    // The shortlist: the recommendation, and the front of what llama.cpp runs, measured
    // under --ram; the final plan ranks the measured figures, the predicted beside them.
    const json predicted = read_json(run / "plan" / "predicted.json");
    const json & recommended = plan["options"][plan["recommended"].get<size_t>()];
    EXPECT_TRUE(recommended.contains("shortlist") || recommended.contains("measured_ram"))
        << "the recommendation was measured: " << plan["why"];
    EXPECT_EQ(recommended["runs_on"], "llama.cpp");
    size_t measured_options = 0;
    for (const json & o : plan["options"]) {
        if (!o.contains("shortlist")) {
            continue;
        }
        ++measured_options;
        const json & s = o["shortlist"];
        EXPECT_EQ(s["ram"], "0.3GB");
        EXPECT_EQ(o["tok_per_s"], s["measured_tok_per_s"]);
        const json m = read_json(s["measure"].get<std::string>());
        EXPECT_EQ(s["measured_tok_per_s"], m["runs"][0]["decode"]["tokens_per_second"]);
        EXPECT_FALSE(fs::exists(s["model"].get<std::string>()) && o["k"] != predicted["inputs"]["geometry"]["experts"])
            << "a sliced model is deleted once measured";
    }
    // K 6 and 8 of reap and freq, each resident: four options, the shortlist's default.
    EXPECT_EQ(measured_options, 4u);
    if (recommended.contains("shortlist")) {
        EXPECT_NE(plan["why"].get<std::string>().find("before it was measured"), std::string::npos) << plan["why"];
    }
    // The report's first screen: what to run, measured how fast, at what cost, under what.
    const json & answer = report["recommendation"]["answer"];
    ASSERT_EQ(answer.size(), 4u) << answer;
    EXPECT_EQ(answer[1].get<std::string>().rfind("It decoded ", 0), 0u) << answer;
    EXPECT_NE(answer[1].get<std::string>().find("measured by llama.cpp"), std::string::npos) << answer;
    EXPECT_EQ(answer[3].get<std::string>().rfind("Conditions: a memory limit of ", 0), 0u) << answer;
    EXPECT_EQ(report["recommendation"]["commands"], plan["commands"]);
    EXPECT_NE(test::read_bytes(run / "report.html").find("Runs today in llama.cpp"), std::string::npos);
    const json verify = read_json(run / "verify" / "summary.json");
    EXPECT_EQ(verify["predicted_tok_per_s"],
              recommended.contains("shortlist") ? recommended["shortlist"]["predicted_tok_per_s"] : recommended["tok_per_s"]);
    EXPECT_GT(verify["measured_tok_per_s"].get<double>(), 0);
    const json verified = read_json(run / "verify" / "verify.json");
    EXPECT_EQ(verified["runs"].size(), 1u);
    // Verified under the limit it was measured under, which its commands use: a measure's
    // limit for an option measure timed, --ram for the shortlist's.
    if (recommended.contains("measured_limit_bytes")) {
        EXPECT_EQ(verified["runs"][0]["limit_bytes"].get<double>(), recommended["measured_limit_bytes"].get<double>());
        EXPECT_EQ(verify["ram"], std::to_string(uint64_t(recommended["measured_limit_bytes"].get<double>())));
    } else {
        EXPECT_EQ(verify["ram"], "0.3GB");
    }
    EXPECT_NE(r.output.find("verify: "), std::string::npos) << r.output;
    // Beside it, the machine's drift since the shortlist: the same model's resident decodes.
    EXPECT_EQ(verify["resident_tok_per_s"], verified["resident"]["decode"]["tokens_per_second"]);
    if (recommended.contains("shortlist")) {
        EXPECT_EQ(verify["shortlist_resident_tok_per_s"],
                  read_json(recommended["shortlist"]["measure"].get<std::string>())["resident"]["decode"]["tokens_per_second"]);
        EXPECT_NEAR(verify["drift"].get<double>(),
                    verify["resident_tok_per_s"].get<double>() / verify["shortlist_resident_tok_per_s"].get<double>() - 1,
                    1e-12);
        EXPECT_NE(r.output.find("when the shortlist measured it: the machine ran "), std::string::npos) << r.output;
    }

    r = test::run_command(moeprune_cmd(args));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "unchanged, skipped"), 11) << r.output;

    // Killed while measuring again: the earlier measurement is not left under its final
    // name without the stage's manifest, where plan --measured would take it.
    test::write_text(tmp_ / "kill.sh", fmt::format(
        "{} --from measure > {} 2>&1 & m=$!; for i in $(seq 600); do grep -q 'measure  running' {} && break; sleep 0.02; done; "
        "kill -9 $m; wait $m; true", moeprune_cmd(args), (tmp_ / "log").string(), (tmp_ / "log").string()));
    test::run_command("bash " + (tmp_ / "kill.sh").string());
    EXPECT_NE(test::read_bytes(tmp_ / "log").find("measure  running"), std::string::npos) << test::read_bytes(tmp_ / "log");
    for (const char * out : {"measure.json", "measure.txt"}) {
        EXPECT_FALSE(fs::exists(run / "measure" / out) && !fs::exists(run / "measure" / "stage.json")) << out;
    }
}

// run.toml's keys are one table: every key is documented, and a config with every key
// set to something other than its default reads back as written.
TEST(RunConfigKeys, EveryKeyIsDocumentedAndReadsBackAsWritten) {
    const std::string docs = test::read_bytes(fs::path(MOEPRUNE_SOURCE_DIR) / "docs" / "run.md");
    const std::vector<std::string> keys = run_config_keys();
    ASSERT_EQ(keys.size(), 39u) << "one key per RunConfig member";
    for (const std::string & k : keys) {
        EXPECT_NE(docs.find("`" + k + "`"), std::string::npos) << k << " is not in docs/run.md";
    }

    RunConfig c;
    c.model = "/m/model.gguf";
    c.corpus = {"prose=/c/prose", "code=/c/code"};
    c.mmproj = "/m/mmproj.gguf";
    c.ks = {6, 8};
    c.criteria = {"freq"};
    c.ram = "3G";
    c.reserve = "1G";
    c.ssd = 3.9;
    c.read_latency_us = 60;
    c.queue_depth = 8;
    c.compute_ms = 1.5;
    c.sync_us = 2;
    c.policies = {"lru"};
    c.cache_shares = {0.5};
    c.lambdas = {0, 0.5};
    c.max_kld = 0.05;
    c.min_accuracy = 0.9;
    c.runs_on = RunsOn::Any;
    c.llama_bin = "/opt/llama/bin";
    c.hellaswag = "/t/hellaswag.txt";
    c.winogrande = "/t/winogrande.csv";
    c.multiple_choice = "/t/mc.bin";
    c.tasks = 50;
    c.ctx = 256;
    c.threads = 2;
    c.seed = 7;
    c.eval_share = 0.2;
    c.tokens = 1000;
    c.doc_tokens = 64;
    c.tasks_per_domain = 200;
    c.trace_top = 16;
    c.save_every = 4;
    c.slice = "best";
    c.measure = {"25%", "50%"};
    c.measure_tokens = 32;
    c.measure_repeats = 3;
    c.measure_shortlist = 2;
    c.read_ahead_kb = {128, 8192};
    c.verify = true;
    const std::string text = run_config_toml(c);
    for (const std::string & k : keys) {
        EXPECT_NE(text.find("\n" + k + " = "), std::string::npos) << k << " is not written";
    }
    test::TempDir dir;
    test::write_text(dir / "run.toml", text);
    EXPECT_EQ(run_config_toml(read_run_config(dir / "run.toml")), text);

    test::write_text(dir / "bad.toml", "model = \"m.gguf\"\nram = [\"3G\"]\n");
    try {
        read_run_config(dir / "bad.toml");
        FAIL() << "an array where one value goes";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("bad.toml:2:1: \"ram\" must be a single value"), std::string::npos) << e.what();
    }
}
