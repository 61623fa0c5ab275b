#pragma once
// Progress of long work on stderr: rate and ETA, redrawn at most a few times a
// second, and only when stderr is a terminal so that piped runs stay quiet.
#include <chrono>
#include <cstdint>
#include <string>

namespace moeprune {

class Progress {
public:
    // `unit` names what `total` counts ("MiB", "tokens"); `scale` converts raw
    // counts into that unit (e.g. 1/1048576 for bytes shown as MiB).
    Progress(std::string label, uint64_t total, std::string unit, double scale = 1.0);
    ~Progress();
    void advance(uint64_t n);
    void finish();

private:
    void draw(bool final);
    std::string label_, unit_;
    uint64_t total_, done_ = 0;
    double scale_;
    bool enabled_, finished_ = false;
    std::chrono::steady_clock::time_point start_, last_draw_;
};

} // namespace moeprune
