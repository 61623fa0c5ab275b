// measure's child processes, and the storage and page cache they meet.
#include "measure/child.h"

#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <initializer_list>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moeprune {

namespace {

std::string read_first_line(const fs::path & p) {
    std::ifstream in(p);
    std::string line;
    std::getline(in, line);
    return line;
}

} // namespace

// The model's file system and block device, as /proc/self/mountinfo and sysfs name them.
json storage_of(const fs::path & file) {
    struct stat st{};
    if (::stat(file.c_str(), &st) != 0) {
        fail_file(file.string(), std::strerror(errno));
    }
    const std::string dev = fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
    json out = {{"dev", dev}};
    for (const Mount & m : mount_table()) {
        if (m.dev == dev) {
            out["filesystem"] = m.type;
            out["source"] = m.source;
            break;
        }
    }
    const fs::path block = fs::path("/sys/dev/block") / dev;
    std::error_code ec;
    const fs::path real = fs::canonical(block, ec);
    if (!ec) {
        out["device"] = real.filename().string();
        // A partition's disk is the folder above it.
        const fs::path disk = fs::exists(real / "queue") ? real : real.parent_path();
        out["rotational"] = read_first_line(disk / "queue" / "rotational") == "1";
        const std::string ra = read_first_line(disk / "queue" / "read_ahead_kb");
        if (!ra.empty()) {
            out["read_ahead_kb"] = std::stoull(ra);
            out["read_ahead_file"] = (disk / "queue" / "read_ahead_kb").string();
        }
        out["device_model"] = read_first_line(disk / "device" / "model");
    }
    return out;
}

// Refuses a file whose pages the kernel cannot drop: a RAM file system keeps them.
void refuse_ram_filesystem(const fs::path & shard) {
    struct statfs sf{};
    if (::statfs(shard.c_str(), &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC)) {
        fail_file(shard.string(), "is on a RAM file system (tmpfs or ramfs), whose pages cannot be dropped from the "
                                  "page cache: measure reads the model from storage; put it on a disk");
    }
}

// Drops the model's own pages from the page cache, then checks that they went: pages
// another process maps or locks stay, and the runs would then read less than they need.
void drop_model_pages(const std::vector<fs::path> & shards) {
    for (const fs::path & shard : shards) {
        const int fd = ::open(shard.c_str(), O_RDONLY);
        if (fd < 0) {
            fail_file(shard.string(), std::string("cannot be opened: ") + std::strerror(errno));
        }
        ::fdatasync(fd);
        const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        const uint64_t size = fs::file_size(shard);
        void * addr = size ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
        ::close(fd);
        if (rc != 0) {
            fail_file(shard.string(), fmt::format("posix_fadvise(DONTNEED) failed: {}", std::strerror(rc)));
        }
        if (addr == MAP_FAILED) {
            continue;
        }
        const size_t page = size_t(::sysconf(_SC_PAGESIZE));
        std::vector<unsigned char> resident((size + page - 1) / page);
        const bool known = ::mincore(addr, size, resident.data()) == 0;
        ::munmap(addr, size);
        const size_t kept = size_t(std::count_if(resident.begin(), resident.end(), [](unsigned char c) { return c & 1; }));
        if (known && kept * 10 > resident.size()) {
            fail_file(shard.string(), fmt::format("{} of its {} pages stayed in the page cache after "
                                                  "posix_fadvise(DONTNEED): another process maps or locks the model, "
                                                  "or its file system keeps pages; measure needs them dropped",
                                                  kept, resident.size()));
        }
    }
}


// Runs `args` in a child process, inside `cgroup` when given, its standard output into
// `stdout_path` when given. The child joins the cgroup before exec, so everything it maps
// and faults is charged there, and dies with this process (PR_SET_PDEATHSIG) so a killed
// measure leaves no child behind. It leads its own process group, which a signal to
// measure (DeferredSignals) or `timeout_s` kills whole: a script's children too.
namespace {

// The terminal moeprune's process group has in the foreground, or -1: a command run there
// gets the terminal while it runs, as a shell gives it, so that it can read it.
int foreground_terminal() {
    return ::isatty(STDIN_FILENO) && ::tcgetpgrp(STDIN_FILENO) == ::getpgrp() ? STDIN_FILENO : -1;
}

// tcsetpgrp from a group that is not in the foreground raises SIGTTOU unless it is blocked.
void give_terminal(int tty, pid_t group) {
    sigset_t ttou, old;
    sigemptyset(&ttou);
    sigaddset(&ttou, SIGTTOU);
    ::sigprocmask(SIG_BLOCK, &ttou, &old);
    ::tcsetpgrp(tty, group);
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
}

void say(std::initializer_list<const char *> parts) {
    for (const char * part : parts) {
        [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, part, std::strlen(part));
    }
}

// In the child after execv failed: why, as a shell says it, and its exit status (127: not
// found, 126: found but not runnable). A script whose #! interpreter is missing fails with
// ENOENT although the script is there: the interpreter is named.
[[noreturn]] void exec_failed(const char * program) {
    const int why = errno;
    if (why == ENOENT && ::access(program, F_OK) == 0) {
        char head[256] = {};
        const int fd = ::open(program, O_RDONLY | O_CLOEXEC);
        const ssize_t n = fd >= 0 ? ::read(fd, head, sizeof head - 1) : 0;
        if (n > 2 && head[0] == '#' && head[1] == '!') {
            char * interp = head + 2;
            while (*interp == ' ' || *interp == '\t') {
                ++interp;
            }
            interp[std::strcspn(interp, " \t\n")] = '\0';
            say({"cannot run ", program, ": its interpreter ", interp, " (the #! line) does not exist\n"});
            ::_exit(126);
        }
    }
    say({"cannot run ", program, ": ", std::strerror(why), "\n"});
    ::_exit(why == ENOENT ? 127 : 126);
}

} // namespace

WorkerExit spawn_in(std::vector<std::string> args, const MemoryCgroup * cgroup, const fs::path & stdout_path,
                    const fs::path & stderr_path, double timeout_s, bool job_control) {
    const std::string procs = cgroup ? cgroup->procs_file().string() : "";
    std::vector<char *> argv;
    for (std::string & a : args) {
        argv.push_back(a.data());
    }
    argv.push_back(nullptr);
    const int tty = job_control ? foreground_terminal() : -1;
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
        throw Error(fmt::format("cannot start {}: {}", args.front(), std::strerror(errno)));
    }
    if (pid == 0) {
        ::setpgid(0, 0);
        if (tty >= 0) {
            give_terminal(tty, ::getpgrp());
        }
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) {
            ::_exit(125);
        }
        if (!procs.empty()) {
            const int fd = ::open(procs.c_str(), O_WRONLY);
            char buf[32];
            const int n = std::snprintf(buf, sizeof buf, "%d", int(::getpid()));
            if (fd < 0 || ::write(fd, buf, size_t(n)) != n) {
                ::_exit(126);
            }
            ::close(fd);
        }
        for (const auto & [path, target] : {std::pair{&stdout_path, STDOUT_FILENO}, {&stderr_path, STDERR_FILENO}}) {
            if (!path->empty()) {
                const int fd = ::open(path->c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
                if (fd < 0 || ::dup2(fd, target) < 0) {
                    ::_exit(126);
                }
                ::close(fd);
            }
        }
        restore_inherited_signals();
        ::execv(argv[0], argv.data());
        exec_failed(argv[0]);
    }
    ::setpgid(pid, pid);  // as the child does, so the group exists before either goes on
    if (tty >= 0) {
        give_terminal(tty, pid);
    }
    DeferredSignals::add_child_group(pid);
    WorkerExit out;
    const auto t0 = std::chrono::steady_clock::now();
    int status = 0;
    for (;;) {
        const pid_t done = ::waitpid(pid, &status, WNOHANG | (job_control ? WUNTRACED : 0));
        if (done == pid && WIFSTOPPED(status)) {
            // Stopped (Ctrl-Z on its terminal, or by itself): moeprune stops too, so that its
            // shell sees the job stopped, and when continued gives the command the terminal
            // and continues it.
            if (tty >= 0) {
                give_terminal(tty, ::getpgrp());
            }
            ::raise(SIGSTOP);
            if (tty >= 0) {
                give_terminal(tty, pid);
            }
            ::kill(-pid, SIGCONT);
            continue;
        }
        if (done == pid || (done < 0 && errno != EINTR)) {
            break;
        }
        out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (timeout_s > 0 && out.seconds > timeout_s && !out.timed_out) {
            out.timed_out = true;
            ::kill(-pid, SIGKILL);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (tty >= 0) {
        give_terminal(tty, ::getpgrp());
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::kill(-pid, SIGKILL);  // what the child started and left behind
    DeferredSignals::remove_child_group(pid);
    DeferredSignals::check();
    if (WIFSIGNALED(status)) {
        out.signal = WTERMSIG(status);
    } else {
        out.status = WEXITSTATUS(status);
    }
    return out;
}

// Runs `spec` in `measure-worker`, a child process of this program.
WorkerExit spawn_worker(const fs::path & exe, const WorkerSpec & spec, const MemoryCgroup * cgroup,
                        const MeasureScratch & scratch, const std::string & name) {
    const fs::path spec_path = scratch.path() / (name + ".spec.json");
    const fs::path out_path = scratch.path() / (name + ".result.json");
    write_file_atomic(spec_path, to_json(spec).dump());
    WorkerExit out = spawn_in({exe.string(), "measure-worker", spec_path.string(), out_path.string()}, cgroup);
    if (out.signal == 0 && out.status == 0) {
        out.result = parse_json(read_text_file(out_path), out_path.string());
    }
    return out;
}

} // namespace moeprune
