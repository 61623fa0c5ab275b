#include "measure/limit.h"

#include "core/atomic_file.h"
#include "core/errors.h"
#include "measure/cgroup.h"
#include "measure/child.h"
#include "measure/read_ahead.h"

#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <unistd.h>

namespace moeprune {

namespace {

// execv takes a path; a shell would have searched the PATH for a bare name.
std::string on_path(const std::string & program) {
    if (program.find('/') != std::string::npos) {
        return program;
    }
    const char * path = std::getenv("PATH");
    std::istringstream dirs(path ? path : "");
    for (std::string dir; std::getline(dirs, dir, ':');) {
        const std::filesystem::path candidate = std::filesystem::path(dir.empty() ? "." : dir) / program;
        if (::access(candidate.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(candidate)) {
            return candidate.string();
        }
    }
    throw Error(fmt::format("{}: no such program on the PATH", program));
}

std::string mib(uint64_t bytes) { return fmt::format("{:.1f} MiB", double(bytes) / (1 << 20)); }

} // namespace

int run_limited(std::vector<std::string> command, uint64_t limit_bytes) {
    if (command.empty()) {
        throw Error("give the command to run under the limit after --");
    }
    if (limit_bytes < kLeastLimitBytes) {
        throw Error(fmt::format("--ram {} bytes: under the {} any command needs to start; a size takes its unit "
                                "(--ram 1G is 1 GiB, --ram 1 one byte)",
                                limit_bytes, mib(kLeastLimitBytes)));
    }
    command.front() = on_path(command.front());
    const CgroupSupport support = find_memory_cgroup("limit");
    if (support.version == 0) {
        throw Error(support.problem);
    }
    print_left_read_ahead();
    DeferredSignals signals;
    MeasureScratch scratch("limit");
    sweep_stale_measures(support, scratch, "a measure or limit");
    const std::optional<InheritedLimit> above = inherited_limit(support);
    if (above && above->bytes < limit_bytes) {
        std::fprintf(stderr, "moeprune: warning: --ram %s is above the limit of %s that moeprune itself runs under "
                             "(%s): the command is held to %s\n",
                     mib(limit_bytes).c_str(), mib(above->bytes).c_str(), above->cgroup.c_str(),
                     mib(above->bytes).c_str());
    }
    MemoryCgroup cgroup(support, limit_bytes, scratch);
    const WorkerExit w = spawn_in(command, &cgroup, {}, {}, 0, /*job_control=*/true);
    if (const uint64_t kills = cgroup.oom_kills(); kills > 0) {
        const bool inherited = above && above->bytes < limit_bytes;
        const std::string who = w.signal == SIGKILL ? command.front() + ": the kernel killed it"
                                                    : fmt::format("the kernel killed {} process{} that {} started", kills,
                                                                  kills == 1 ? "" : "es", command.front());
        std::fprintf(stderr, "moeprune: %s for memory under the limit of %s%s: the limit is too small for what it keeps "
                             "in anonymous memory (the page cache is reclaimed first)\n",
                     who.c_str(), mib(inherited ? above->bytes : limit_bytes).c_str(),
                     inherited ? fmt::format(" set on {}, above --ram", above->cgroup.string()).c_str() : "");
    }
    return w.signal != 0 ? 128 + w.signal : w.status;
}

} // namespace moeprune
