#pragma once
// The read-ahead of the block device under a model (sysfs queue/read_ahead_kb), changed
// for `measure --read-ahead-kb` and put back as it was found: when the measurement ends,
// also by an error or a signal measure defers, and after a kill -9 by the next measure,
// from a state file written before the first change. docs/measure.md, "Read-ahead".
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

// Where the state files live: $MOEPRUNE_STATE_DIR, else /run/moeprune (gone at a reboot,
// as the device's setting is).
std::filesystem::path read_ahead_state_dir();

// Puts back every read-ahead a measure that is no longer running left changed; returns
// what it did, a line each.
std::vector<std::string> restore_left_read_ahead(const std::filesystem::path & state_dir);

class ReadAhead {
public:
    // Refuses, naming the file, a setting this process cannot change, and one another
    // running measure has changed; changes nothing.
    ReadAhead(std::filesystem::path setting, std::filesystem::path state_dir);
    ~ReadAhead();
    ReadAhead(const ReadAhead &) = delete;
    ReadAhead & operator=(const ReadAhead &) = delete;

    uint64_t original_kb() const { return original_; }
    void set(uint64_t kb);

private:
    void restore() noexcept;
    std::filesystem::path setting_, state_;
    uint64_t original_ = 0;
    bool changed_ = false;
};

} // namespace moeprune
