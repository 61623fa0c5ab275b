// `moeprune measure` end to end where this machine lets it make a memory cgroup (root or
// a delegated cgroup); skipped with the reason where it cannot.
#include "formats/trace.h"
#include "measure/cgroup.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <csignal>
#include <unistd.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

// A small model and ~700 tokens of text in `dir`.
void make_inputs(const test::TempDir & dir) {
    const auto r = test::run_command(moeprune_cmd(fmt::format(
        "synth --layers 4 --experts 16 --used 4 --ff 512 --type q8_0 -o {}", (dir / "m.gguf").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    test::write_text(dir / "text.txt", test::mixed_text());
}

std::string measure_args(const test::TempDir & dir, const std::string & extra, int tokens = 16, int warmup = 4) {
    return fmt::format("measure -m {} -f {} --warmup {} --tokens {} --probe-mib 1 {}", (dir / "m.gguf").string(),
                       (dir / "text.txt").string(), warmup, tokens, extra);
}

// A cgroup name moeprune would make for a process that is gone.
fs::path planted_stale_cgroup(const CgroupSupport & s) {
    pid_t dead = 0;
    for (pid_t p = 4000000; p > 1000; p -= 7919) {
        if (::kill(p, 0) != 0 && errno == ESRCH) {
            dead = p;
            break;
        }
    }
    const fs::path stale = s.parent / fmt::format("{}{}-0", kCgroupPrefix, dead);
    fs::create_directory(stale);
    return stale;
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
        moeprune_cmd(measure_args(dir, fmt::format("--ram 50%,100% --json {} --trace {} --llama-bench {}", out.string(),
                                                   trace.string(), test::bin("llama-bench").string()))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json m = json::parse(test::read_bytes(out));
    EXPECT_EQ(m.at("format"), "moeprune-measure");
    EXPECT_EQ(m.at("system").at("cgroup_version"), support.version);
    ASSERT_EQ(m.at("runs").size(), 2u);
    const uint64_t need = m.at("resident_need_bytes").get<uint64_t>();
    EXPECT_GT(need, m.at("resident_weight_bytes").get<uint64_t>());   // plus the process's own memory
    uint64_t previous = 0;
    for (const json & run : m.at("runs")) {
        EXPECT_GT(run.at("limit_bytes").get<uint64_t>(), need);
        EXPECT_GT(run.at("limit_bytes").get<uint64_t>(), previous);
        previous = run.at("limit_bytes").get<uint64_t>();
        EXPECT_LE(run.at("peak_bytes").get<uint64_t>(), run.at("limit_bytes").get<uint64_t>());
        EXPECT_EQ(run.at("decode").at("tokens"), 16);
        EXPECT_EQ(run.at("detail").at("per_token").at("wall_us").size(), 16u);
        EXPECT_GT(run.at("decode").at("tokens_per_second").get<double>(), 0);
        EXPECT_GT(run.at("predicted").at("tokens_per_second").get<double>(), 0);
        EXPECT_GE(run.at("error").get<double>(), 0);
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
    // At 100% the whole model fits: llama.cpp's prefetch left every expert cached, and the simulation agrees.
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
    EXPECT_GT(m.at("probe").at("experts").get<int>(), 0);
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
    // also removes the cgroup a killed measure left.
    const fs::path stale = planted_stale_cgroup(support);
    r = test::run_command(moeprune_cmd(measure_args(dir, "--ram 1M")));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("--ram 1M: 1.0 MiB is below what"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(stale)) << r.output;
    EXPECT_NE(r.output.find("removed " + stale.string()), std::string::npos) << r.output;

    // kill -9 of measure while its worker decodes: the worker dies with it, and the next
    // measure removes the cgroup it left.
    const std::string script = fmt::format(
        "{} >/dev/null 2>&1 & m=$!; for i in $(seq 200); do ls {} | grep -q \"^{}$m-\" && break; sleep 0.05; done; "
        "kill -9 $m; wait $m 2>/dev/null; sleep 0.3; echo; ls {} | grep -c \"^{}$m-\"",
        moeprune_cmd(measure_args(dir, "", 600, 0)), support.parent.string(), kCgroupPrefix,
        support.parent.string(), kCgroupPrefix);
    test::write_text(dir / "kill.sh", script);
    r = test::run_command("bash " + (dir / "kill.sh").string());
    EXPECT_TRUE(r.output.ends_with("\n1\n")) << "the killed measure's cgroup should remain until the next run: " << r.output;
    r = test::run_command(moeprune_cmd(measure_args(dir, "--ram 1M")));
    EXPECT_NE(r.output.find("left by a measure that was killed"), std::string::npos) << r.output;
    for (const fs::directory_entry & e : fs::directory_iterator(support.parent)) {
        const std::string name = e.path().filename().string();
        if (name.rfind(kCgroupPrefix, 0) == 0) {
            const long pid = std::stol(name.substr(std::string(kCgroupPrefix).size()));
            EXPECT_EQ(::kill(pid_t(pid), 0), 0) << name << " was left by a process that is gone";
        }
    }
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
