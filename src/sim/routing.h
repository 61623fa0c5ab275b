#pragma once
// One token's routing at one cache and its request, by the rules of docs/replay.md:
// the unbiased top-k, or with λ > 0 MoCE's pick among the candidates favouring
// residents. Replay's runner (over a trace) and eval's closed loop (inside the forward
// pass) both route through this, so the two apply the same rule to the same numbers.
#include "sim/moce.h"
#include "sim/policy.h"
#include "sim/throughput.h"

#include <cstdint>
#include <span>
#include <vector>

namespace moeprune {

class RoutingStep {
public:
    RoutingStep(CachePolicy & policy, double lambda, int j, bool credits_candidates)
        : policy_(policy), lambda_(lambda), j_(j), credits_candidates_(credits_candidates) {}

    // Whether choose() reads the candidates, beyond the unbiased top-k.
    bool reads_candidates() const { return lambda_ > 0.0 || credits_candidates_; }

    // The chosen experts (cache ids, ascending). `ranked`: the candidates as cache ids,
    // best unbiased first, `z` their logits; `unbiased`: the top-k, ascending; `delta`:
    // the token's MoCE Δ. MoCE's swaps and moved mass go to `counts`; after a re-route,
    // rerouted() holds and chosen_ranks() are the ranks chosen, best biased first.
    std::span<const int32_t> choose(std::span<const int32_t> ranked, std::span<const float> z,
                                    std::span<const int32_t> unbiased, int k, double delta, PhaseCounts & counts) {
        rerouted_ = false;
        if (lambda_ == 0.0 || ranked.size() <= size_t(k)) {
            return unbiased;
        }
        const MocePick pick = moce_pick(z.data(), uint32_t(ranked.size()), k, lambda_ * delta, j_,
                                        [&](uint32_t i) { return policy_.resident(ranked[i]); }, moce_);
        counts.swaps += pick.swaps;
        counts.moved_mass += pick.moved_mass;
        rerouted_ = pick.swaps > 0;
        chosen_.clear();
        for (int i = 0; i < k; ++i) {
            chosen_.push_back(ranked[moce_.order[size_t(i)]]);
        }
        std::sort(chosen_.begin(), chosen_.end());
        return chosen_;
    }
    bool rerouted() const { return rerouted_; }
    std::span<const uint32_t> chosen_ranks(int k) const { return {moce_.order.data(), size_t(k)}; }

    // The request of `chosen`, crediting the candidates where the policy does; returns
    // how many chosen experts were not resident.
    int request(std::span<const int32_t> chosen, std::span<const int32_t> ranked, std::span<const float> z) {
        return credits_candidates_ ? policy_.access({chosen, ranked, z}) : policy_.access({chosen, {}, {}});
    }

private:
    CachePolicy & policy_;
    double lambda_;
    int j_;
    bool credits_candidates_;
    bool rerouted_ = false;
    MoceScratch moce_;
    std::vector<int32_t> chosen_;
};

} // namespace moeprune
