// Every cache size of a stack-algorithm policy in one pass over a layer, where the requests
// do not depend on the cache.
#include "replay/internal.h"

#include <algorithm>

namespace moeprune::replay_impl {

// The configurations of each stack-algorithm policy whose requests do not depend on
// the cache, where enough sizes share one pass (per-layer caches). The pass scans
// the stack down to each chosen expert, as deep as the largest size, about as long
// as one heap update per 32 positions measures (bench/replay.sh): a few sizes far
// apart (thousands of storage objects) run faster one cache each.
std::map<std::string, std::vector<size_t>> stack_passes(const ReplayOptions & opt, const std::vector<Config> & configs,
                                                        int n_predict) {
    std::map<std::string, std::vector<size_t>> all_sizes;
    if (!opt.global && opt.prefill_union == 0 && n_predict == 0) {
        for (size_t c = 0; c < configs.size(); ++c) {
            if (configs[c].lambda == 0.0 && policy_is_stack_algorithm(configs[c].policy)) {
                all_sizes[configs[c].policy].push_back(c);
            }
        }
        std::erase_if(all_sizes, [&](const auto & group) {
            int largest = 0;
            for (size_t c : group.second) {
                largest = std::max(largest, *std::max_element(configs[c].slots.begin(), configs[c].slots.end()));
            }
            return group.second.size() < 2 || size_t(largest) > 32 * group.second.size();
        });
    }
    return all_sizes;
}

// Configurations `members` of one stack-algorithm policy (policy.h's StackPolicy) in
// one pass over layer l: each token's chosen experts are requested once, and each
// configuration counts those at least as deep as its slots as misses, the counters a
// Runner keeps. Only where the requests do not depend on the cache: unbiased routing
// of single tokens (lambda 0, no prefill unions) without prefetch.
void replay_all_sizes(const Setup & s, const ReplayOptions & opt, uint32_t l, const LayerData & d,
                      const std::vector<Config> & configs, const std::vector<size_t> & members,
                      const AccessSequence * future, std::vector<std::array<PhaseCounts, 2>> & local) {
    const std::string & policy = configs[members.front()].policy;
    std::vector<int> slots;
    for (size_t c : members) {
        slots.push_back(configs[c].slots[l]);
    }
    const auto stack = make_stack_policy(policy, s.n_expert, *std::max_element(slots.begin(), slots.end()), s.params, future);
    const bool credits = policy_credits_candidates(policy);
    std::vector<int32_t> depth(size_t(s.k));
    for (uint64_t t = 0; t < s.meta.size(); ++t) {
        if (session_resets_at(s, opt, t)) {
            stack->reset();
        }
        const std::span<const int32_t> chosen = d.unbiased_of(t, s.k);
        stack->depths(credits ? Request{chosen, d.cand_of(t), d.logit_of(t)} : Request{chosen, {}, {}}, depth);
        if (t < opt.warmup) {
            continue;
        }
        const uint64_t forced = d.forced[t];
        for (size_t m = 0; m < members.size(); ++m) {
            uint64_t misses = 0;
            for (size_t j = 0; j < chosen.size(); ++j) {
                misses += depth[j] >= slots[m];
            }
            PhaseCounts & pc = local[members[m]][phase_index(s, t)];
            pc.picks += uint64_t(s.k);
            pc.forced_misses += forced;
            pc.misses += misses;
            count_exposed(s, opt, l, misses + forced, pc);
        }
    }
}

} // namespace moeprune::replay_impl
