#pragma once
// Memory cgroups for measured child processes: made under the cgroup moeprune itself
// runs in (as root, or in a subtree delegated to the user), one per measured run, and
// removed afterwards. A mapped file's page-cache pages are charged to the cgroup that
// faulted them, so a limit on the child is a limit on how much of the model it keeps
// cached, as on a machine with that much memory.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// One line of /proc/self/mountinfo.
struct Mount {
    std::string dev;                  // "MAJ:MIN"
    std::filesystem::path root, point;
    std::string type, source, options;
};
std::vector<Mount> mount_table();

struct CgroupSupport {
    int version = 0;                  // 1 or 2; 0 when no memory cgroup can be made
    std::filesystem::path parent;     // where moeprune makes its cgroups (its own cgroup)
    std::string problem;              // why none can be made, and how to get one
    std::string command = "measure";  // the moeprune command asking, as its messages name it
};

// Finds the memory controller (cgroup v2, else v1) and checks that moeprune may make
// cgroups under its own; `problem` says what is missing otherwise, in advice for `command`.
CgroupSupport find_memory_cgroup(const std::string & command = "measure");

// The tightest memory limit on moeprune's own cgroup and those above it, which holds
// every cgroup it makes whatever their own limit; nullopt when none is set.
struct InheritedLimit {
    uint64_t bytes = 0;
    std::filesystem::path cgroup;     // the cgroup that sets it
};
std::optional<InheritedLimit> inherited_limit(const CgroupSupport & support);

// Every measure (and limit) claims what it makes with a marker only a live one holds: a
// scratch folder TMPDIR/moeprune-measure-TOKEN whose file `owner.lock` it keeps locked
// (flock) for its whole life, and cgroups named moeprune-measure-TOKEN-N, each listed in
// the folder's file `cgroups` before it is made. A later measure or limit removes a cgroup
// or scratch folder only when that lock exists and can be taken (its maker is gone), and
// leaves every other name alone, saying so. The folder, and so the marker, goes only
// after every cgroup it lists is gone, wherever it was made: a sweep from another cgroup
// removes those by their recorded paths.
constexpr const char * kCgroupPrefix = "moeprune-measure-";

// The scratch folder of one measure (workers' specs and results, llama-bench's output),
// locked while it lives and removed with everything in it.
class MeasureScratch {
public:
    explicit MeasureScratch(const std::string & command = "measure");
    ~MeasureScratch();
    MeasureScratch(const MeasureScratch &) = delete;
    MeasureScratch & operator=(const MeasureScratch &) = delete;

    const std::filesystem::path & path() const { return path_; }
    const std::string & token() const { return token_; }

private:
    std::filesystem::path path_;
    std::string token_;
    int lock_fd_ = -1;
};

class MemoryCgroup {
public:
    // A cgroup limited to `limit_bytes` of memory (0: no limit, only accounting), claimed by `owner`.
    MemoryCgroup(const CgroupSupport & support, uint64_t limit_bytes, const MeasureScratch & owner);
    ~MemoryCgroup();  // kills what is left inside and removes the cgroup
    MemoryCgroup(const MemoryCgroup &) = delete;
    MemoryCgroup & operator=(const MemoryCgroup &) = delete;

    const std::filesystem::path & path() const { return path_; }
    uint64_t limit_bytes() const { return limit_; }
    // The file a process writes its pid into to join.
    std::filesystem::path procs_file() const { return path_ / "cgroup.procs"; }
    // The most memory charged at once (v2 kernels before 5.19 have no record: 0).
    uint64_t peak_bytes() const;
    // Processes the kernel's out-of-memory killer chose inside this cgroup.
    uint64_t oom_kills() const;

private:
    int version_;
    uint64_t limit_;
    std::filesystem::path path_;
};

struct StaleSweep {
    std::vector<std::string> removed;   // cgroups and scratch folders of measures that are gone
    std::vector<std::string> left;      // names like moeprune's that no marker proves its own, and why
};

// Removes the cgroups and scratch folders earlier measures made and could not remove
// (they were killed), by the rule of kCgroupPrefix; `own` is this measure's.
StaleSweep remove_stale_measures(const CgroupSupport & support, const MeasureScratch & own);

// remove_stale_measures, each line said on stderr: what it removed as left by `killed`
// ("a measure"), and what it left alone and why.
void sweep_stale_measures(const CgroupSupport & support, const MeasureScratch & own, const char * killed);

} // namespace moeprune
