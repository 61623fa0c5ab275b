#pragma once
// Cache-aware (MoCE) re-routing of one token's candidates, shared by replay (open
// loop, over a trace) and eval's closed loop (inside the forward pass), so both apply
// the rules of docs/replay.md to the same numbers.
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace moeprune {

struct MoceScratch {
    std::vector<double> biased;
    std::vector<uint32_t> order;   // after moce_pick: the chosen ranks, best biased first
    std::vector<char> picked;
};

struct MocePick {
    uint64_t swaps = 0;      // chosen ranks >= k (not in the unbiased top-k)
    double moved_mass = 0;   // unbiased gate mass of the top-k that was not chosen
};

// z: the n >= k candidates' logits, best unbiased first. A candidate of rank i is
// favored (gets `bonus`) when i < j or favored(i) holds; the k chosen are the best by
// (biased logit descending, rank ascending), written to s.order[0..k).
template <class Favored>
MocePick moce_pick(const float * z, uint32_t n, int k, double bonus, int j, Favored && favored, MoceScratch & s) {
    s.biased.resize(n);
    s.order.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
        s.biased[i] = double(z[i]) + (i < uint32_t(j) || favored(i) ? bonus : 0.0);
        s.order[i] = i;
    }
    std::partial_sort(s.order.begin(), s.order.begin() + k, s.order.end(), [&](uint32_t a, uint32_t b) {
        return s.biased[a] != s.biased[b] ? s.biased[a] > s.biased[b] : a < b;
    });
    s.picked.assign(size_t(k), 0);
    MocePick p;
    for (int i = 0; i < k; ++i) {
        const uint32_t r = s.order[size_t(i)];
        if (r >= uint32_t(k)) {
            ++p.swaps;
        } else {
            s.picked[r] = 1;
        }
    }
    double kept_mass = 0, all_mass = 0;
    for (int i = 0; i < k; ++i) {
        const double w = std::exp(double(z[i]) - double(z[0]));
        all_mass += w;
        kept_mass += s.picked[size_t(i)] ? w : 0.0;
    }
    p.moved_mass = (all_mass - kept_mass) / all_mass;
    return p;
}

// J when none is given: 2, or k - 1 where 2 would give every chosen expert the bonus.
inline int moce_j(const std::optional<int> & j, int k) { return j ? *j : std::min(2, k - 1); }

// With j >= k every expert of the unbiased top-k gets the bonus, and a candidate
// beyond it, bonus or not, can then never overtake one: any λ > 0 would change nothing
// while its records claimed a cache-aware routing.
inline void refuse_inert_moce(int j, int k, const std::vector<double> & lambdas) {
    const bool biased = std::any_of(lambdas.begin(), lambdas.end(), [](double l) { return l > 0; });
    if (biased && j >= k) {
        throw Error(fmt::format("--j {} gives all {} experts of every token the bonus, so --lambda > 0 would never change a "
                                "choice; give --j below {}",
                                j, k, k));
    }
}

// The MoCE prior's Δ for one layer: the running mean of each token's z_0 - z_{k-1}.
class MocePrior {
public:
    // Adds a token with at least k candidates; returns Δ for it.
    double add(double gap) {
        sum_ += gap;
        ++n_;
        return value();
    }
    double value() const { return n_ ? sum_ / double(n_) : 0.0; }

private:
    double sum_ = 0;
    uint64_t n_ = 0;
};

} // namespace moeprune
