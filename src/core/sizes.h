#pragma once
// Sizes of memory as people write them on a command line.
#include <string>

namespace moeprune {

// "24G" / "24GiB" (2^30), "24GB" (10^9), "512M", "1.5T", or bytes; `what` names the flag.
double parse_size(const std::string & text, const std::string & what);

} // namespace moeprune
