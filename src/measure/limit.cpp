#include "measure/limit.h"

#include "core/atomic_file.h"
#include "core/errors.h"
#include "measure/cgroup.h"
#include "measure/child.h"

#include <fmt/format.h>

#include <csignal>
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

} // namespace

int run_limited(std::vector<std::string> command, uint64_t limit_bytes) {
    if (command.empty()) {
        throw Error("give the command to run under the limit after --");
    }
    if (limit_bytes == 0) {
        throw Error("--ram must be more than 0 bytes");
    }
    command.front() = on_path(command.front());
    const CgroupSupport support = find_memory_cgroup();
    if (support.version == 0) {
        throw Error(support.problem);
    }
    DeferredSignals signals;
    // Its cgroup is marked as measure's are, so that the next measure removes it where a
    // kill -9 left it; the sweep of leftovers is measure's alone.
    MeasureScratch scratch;
    MemoryCgroup cgroup(support, limit_bytes, scratch);
    const WorkerExit w = spawn_in(command, &cgroup);
    if (w.signal == SIGKILL && cgroup.oom_kills() > 0) {
        throw Error(fmt::format("{}: the kernel killed it for memory under the limit of {:.1f} MiB: the limit is too "
                                "small for what it keeps in anonymous memory (the page cache is reclaimed first)",
                                command.front(), double(limit_bytes) / (1 << 20)));
    }
    return w.signal != 0 ? 128 + w.signal : w.status;
}

} // namespace moeprune
