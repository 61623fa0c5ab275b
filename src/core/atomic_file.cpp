#include "core/atomic_file.h"
#include "core/errors.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
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

} // namespace

void install_cleanup_on_signals() {
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) {
        std::signal(sig, remove_temps_and_die);
    }
    std::signal(SIGXFSZ, SIG_IGN);
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

void write_file_atomic(const fs::path & path, const std::string & contents) {
    AtomicOutput out(path);
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
    out.commit();
}

void refuse_overwrite_of_inputs(const fs::path & output, const std::vector<fs::path> & inputs) {
    std::error_code ec;
    if (!fs::exists(output, ec)) {
        return;
    }
    for (const auto & in : inputs) {
        if (fs::exists(in, ec) && fs::equivalent(output, in, ec)) {
            fail_file(output.string(), "refusing to overwrite the input " + in.string());
        }
    }
}

std::string read_text_file(const fs::path & path) {
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
