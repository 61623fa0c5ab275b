#include "measure/read_ahead.h"

#include "core/atomic_file.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moeprune {

namespace fs = std::filesystem;

namespace {

uint64_t read_kb(const fs::path & setting) {
    std::ifstream in(setting);
    uint64_t kb = 0;
    if (!(in >> kb)) {
        fail_file(setting.string(), "cannot be read as a read-ahead in KB");
    }
    return kb;
}

// Writes `kb`; false with errno set when the kernel refuses it.
bool write_kb(const fs::path & setting, uint64_t kb) {
    std::ofstream out(setting);
    out << kb << '\n';
    out.flush();
    return bool(out);
}

fs::path state_file(const fs::path & state_dir, const fs::path & setting) {
    std::string name = setting.string();
    for (char & c : name) {
        c = c == '/' ? '_' : c;
    }
    return state_dir / ("read-ahead" + name);
}

// Opens `file` and takes its lock without waiting: -1 when another process holds it (a
// live measure), or when the file is not a plain file of root's. The lock is taken on the
// name still linked at `file`, so a restorer that unlinks it meanwhile is not missed. It is
// a record lock (fcntl), which a forked child does not share, unlike flock: a killed
// measure's claim is free when it dies, not when a child it was starting dies after it.
bool try_lock(int fd) {
    struct flock whole{};
    whole.l_type = F_WRLCK;
    whole.l_whence = SEEK_SET;
    return ::fcntl(fd, F_SETLK, &whole) == 0;
}

int lock_state(const fs::path & file, bool create) {
    for (int attempt = 0; attempt < 8; ++attempt) {
        const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0), 0644);
        if (fd < 0) {
            return -1;
        }
        struct stat held{}, linked{};
        if (::fstat(fd, &held) != 0 || !S_ISREG(held.st_mode) || held.st_uid != 0 || !try_lock(fd)) {
            const int why = errno;
            ::close(fd);
            errno = why;
            return -1;
        }
        if (::lstat(file.c_str(), &linked) == 0 && linked.st_ino == held.st_ino && linked.st_dev == held.st_dev) {
            return fd;
        }
        ::close(fd);   // unlinked by the restorer between open and lock: the name is free again
    }
    errno = EBUSY;
    return -1;
}

std::string read_fd(int fd) {
    std::string text;
    char buf[512];
    for (off_t at = 0;;) {
        const ssize_t n = ::pread(fd, buf, sizeof buf, at);
        if (n <= 0) {
            break;
        }
        text.append(buf, size_t(n));
        at += n;
    }
    return text;
}

struct State {
    fs::path setting;
    uint64_t original_kb = 0;
    pid_t pid = 0;
};

bool parse_state(const std::string & text, State & s) {
    std::istringstream in(text);
    std::string setting;
    if (!std::getline(in, setting) || !(in >> s.original_kb >> s.pid)) {
        return false;
    }
    s.setting = setting;
    return true;
}

} // namespace

fs::path read_ahead_state_dir() {
    const char * dir = std::getenv("MOEPRUNE_STATE_DIR");
    return dir && *dir ? fs::path(dir) : fs::path("/run/moeprune");
}

bool is_read_ahead_setting(const fs::path & setting) {
    const std::string text = setting.string();
    const std::string head = "/sys/devices/", tail = "/queue/read_ahead_kb";
    if (text.rfind(head, 0) != 0 || text.size() <= head.size() + tail.size() ||
        text.compare(text.size() - tail.size(), tail.size(), tail) != 0) {
        return false;
    }
    std::error_code ec;
    const fs::path real = fs::canonical(setting, ec);
    return !ec && real == setting;
}

std::string state_dir_problem(const fs::path & state_dir) {
    struct stat st{};
    if (::lstat(state_dir.c_str(), &st) != 0) {
        return errno == ENOENT ? "" : fmt::format("{}: cannot be read ({})", state_dir.string(), std::strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) {
        return fmt::format("{}: is not a folder (a symbolic link or a file)", state_dir.string());
    }
    if (st.st_uid != 0 || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        return fmt::format("{}: the read-ahead state folder must be root's and writable by root alone (owner {}, "
                           "mode {:o}): another user could name any file in it for root to write; use a folder such "
                           "as /run/moeprune (MOEPRUNE_STATE_DIR)",
                           state_dir.string(), st.st_uid, st.st_mode & 07777);
    }
    return "";
}

std::vector<std::string> restore_left_read_ahead(const fs::path & state_dir) {
    std::vector<std::string> done;
    if (::geteuid() != 0) {
        return done;   // only root changes a read-ahead, so only root has one to put back
    }
    if (const std::string problem = state_dir_problem(state_dir); !problem.empty()) {
        std::error_code ec;
        if (fs::exists(state_dir, ec)) {
            done.push_back("left every read-ahead as it is: " + problem);
        }
        return done;
    }
    std::error_code ec;
    for (const auto & e : fs::directory_iterator(state_dir, ec)) {
        if (e.path().filename().string().rfind("read-ahead", 0) != 0) {
            continue;
        }
        const int fd = lock_state(e.path(), false);
        if (fd < 0) {
            continue;   // a live measure's, or not a plain file of root's
        }
        State s;
        const std::string text = read_fd(fd);
        if (text.empty()) {
            ::unlink(e.path().c_str());   // claimed by a measure killed before it changed anything
        } else if (!parse_state(text, s) || !is_read_ahead_setting(s.setting)) {
            done.push_back(fmt::format("left {} alone: it names no device's read-ahead setting (a canonical "
                                       "/sys/devices/.../queue/read_ahead_kb); remove it",
                                       e.path().string()));
        } else if (write_kb(s.setting, s.original_kb)) {
            ::unlink(e.path().c_str());
            done.push_back(fmt::format("put {} back to {} KB, left changed by a measure that was killed (process {})",
                                       s.setting.string(), s.original_kb, s.pid));
        } else {
            done.push_back(fmt::format("could not put {} back to {} KB ({}): {} says so", s.setting.string(),
                                       s.original_kb, std::strerror(errno), e.path().string()));
        }
        ::close(fd);
    }
    return done;
}

void print_left_read_ahead() {
    for (const std::string & line : restore_left_read_ahead(read_ahead_state_dir())) {
        std::fprintf(stderr, "moeprune: %s\n", line.c_str());
    }
}

ReadAhead::ReadAhead(fs::path setting, fs::path state_dir)
    : setting_(std::move(setting)), state_(state_file(state_dir, setting_)) {
    if (::geteuid() != 0) {
        fail_file(setting_.string(), "is the model's device read-ahead: --read-ahead-kb changes it, which needs root "
                                     "(nothing was changed)");
    }
    if (!is_read_ahead_setting(setting_)) {
        fail_file(setting_.string(), "is not a device's read-ahead setting (a canonical "
                                     "/sys/devices/.../queue/read_ahead_kb; nothing was changed)");
    }
    if (const std::string problem = state_dir_problem(state_dir); !problem.empty()) {
        throw Error(problem + " (--read-ahead-kb; nothing was changed)");
    }
    // The claim on the device, held from before the first run to the last restore, and
    // taken before the setting is read: a measure holding it may have changed it.
    create_output_dir(state_dir);
    ::chmod(state_dir.c_str(), 0755);
    lock_fd_ = lock_state(state_, true);
    if (lock_fd_ < 0) {
        State s;
        const int fd = ::open(state_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        const bool named = fd >= 0 && parse_state(read_fd(fd), s);
        if (fd >= 0) {
            ::close(fd);
        }
        fail_file(setting_.string(), fmt::format("is being changed by another measure ({}{}): measure read-ahead one at "
                                                 "a time (nothing was changed)",
                                                 named ? fmt::format("process {}, ", s.pid) : "", state_.string()));
    }
    try {
        original_ = read_kb(setting_);
        if (::access(setting_.c_str(), W_OK) != 0 || !write_kb(setting_, original_)) {
            fail_file(setting_.string(), fmt::format("cannot be changed ({}): this device's read-ahead is fixed here "
                                                     "(nothing was changed)", std::strerror(errno)));
        }
    } catch (...) {
        ::unlink(state_.c_str());
        ::close(lock_fd_);
        throw;
    }
}

ReadAhead::~ReadAhead() {
    restore();
    if (!changed_) {
        ::unlink(state_.c_str());
    }
    ::close(lock_fd_);
}

void ReadAhead::set(uint64_t kb) {
    if (!changed_) {
        const std::string record = fmt::format("{}\n{} {}\n", setting_.string(), original_, ::getpid());
        if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, record.data(), record.size(), 0) != ssize_t(record.size()) ||
            ::fsync(lock_fd_) != 0) {
            fail_file(state_.string(), fmt::format("cannot be written ({}): without it a killed measure could not put "
                                                   "the read-ahead back (nothing was changed)",
                                                   std::strerror(errno)));
        }
        changed_ = true;
    }
    if (!write_kb(setting_, kb)) {
        fail_file(setting_.string(), fmt::format("refused {} KB ({})", kb, std::strerror(errno)));
    }
    set_kb_ = kb;
}

void ReadAhead::check() const {
    if (!changed_) {
        return;
    }
    const uint64_t now = read_kb(setting_);
    if (now != set_kb_) {
        fail_file(setting_.string(), fmt::format("changed to {} KB while measure ran at {} KB (by something other than "
                                                 "moeprune, which claims the device): the run is not at the read-ahead "
                                                 "it names, so it is not kept",
                                                 now, set_kb_));
    }
}

void ReadAhead::restore() noexcept {
    if (!changed_) {
        return;
    }
    if (!write_kb(setting_, original_)) {
        std::fprintf(stderr, "moeprune: could not put %s back to %llu KB; the next measure tries again (%s)\n",
                     setting_.c_str(), static_cast<unsigned long long>(original_), state_.c_str());
        return;   // the record stays for the next measure (the destructor does not unlink it then)
    }
    ::ftruncate(lock_fd_, 0);
    changed_ = false;
}

} // namespace moeprune
