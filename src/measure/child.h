#pragma once
// measure's child processes (the worker, llama-bench), each in its own process group and
// memory cgroup, and the storage and page cache they meet.
#include "measure/cgroup.h"
#include "measure/worker.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

// The model's file system and block device, as /proc/self/mountinfo and sysfs name them.
nlohmann::json storage_of(const std::filesystem::path & file);

// Refuses a file whose pages the kernel cannot drop: a RAM file system keeps them.
void refuse_ram_filesystem(const std::filesystem::path & shard);

// Drops the model's own pages from the page cache, then checks that they went: pages
// another process maps or locks stay, and the runs would then read less than they need.
void drop_model_pages(const std::vector<std::filesystem::path> & shards);

struct WorkerExit {
    nlohmann::json result;
    int signal = 0;   // the signal that killed the worker, 0 when it exited
    int status = 0;
    bool timed_out = false;   // killed (with its process group) after `timeout_s`
    double seconds = 0;
};

// Runs `args` in a child process, inside `cgroup` when given, its standard output into
// `stdout_path` when given. The child joins the cgroup before exec, so everything it maps
// and faults is charged there, and dies with this process (PR_SET_PDEATHSIG) so a killed
// measure leaves no child behind. It leads its own process group, which a signal to
// measure (DeferredSignals) or `timeout_s` kills whole: a script's children too. With
// `job_control` (limit), it also has moeprune's terminal in the foreground while it runs,
// and a stop of it stops moeprune too, as a shell runs a job. Its exit status is a
// shell's where it cannot be run: 127 not found, 126 not runnable.
WorkerExit spawn_in(std::vector<std::string> args, const MemoryCgroup * cgroup,
                    const std::filesystem::path & stdout_path = {}, const std::filesystem::path & stderr_path = {},
                    double timeout_s = 0, bool job_control = false);

// Runs `spec` in `measure-worker`, a child process of this program.
WorkerExit spawn_worker(const std::filesystem::path & exe, const WorkerSpec & spec, const MemoryCgroup * cgroup,
                        const MeasureScratch & scratch, const std::string & name);

} // namespace moeprune
