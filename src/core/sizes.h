#pragma once
// Sizes of memory as people write them on a command line.
#include <string>

namespace moeprune {

// What a bare K, M, G or T means ("24G"). "GiB" (2^30) and "GB" (10^9) always mean what they say.
enum class SizeUnits {
    binary,   // 2^30: moeprune's memory sizes (--ram, --reserve, measure's limits)
    decimal,  // 10^9: as llama-gguf-split reads --split-max-size
};

// "24G", "24GiB", "24GB", "512M", "1.5T", or bytes; `what` names the flag.
double parse_size(const std::string & text, const std::string & what, SizeUnits units = SizeUnits::binary);

} // namespace moeprune
