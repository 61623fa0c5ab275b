#pragma once
// The deliberately simple replay every engine policy is checked against: one
// configuration, scans over all experts, eager decay, no cleverness.
#include "replay/policy.h"

#include <string>
#include <vector>

namespace moeprune::test {

// Misses of each token of one cache's access sequence; the cache is emptied before
// every token with reset_before set.
std::vector<int> reference_misses(const std::string & policy, int n_expert, int capacity, const PolicyParams & p,
                                  const std::vector<std::vector<int32_t>> & chosen, const std::vector<char> & reset_before);

} // namespace moeprune::test
