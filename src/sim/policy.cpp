#include "sim/policy.h"
#include "core/errors.h"
#include "sim/policies/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moeprune {

nlohmann::json to_json(const PolicyParams & p) {
    return {{"ema_decay", p.ema_decay},
            {"near_pick", p.near_pick},
            {"lfru_half_life", p.lfru_half_life},
            {"slru_protected", p.slru_protected},
            {"s3fifo_small", p.s3fifo_small}};
}

namespace {

struct PolicyEntry {
    std::string name;
    policies::PolicyFactory make;
    policies::StackFactory make_stack;
    bool reads_future;
    PolicyCredit credit;
    PolicyDecay decay;
};

const std::vector<PolicyEntry> & registry() {
    static const std::vector<PolicyEntry> entries = {
#define MOEPRUNE_POLICY(name, factory, stack_factory, reads_future, credit, decay)                                             \
    {name, &policies::factory, &policies::stack_factory, reads_future, PolicyCredit::credit, PolicyDecay::decay},
#include "sim/policies/registry.def"
#undef MOEPRUNE_POLICY
    };
    return entries;
}

const PolicyEntry * find_policy(const std::string & name) {
    for (const PolicyEntry & e : registry()) {
        if (e.name == name) {
            return &e;
        }
    }
    return nullptr;
}

} // namespace

namespace policies {

std::unique_ptr<StackPolicy> not_a_stack_algorithm(const PolicySpec &) { return nullptr; }

} // namespace policies

void AccessSequence::index_next_uses(int n_expert) {
    std::vector<uint64_t> seen(size_t(n_expert), kNeverAgain);
    next_use.assign(ids.size(), kNeverAgain);
    for (size_t t = size(); t-- > 0;) {
        for (uint64_t i = offsets[t]; i < offsets[t + 1]; ++i) {
            next_use[i] = seen[size_t(ids[i])];
        }
        for (uint64_t i = offsets[t]; i < offsets[t + 1]; ++i) {
            seen[size_t(ids[i])] = t + 1;
        }
    }
}

const std::vector<std::string> & policy_names() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> n;
        for (const PolicyEntry & e : registry()) {
            n.push_back(e.name);
        }
        return n;
    }();
    return names;
}

bool policy_reads_future(const std::string & name) {
    const PolicyEntry * e = find_policy(name);
    return e && e->reads_future;
}

bool policy_credits_candidates(const std::string & name) { return policy_credit(name) != PolicyCredit::Chosen; }

PolicyCredit policy_credit(const std::string & name) {
    const PolicyEntry * e = find_policy(name);
    return e ? e->credit : PolicyCredit::Chosen;
}

PolicyDecay policy_decay(const std::string & name) {
    const PolicyEntry * e = find_policy(name);
    return e ? e->decay : PolicyDecay::None;
}

bool policy_takes_key_schedule(const std::string & name) { return policy_decay(name) != PolicyDecay::None; }

namespace {

const PolicyEntry & policy_entry(const std::string & name, int n_expert) {
    if (n_expert > 65536) {
        throw Error(fmt::format("a cache of {} expert ids is more than the 65536 the policies address", n_expert));
    }
    const PolicyEntry * e = find_policy(name);
    if (!e) {
        throw Error(fmt::format("unknown policy \"{}\" (known: {})", name, fmt::join(policy_names(), ", ")));
    }
    return *e;
}

} // namespace

bool policy_is_stack_algorithm(const std::string & name) {
    const PolicyEntry * e = find_policy(name);
    return e && e->make_stack != &policies::not_a_stack_algorithm;
}

std::unique_ptr<StackPolicy> make_stack_policy(const std::string & name, int n_expert, int largest, const PolicyParams & p,
                                               const AccessSequence * future) {
    const PolicyEntry & e = policy_entry(name, n_expert);
    return e.make_stack({name, n_expert, largest, p, e.reads_future ? future : nullptr, nullptr});
}

std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const AccessSequence * future, const KeySchedule * keys) {
    const PolicyEntry * e = &policy_entry(name, n_expert);
    if (keys && !policy_takes_key_schedule(name)) {
        throw Error(fmt::format("internal: policy {} cannot follow a key schedule", name));
    }
    return e->make({name, n_expert, capacity, p, e->reads_future ? future : nullptr, keys});
}

} // namespace moeprune
