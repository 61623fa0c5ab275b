#include "core/atomic_file.h"
#include "core/errors.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <sstream>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moeprune {

namespace fs = std::filesystem;

namespace {

// Temporary paths a signal handler may unlink: plain pointers in atomics, since a
// handler may not lock or allocate.
constexpr size_t kMaxLiveOutputs = 256;
std::atomic<const char *> g_live_temps[kMaxLiveOutputs];

void register_temp(const char * path) {
    for (auto & slot : g_live_temps) {
        const char * expected = nullptr;
        if (slot.compare_exchange_strong(expected, path)) {
            return;
        }
    }
    throw Error("too many output files open at once");
}

void unregister_temp(const char * path) {
    for (auto & slot : g_live_temps) {
        const char * expected = path;
        if (slot.compare_exchange_strong(expected, nullptr)) {
            return;
        }
    }
}

extern "C" void remove_temps_and_die(int sig) {
    for (auto & slot : g_live_temps) {
        if (const char * p = slot.load()) {
            ::unlink(p);
        }
    }
    std::signal(sig, SIG_DFL);
    std::raise(sig);
}

constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// The signal a DeferredSignals scope received (0: none), and the process groups its
// handler kills: plain atomics, as a handler may not lock or allocate.
std::atomic<int> g_deferred_signal{0};
std::atomic<int> g_deferring{0};
constexpr size_t kMaxChildGroups = 8;
std::atomic<pid_t> g_child_groups[kMaxChildGroups];

extern "C" void defer_signal(int sig) {
    int none = 0;
    if (!g_deferred_signal.compare_exchange_strong(none, sig)) {
        remove_temps_and_die(sig);  // a second signal: the person insists
    }
    for (auto & slot : g_child_groups) {
        if (const pid_t group = slot.load(); group > 0) {
            ::kill(-group, SIGKILL);
        }
    }
}

void (*g_inherited_sigxfsz)(int) = SIG_DFL;  // what this process found, before it ignored it

} // namespace

void install_cleanup_on_signals() {
    for (int sig : kCleanupSignals) {
        std::signal(sig, remove_temps_and_die);
    }
    g_inherited_sigxfsz = std::signal(SIGXFSZ, SIG_IGN);
}

void restore_inherited_signals() { std::signal(SIGXFSZ, g_inherited_sigxfsz == SIG_IGN ? SIG_IGN : SIG_DFL); }

Interrupted::Interrupted(int sig)
    : Error(fmt::format("interrupted by {}", ::sigabbrev_np(sig) ? std::string("SIG") + ::sigabbrev_np(sig)
                                                                  : fmt::format("signal {}", sig))),
      signal_(sig) {}

DeferredSignals::DeferredSignals() {
    if (g_deferring++ == 0) {
        for (int sig : kCleanupSignals) {
            struct sigaction sa {};
            sa.sa_handler = defer_signal;
            sigemptyset(&sa.sa_mask);
            ::sigaction(sig, &sa, nullptr);  // no SA_RESTART: a blocking wait returns to check
        }
    }
}

DeferredSignals::~DeferredSignals() {
    if (--g_deferring == 0) {
        for (int sig : kCleanupSignals) {
            std::signal(sig, remove_temps_and_die);
        }
    }
}

void DeferredSignals::check() {
    if (const int sig = g_deferred_signal.load()) {
        throw Interrupted(sig);
    }
}

bool DeferredSignals::interrupted() { return g_deferred_signal.load() != 0; }

void DeferredSignals::add_child_group(pid_t group) {
    for (auto & slot : g_child_groups) {
        pid_t none = 0;
        if (slot.compare_exchange_strong(none, group)) {
            if (interrupted()) {
                ::kill(-group, SIGKILL);  // the signal came while it was starting
            }
            return;
        }
    }
    throw Error("too many child processes at once");
}

void DeferredSignals::remove_child_group(pid_t group) {
    for (auto & slot : g_child_groups) {
        pid_t expected = group;
        if (slot.compare_exchange_strong(expected, 0)) {
            return;
        }
    }
}

AtomicOutput::AtomicOutput(fs::path final_path) : final_(std::move(final_path)) {
    temp_ = final_;
    temp_ += ".partial." + std::to_string(::getpid());
    register_temp(temp_.c_str());
}

AtomicOutput::~AtomicOutput() {
    unregister_temp(temp_.c_str());
    if (!committed_) {
        std::error_code ec;
        fs::remove(temp_, ec);
    }
}

void AtomicOutput::commit() {
    std::error_code ec;
    fs::rename(temp_, final_, ec);
    if (ec) {
        fail_file(final_.string(), "cannot rename " + temp_.string() + " into place: " + ec.message());
    }
    committed_ = true;
}

void refuse_unwritable_output(const fs::path & out, const std::string & flag) {
    if (out.empty()) {
        return;
    }
    std::error_code ec;
    if (fs::is_directory(out, ec)) {
        fail_file(out.string(), flag + ": is a folder; give a file name");
    }
    AtomicOutput probe(out);
    const int fd = ::open(probe.temp_path().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        fail_file(out.string(), fmt::format("{}: cannot be written ({})", flag, std::strerror(errno)));
    }
    ::close(fd);
}

void write_file_atomic(const fs::path & path, const std::string & contents) {
    AtomicOutput out(path);
    write_temp_file(out, contents);
    out.commit();
}

void write_temp_file(const AtomicOutput & out, const std::string & contents) {
    FILE * f = std::fopen(out.temp_path().c_str(), "wb");
    if (!f) {
        fail_file(out.temp_path().string(), std::string("cannot create: ") + std::strerror(errno));
    }
    const size_t written = std::fwrite(contents.data(), 1, contents.size(), f);
    const bool flushed = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    const int saved_errno = errno;
    std::fclose(f);
    if (written != contents.size() || !flushed) {
        fail_file(out.temp_path().string(), std::string("write failed: ") + std::strerror(saved_errno));
    }
}

namespace {

// Where a path's bytes live: the inode of an existing file (links resolve to it), else
// the absolute path with its existing directories' symbolic links resolved.
struct FileIdentity {
    bool exists = false;
    dev_t dev = 0;
    ino_t ino = 0;
    fs::path canonical;
    bool operator==(const FileIdentity & o) const {
        return exists == o.exists && (exists ? dev == o.dev && ino == o.ino : canonical == o.canonical);
    }
};

FileIdentity identity_of(const fs::path & p) {
    FileIdentity id;
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) {
        id.exists = true;
        id.dev = st.st_dev;
        id.ino = st.st_ino;
    } else {
        std::error_code ec;
        id.canonical = fs::weakly_canonical(fs::absolute(p, ec), ec);
        if (ec) {
            id.canonical = fs::absolute(p, ec).lexically_normal();
        }
    }
    return id;
}

} // namespace

void refuse_repeated_inputs(const std::vector<fs::path> & inputs, const std::string & why) {
    std::vector<std::pair<fs::path, FileIdentity>> seen;
    for (const auto & in : inputs) {
        const FileIdentity id = identity_of(in);
        for (const auto & [other, other_id] : seen) {
            if (other_id == id) {
                fail_file(in.string(), "is given twice (also as " + other.string() + "): " + why);
            }
        }
        seen.emplace_back(in, id);
    }
}

void refuse_output_clashes(const std::vector<fs::path> & outputs, const std::vector<fs::path> & inputs) {
    std::vector<FileIdentity> in_ids;
    for (const auto & in : inputs) {
        if (!in.empty()) {
            in_ids.push_back(identity_of(in));
        }
    }
    std::vector<std::pair<fs::path, FileIdentity>> seen;
    for (const auto & out : outputs) {
        if (out.empty()) {
            continue;
        }
        const FileIdentity id = identity_of(out);
        for (size_t i = 0, j = 0; i < inputs.size(); ++i) {
            if (inputs[i].empty()) {
                continue;
            }
            if (in_ids[j++] == id) {
                fail_file(out.string(), "refusing to overwrite the input " + inputs[i].string());
            }
        }
        for (const auto & [other, other_id] : seen) {
            if (other_id == id) {
                fail_file(out.string(), "is given for two outputs (also as " + other.string() + "); each needs its own file");
            }
        }
        seen.emplace_back(out, id);
    }
}

void create_output_dir(const fs::path & dir) {
    std::error_code ec;
    if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
        fail_file(dir.string(), "exists and is not a folder: outputs are written into a folder of this name");
    }
    fs::create_directories(dir, ec);
    if (ec) {
        fail_file(dir.string(), "cannot create the output folder: " + ec.message());
    }
}

std::string read_text_file(const fs::path & path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
        fail_file(path.string(), std::string("cannot open: ") + std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        fail_file(path.string(), "not a regular file (a directory, FIFO or device cannot be read as an input)");
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        fail_file(path.string(), std::string("cannot open: ") + std::strerror(errno));
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) {
        fail_file(path.string(), "read failed");
    }
    return ss.str();
}

} // namespace moeprune
