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

// Below this no program starts (the kernel kills it at exec): a --ram under it is a size
// without its unit.
inline constexpr uint64_t kLeastLimitBytes = uint64_t(4) << 20;

// Runs `command` (its program found on the PATH when it names no folder) limited to
// `limit_bytes`; returns its exit status, or 128 + the signal that ended it, as a shell
// would. On a terminal the command has it in the foreground, as a shell's job. Throws where
// no cgroup can be made. Says so when the kernel killed the command or anything it started
// for memory, naming the limit that held: --ram, or a tighter one on moeprune's own cgroup
// (warned about before the command starts). First removes what a killed measure or limit
// left (cgroups, scratch folders, a changed read-ahead).
int run_limited(std::vector<std::string> command, uint64_t limit_bytes);

} // namespace moeprune
