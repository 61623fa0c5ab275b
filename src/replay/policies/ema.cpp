#include "replay/policies/registry.h"
#include "replay/policies/keyed_cache.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace moeprune::policies {

namespace {

// How a candidate of the request that was not chosen earns credit in the ema family.
enum class Credit { ChosenOnly, NearPick, InverseRouter };

// Exponentially decayed credit of every expert, decayed lazily: an expert's score s
// at its last update t0 is worth s * d^(t - t0) later. Comparing those at a common t
// is comparing ln(s) - t0 * ln(d), which no longer moves with time, so that (on a
// grid of 2^-20, see ema_key) is the key, and untouched experts never need updating.
// Credit is positive, so a key only grows: heap entries may stay stale (see KeyedCache).
class DecayedScore : public KeyedCache<DecayedScore> {
public:
    DecayedScore(int n_expert, int capacity, double decay, Credit credit, int near_pick)
        : KeyedCache(n_expert, capacity, true), decay_(decay), log_decay_(std::log(decay)), credit_(credit),
          near_pick_(near_pick) {}
private:
    friend class KeyedCache<DecayedScore>;
    void add_score(int32_t e, double credit) {
        Slot & s = slot(e);
        const uint64_t gap = now() - s.stamp;
        s.score = s.score * decay_pow(gap) + credit;
        s.stamp = now();
    }
    // d^gap, from a table grown as far as the gaps seen go: a sweep builds thousands of
    // these caches, and most gaps are short.
    double decay_pow(uint64_t gap) {
        if (gap >= kDecayTable) {
            return std::pow(decay_, double(gap));
        }
        while (decay_pow_.size() <= gap) {
            decay_pow_.push_back(std::pow(decay_, double(decay_pow_.size())));
        }
        return decay_pow_[gap];
    }
    // The key from the last update is the key at any later time (see above), so it
    // can be computed whenever the heap asks: one log per eviction or load, not per credit.
    int64_t current_key(int32_t e) {
        const Slot & s = slot(e);
        return ema_key(std::log(s.score), s.stamp, log_decay_);
    }
    void on_chosen(int32_t e, size_t) {
        add_score(e, 1.0);
        mark_stale(e);
    }
    void credit_candidates(const Request & r) {
        if (credit_ == Credit::ChosenOnly) {
            return;
        }
        const size_t n = credit_ == Credit::NearPick ? std::min(r.ranked.size(), size_t(near_pick_)) : r.ranked.size();
        const double z0 = r.logits.empty() ? 0.0 : double(r.logits[0]);
        for (size_t i = 0; i < n; ++i) {
            const int32_t e = r.ranked[i];
            if (chosen_now(e)) {
                continue;
            }
            const double c = credit_ == Credit::NearPick ? 1.0 - double(i) / double(near_pick_)
                                                         : exp_memo(double(r.logits[i]) - z0);
            if (c <= 0.0) {
                continue;
            }
            add_score(e, c);
            mark_stale(e);
        }
    }
    // A function's values remembered by argument, direct-mapped: a remembered value is
    // the same number, so results do not change, only what they cost.
    template <double (*F)(double), int Bits> class Memo {
    public:
        double operator()(double x) {
            if (table_.empty()) {
                table_.assign(size_t(1) << Bits, {std::numeric_limits<double>::quiet_NaN(), 0.0});
            }
            uint64_t bits;
            std::memcpy(&bits, &x, sizeof(bits));
            auto & [arg, value] = table_[size_t((bits * 0x9E3779B97F4A7C15ull) >> (64 - Bits))];
            if (arg != x) {  // NaN at first: never equal
                arg = x;
                value = F(x);
            }
            return value;
        }
    private:
        std::vector<std::pair<double, double>> table_;
    };
    static double exp_of(double x) { return std::exp(x); }
    double decay_, log_decay_;
    Credit credit_;
    int near_pick_;
    // Gaps between an expert's updates reach thousands of requests in a global cache
    // (one request per layer and token); beyond the table, pow.
    static constexpr size_t kDecayTable = size_t(1) << 14;
    std::vector<double> decay_pow_;
    // exp of a logit difference: logits come from fp16 trace values, so the same few
    // thousand differences recur.
    Memo<exp_of, 14> exp_memo;
};

} // namespace

namespace {

std::unique_ptr<CachePolicy> make_decayed(const PolicySpec & s, Credit credit) {
    const PolicyParams & p = s.params;
    if (!(p.ema_decay > 0.0 && p.ema_decay < 1.0)) {
        throw Error(fmt::format("--ema-decay must be in (0, 1), got {}", p.ema_decay));
    }
    if (!(p.lfru_half_life > 0.0)) {
        throw Error(fmt::format("--lfru-half-life must be positive, got {}", p.lfru_half_life));
    }
    if (p.near_pick < 1) {
        throw Error(fmt::format("--near-pick must be at least 1, got {}", p.near_pick));
    }
    return std::make_unique<DecayedScore>(s.n_expert, s.capacity, effective_decay(s.name, p), credit, p.near_pick);
}

} // namespace

std::unique_ptr<CachePolicy> make_ema(const PolicySpec & s) { return make_decayed(s, Credit::ChosenOnly); }
std::unique_ptr<CachePolicy> make_lfru(const PolicySpec & s) { return make_decayed(s, Credit::ChosenOnly); }
std::unique_ptr<CachePolicy> make_near_pick_ema(const PolicySpec & s) { return make_decayed(s, Credit::NearPick); }
std::unique_ptr<CachePolicy> make_inverse_router_ema(const PolicySpec & s) { return make_decayed(s, Credit::InverseRouter); }

} // namespace moeprune::policies

namespace moeprune {

int64_t ema_key(double log_score, uint64_t t, double log_decay) {
    return int64_t(std::floor((log_score - double(t) * log_decay) * double(1 << 20) + 0.5));
}

double effective_decay(const std::string & name, const PolicyParams & p) {
    const double per_token = name == "lfru" ? std::exp2(-1.0 / p.lfru_half_life) : p.ema_decay;
    return std::pow(per_token, 1.0 / double(p.requests_per_token));
}

} // namespace moeprune
