#include "core/progress.h"

#include <fmt/format.h>

#include <cstdio>
#include <unistd.h>

namespace moeprune {

using clock_type = std::chrono::steady_clock;

Progress::Progress(std::string label, uint64_t total, std::string unit, double scale)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), scale_(scale),
      enabled_(::isatty(STDERR_FILENO) == 1), start_(clock_type::now()), last_draw_(start_) {}

Progress::~Progress() {
    if (enabled_ && !finished_ && done_ > 0) {
        std::fputc('\n', stderr);
    }
}

void Progress::advance(uint64_t n) {
    done_ += n;
    if (enabled_ && clock_type::now() - last_draw_ > std::chrono::milliseconds(250)) {
        draw(false);
    }
}

void Progress::finish() {
    if (enabled_ && !finished_) {
        draw(true);
        std::fputc('\n', stderr);
    }
    finished_ = true;
}

void Progress::draw(bool final) {
    const auto now = clock_type::now();
    last_draw_ = now;
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double rate = secs > 0 ? double(done_) * scale_ / secs : 0.0;
    std::string eta = "--";
    if (!final && rate > 0 && total_ > done_) {
        const double left = double(total_ - done_) * scale_ / rate;
        eta = fmt::format("{}:{:02}", int(left) / 60, int(left) % 60);
    }
    const double pct = total_ > 0 ? 100.0 * double(done_) / double(total_) : 100.0;
    std::fprintf(stderr, "\r%s: %.0f/%.0f %s (%.1f%%), %.1f %s/s, ETA %s   ", label_.c_str(), double(done_) * scale_,
                 double(total_) * scale_, unit_.c_str(), pct, rate, unit_.c_str(), eta.c_str());
    std::fflush(stderr);
}

} // namespace moeprune
