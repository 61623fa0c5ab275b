#pragma once
// Outputs are written under a temporary name beside the destination and renamed
// only once complete, so a crash or an error never leaves a valid-looking broken
// file, and an existing file at the destination survives until the new one is whole.
#include "core/errors.h"

#include <filesystem>
#include <string>
#include <sys/types.h>
#include <vector>

namespace moeprune {

class AtomicOutput {
public:
    explicit AtomicOutput(std::filesystem::path final_path);
    ~AtomicOutput();  // removes the temporary file unless commit() ran
    AtomicOutput(const AtomicOutput &) = delete;
    AtomicOutput & operator=(const AtomicOutput &) = delete;

    const std::filesystem::path & temp_path() const { return temp_; }
    const std::filesystem::path & final_path() const { return final_; }
    void commit();

private:
    std::filesystem::path final_;
    std::filesystem::path temp_;
    bool committed_ = false;
};

// Writes a whole text or binary blob atomically.
void write_file_atomic(const std::filesystem::path & path, const std::string & contents);
// Writes a whole blob, made durable, under `out`'s temporary name, for a caller that
// commits it together with other outputs.
void write_temp_file(const AtomicOutput & out, const std::string & contents);

// The one check every command that writes runs before it writes anything: refuses an
// output that is one of `inputs` or another of `outputs` (the same path, a hard link,
// or a symbolic link to it). Give every shard of a split model as an input.
void refuse_output_clashes(const std::vector<std::filesystem::path> & outputs,
                           const std::vector<std::filesystem::path> & inputs);

// Refuses, before any work, an output (given by `flag`; empty: none) that could not be
// written at the end: a folder, a missing folder, a read-only file system. Leaves nothing.
void refuse_unwritable_output(const std::filesystem::path & out, const std::string & flag);

// Refuses a file given twice among `inputs` (the same path, a hard link, or a symbolic
// link to it), saying `why` that is wrong.
void refuse_repeated_inputs(const std::vector<std::filesystem::path> & inputs, const std::string & why);

// Creates the folder a command writes its outputs into (and its parents); a path that
// exists as something else than a folder is refused by name, as is one that cannot be made.
void create_output_dir(const std::filesystem::path & dir);

// Reads a whole regular file; FIFOs, devices and directories are refused by name
// before they are opened, so an endless or blocking input cannot hang or exhaust memory.
std::string read_text_file(const std::filesystem::path & path);

// On SIGINT, SIGTERM, SIGHUP and SIGQUIT, removes the temporary files of every live
// AtomicOutput and then dies of the same signal. Also ignores SIGXFSZ, so that a
// write over the file size limit fails with EFBIG (reported, cleaned up) instead of
// killing the process with a half-written temporary file left behind.
void install_cleanup_on_signals();

// In a forked child before exec: SIGXFSZ as this process found it, so that a program it
// runs is killed by the file size limit as it would be without moeprune (async-signal-safe).
void restore_inherited_signals();

// What a work raises when a DeferredSignals scope received a signal: main removes
// nothing more, and dies of the same signal.
class Interrupted : public Error {
public:
    explicit Interrupted(int sig);
    int signal() const { return signal_; }

private:
    int signal_;
};

// Work that leaves what only it can remove (child processes, memory cgroups, a scratch
// folder) unwinds on SIGINT, SIGTERM, SIGHUP and SIGQUIT instead of dying at once:
// while a scope lives, the first such signal kills the process groups of the children
// it was told of and is remembered, and check() throws Interrupted, so destructors
// remove what was made. A second signal removes temporary files and dies, as outside.
class DeferredSignals {
public:
    DeferredSignals();
    ~DeferredSignals();
    DeferredSignals(const DeferredSignals &) = delete;
    DeferredSignals & operator=(const DeferredSignals &) = delete;

    static void check();
    static bool interrupted();
    // A child that leads its own process group; killed with its whole group on a signal.
    static void add_child_group(pid_t group);
    static void remove_child_group(pid_t group);
};

} // namespace moeprune
