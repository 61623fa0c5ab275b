#pragma once
// The defaults several stages share, in one place: collect's trace and eval's closed loop
// read the same candidates, and plan's reserve is run's.
#include <cstdint>

namespace moeprune {

// Tokens per window a document is decoded in (-c of collect, eval and run).
inline constexpr int kDefaultContext = 512;
// Router candidates per layer and token a trace keeps (--trace-top).
inline constexpr int kDefaultTraceTop = 64;
// RAM kept for the KV cache, the OS and the program when none is given or measured.
inline constexpr const char * kDefaultReserve = "2G";
inline constexpr double kDefaultReserveBytes = double(uint64_t(2) << 30);

} // namespace moeprune
