#include "measure/read_ahead.h"

#include "core/atomic_file.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

struct State {
    fs::path setting;
    uint64_t original_kb = 0;
    pid_t pid = 0;
};

bool read_state(const fs::path & file, State & s) {
    std::ifstream in(file);
    std::string setting;
    if (!std::getline(in, setting) || !(in >> s.original_kb >> s.pid)) {
        return false;
    }
    s.setting = setting;
    return true;
}

bool alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

} // namespace

fs::path read_ahead_state_dir() {
    const char * dir = std::getenv("MOEPRUNE_STATE_DIR");
    return dir && *dir ? fs::path(dir) : fs::path("/run/moeprune");
}

std::vector<std::string> restore_left_read_ahead(const fs::path & state_dir) {
    std::vector<std::string> done;
    std::error_code ec;
    for (const auto & e : fs::directory_iterator(state_dir, ec)) {
        const std::string name = e.path().filename().string();
        State s;
        if (name.rfind("read-ahead", 0) != 0 || !read_state(e.path(), s) || alive(s.pid)) {
            continue;
        }
        if (write_kb(s.setting, s.original_kb)) {
            fs::remove(e.path(), ec);
            done.push_back(fmt::format("put {} back to {} KB, left changed by a measure that was killed",
                                       s.setting.string(), s.original_kb));
        } else {
            done.push_back(fmt::format("could not put {} back to {} KB ({}): {} says so", s.setting.string(),
                                       s.original_kb, std::strerror(errno), e.path().string()));
        }
    }
    return done;
}

ReadAhead::ReadAhead(fs::path setting, fs::path state_dir)
    : setting_(std::move(setting)), state_(state_file(state_dir, setting_)) {
    if (::geteuid() != 0) {
        fail_file(setting_.string(), "is the model's device read-ahead: --read-ahead-kb changes it, which needs root "
                                     "(nothing was changed)");
    }
    original_ = read_kb(setting_);
    if (State s; read_state(state_, s) && alive(s.pid)) {
        fail_file(setting_.string(), fmt::format("is being changed by another measure (process {}, {}): measure "
                                                 "read-ahead one at a time (nothing was changed)",
                                                 s.pid, state_.string()));
    }
    if (::access(setting_.c_str(), W_OK) != 0 || !write_kb(setting_, original_)) {
        fail_file(setting_.string(), fmt::format("cannot be changed ({}): this device's read-ahead is fixed here "
                                                 "(nothing was changed)", std::strerror(errno)));
    }
}

ReadAhead::~ReadAhead() { restore(); }

void ReadAhead::set(uint64_t kb) {
    if (!changed_) {
        create_output_dir(state_.parent_path());
        write_file_atomic(state_, fmt::format("{}\n{} {}\n", setting_.string(), original_, ::getpid()));
        changed_ = true;
    }
    if (!write_kb(setting_, kb)) {
        fail_file(setting_.string(), fmt::format("refused {} KB ({})", kb, std::strerror(errno)));
    }
}

void ReadAhead::restore() noexcept {
    if (!changed_) {
        return;
    }
    if (write_kb(setting_, original_)) {
        std::error_code ec;
        fs::remove(state_, ec);
    } else {
        std::fprintf(stderr, "moeprune: could not put %s back to %llu KB; the next measure tries again (%s)\n",
                     setting_.c_str(), static_cast<unsigned long long>(original_), state_.c_str());
    }
    changed_ = false;
}

} // namespace moeprune
