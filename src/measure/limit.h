#pragma once
// A command run as measure runs llama.cpp: in a memory cgroup of its own whose limit holds
// the command's memory and the page cache it faults, removed when it ends. What plan's
// printed commands use, so that the answer runs under the limit it was measured under on
// any machine measure works on (cgroup v1 or v2, as root or with a delegated subtree),
// without systemd.
#include <cstdint>
#include <string>
#include <vector>

namespace moeprune {

// Runs `command` (its program found on the PATH when it names no folder) limited to
// `limit_bytes`; returns its exit status, or 128 + the signal that ended it. Throws where no
// cgroup can be made, and names the limit when the kernel killed the command for memory.
int run_limited(std::vector<std::string> command, uint64_t limit_bytes);

} // namespace moeprune
