#pragma once
// Thread counts as people give them (-t, run.toml's threads).
#include <cstdint>
#include <string>

namespace moeprune {

// The threads to use for `requested` (0: one per core). Refuses a negative count, and
// one far above this machine's CPUs (more than 4 per CPU, at least 8 allowed), which only
// slows llama.cpp down until it never seems to finish; `flag` names where it was given.
int check_threads(int64_t requested, const std::string & flag);

} // namespace moeprune
