// `moeprune measure` end to end where this machine lets it make a memory cgroup (root or
// a delegated cgroup); skipped with the reason where it cannot.
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "measure/cgroup.h"
#include "measure/measure.h"
#include "measure/predict.h"
#include "model/inspect.h"
#include "model/model_file.h"
#include "run/shortlist.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <chrono>
#include <sstream>
#include <csignal>
#include <unistd.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

// A small model and ~700 tokens of text in `dir`. Its experts (20 MB) are most of it, so a
// limit at 50% of them leaves megabytes above what stays resident: more than the process's
// own memory varies, and with no large vocabulary matrices for the kernel to evict instead.
void make_inputs(const test::TempDir & dir) {
    const auto r = test::run_command(moeprune_cmd(fmt::format(
        "synth --layers 4 --experts 16 --used 4 --ff 2048 --type q8_0 -o {}", (dir / "m.gguf").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    test::write_text(dir / "text.txt", test::mixed_text());
}

std::string measure_args(const test::TempDir & dir, const std::string & extra, int tokens = 16, int warmup = 4) {
    return fmt::format("measure -m {} -f {} --warmup {} --tokens {} --probe-mib 1 {}", (dir / "m.gguf").string(),
                       (dir / "text.txt").string(), warmup, tokens, extra);
}

// What a killed measure leaves: its scratch folder with the marker no one holds, and a
// cgroup named by its token. Returns the cgroup.
fs::path planted_killed_measure(const CgroupSupport & s, const std::string & token) {
    const fs::path scratch = fs::temp_directory_path() / (kCgroupPrefix + token);
    fs::create_directories(scratch);
    test::write_text(scratch / "owner.lock", "");
    const fs::path stale = s.parent / fmt::format("{}{}-0", kCgroupPrefix, token);
    fs::create_directory(stale);
    return stale;
}

// pgrep for a command line, less the shell that runs it (whose own line holds the pattern).
std::string pgrep(const std::string & marker) { return fmt::format("pgrep -f '[{}]{}'", marker[0], marker.substr(1)); }

size_t count_named(const fs::path & dir, const std::string & prefix) {
    size_t n = 0;
    for (const fs::directory_entry & e : fs::directory_iterator(dir)) {
        n += e.path().filename().string().rfind(prefix, 0) == 0;
    }
    return n;
}

} // namespace

TEST(Measure, DecodesUnderLimitsPredictsAndTracesTheTimedTokens) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const fs::path out = dir / "m.json", trace = dir / "m.mptrace";
    const auto r = test::run_command(
        moeprune_cmd(measure_args(dir, fmt::format("--ram 50%,200% --min-seconds 0.5 --json {} --trace {} --llama-bench {}", out.string(),
                                                   trace.string(), test::bin("llama-bench").string()))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json m = json::parse(test::read_bytes(out));
    EXPECT_EQ(m.at("format"), "moeprune-measure");
    ASSERT_TRUE(m.at("busy").is_null()) << m.at("busy");
    EXPECT_EQ(m.at("system").at("cgroup_version"), support.version);
    ASSERT_EQ(m.at("runs").size(), 2u);
    const uint64_t need = m.at("resident_need_bytes").get<uint64_t>();
    EXPECT_GT(need, m.at("resident_weight_bytes").get<uint64_t>());   // plus the process's own memory
    // The process's own memory: its anonymous pages and its page tables, both charged to the limit.
    const json & process = m.at("resident").at("detail").at("process");
    EXPECT_GT(process.at("VmPTE").get<uint64_t>(), 0u) << process;
    EXPECT_EQ(m.at("process_bytes").get<uint64_t>(),
              process.at("RssAnon").get<uint64_t>() + process.at("VmPTE").get<uint64_t>());
    uint64_t previous = 0;
    const GgufModel gguf = GgufModel::open(dir / "m.gguf");
    for (const json & run : m.at("runs")) {
        EXPECT_GT(run.at("limit_bytes").get<uint64_t>(), need);
        EXPECT_GT(run.at("limit_bytes").get<uint64_t>(), previous);
        previous = run.at("limit_bytes").get<uint64_t>();
        EXPECT_LE(run.at("peak_bytes").get<uint64_t>(), run.at("limit_bytes").get<uint64_t>());
        EXPECT_EQ(run.at("decode").at("tokens"), 16);
        EXPECT_EQ(run.at("detail").at("per_token").at("wall_us").size(), 16u);
        EXPECT_EQ(run.at("detail").at("per_token").at("major_faults").size(), 16u);
        EXPECT_GT(run.at("decode").at("tokens_per_second").get<double>(), 0);
        EXPECT_GT(run.at("predicted").at("tokens_per_second").get<double>(), 0);
        EXPECT_GE(run.at("error").get<double>(), 0);
        // The prediction says when it is outside its model (a read-around window over half the
        // page cache, or a model too large whose every-token weights the active list cannot hold).
        const uint64_t window = m.at("calibration").at("readaround_bytes").get<uint64_t>();
        const uint64_t cache = run.at("predicted").at("page_cache_bytes").get<uint64_t>();
        const json & outside = run.at("predicted").at("outside_model");
        EXPECT_EQ(outside.is_null() ? std::string() : outside.get<std::string>(),
                  outside_model(cache, window, m.at("model").at("file_bytes").get<uint64_t>(), every_token_bytes(gguf)))
            << run.at("predicted");
        // Which experts the kernel held, by mincore() after every timed token, against the simulation.
        const json & residency = run.at("residency");
        EXPECT_EQ(residency.at("samples"), 16) << residency;
        EXPECT_EQ(run.at("detail").at("residency").size(), 16u);
        EXPECT_EQ(residency.at("experts").get<size_t>(), m.at("model").at("routed_layers").size() * 16);
        for (const char * share : {"agreement", "jaccard"}) {
            EXPECT_GE(residency.at(share).get<double>(), 0) << residency;
            EXPECT_LE(residency.at(share).get<double>(), 1) << residency;
        }
        EXPECT_LE(residency.at("measured_resident_mean").get<double>(), residency.at("experts").get<double>());
    }
    // At 200% the whole model fits with room to spare: llama.cpp's prefetch left every expert
    // cached, and the simulation agrees. (100% leaves no room at all above the experts: a few MB
    // more process memory than in the resident run, as under ASan, evicts some of them.)
    const json & fits = m.at("runs").at(1).at("residency");
    EXPECT_GE(fits.at("measured_resident_mean").get<double>(), 0.9 * fits.at("experts").get<double>()) << fits;
    EXPECT_GE(fits.at("agreement").get<double>(), 0.9) << fits;
    // llama.cpp's llama-bench ran under the same limits, before and after each run: three
    // repetitions each, the first cold and left out.
    for (const json & run : {m.at("resident"), m.at("runs").at(0), m.at("runs").at(1)}) {
        const json & lb = run.at("llama_bench");
        double steady = 0;
        for (const char * side : {"before", "after"}) {
            const json & samples = lb.at(side).at("samples_ts");
            ASSERT_EQ(samples.size(), 3u) << lb;
            const double mean = (samples[1].get<double>() + samples[2].get<double>()) / 2;
            EXPECT_DOUBLE_EQ(lb.at(side).at("tokens_per_second").get<double>(), mean);
            steady += mean / 2;
        }
        EXPECT_DOUBLE_EQ(lb.at("tokens_per_second").get<double>(), steady);
        EXPECT_NEAR(lb.at("difference").get<double>(),
                    std::abs(run.at("decode").at("tokens_per_second").get<double>() - steady) / steady, 1e-9);
        EXPECT_NE(lb.at("command").get<std::string>().find("-n 16"), std::string::npos) << lb;
    }
    // Only the model's pages were dropped before the resident run, and its load read them all.
    const json & resident = m.at("resident").at("detail");
    if (resident.at("read_bytes_counted").get<bool>()) {
        EXPECT_GE(resident.at("load_read_bytes").get<double>(), 0.9 * m.at("model").at("file_bytes").get<double>());
    }
    EXPECT_EQ(m.at("resident").at("decode").at("major_faults_per_token"), 0.0);
    // 16 tokens of this model decode in less than --min-seconds (but under ASan, perhaps):
    // the resident run decoded them again until that much was timed, each token's time the
    // median of its passes.
    EXPECT_GE(resident.at("passes").get<int>(), 1);
    EXPECT_TRUE(resident.at("timed_seconds").get<double>() >= 0.5 || resident.at("passes") == 64) << resident;
    EXPECT_EQ(m.at("settings").at("min_seconds"), 0.5);
    EXPECT_GT(m.at("probe").at("experts").get<int>(), 0);
    // The probe's sequential reads give the device's rate, and its faults the wait beyond it.
    EXPECT_GT(m.at("probe").at("sequential_gbps").get<double>(), 0) << m.at("probe");
    if (m.at("probe").at("fault_ms").is_number()) {
        EXPECT_GE(m.at("probe").at("fault_ms").get<double>(), 0) << m.at("probe");
    }
    // The read rate the plan prices with is the decode's own, fitted on the limits that
    // streamed; each limit's prediction used the rate of the others (the probe's where none).
    const json & calibration = m.at("calibration");
    const double compute_ms = calibration.at("compute_ms").get<double>();
    // The tensors every token reads whole at the device's sequential rate, the probe's.
    const double sequential_gbps = m.at("probe").at("sequential_gbps").get<double>();
    EXPECT_EQ(calibration.at("sequential_gbps").get<double>(), sequential_gbps);
    const auto fit = [&](const json * left_out, std::vector<std::string> & on) {
        std::vector<StreamFitPoint> points;
        for (const json & run : m.at("runs")) {
            if (&run != left_out && run.at("predicted").at("read_bytes_per_token").get<double>() > 0) {
                points.push_back({run.at("predicted").at("expert_read_bytes_per_token").get<double>(),
                                  run.at("decode").at("ms_per_token").at("mean").get<double>(),
                                  run.at("predicted").at("other_read_bytes_per_token").get<double>() / 1e6 /
                                      sequential_gbps});
                on.push_back(run.at("ram").get<std::string>());
            }
        }
        return fit_stream(points, compute_ms, m.at("probe").at("sequential_gbps").get<double>());
    };
    std::vector<std::string> on;
    if (const StreamFit all = fit(nullptr, on); all.read_gbps > 0) {
        EXPECT_EQ(calibration.at("fitted_on").get<std::vector<std::string>>(), on);
        EXPECT_DOUBLE_EQ(calibration.at("read_gbps").get<double>(), all.read_gbps);
        EXPECT_DOUBLE_EQ(calibration.at("stream_ms").get<double>(), all.stream_ms);
        EXPECT_EQ(calibration.at("fault_ms").get<double>(), 0.0);
    } else {
        EXPECT_TRUE(calibration.at("fitted_on").empty()) << calibration;
        EXPECT_EQ(calibration.at("read_gbps"), m.at("probe").at("sequential_gbps"));
    }
    for (const json & run : m.at("runs")) {
        std::vector<std::string> others;
        const StreamFit others_fit = fit(&run, others);
        const json & p = run.at("predicted");
        const double transfer_ms = p.at("read_bytes_per_token").get<double>() / 1e6;
        const double expert_ms = p.at("expert_read_bytes_per_token").get<double>() / 1e6;
        const double other_ms = p.at("other_read_bytes_per_token").get<double>() / 1e6 / sequential_gbps;
        const double expected = others_fit.read_gbps > 0
                                    ? compute_ms + expert_ms / others_fit.read_gbps + other_ms +
                                          (transfer_ms > 0 ? others_fit.stream_ms : 0)
                                    : compute_ms + p.at("faults_per_token").get<double>() *
                                                            m.at("probe").value("fault_ms", 0.0) +
                                               transfer_ms / sequential_gbps;
        EXPECT_NEAR(p.at("ms_per_token").get<double>(), expected, 1e-6 * expected) << run.at("ram");
    }
    EXPECT_TRUE(m.at("median_error").is_number());
    // The trace holds exactly the timed tokens, after the warm-up.
    const TraceReader t = TraceReader::open(trace);
    ASSERT_EQ(t.n_tokens(), 16u);
    EXPECT_EQ(t.token_meta().front().pos, 4);
    EXPECT_EQ(t.header().n_layer, m.at("model").at("routed_layers").size());

    // A plan calibrated by it: compute time from the resident run, every limit an option as measured.
    const fs::path plan = dir / "plan.json";
    const auto p = test::run_command(moeprune_cmd(
        fmt::format("plan -m {} -k 16 --measured {} --json {}", (dir / "m.gguf").string(), out.string(), plan.string())));
    ASSERT_EQ(p.exit_code, 0) << p.output;
    const json pj = json::parse(test::read_bytes(plan));
    EXPECT_EQ(pj.at("inputs").at("throughput").at("compute_ms").get<double>(),
              m.at("resident").at("decode").at("ms_per_token").at("mean").get<double>());
    EXPECT_EQ(pj.at("inputs").at("throughput").at("ssd_gbps").get<double>(),
              m.at("probe").at("effective_gbps").get<double>());
    size_t measured_options = 0;
    for (const json & o : pj.at("options")) {
        if (o.contains("measured_ram")) {
            const json & run = m.at("runs").at(measured_options++);
            EXPECT_EQ(o.at("measured_ram"), run.at("ram"));
            EXPECT_EQ(o.at("tok_per_s").get<double>(), run.at("decode").at("tokens_per_second").get<double>());
        }
    }
    EXPECT_EQ(measured_options, 2u);
    EXPECT_NE(p.output.find("measured by"), std::string::npos) << p.output;
}

// --repeats: the limits measured round after round, each kept at its median run, the
// resident decode its prediction starts from as well.
TEST(Measure, RepeatsKeepEachLimitsMedianRunAndPredictFromTheMedianCompute) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const fs::path out = dir / "m.json";
    const auto r = test::run_command(moeprune_cmd(
        measure_args(dir, fmt::format("--ram 50%,75% --repeats 3 --min-seconds 0 --json {}", out.string()))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each limit is the median of 3 runs"), std::string::npos) << r.output;
    const json m = json::parse(test::read_bytes(out));
    EXPECT_EQ(m.at("settings").at("repeats"), 3);
    ASSERT_EQ(m.at("runs").size(), 2u) << "one run per limit, not per repeat";
    for (const json & run : m.at("runs")) {
        std::vector<double> speeds = run.at("repeats_tokens_per_second").get<std::vector<double>>();
        ASSERT_EQ(speeds.size(), 3u) << run.at("ram");
        std::sort(speeds.begin(), speeds.end());
        EXPECT_EQ(run.at("decode").at("tokens_per_second").get<double>(), speeds[1]) << run.at("ram");
        EXPECT_EQ(run.at("detail").at("per_token").at("wall_us").size(), 16u) << "the kept run's own detail";
    }
    ASSERT_EQ(m.at("calibrations").size(), 1u);
    const json & c = m.at("calibrations").at(0);
    std::vector<double> compute = c.at("compute_ms_repeats").get<std::vector<double>>();
    ASSERT_EQ(compute.size(), 3u);
    EXPECT_EQ(compute.front(), m.at("resident").at("decode").at("ms_per_token").at("mean").get<double>())
        << "the first round's resident decode is the resident run";
    std::sort(compute.begin(), compute.end());
    EXPECT_EQ(c.at("compute_ms").get<double>(), compute[1]);
    // Each limit predicted from the median compute: at least that long per token.
    if (m.at("busy").is_null()) {
        for (const json & run : m.at("runs")) {
            EXPECT_GE(run.at("predicted").at("ms_per_token").get<double>(), compute[1] * (1 - 1e-9)) << run.at("ram");
        }
    }
}

// moeprune limit, as plan's printed commands use it: the command runs in a cgroup of its
// own under the limit, its status comes back, and the cgroup goes with it.
TEST(Measure, LimitRunsACommandInACgroupOfItsOwnAndPassesItsStatus) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    const size_t before = count_named(support.parent, kCgroupPrefix);
    // Its cgroup, limited to what --ram says (32000000 bytes, as plan prints it), one of
    // moeprune's under the same parent as measure's.
    const std::string limit_file = support.version == 2 ? "memory.max" : "memory.limit_in_bytes";
    const fs::path seen = dir / "seen.txt";
    auto r = test::run_command(moeprune_cmd(fmt::format(
        "limit --ram 32000000 -- sh -c 'g=$(basename $(grep -E \"^0::|:memory:\" /proc/self/cgroup | cut -d: -f3)); "
        "cat {}/$g/{} > {} && echo $g >> {}; exit 3'",
        support.parent.string(), limit_file, seen.string(), seen.string())));
    EXPECT_EQ(r.exit_code, 3) << r.output;
    std::istringstream lines(test::read_bytes(seen));
    uint64_t limit = 0;
    std::string name;
    lines >> limit >> name;
    EXPECT_LE(limit, 32000000u) << "the kernel keeps whole pages";
    EXPECT_GT(limit, 32000000u - 4096 * 16);
    EXPECT_EQ(name.rfind(kCgroupPrefix, 0), 0u) << name;
    EXPECT_EQ(count_named(support.parent, kCgroupPrefix), before) << "the cgroup is removed with its command";
    // llama.cpp's own tool under it, as plan prints it, mapping its model.
    make_inputs(dir);
    r = test::run_command(moeprune_cmd(fmt::format("limit --ram 512MB -- {} -m {} -t 1 -c 64 -p Hello -n 4 -no-cnv",
                                                   test::bin("llama-completion").string(), (dir / "m.gguf").string())));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("Hello"), std::string::npos) << r.output;
    // The kernel's out-of-memory kill, named with the limit.
    r = test::run_command(moeprune_cmd("limit --ram 16MB -- dd if=/dev/zero of=/dev/null bs=64M count=1"));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("the kernel killed it for memory under the limit of 15.3 MiB"), std::string::npos) << r.output;
    EXPECT_EQ(r.exit_code, 137) << "the command's status, as docs/measure.md says";
    // A program that is nowhere, and no program.
    r = test::run_command(moeprune_cmd("limit --ram 16MB -- moeprune-no-such-program"));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("moeprune-no-such-program: no such program on the PATH"), std::string::npos) << r.output;
    r = test::run_command(moeprune_cmd("limit --ram 16MB"));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(count_named(support.parent, kCgroupPrefix), before);
}

TEST(Measure, RefusesWhatCannotBeMeasuredAndLeavesNoCgroup) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    // A text too short for --tokens: named, before anything runs.
    auto r = test::run_command(moeprune_cmd(measure_args(dir, "", 100000)));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find((dir / "text.txt").string() + ": has "), std::string::npos) << r.output;
    // A model on a RAM file system cannot be dropped from the page cache.
    if (fs::is_directory("/dev/shm")) {
        const fs::path shm = fs::path("/dev/shm") / fmt::format("moeprune-measure-test-{}.gguf", ::getpid());
        fs::copy_file(dir / "m.gguf", shm, fs::copy_options::overwrite_existing);
        r = test::run_command(moeprune_cmd(fmt::format("measure -m {} -f {}", shm.string(), (dir / "text.txt").string())));
        fs::remove(shm);
        EXPECT_NE(r.exit_code, 0);
        EXPECT_NE(r.output.find("RAM file system"), std::string::npos) << r.output;
    }
    // A limit below what stays resident, after the resident run measured it; that run
    // also removes what a killed measure left.
    const std::string token = fmt::format("t{}", ::getpid());
    const fs::path stale = planted_killed_measure(support, token);
    r = test::run_command(moeprune_cmd(measure_args(dir, "--ram 1M")));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("--ram 1M: 1.0 MiB is below what"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(stale)) << r.output;
    EXPECT_FALSE(fs::exists(fs::temp_directory_path() / (kCgroupPrefix + token))) << r.output;
    EXPECT_NE(r.output.find("removed " + stale.string()), std::string::npos) << r.output;
}

// Every signal a person sends: INT, TERM and HUP unwind (no cgroup, scratch folder, child
// or output left, and the process dies of the signal); KILL leaves what the next measure
// removes. Only what a marker proves a measure's own is ever removed.
TEST(Measure, SignalsLeaveNothingAndOnlyMarkedLeftoversAreRemoved) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const fs::path tmp = dir / "tmp";
    fs::create_directory(tmp);
    // A measure started through a link (its process is not named moeprune), and a cgroup
    // with moeprune's prefix that no measure made, with a process inside: both must live on.
    // Every measure here waits in a llama-bench that never ends (a script and its child).
    fs::create_symlink(test::bin("moeprune"), dir / "renamed");
    const fs::path foreign = support.parent / fmt::format("{}99999999999999999999-0", kCgroupPrefix);
    fs::create_directory(foreign);
    const std::string long_marker = fmt::format("moeprune-test-long-{}", ::getpid());
    const std::string marker = fmt::format("moeprune-test-bench-{}", ::getpid());
    for (const auto & [file, name] : {std::pair{"long.sh", long_marker}, {"bench.sh", marker}}) {
        test::write_text(dir / file, fmt::format("#!/bin/bash\nbash -c 'exec -a {} sleep 1000' & wait\n", name));
        fs::permissions(dir / file, fs::perms::owner_all);
    }
    const std::string args = measure_args(dir, "--llama-bench-timeout 300 --llama-bench ", 16, 0);
    const std::string kill_script = fmt::format(
        "export TMPDIR={tmp}; {renamed} {args}{dir}/long.sh >/dev/null 2>&1 & long=$!; "
        "sleep 1000 & sleeper=$!; echo $sleeper > {foreign}/cgroup.procs; "
        "for sig in INT TERM HUP KILL; do "
        "  {moeprune} {args}{dir}/bench.sh --json {dir}/$sig.json > {dir}/$sig.log 2>&1 & m=$!; "
        "  for i in $(seq 400); do [ $(pgrep -fc {marker}) -ge 1 ] && [ $(pgrep -fc {long_marker}) -ge 1 ] && break; sleep 0.05; done; "
        "  kill -$sig $m; wait $m; echo \"$sig $?\"; sleep 0.3; "
        "  echo \"$sig left $(ls {parent} | grep -c '^{prefix}') $(ls {tmp} | grep -c '^{prefix}') "
        "$(ls {dir} | grep -c partial) $(pgrep -fc {marker})\"; "
        "done; "
        "kill -0 $long && echo long-alive; kill -0 $sleeper && echo sleeper-alive; kill $long $sleeper; wait",
        fmt::arg("tmp", tmp.string()), fmt::arg("renamed", (dir / "renamed").string()), fmt::arg("args", args),
        fmt::arg("dir", dir.path().string()), fmt::arg("foreign", foreign.string()),
        fmt::arg("moeprune", test::bin("moeprune").string()), fmt::arg("marker", marker),
        fmt::arg("long_marker", long_marker), fmt::arg("parent", support.parent.string()),
        fmt::arg("prefix", kCgroupPrefix));
    test::write_text(dir / "kill.sh", kill_script);
    auto r = test::run_command("bash " + (dir / "kill.sh").string());
    // The long measure's cgroup and scratch folder, the foreign cgroup: 2 and 1; INT, TERM
    // and HUP add nothing, and kill llama-bench's child; KILL leaves its cgroup, folder and
    // the child (PR_SET_PDEATHSIG reaches the script only).
    for (const char * line : {"INT 130", "TERM 143", "HUP 129", "KILL 137", "INT left 2 1 0 0", "TERM left 2 1 0 0",
                              "HUP left 2 1 0 0", "KILL left 3 2 0 1", "long-alive", "sleeper-alive"}) {
        EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
    }
    for (const char * sig : {"INT", "TERM", "HUP"}) {
        const std::string log = test::read_bytes(dir / (std::string(sig) + ".log"));
        EXPECT_NE(log.find(std::string("interrupted by SIG") + sig), std::string::npos) << log;
        EXPECT_FALSE(fs::exists(dir / (std::string(sig) + ".json")));
    }
    // The next measure removes the killed one's cgroup and scratch folder, names the
    // foreign cgroup and leaves it (its process alive), and kills nothing else.
    fs::create_directory(dir / "leftover");
    r = test::run_command(fmt::format("TMPDIR={} ", tmp.string()) + moeprune_cmd(measure_args(dir, "--ram 1M")));
    EXPECT_NE(r.output.find("left by a measure that was killed"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(foreign.string() + ": left alone"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("stol"), std::string::npos) << r.output;
    EXPECT_EQ(count_named(tmp, kCgroupPrefix), 0u) << r.output;
    EXPECT_TRUE(fs::exists(foreign));
    EXPECT_NE(test::run_command(pgrep(marker)).exit_code, 0) << "the killed measure's llama-bench child lives on";
    fs::remove(foreign);
    size_t ours = 0;
    for (const fs::directory_entry & e : fs::directory_iterator(support.parent)) {
        ours += e.path().filename().string().rfind(kCgroupPrefix, 0) == 0;
    }
    EXPECT_EQ(ours, 0u) << "every measure of this test is gone";
}

// A cgroup below a killed measure's (made by hand) is removed with it, at once.
TEST(Measure, StaleCgroupWithChildrenIsRemovedWhole) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const std::string token = fmt::format("c{}", ::getpid());
    const fs::path stale = planted_killed_measure(support, token);
    fs::create_directory(stale / "child");
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = test::run_command(moeprune_cmd(measure_args(dir, "--ram 1M")));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_FALSE(fs::exists(stale)) << r.output;
    EXPECT_NE(r.output.find("removed " + stale.string()), std::string::npos) << r.output;
    EXPECT_LT(seconds, 60) << r.output;
}

// Hostile numbers and programs: refused by name before the resident run, inputs intact.
TEST(Measure, HostileSettingsAndLlamaBenchProgramsAreRefusedByName) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const auto refused = [&](const std::string & extra, const std::string & message, const std::string & env = "") {
        const auto r = test::run_command(env + moeprune_cmd(measure_args(dir, extra)));
        EXPECT_NE(r.exit_code, 0) << extra << "\n" << r.output;
        EXPECT_NE(r.output.find(message), std::string::npos) << extra << "\n" << r.output;
        EXPECT_EQ(r.output.find("resident run"), std::string::npos) << "checked only after the resident run: " << r.output;
        return r.output;
    };
    refused("-t 10000", "threads are 0 (one per CPU) to");
    refused("--ram , -t 1", "--ram ,: an empty list");
    refused("--ram 5x", "--ram \"5x\" is not a size");
    refused("--ram 50%%%", "--ram \"50%%%\": not a share");
    refused("--json " + dir.path().string(), ": --json: is a folder");
    refused("--json " + (dir / "no" / "m.json").string(), "--json: cannot be written");
    refused("", "TMPDIR=/nonexistent: is not a folder", "TMPDIR=/nonexistent ");
    for (const auto & [flags, message] :
         {std::pair<std::string, std::string>{"--probe-mib -1", "--probe-mib -1: the storage probe reads 0 (none) to"},
          {"--probe-mib 17592186044416", "--probe-mib 17592186044416: the storage probe reads 0 (none) to"},
          {"--tokens 2147483647", "--tokens 2147483647 and --warmup 32: tokens 1 to"},
          {"--min-seconds -1", "--min-seconds -1: 0 (one pass) to 600 seconds"},
          {"--min-seconds 601", "--min-seconds 601: 0 (one pass) to 600 seconds"},
          {"--repeats 0", "--repeats 0: every limit is measured 1 to 100 times"}}) {
        const auto r = test::run_command(moeprune_cmd(
            fmt::format("measure -m {} -f {} {}", (dir / "m.gguf").string(), (dir / "text.txt").string(), flags)));
        EXPECT_NE(r.exit_code, 0);
        EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    }
    // llama-bench programs: one that never ends (nor does its child), one printing
    // impossible samples, one that cannot run, and one given as --json.
    const std::string marker = fmt::format("moeprune-test-hang-{}", ::getpid());
    test::write_text(dir / "hang.sh", fmt::format("#!/bin/bash\nbash -c 'exec -a {} sleep 1000' & wait\n", marker));
    test::write_text(dir / "bad.sh", "#!/bin/sh\necho '[{\"samples_ts\": [0, -5, 12]}]'\n");
    test::write_text(dir / "noexec.sh", "#!/bin/sh\n");
    test::write_text(dir / "text.sh", "#!/bin/sh\nprintf 'hello \\033[2J'\n");
    for (const char * f : {"hang.sh", "bad.sh", "text.sh"}) {  // noexec.sh stays without the right to run
        fs::permissions(dir / f, fs::perms::owner_all);
    }
    const std::string bad_before = test::read_bytes(dir / "bad.sh");
    std::string out = refused("--llama-bench " + (dir / "hang.sh").string() + " --llama-bench-timeout 0.25",
                              "did not finish in 0.25 s");
    EXPECT_NE(out.find((dir / "hang.sh").string()), std::string::npos) << out;
    EXPECT_NE(test::run_command(pgrep(marker)).exit_code, 0) << "llama-bench's child outlived measure";
    refused("--llama-bench " + (dir / "bad.sh").string(), "printed samples_ts [0, -5, 12]: tokens/s must be finite and > 0");
    refused("--llama-bench " + (dir / "noexec.sh").string(), "--llama-bench: is not a program this user can run");
    out = refused("--llama-bench " + (dir / "text.sh").string(), "its standard output is not JSON, as llama-bench -o json "
                                                                  "prints (10 bytes, starting \"hello ?[2J\")");
    EXPECT_EQ(out.find("json.exception"), std::string::npos) << out;
    EXPECT_EQ(out.find("\033"), std::string::npos) << out;
    refused("--llama-bench " + (dir / "bad.sh").string() + " --json " + (dir / "bad.sh").string(), "refusing to overwrite");
    refused("--llama-bench " + (dir / "bad.sh").string() + " --trace " + (dir / "bad.sh").string(), "refusing to overwrite");
    EXPECT_EQ(test::read_bytes(dir / "bad.sh"), bad_before);
    EXPECT_EQ(count_named(support.parent, kCgroupPrefix), 0u);
}

// A resident run slower than a limited one cannot come from a quiet machine: flagged,
// and nothing is calibrated on it.
TEST(MeasureBusy, AResidentRunSlowerThanALimitedOneIsAMachineBusy) {
    MeasureReport r;
    r.model = json::object();
    r.resident.decode.ms_median = 344;
    r.resident.decode.tokens_per_second = 1000.0 / 344;
    MeasuredRun limited;
    limited.ram = "50%";
    limited.decode.ms_median = 13;
    r.runs.push_back(limited);
    const std::string busy = machine_was_busy(r);
    EXPECT_NE(busy.find("--ram 50%"), std::string::npos) << busy;
    r.resident.decode.ms_median = 50;   // noise, or a loaded machine: a limited run up to 5 times faster
    EXPECT_EQ(machine_was_busy(r), "");
    r.resident.decode.tokens_per_second = 70;
    r.resident.llama_bench = {{"tokens_per_second", 400.0}, {"difference", 4.7}};
    r.busy = machine_was_busy(r);
    EXPECT_NE(r.busy.find("llama-bench"), std::string::npos);
    EXPECT_NE(to_text(r).find("the machine was busy"), std::string::npos);
    EXPECT_FALSE(to_json(r).at("busy").is_null());
}

// Without the right to make a cgroup: the error says what is missing and how to get it.
TEST(Measure, WithoutACgroupSaysHowToGetOne) {
    if (::geteuid() != 0 || test::run_command("command -v setpriv").exit_code != 0) {
        GTEST_SKIP() << "needs root to run measure as an unprivileged user (setpriv)";
    }
    test::TempDir dir;
    make_inputs(dir);
    fs::permissions(dir.path(), fs::perms::all, fs::perm_options::add);
    const auto r = test::run_command("setpriv --reuid=65534 --regid=65534 --clear-groups " +
                                     moeprune_cmd(measure_args(dir, "")));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("cannot make a memory cgroup"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("systemd-run --user --scope"), std::string::npos) << r.output;
    // --check says the same without a model, and fails; as root it names the parent cgroup.
    const auto check = test::run_command("setpriv --reuid=65534 --regid=65534 --clear-groups " + moeprune_cmd("measure --check"));
    EXPECT_EQ(check.exit_code, 1) << check.output;
    EXPECT_NE(check.output.find("cannot make a memory cgroup"), std::string::npos) << check.output;
    const CgroupSupport support = find_memory_cgroup();
    const auto root = test::run_command(moeprune_cmd("measure --check"));
    EXPECT_EQ(root.exit_code, support.version == 0 ? 1 : 0) << root.output;
    if (support.version != 0) {
        EXPECT_NE(root.output.find(support.parent.string()), std::string::npos) << root.output;
    }
}

// --read-ahead-kb: every limit measured at each read-ahead of the model's device, which is
// put back afterwards, and by the next measure after a kill -9; without root it is refused
// and nothing changes.
TEST(Measure, ReadAheadIsMeasuredAtEachSettingAndPutBackEvenAfterAKill) {
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        GTEST_SKIP() << support.problem;
    }
    test::TempDir dir;
    make_inputs(dir);
    const std::string env = "MOEPRUNE_STATE_DIR=" + (dir / "state").string() + " ";
    const fs::path out = dir / "m.json";
    if (::geteuid() != 0) {
        const auto r = test::run_command(env + moeprune_cmd(measure_args(dir, "--ram 50% --read-ahead-kb 128")));
        EXPECT_NE(r.exit_code, 0);
        EXPECT_NE(r.output.find("needs root"), std::string::npos) << r.output;
        GTEST_SKIP() << "not root: only the refusal is checked";
    }
    const fs::path trace = dir / "m.mptrace";
    auto r = test::run_command(env + moeprune_cmd(measure_args(
                                         dir, fmt::format("--ram 50% --read-ahead-kb 128,256 --json {} --trace {}",
                                                          out.string(), trace.string()),
                                         40)));
    if (r.exit_code != 0 && r.output.find("no block device whose read-ahead") != std::string::npos) {
        GTEST_SKIP() << "the temporary folder has no block device: " << r.output;
    }
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json m = json::parse(test::read_bytes(out));
    ASSERT_EQ(m.at("runs").size(), 2u);
    EXPECT_EQ(m.at("runs").at(0).at("read_ahead_kb"), 128);
    EXPECT_EQ(m.at("runs").at(1).at("read_ahead_kb"), 256);
    const json & storage = m.at("system").at("storage");
    // Each run predicted from a calibration at its own read-ahead: a probe and a resident
    // decode after the setting changed (the resident run's own where it is the device's).
    ASSERT_TRUE(m.at("median_error").is_number()) << m.at("busy");
    ASSERT_EQ(m.at("probes").size(), 2u);
    ASSERT_EQ(m.at("calibrations").size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        const json & run = m.at("runs").at(i);
        const json & c = m.at("calibrations").at(i);
        const uint64_t kb = run.at("read_ahead_kb").get<uint64_t>();
        EXPECT_EQ(m.at("probes").at(i).at("read_ahead_kb"), kb);
        EXPECT_EQ(c.at("read_ahead_kb"), kb);
        EXPECT_EQ(c.at("readaround_bytes").get<uint64_t>(), kb * 2048);
        if (kb != storage.at("read_ahead_kb").get<uint64_t>()) {
            EXPECT_NE(c.at("compute_ms").get<double>(),
                      m.at("resident").at("decode").at("ms_per_token").at("mean").get<double>());
        }
        // The only limit at its read-ahead: predicted with the probe's figures, and the
        // calibration kept for the plan fitted on it where it streamed.
        const json & p = run.at("predicted");
        const json & probe = m.at("probes").at(i);
        EXPECT_NEAR(p.at("ms_per_token").get<double>(),
                    c.at("compute_ms").get<double>() + p.at("faults_per_token").get<double>() * probe.value("fault_ms", 0.0) +
                        p.at("read_bytes_per_token").get<double>() / (probe.at("sequential_gbps").get<double>() * 1e6),
                    1e-6 * p.at("ms_per_token").get<double>());
        const std::vector<StreamFitPoint> own{
            {p.at("expert_read_bytes_per_token").get<double>(), run.at("decode").at("ms_per_token").at("mean").get<double>(),
             p.at("other_read_bytes_per_token").get<double>() / 1e6 / probe.at("sequential_gbps").get<double>()}};
        const double fitted =
            fit_stream(own, c.at("compute_ms").get<double>(), probe.at("sequential_gbps").get<double>()).read_gbps;
        EXPECT_EQ(c.at("fitted_on").size(), fitted > 0 ? 1u : 0u) << c;
        EXPECT_DOUBLE_EQ(c.at("read_gbps").get<double>(), fitted > 0 ? fitted : probe.at("sequential_gbps").get<double>());
    }
    // A sliced model that does not fit is priced at each read-ahead calibrated, as run's
    // plan offers it: its first 8 experts of 16, under room for 2 of them per layer.
    const GgufModel gguf = GgufModel::open(dir / "m.gguf");
    const InspectReport info = inspect_model(gguf, {});
    KeepMap keep{16, 8, "first", nlohmann::json::object(), {}};
    for (const int layer : info.routed_layers()) {
        keep.layers[layer] = {0, 1, 2, 3, 4, 5, 6, 7};
    }
    write_keep_map(dir / "first-k8.json", keep);
    double expert_sum = 0;
    for (const double b : info.routed_layer_expert_bytes()) {
        expert_sum += b;
    }
    const std::string ram = std::to_string(uint64_t(m.at("resident_need_bytes").get<double>() + 2 * expert_sum));
    const std::vector<StreamedSlice> priced =
        price_streamed_slices(dir / "m.gguf", {dir / "first-k8.json"}, trace, out, ram, dir / "streamed");
    ASSERT_EQ(priced.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(priced[i].k, 8);
        // Named only where it is a setting to change, not the device's own.
        const uint64_t kb = m.at("calibrations").at(i).at("read_ahead_kb").get<uint64_t>();
        EXPECT_EQ(priced[i].read_ahead_kb,
                  kb == storage.at("read_ahead_kb").get<uint64_t>() ? std::nullopt : std::optional(kb));
        EXPECT_GT(priced[i].prediction.read_bytes_per_token, 0);
        EXPECT_GT(priced[i].prediction.tokens_per_second, 0);
    }
    EXPECT_NE(priced[0].prediction.read_bytes_per_token, priced[1].prediction.read_bytes_per_token)
        << "each with its own read-around";
    EXPECT_FALSE(fs::exists(dir / "streamed")) << "the sliced model is deleted once priced";

    const fs::path setting = storage.at("read_ahead_file").get<std::string>();
    const std::string original = std::to_string(storage.at("read_ahead_kb").get<uint64_t>());
    const auto current = [&] {
        std::string v = test::read_bytes(setting);
        return v.substr(0, v.find('\n'));
    };
    EXPECT_EQ(current(), original) << "put back when the runs end";
    EXPECT_EQ(count_named(dir / "state", "read-ahead"), 0u);

    // Killed while the setting is changed (the state file, the claim, exists from before the
    // first run): the next measure puts it back from the state file.
    const std::string changed = original == "64" ? "96" : "64";
    test::write_text(dir / "kill.sh",
                     fmt::format("{}{} > {} 2>&1 & m=$!; for i in $(seq 3000); do [ \"$(cat {})\" = {} ] "
                                 "&& break; sleep 0.02; done; kill -9 $m; wait $m; true",
                                 env, moeprune_cmd(measure_args(dir, "--ram 50% --read-ahead-kb " + changed, 1100)),
                                 (dir / "log").string(), setting.string(), changed));
    test::run_command("bash " + (dir / "kill.sh").string());
    ASSERT_EQ(count_named(dir / "state", "read-ahead"), 1u) << test::read_bytes(dir / "log");
    EXPECT_EQ(current(), changed) << "left changed by the kill";
    r = test::run_command(env + moeprune_cmd(measure_args(dir, "--ram 50%")));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("back to " + original + " KB, left changed by a measure that was killed"), std::string::npos)
        << r.output;
    EXPECT_EQ(current(), original);
    EXPECT_EQ(count_named(dir / "state", "read-ahead"), 0u);

    // Refused for a user who is not root, before anything is read or changed.
    if (test::run_command("setpriv --reuid=65534 --regid=65534 --clear-groups true").exit_code == 0) {
        r = test::run_command("setpriv --reuid=65534 --regid=65534 --clear-groups env " + env +
                              moeprune_cmd(measure_args(dir, "--ram 50% --read-ahead-kb 128")));
        if (r.output.find("Permission denied") == std::string::npos) {   // the build folder is closed to others
            EXPECT_NE(r.exit_code, 0);
            EXPECT_NE(r.output.find("needs root"), std::string::npos) << r.output;
        }
        EXPECT_EQ(current(), original);
    }
}

TEST(StreamFit, TheDecodesReadRateIsItsTimeBeyondComputePerSimulatedByte) {
    constexpr double kAny = 1e9;
    // On a line through compute: 1 GB/s, nothing per token beyond the bytes.
    const std::vector<StreamFitPoint> points{{100e6, 110}, {50e6, 60}};
    EXPECT_DOUBLE_EQ(fit_stream(points, 10, kAny).read_gbps, 1.0);
    EXPECT_NEAR(fit_stream(points, 10, kAny).stream_ms, 0, 1e-9);
    // One point: the rate alone, whatever time it took beyond its bytes.
    EXPECT_DOUBLE_EQ(fit_stream(std::span(points).first(1), 10, kAny).read_gbps, 1.0);
    EXPECT_EQ(fit_stream(std::span(points).first(1), 10, kAny).stream_ms, 0);
    // bench/stream.sh's three limits at 8192 KB (predicted bytes, measured ms, 16.3 ms of
    // compute): 75% took far longer than its bytes at the others' rate, and a time per
    // token that streams fits all three (0.675 ms per MB and 87 ms through 25% and 75%).
    const std::vector<StreamFitPoint> bench{{1023.5e6, 795.5}, {680.0e6, 573.1}, {183.0e6, 227.0}};
    const StreamFit fit = fit_stream(bench, 16.3, kAny);
    EXPECT_NEAR(1 / fit.read_gbps, 0.675, 0.02);   // ms per MB
    EXPECT_NEAR(fit.stream_ms, 90, 10);
    for (const StreamFitPoint & b : bench) {
        const double ms = 16.3 + fit.stream_ms + b.scattered_read_bytes_per_token / (fit.read_gbps * 1e6);
        EXPECT_NEAR(ms, b.measured_ms_per_token, 0.03 * b.measured_ms_per_token);
    }
    // bench/stream.sh at 8192 KB, five rounds (the experts' simulated bytes, measured ms, the
    // rest's bytes at the probe's 2.73 GB/s; 15.15 ms of compute). The 25% and 50% limits
    // read 202 and 154 MB of whole tensors per token, the 75% limit 7: priced at the
    // experts' rate too, they made 75% 28% too fast from the other two; at the sequential
    // rate, 15%.
    const auto at_sequential = [](double mb) { return mb / 2.731; };
    const std::vector<StreamFitPoint> limits{{812.4e6, 909.65, at_sequential(202.3)},
                                             {524.7e6, 575.13, at_sequential(154.0)},
                                             {176.7e6, 221.24, at_sequential(6.56)}};
    const StreamFit from_two = fit_stream(std::span(limits).first(2), 15.15, kAny);
    const double ms_75 = 15.15 + from_two.stream_ms + limits[2].sequential_ms_per_token +
                         limits[2].scattered_read_bytes_per_token / (from_two.read_gbps * 1e6);
    EXPECT_NEAR(1e3 / ms_75, 1e3 / 221.24, 0.16 * 1e3 / 221.24);
    const std::vector<StreamFitPoint> alike{{1014.7e6, 909.65}, {678.7e6, 575.13}};
    const StreamFit alike_fit = fit_stream(alike, 15.15, kAny);
    EXPECT_GT(1e3 / (15.15 + alike_fit.stream_ms + 183.3 / alike_fit.read_gbps), 1.25 * 1e3 / 221.24);
    // A line that would need a negative time per token (less time per byte the fewer bytes
    // read) is not one: the rate alone, fitted as over one point.
    const std::vector<StreamFitPoint> concave{{100e6, 110}, {50e6, 20}};
    EXPECT_EQ(fit_stream(concave, 10, kAny).stream_ms, 0);
    EXPECT_DOUBLE_EQ(fit_stream(concave, 10, kAny).read_gbps, 150e6 / 0.11 / 1e9);
    EXPECT_DOUBLE_EQ(fit_stream(points, 35, kAny).read_gbps, 150e6 / 0.1 / 1e9);
    // Nothing to fit on: no run read, or none took longer than compute.
    EXPECT_EQ(fit_stream({}, 10, kAny).read_gbps, 0);
    EXPECT_EQ(fit_stream(std::vector<StreamFitPoint>{{0, 50}}, 10, kAny).read_gbps, 0);
    EXPECT_EQ(fit_stream(points, 200, kAny).read_gbps, 0);
    // Faster than the device reads sequentially: a few simulated bytes over timing noise
    // (a limit that reads almost nothing once made 16,333 GB/s), not a rate.
    EXPECT_DOUBLE_EQ(fit_stream(points, 10, 1.0).read_gbps, 1.0);
    EXPECT_EQ(fit_stream(points, 10, 0.99).read_gbps, 0);
    EXPECT_EQ(fit_stream(std::vector<StreamFitPoint>{{1e5, 10.001}}, 10, 3.0).read_gbps, 0);
    // A prediction's time: compute, plus its faults' waits, plus its reads at the rate, plus
    // the time per token that streams where it reads at all.
    StreamPrediction p;
    p.read_bytes_per_token = 20e6;
    p.faults_per_token = 4;
    StreamCalibration c;
    c.compute_ms = 5;
    c.read_gbps = 2;
    c.fault_ms = 0.5;
    c.stream_ms = 3;
    time_stream(p, c);
    EXPECT_DOUBLE_EQ(p.ms_per_token, 5 + 2 + 10 + 3);
    EXPECT_DOUBLE_EQ(p.tokens_per_second, 1e3 / 20);
    p.read_bytes_per_token = 0;
    p.faults_per_token = 0;
    time_stream(p, c);
    EXPECT_DOUBLE_EQ(p.ms_per_token, 5);
    // With the device's sequential rate, the experts' bytes at the fitted rate and the rest
    // at that one.
    p.read_bytes_per_token = 20e6;
    p.expert_read_bytes_per_token = 12e6;
    p.other_read_bytes_per_token = 8e6;
    p.faults_per_token = 4;
    c.sequential_gbps = 4;
    time_stream(p, c);
    EXPECT_DOUBLE_EQ(p.ms_per_token, 5 + 2 + 6 + 2 + 3);
    const StreamFitPoint point = fit_point(p, c, 30);
    EXPECT_EQ(point.scattered_read_bytes_per_token, 12e6);
    EXPECT_DOUBLE_EQ(point.sequential_ms_per_token, 2);
    c.sequential_gbps = 0;
    EXPECT_EQ(fit_point(p, c, 30).scattered_read_bytes_per_token, 20e6);
    EXPECT_EQ(fit_point(p, c, 30).sequential_ms_per_token, 0);
}

// When a limit is outside what the simulation follows, with the cases it was measured at.
TEST(StreamFit, PredictionsOutsideThePageCacheModelAreNamed) {
    constexpr uint64_t kMiB = 1 << 20, kGiB = uint64_t(1) << 30;
    // A read-around window over half the page cache (the demo's 16 MiB window in 3 MiB).
    EXPECT_NE(outside_model(3 * kMiB, 16 * kMiB, 30 * kMiB, kMiB).find("read-around window"), std::string::npos);
    // The demo's K 16 slice: 23 MiB in a 21.7 MiB page cache, a 17 MiB head and dense
    // weights read by every token, more than the half of a small cache the kernel keeps
    // active. It read its whole file every token.
    const std::string k16 = outside_model(uint64_t(21.7 * kMiB), 256 * 1024, 23 * kMiB, 18 * kMiB);
    EXPECT_NE(k16.find("the 18.0 MiB every token reads"), std::string::npos) << k16;
    EXPECT_NE(k16.find("the 50% of the 21.7 MiB page cache"), std::string::npos) << k16;
    // The same, had it fit: nothing is reclaimed.
    EXPECT_EQ(outside_model(24 * kMiB, 256 * 1024, 23 * kMiB, 18 * kMiB), "");
    // bench/stream.sh at 75%: a 2 GiB model, a 1.6 GiB cache, 30 MiB read every token
    // (predicted within 11-53% of the measured, not 13x).
    EXPECT_EQ(outside_model(uint64_t(1.6 * double(kGiB)), 16 * kMiB, 2 * kGiB, 30 * kMiB), "");
    // From a GiB up the kernel lets the active list hold more: 3/4 at 1 GiB (ratio 3),
    // 10/11 at 10 GiB (ratio 10).
    EXPECT_EQ(outside_model(kGiB, 0, 2 * kGiB, uint64_t(0.74 * double(kGiB))), "");
    EXPECT_NE(outside_model(kGiB, 0, 2 * kGiB, uint64_t(0.76 * double(kGiB))), "");
    EXPECT_EQ(outside_model(10 * kGiB, 0, 20 * kGiB, uint64_t(0.90 * 10 * double(kGiB))), "");
    EXPECT_NE(outside_model(10 * kGiB, 0, 20 * kGiB, uint64_t(0.92 * 10 * double(kGiB))), "");
}
