#include "measure/cgroup.h"

#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace moeprune {

namespace {

std::string read_small(const fs::path & p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

bool write_small(const fs::path & p, const std::string & value) {
    std::ofstream out(p);
    out << value;
    out.flush();
    return bool(out);
}

std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> parts;
    std::stringstream ss(s);
    for (std::string part; std::getline(ss, part, sep);) {
        parts.push_back(part);
    }
    return parts;
}

// Where this process's cgroup is under a mount: its path from /proc/self/cgroup, less
// the part of the hierarchy above the mount's root (a container sees its own subtree).
fs::path own_cgroup_dir(const Mount & m, const std::string & cgroup_path) {
    std::string rel = cgroup_path;
    const std::string root = m.root.string();
    if (root != "/" && rel.rfind(root, 0) == 0) {
        rel = rel.substr(root.size());
    }
    return m.point / fs::path(rel).relative_path();
}

bool has_word(const std::string & list, const std::string & word, char sep) {
    for (const std::string & w : split(list, sep)) {
        if (w == word) {
            return true;
        }
    }
    return false;
}

std::string how_to_get_one(const std::string & command) {
    return fmt::format("run moeprune as root, or inside a cgroup delegated to you with the memory controller, e.g. "
                       "`systemd-run --user --scope -p Delegate=yes -p MemoryMax=infinity moeprune {} ...`",
                       command);
}

// Kills every process left in `dir` and in the cgroups below it, and removes them all,
// waiting a little for the kernel to let the killed go. False when `dir` is still there.
bool kill_and_remove(const fs::path & dir) {
    std::error_code ec;
    for (const fs::directory_entry & e : fs::directory_iterator(dir, ec)) {
        if (e.is_directory(ec) && !e.is_symlink(ec)) {
            kill_and_remove(e.path());  // a cgroup with children cannot be removed
        }
    }
    for (int attempt = 0; attempt < 100; ++attempt) {
        for (const std::string & pid : split(read_small(dir / "cgroup.procs"), '\n')) {
            char * end = nullptr;
            const long p = std::strtol(pid.c_str(), &end, 10);
            if (p > 0 && end && *end == '\0') {
                ::kill(pid_t(p), SIGKILL);
            }
        }
        if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) {
            return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
}

constexpr const char * kOwnerLock = "owner.lock";
constexpr const char * kCgroupList = "cgroups";

fs::path temp_dir(const std::string & command) {
    std::error_code ec;
    const fs::path base = fs::temp_directory_path(ec);
    const char * tmpdir = std::getenv("TMPDIR");
    if (ec || !fs::is_directory(base, ec)) {
        throw Error(fmt::format("TMPDIR={}: is not a folder; {} keeps {} in the temporary folder: set TMPDIR to a "
                                "writable folder",
                                tmpdir ? tmpdir : "(unset)", command,
                                command == "measure" ? "its scratch files" : "the marker of the cgroup it makes"));
    }
    return base;
}

// A cgroup a scratch folder lists, checked before anything in it is killed: its name
// must be one this scratch folder's maker would have made.
bool listed_cgroup_is_its_own(const fs::path & cgroup, const std::string & token) {
    const std::string name = cgroup.filename().string();
    const std::string head = std::string(kCgroupPrefix) + token + "-";
    return cgroup.is_absolute() && name.rfind(head, 0) == 0 && name.size() > head.size() &&
           name.find_first_not_of("0123456789", head.size()) == std::string::npos &&
           cgroup.string().rfind("/sys/fs/cgroup/", 0) == 0;
}

// Removes the cgroups a gone measure's scratch folder lists; false when one may still be
// there: it could not be removed, or its folder above cannot be seen from here.
bool remove_listed_cgroups(const fs::path & scratch, const std::string & token, StaleSweep & out) {
    bool all_gone = true;
    std::ifstream in(scratch / kCgroupList);
    std::error_code ec;
    for (std::string line; std::getline(in, line);) {
        const fs::path cgroup = line;
        if (line.empty() || !listed_cgroup_is_its_own(cgroup, token)) {
            continue;
        }
        if (!fs::exists(cgroup, ec)) {
            if (!fs::is_directory(cgroup.parent_path(), ec)) {
                all_gone = false;   // made where this process cannot see (another cgroup namespace)
                out.left.push_back(fmt::format("{}: cannot be seen from here, so {} stays as its marker", line,
                                               scratch.string()));
            }
            continue;
        }
        if (kill_and_remove(cgroup)) {
            out.removed.push_back(line);
        } else {
            all_gone = false;
            out.left.push_back(fmt::format("{}: could not be removed (processes in it would not die)", line));
        }
    }
    return all_gone;
}

std::atomic<unsigned> g_cgroups_made{0};

} // namespace

// /proc/self/mountinfo: "ID PARENT MAJ:MIN ROOT POINT OPTS [TAGS...] - TYPE SOURCE SUPEROPTS".
std::vector<Mount> mount_table() {
    std::vector<Mount> mounts;
    std::ifstream in("/proc/self/mountinfo");
    for (std::string line; std::getline(in, line);) {
        std::istringstream fields(line);
        std::string id, parent, root, point, opts, word;
        Mount m;
        fields >> id >> parent >> m.dev >> root >> point >> opts;
        while (fields >> word && word != "-") {
        }
        fields >> m.type >> m.source >> m.options;
        m.root = root;
        m.point = point;
        mounts.push_back(std::move(m));
    }
    return mounts;
}

CgroupSupport find_memory_cgroup(const std::string & command) {
    CgroupSupport s;
    s.command = command;
    std::string v2_path, v1_path;
    bool v1_listed = false;
    std::ifstream in("/proc/self/cgroup");
    for (std::string line; std::getline(in, line);) {
        const auto first = line.find(':'), second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) {
            continue;
        }
        const std::string controllers = line.substr(first + 1, second - first - 1);
        const std::string path = line.substr(second + 1);
        if (line.substr(0, first) == "0" && controllers.empty()) {
            v2_path = path;
        } else if (has_word(controllers, "memory", ',')) {
            v1_path = path;
            v1_listed = true;
        }
    }
    std::vector<std::string> seen;
    const std::vector<Mount> mounts = mount_table();
    for (const Mount & m : mounts) {
        if (m.type == "cgroup2" && !v2_path.empty()) {
            const fs::path dir = own_cgroup_dir(m, v2_path);
            std::string controllers = read_small(dir / "cgroup.controllers");
            std::replace(controllers.begin(), controllers.end(), '\n', ' ');
            if (has_word(controllers, "memory", ' ')) {
                if (::access(dir.c_str(), W_OK) == 0) {
                    return {2, dir, "", command};
                }
                seen.push_back(fmt::format("cgroup v2 at {} is not writable by this user", dir.string()));
            } else {
                seen.push_back(fmt::format("cgroup v2 at {} has no memory controller", dir.string()));
            }
        }
    }
    for (const Mount & m : mounts) {
        if (m.type == "cgroup" && has_word(m.options, "memory", ',') && v1_listed) {
            const fs::path dir = own_cgroup_dir(m, v1_path);
            if (fs::exists(dir / "memory.limit_in_bytes") && ::access(dir.c_str(), W_OK) == 0) {
                return {1, dir, "", command};
            }
            seen.push_back(fmt::format("cgroup v1 memory at {} is not writable by this user", dir.string()));
        }
    }
    if (seen.empty()) {
        seen.push_back("no memory cgroup controller is mounted (neither cgroup v2 nor v1)");
    }
    s.problem = fmt::format("cannot make a memory cgroup: {}; {}", fmt::join(seen, "; "), how_to_get_one(command));
    return s;
}

std::optional<InheritedLimit> inherited_limit(const CgroupSupport & support) {
    std::optional<InheritedLimit> tightest;
    const char * file = support.version == 2 ? "memory.max" : "memory.limit_in_bytes";
    for (fs::path dir = support.parent; !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
        std::string text = read_small(dir / file);
        if (text.empty()) {
            break;   // above the hierarchy's root
        }
        char * end = nullptr;
        const unsigned long long bytes = std::strtoull(text.c_str(), &end, 10);
        // v1 writes "no limit" as a page-rounded 2^63 - 1; v2 as "max".
        if (end != text.c_str() && bytes < (uint64_t(1) << 62) && (!tightest || bytes < tightest->bytes)) {
            tightest = InheritedLimit{bytes, dir};
        }
    }
    return tightest;
}

MeasureScratch::MeasureScratch(const std::string & command) {
    const fs::path base = temp_dir(command);
    std::string tmpl = (base / (std::string(kCgroupPrefix) + "XXXXXX")).string();
    if (!::mkdtemp(tmpl.data())) {
        throw Error(fmt::format("TMPDIR={}: cannot make a scratch folder in it: {}; set TMPDIR to a writable folder",
                                base.string(), std::strerror(errno)));
    }
    path_ = tmpl;
    token_ = path_.filename().string().substr(std::strlen(kCgroupPrefix));
    const fs::path lock = path_ / kOwnerLock;
    lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
        const std::string why = std::strerror(errno);
        std::error_code ec;
        fs::remove_all(path_, ec);
        throw Error(fmt::format("{}: cannot be made and locked ({}); {} marks what it makes so; set TMPDIR "
                                "to a local folder", lock.string(), why, command));
    }
}

MeasureScratch::~MeasureScratch() {
    std::error_code ec;
    fs::remove_all(path_, ec);
    ::close(lock_fd_);
}

MemoryCgroup::MemoryCgroup(const CgroupSupport & support, uint64_t limit_bytes, const MeasureScratch & owner)
    : version_(support.version), limit_(limit_bytes) {
    if (version_ == 0) {
        throw Error(support.problem);
    }
    path_ = support.parent / fmt::format("{}{}-{}", kCgroupPrefix, owner.token(), g_cgroups_made++);
    // Listed before it exists, so that a sweep finds it whatever cgroup the sweeper is in.
    {
        std::ofstream list(owner.path() / kCgroupList, std::ios::app);
        list << path_.string() << '\n';
        if (!list.flush()) {
            throw Error(fmt::format("{}: cannot be written: the list of the cgroups it makes keeps them findable "
                                    "after a kill; set TMPDIR to a writable folder",
                                    (owner.path() / kCgroupList).string()));
        }
    }
    if (::mkdir(path_.c_str(), 0755) != 0) {
        throw Error(fmt::format("cannot make the memory cgroup {}: {}; {}", path_.string(), std::strerror(errno),
                                how_to_get_one(support.command)));
    }
    if (version_ == 2 && !fs::exists(path_ / "memory.max")) {
        // The memory controller must be enabled for the children of moeprune's own cgroup,
        // which cgroup v2 refuses while that cgroup holds processes of its own.
        write_small(support.parent / "cgroup.subtree_control", "+memory");
        if (!fs::exists(path_ / "memory.max")) {
            ::rmdir(path_.c_str());
            throw Error(fmt::format("cannot enable the memory controller below {} (a cgroup v2 that holds processes "
                                    "cannot give its children one); {}",
                                    support.parent.string(), how_to_get_one(support.command)));
        }
    }
    if (limit_bytes > 0) {
        const fs::path file = path_ / (version_ == 2 ? "memory.max" : "memory.limit_in_bytes");
        if (!write_small(file, std::to_string(limit_bytes))) {
            kill_and_remove(path_);
            throw Error(fmt::format("cannot set {} to {} bytes", file.string(), limit_bytes));
        }
        if (version_ == 2) {
            // Without swap limits, anonymous memory could leave for swap instead of the cache shrinking.
            write_small(path_ / "memory.swap.max", "0");
        }
    }
}

MemoryCgroup::~MemoryCgroup() {
    if (!kill_and_remove(path_)) {
        // This measure's marker goes with its scratch folder, so no later measure will.
        std::fprintf(stderr, "moeprune: warning: could not remove the cgroup %s (a process in it would not die): "
                             "remove it with rmdir once it is empty\n",
                     path_.c_str());
    }
}

uint64_t MemoryCgroup::peak_bytes() const {
    const std::string text = read_small(path_ / (version_ == 2 ? "memory.peak" : "memory.max_usage_in_bytes"));
    return text.empty() ? 0 : std::stoull(text);
}

uint64_t MemoryCgroup::oom_kills() const {
    const std::string file = version_ == 2 ? "memory.events" : "memory.oom_control";
    for (const std::string & line : split(read_small(path_ / file), '\n')) {
        if (line.rfind("oom_kill ", 0) == 0) {
            return std::stoull(line.substr(9));
        }
    }
    return 0;
}

StaleSweep remove_stale_measures(const CgroupSupport & support, const MeasureScratch & own) {
    StaleSweep out;
    const fs::path tmp = own.path().parent_path();
    const std::string prefix = kCgroupPrefix;
    // A scratch folder whose lock can be taken belongs to a measure that is gone; the
    // lock is held until its cgroups and the folder are removed.
    std::map<std::string, int> gone;
    std::error_code ec;
    for (const fs::directory_entry & e : fs::directory_iterator(tmp, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind(prefix, 0) != 0 || e.is_symlink(ec) || !e.is_directory(ec) || name == own.path().filename()) {
            continue;
        }
        const int fd = ::open((e.path() / kOwnerLock).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) {
            continue;  // no marker: not provably a measure's
        }
        if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
            gone[name.substr(prefix.size())] = fd;
        } else {
            ::close(fd);
        }
    }
    if (support.version != 0) {
        for (const fs::directory_entry & e : fs::directory_iterator(support.parent, ec)) {
            const std::string name = e.path().filename().string();
            if (name.rfind(prefix, 0) != 0 || !e.is_directory(ec)) {
                continue;
            }
            const std::string rest = name.substr(prefix.size());
            const std::string token = rest.substr(0, rest.find('-'));
            if (token == own.token()) {
                continue;
            }
            const fs::path marker = tmp / (prefix + token) / kOwnerLock;
            if (gone.count(token) && fs::exists(tmp / (prefix + token) / kCgroupList, ec)) {
                continue;   // removed below by its recorded path, with any others it lists
            }
            if (gone.count(token)) {
                if (kill_and_remove(e.path())) {
                    out.removed.push_back(e.path().string());
                } else {
                    out.left.push_back(fmt::format("{}: could not be removed (processes in it would not die)", e.path().string()));
                }
            } else if (!fs::exists(marker, ec)) {
                out.left.push_back(fmt::format("{}: left alone: no live or killed measure claims it ({} is missing: "
                                               "made under another TMPDIR, by an older moeprune, or not by moeprune)",
                                               e.path().string(), marker.string()));
            }
        }
    }
    for (const auto & [token, fd] : gone) {
        const fs::path dir = tmp / (prefix + token);
        if (remove_listed_cgroups(dir, token, out)) {
            fs::remove_all(dir, ec);
            out.removed.push_back(dir.string());
        }
        ::close(fd);
    }
    return out;
}

void sweep_stale_measures(const CgroupSupport & support, const MeasureScratch & own, const char * killed) {
    const StaleSweep swept = remove_stale_measures(support, own);
    for (const std::string & stale : swept.removed) {
        std::fprintf(stderr, "moeprune: removed %s, left by %s that was killed\n", stale.c_str(), killed);
    }
    for (const std::string & left : swept.left) {
        std::fprintf(stderr, "moeprune: %s\n", left.c_str());
    }
}

} // namespace moeprune
