#pragma once
// What a policy's factory is given, and the factories of registry.def.
#include "sim/policy.h"

#include <memory>
#include <string>

namespace moeprune::policies {

struct PolicySpec {
    const std::string & name;
    int n_expert, capacity;
    const PolicyParams & params;
    const AccessSequence * future;   // set for policies that read the future
    const KeySchedule * keys;        // optional, for the ema family
};

using PolicyFactory = std::unique_ptr<CachePolicy> (*)(const PolicySpec &);
// Given the largest cache size as the capacity; for policies that are not stack
// algorithms, not_a_stack_algorithm, which returns nullptr.
using StackFactory = std::unique_ptr<StackPolicy> (*)(const PolicySpec &);
std::unique_ptr<StackPolicy> not_a_stack_algorithm(const PolicySpec &);

#define MOEPRUNE_POLICY(name, factory, stack_factory, reads_future, credit, decay)                                                 \
    std::unique_ptr<CachePolicy> factory(const PolicySpec &);                                                          \
    std::unique_ptr<StackPolicy> stack_factory(const PolicySpec &);
#include "sim/policies/registry.def"
#undef MOEPRUNE_POLICY

} // namespace moeprune::policies
