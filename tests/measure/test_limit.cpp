// `moeprune limit` and the read-ahead's state as a careless or hostile user meets them
// (issue 62): a terminal, stops, nesting, out-of-memory kills of grandchildren, exec
// failures, kills that leave cgroups, and state files that name what is not a read-ahead.
// Where no memory cgroup can be made, skipped with the reason.
#include "measure/cgroup.h"
#include "measure/child.h"
#include "measure/read_ahead.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <sys/stat.h>
#include <unistd.h>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

std::string limit_cmd(const std::string & args) { return "timeout 60 " + test::bin("moeprune").string() + " limit " + args; }

size_t count_named(const fs::path & dir, const std::string & prefix) {
    size_t n = 0;
    std::error_code ec;
    for (const fs::directory_entry & e : fs::directory_iterator(dir, ec)) {
        n += e.path().filename().string().rfind(prefix, 0) == 0;
    }
    return n;
}

std::string first_line(const fs::path & p) {
    const std::string text = test::read_bytes(p);
    return text.substr(0, text.find('\n'));
}

#define NEEDS_CGROUPS(support)                                                                                         \
    const CgroupSupport support = find_memory_cgroup("limit");                                                         \
    if (support.version == 0) {                                                                                        \
        GTEST_SKIP() << support.problem;                                                                               \
    }

} // namespace

// On a terminal the command reads it (a shell's job in the foreground), and a command that
// stops itself stops moeprune with it; continued, both go on.
TEST(Measure, LimitGivesTheCommandTheTerminalAndFollowsItsStops) {
    NEEDS_CGROUPS(support);
    test::TempDir dir;
    // Inside script's terminal, moeprune is the shell's foreground job (no `timeout` between,
    // which would put it in a group of its own); script's own deadline bounds it.
    const std::string moeprune = test::bin("moeprune").string();
    auto r = test::run_command(fmt::format(
        "(sleep 2; echo hello) | timeout 30 script -qfec \"{} limit --ram 64M -- sh -c 'read x; echo got:\\$x'\" /dev/null",
        moeprune));
    EXPECT_NE(r.output.find("got:hello"), std::string::npos) << r.output;

    test::write_text(dir / "stop.sh",
                     fmt::format("{} limit --ram 64M -- sh -c 'kill -STOP $$; echo resumed' > {} 2>&1 & m=$!\n"
                                 "trap 'kill -9 $m 2>/dev/null' EXIT\n"
                                 "for i in $(seq 200); do [ \"$(ps -o stat= -p $m | cut -c1)\" = T ] && break; sleep 0.05; done\n"
                                 "echo state:$(ps -o stat= -p $m | cut -c1)\n"
                                 "kill -CONT $m; wait $m; echo rc:$?\n",
                                 moeprune, (dir / "out").string()));
    r = test::run_command("timeout 60 bash " + (dir / "stop.sh").string());
    EXPECT_NE(r.output.find("state:T"), std::string::npos) << "moeprune stops with its command\n" << r.output;
    EXPECT_NE(r.output.find("rc:0"), std::string::npos) << r.output;
    EXPECT_NE(test::read_bytes(dir / "out").find("resumed"), std::string::npos);
}

// Exit statuses as a shell gives them, the interpreter of a script named, SIGXFSZ as found.
TEST(Measure, LimitExitsAsAShellWouldAndRestoresInheritedSignals) {
    NEEDS_CGROUPS(support);
    test::TempDir dir;
    test::write_text(dir / "bad.sh", "#!/nonexistent/interp\necho hi\n");
    fs::permissions(dir / "bad.sh", fs::perms::owner_all);
    test::write_text(dir / "plain.txt", "echo hi\n");
    auto r = test::run_command(limit_cmd("--ram 64M -- " + (dir / "bad.sh").string()));
    EXPECT_EQ(r.exit_code, 126) << r.output;
    EXPECT_NE(r.output.find("its interpreter /nonexistent/interp (the #! line) does not exist"), std::string::npos)
        << r.output;
    r = test::run_command(limit_cmd("--ram 64M -- " + (dir / "plain.txt").string()));
    EXPECT_EQ(r.exit_code, 126) << "found but not executable\n" << r.output;
    r = test::run_command(limit_cmd("--ram 64M -- " + dir.path().string()));
    EXPECT_EQ(r.exit_code, 126) << "a folder\n" << r.output;
    r = test::run_command(limit_cmd("--ram 64M -- " + (dir / "missing").string()));
    EXPECT_EQ(r.exit_code, 127) << r.output;

    // SIGXFSZ (signal 25, bit 24 of SigIgn) not ignored in the command: moeprune ignores it
    // for itself only.
    r = test::run_command("(ulimit -f 1; " + limit_cmd("--ram 64M -- sh -c 'grep SigIgn /proc/self/status'") + ")");
    const size_t at = r.output.find("SigIgn:");
    ASSERT_NE(at, std::string::npos) << r.output;
    const uint64_t ignored = std::stoull(r.output.substr(at + 7), nullptr, 16);
    EXPECT_EQ(ignored & (uint64_t(1) << (SIGXFSZ - 1)), 0u) << r.output;
    r = test::run_command("(ulimit -f 1; " +
                          limit_cmd(fmt::format("--ram 64M -- sh -c 'head -c 4096 /dev/zero > {}'", (dir / "big").string())) +
                          ")");
    EXPECT_EQ(r.exit_code, 128 + SIGXFSZ) << "killed by the file size limit, as without moeprune\n" << r.output;
}

// Sizes without their unit, out-of-memory kills of the command and of what it started,
// and a limit inside a tighter one: each named.
TEST(Measure, LimitNamesTheLimitThatHeldAndRefusesSizesWithoutAUnit) {
    NEEDS_CGROUPS(support);
    const size_t before = count_named(support.parent, kCgroupPrefix);
    auto r = test::run_command(limit_cmd("--ram 1 -- true"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--ram 1 bytes: under the 4.0 MiB any command needs to start"), std::string::npos) << r.output;

    r = test::run_command(limit_cmd("--ram 16MB -- dd if=/dev/zero of=/dev/null bs=64M count=1"));
    EXPECT_EQ(r.exit_code, 137) << "the command's own status\n" << r.output;
    EXPECT_NE(r.output.find("the kernel killed it for memory under the limit of 15.3 MiB"), std::string::npos) << r.output;

    r = test::run_command(limit_cmd("--ram 16MB -- sh -c 'dd if=/dev/zero of=/dev/null bs=64M count=1; echo dd:$?'"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("dd:137"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("the kernel killed 1 process that "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("sh started for memory under the limit of 15.3 MiB"), std::string::npos) << r.output;

    // The outer limit leaves room for the inner moeprune itself (more under the sanitizers),
    // not for dd's block.
    r = test::run_command(limit_cmd(fmt::format("--ram 256M -- {} limit --ram 2G -- dd if=/dev/zero of=/dev/null bs=512M count=1",
                                                test::bin("moeprune").string())));
    EXPECT_NE(r.output.find("--ram 2048.0 MiB is above the limit of 256.0 MiB that moeprune itself runs under"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("under the limit of 256.0 MiB set on"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("under the limit of 2048.0 MiB"), std::string::npos) << r.output;
    EXPECT_EQ(count_named(support.parent, kCgroupPrefix), before);

    r = test::run_command("TMPDIR=/nonexistent " + limit_cmd("--ram 64M -- true"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("limit keeps the marker of the cgroup it makes in the temporary folder"), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("measure"), std::string::npos) << r.output;
}

// A limit killed with -9 leaves its cgroup and scratch folder: the next limit removes
// them. A killed measure's cgroup made where the sweeping process cannot list it (under
// another cgroup) is removed by the path its scratch folder recorded, and only then the
// folder with its marker.
TEST(Measure, LimitSweepsWhatKilledLimitsAndMeasuresLeftWhereverTheyMadeIt) {
    NEEDS_CGROUPS(support);
    test::TempDir dir;
    const fs::path tmp = dir / "tmp";
    fs::create_directory(tmp);
    const std::string env = "TMPDIR=" + tmp.string() + " ";
    const size_t before = count_named(support.parent, kCgroupPrefix);
    test::write_text(dir / "kill.sh",
                     fmt::format("{}{} limit --ram 64M -- sleep 300 & m=$!\n"
                                 "for i in $(seq 200); do [ $(ls {} | grep -c '^{}') -gt {} ] && break; sleep 0.05; done\n"
                                 "kill -9 $m; wait $m; sleep 0.3\n"
                                 "echo left:$(ls {} | grep -c '^{}'):$(ls {} | grep -c '^{}')\n",
                                 env, test::bin("moeprune").string(), support.parent.string(), kCgroupPrefix, before,
                                 support.parent.string(), kCgroupPrefix, tmp.string(), kCgroupPrefix));
    auto r = test::run_command("bash " + (dir / "kill.sh").string());
    EXPECT_NE(r.output.find(fmt::format("left:{}:1", before + 1)), std::string::npos) << r.output;
    r = test::run_command(env + limit_cmd("--ram 64M -- true"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("left by a measure or limit that was killed"), std::string::npos) << r.output;
    EXPECT_EQ(count_named(support.parent, kCgroupPrefix), before) << r.output;
    EXPECT_EQ(count_named(tmp, kCgroupPrefix), 0u) << r.output;

    // The sweeper in a cgroup of the test's, so its own parent is not where the killed one
    // made its cgroup: only the recorded path finds it.
    const std::string token = fmt::format("s{}", ::getpid());
    const fs::path scratch = tmp / (kCgroupPrefix + token);
    fs::create_directory(scratch);
    test::write_text(scratch / "owner.lock", "");
    const fs::path stale = support.parent / fmt::format("{}{}-0", kCgroupPrefix, token);
    test::write_text(scratch / "cgroups", stale.string() + "\n");
    fs::create_directory(stale);
    const fs::path elsewhere = support.parent / fmt::format("moeprune-test-elsewhere-{}", ::getpid());
    fs::create_directory(elsewhere);
    r = test::run_command(fmt::format("sh -c 'echo $$ > {}/cgroup.procs && exec env {}{}'", elsewhere.string(), env,
                                      limit_cmd("--ram 64M -- true")));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_FALSE(fs::exists(stale)) << r.output;
    EXPECT_FALSE(fs::exists(scratch)) << r.output;
    EXPECT_NE(r.output.find("removed " + stale.string()), std::string::npos) << r.output;
    ::rmdir(elsewhere.c_str());
}

// A state file names a file root would write a number into: only a canonical sysfs
// read-ahead setting is written, only from a state folder no other user can write.
TEST(Measure, ReadAheadStateFilesNamingOtherFilesAreLeftAlone) {
    if (::geteuid() != 0) {
        GTEST_SKIP() << "only root restores a read-ahead";
    }
    test::TempDir dir;
    const fs::path victim = dir / "victim.txt";
    test::write_text(victim, "important content\n");
    const fs::path state = dir / "state";
    fs::create_directory(state);
    ::chmod(state.c_str(), 0755);
    test::write_text(state / "read-ahead_x", victim.string() + "\n123 999999\n");
    // measure refuses its options after the restore runs; limit, run and plan restore too.
    for (const std::string & command : {std::string("measure -m x.gguf -f x.txt --ram abc"),
                                        std::string("plan --expert-mb 1 --layers 2 --experts 8 --used 2 -k 4")}) {
        const auto r = test::run_command(fmt::format("MOEPRUNE_STATE_DIR={} timeout 60 {} {}", state.string(),
                                                     test::bin("moeprune").string(), command));
        EXPECT_NE(r.output.find("left " + (state / "read-ahead_x").string() + " alone: it names no device's read-ahead setting"),
                  std::string::npos)
            << command << "\n" << r.output;
        EXPECT_EQ(test::read_bytes(victim), "important content\n");
    }
    // A folder others can write: nothing in it is read.
    ::chmod(state.c_str(), 0777);
    const auto r = test::run_command(fmt::format("MOEPRUNE_STATE_DIR={} timeout 60 {} measure -m x.gguf -f x.txt --ram abc",
                                                 state.string(), test::bin("moeprune").string()));
    EXPECT_NE(r.output.find("must be root's and writable by root alone"), std::string::npos) << r.output;
    EXPECT_EQ(test::read_bytes(victim), "important content\n");
    EXPECT_FALSE(is_read_ahead_setting(victim));
    EXPECT_FALSE(is_read_ahead_setting("/sys/block/../devices/x/queue/read_ahead_kb"));
}

// The claim on a device is held from the start: a second measure is refused before it
// changes anything, and a device a killed measure left changed is put back by limit.
TEST(Measure, ReadAheadIsClaimedBeforeTheFirstRunAndRestoredByLimit) {
    NEEDS_CGROUPS(support);
    if (::geteuid() != 0) {
        GTEST_SKIP() << "--read-ahead-kb needs root";
    }
    test::TempDir dir;
    const auto synth = test::run_command(test::moeprune_cmd(
        fmt::format("synth --layers 2 --experts 8 --used 2 -o {}", (dir / "m.gguf").string())));
    ASSERT_EQ(synth.exit_code, 0) << synth.output;
    test::write_text(dir / "text.txt", test::mixed_text());
    const nlohmann::json storage = storage_of(dir / "m.gguf");
    if (!storage.contains("read_ahead_file")) {
        GTEST_SKIP() << "the temporary folder has no block device";
    }
    const fs::path setting = storage.at("read_ahead_file").get<std::string>();
    const std::string original = first_line(setting);
    const fs::path state = dir / "state";
    const std::string env = "MOEPRUNE_STATE_DIR=" + state.string() + " ";
    {
        ReadAhead held(setting, state);   // another measure, before its first change
        const auto r = test::run_command(
            env + test::moeprune_cmd(fmt::format("measure -m {} -f {} --ram 50% --tokens 4 --warmup 0 --read-ahead-kb 64",
                                                 (dir / "m.gguf").string(), (dir / "text.txt").string())));
        EXPECT_EQ(r.exit_code, 1) << r.output;
        EXPECT_NE(r.output.find("is being changed by another measure"), std::string::npos) << r.output;
        EXPECT_EQ(first_line(setting), original);
    }
    EXPECT_EQ(count_named(state, "read-ahead"), 0u) << "the claim goes with its holder";

    // A read-ahead so large that the probe may fault nothing: either refused as a probe that
    // measured no storage, or a probe that read bytes; never a rate of 0 GB/s reported.
    const fs::path json_out = dir / "huge.json";
    auto huge = test::run_command(env + test::moeprune_cmd(fmt::format(
                                            "measure -m {} -f {} --ram 50% --tokens 4 --warmup 0 --probe-mib 1 "
                                            "--read-ahead-kb 1048576 --json {}",
                                            (dir / "m.gguf").string(), (dir / "text.txt").string(), json_out.string())));
    if (huge.exit_code == 0) {
        const nlohmann::json m = test::read_json(json_out);
        for (const nlohmann::json & probe : m.at("probes")) {
            EXPECT_GT(probe.at("bytes_read").get<int64_t>(), 0) << probe.dump();
        }
    } else {
        EXPECT_NE(huge.output.find("read nothing from the device"), std::string::npos) << huge.output;
        EXPECT_FALSE(fs::exists(json_out));
    }
    EXPECT_EQ(first_line(setting), original);

    // What a measure killed after its first change leaves: its record, unlocked.
    const std::string changed = original == "64" ? "96" : "64";
    std::string name = "read-ahead" + setting.string();
    for (char & c : name) {
        c = c == '/' ? '_' : c;
    }
    test::write_text(state / name, fmt::format("{}\n{} 999999\n", setting.string(), original));
    test::write_text(setting, changed + "\n");
    ASSERT_EQ(first_line(setting), changed);
    const auto r = test::run_command(env + limit_cmd("--ram 64M -- true"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("put " + setting.string() + " back to " + original + " KB"), std::string::npos) << r.output;
    EXPECT_EQ(first_line(setting), original);
    EXPECT_EQ(count_named(state, "read-ahead"), 0u);
}
