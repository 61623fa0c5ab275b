#pragma once
// The read-ahead of the block device under a model (sysfs queue/read_ahead_kb), changed
// for `measure --read-ahead-kb` and put back as it was found: when the measurement ends,
// also by an error or a signal measure defers, and after a kill -9 by the next measure,
// from a state file written before the first change. The state file is also the claim on
// the device: a measure holds its lock (fcntl) from before its first run to its restore,
// so a second measure is refused and a restorer knows a live measure from a killed one.
// docs/measure.md, "Read-ahead".
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

// Where the state files live: $MOEPRUNE_STATE_DIR, else /run/moeprune (gone at a reboot,
// as the device's setting is).
std::filesystem::path read_ahead_state_dir();

// A canonical /sys/devices/.../queue/read_ahead_kb: the only files a state file may name,
// since root writes a number into what it names.
bool is_read_ahead_setting(const std::filesystem::path & setting);

// Why `state_dir` may not hold state files ("" when it may, or does not exist): it must be
// a folder of root's that no other user can write.
std::string state_dir_problem(const std::filesystem::path & state_dir);

// Puts back every read-ahead a measure that is no longer running left changed; returns
// what it did, a line each. Only as root, and only from a state folder no other user can
// write, into files that are read-ahead settings.
std::vector<std::string> restore_left_read_ahead(const std::filesystem::path & state_dir);

// restore_left_read_ahead on read_ahead_state_dir(), each line printed: every command that
// runs llama.cpp (measure, limit, run, plan) first puts back what a killed measure left.
void print_left_read_ahead();

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
    // Refuses, naming the file, a device no longer at the read-ahead set last: something
    // other than moeprune changed it during a run.
    void check() const;

private:
    void restore() noexcept;
    std::filesystem::path setting_, state_;
    uint64_t original_ = 0, set_kb_ = 0;
    bool changed_ = false;
    int lock_fd_ = -1;
};

} // namespace moeprune
