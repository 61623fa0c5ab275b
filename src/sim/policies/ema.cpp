#include "sim/policies/registry.h"
#include "sim/policies/keyed_cache.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace moeprune::policies {

namespace {

// How a candidate of the request that was not chosen earns credit in the ema family.
// exp of a logit difference, remembered by argument (direct-mapped): logits come from
// fp16 trace values, so the same few thousand differences recur, and a remembered exp
// is the same number.
class ExpMemo {
public:
    double operator()(double x) {
        if (table_.empty()) {
            table_.assign(size_t(1) << kBits, {std::numeric_limits<double>::quiet_NaN(), 0.0});
        }
        uint64_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        auto & [arg, value] = table_[size_t((bits * 0x9E3779B97F4A7C15ull) >> (64 - kBits))];
        if (arg != x) {  // NaN at first: never equal
            arg = x;
            value = std::exp(x);
        }
        return value;
    }
private:
    static constexpr int kBits = 14;
    std::vector<std::pair<double, double>> table_;
};

// Exponentially decayed credit of every expert, decayed lazily: an expert's score s
// at its last update t0 is worth s * d^(t - t0) later. Comparing those at a common t
// is comparing ln(s) - t0 * ln(d), which no longer moves with time, so that (on a
// grid of 2^-20, see ema_key) is the key, and untouched experts never need updating.
// The scores of a request sequence do not depend on the cache, only evictions do.
class DecayedScores {
public:
    DecayedScores(int n_expert, double decay, PolicyCredit credit, int near_pick)
        : decay_(decay), log_decay_(std::log(decay)), credit_(credit), near_pick_(near_pick),
          scores_(size_t(n_expert)) {}

    // The candidates request `now` credits besides its chosen experts, in rank order:
    // f(e, credit) for each, skipping those is_chosen(e) names.
    template <class IsChosen, class F> void for_each_credit(const Request & r, const IsChosen & is_chosen, F && f) {
        if (credit_ == PolicyCredit::Chosen) {
            return;
        }
        const size_t n = credit_ == PolicyCredit::NearPick ? std::min(r.ranked.size(), size_t(near_pick_)) : r.ranked.size();
        const double z0 = r.logits.empty() ? 0.0 : double(r.logits[0]);
        for (size_t i = 0; i < n; ++i) {
            const int32_t e = r.ranked[i];
            if (is_chosen(e)) {
                continue;
            }
            const double c = credit_ == PolicyCredit::NearPick ? 1.0 - double(i) / double(near_pick_)
                                                         : exp_memo_(double(r.logits[i]) - z0);
            if (c > 0.0) {
                f(e, c);
            }
        }
    }
    void add(int32_t e, double credit, uint64_t now) {
        Score & s = scores_[size_t(e)];
        s.score = s.score * decay_pow(now - s.stamp) + credit;
        s.stamp = now;
    }
    int64_t key(int32_t e) const {
        const Score & s = scores_[size_t(e)];
        return ema_key(std::log(s.score), s.stamp, log_decay_);
    }
    void reset() { std::fill(scores_.begin(), scores_.end(), Score{}); }

private:
    // d^gap, from a table grown as far as the gaps seen go: a sweep builds thousands of
    // these, and most gaps are short. Gaps reach thousands of requests in a global cache
    // (one request per layer and token); beyond the table, pow.
    double decay_pow(uint64_t gap) {
        if (gap >= kDecayTable) {
            return std::pow(decay_, double(gap));
        }
        while (decay_pow_.size() <= gap) {
            decay_pow_.push_back(std::pow(decay_, double(decay_pow_.size())));
        }
        return decay_pow_[gap];
    }
    static constexpr size_t kDecayTable = size_t(1) << 14;
    double decay_, log_decay_;
    PolicyCredit credit_;
    int near_pick_;
    // Score and stamp side by side: a global cache credits thousands of ids per token.
    struct Score {
        double score = 0;
        uint64_t stamp = 0;   // the request that last credited the expert
    };
    std::vector<Score> scores_;
    std::vector<double> decay_pow_;
    ExpMemo exp_memo_;
};

// An ema-family cache. Credit is positive, so a key only grows: heap entries may stay
// stale (see KeyedCache), and a key is computed (one log) only when the heap needs it,
// at an eviction or a load, never per credit. Given the sweep's KeySchedule, it
// computes nothing and takes each key from there.
class DecayedScore : public KeyedCache<DecayedScore> {
public:
    DecayedScore(int n_expert, int capacity, DecayedScores scores, const KeySchedule * keys)
        : KeyedCache(n_expert, capacity, true), scores_(std::move(scores)), keys_(keys) {}

    void reset() override {
        KeyedCache::reset();
        scores_.reset();
    }

private:
    friend class KeyedCache<DecayedScore>;
    int64_t current_key(int32_t e) { return scores_.key(e); }
    void on_chosen(int32_t e, size_t j) {
        if (keys_) {
            const uint64_t at = keys_->offsets[now()] - chosen_count_ + j;
            if (keys_->ids[at] != e) {
                throw Error("internal: a cache strayed from the key schedule of its requests");
            }
            set_key(e, keys_->keys[at]);
            return;
        }
        scores_.add(e, 1.0, now());
        mark_stale(e);
    }
    void credit_candidates(const Request & r) {
        if (keys_) {
            // Request now() - 1 of the schedule: its credits, then r.chosen.size() picks.
            if (now() > keys_->size()) {
                throw Error("internal: a cache saw more requests than its key schedule holds");
            }
            chosen_count_ = r.chosen.size();
            const uint64_t end = keys_->offsets[now()] - chosen_count_;
            for (uint64_t u = keys_->offsets[now() - 1]; u < end; ++u) {
                set_key(keys_->ids[u], keys_->keys[u]);
            }
            return;
        }
        scores_.for_each_credit(r, [&](int32_t e) { return chosen_now(e); }, [&](int32_t e, double c) {
            scores_.add(e, c, now());
            mark_stale(e);
        });
    }
    DecayedScores scores_;
    const KeySchedule * keys_;
    size_t chosen_count_ = 0;
};


} // namespace

namespace {

void check_params(const PolicyParams & p) {
    if (!(p.ema_decay > 0.0 && p.ema_decay < 1.0)) {
        throw Error(fmt::format("--ema-decay must be in (0, 1), got {}", p.ema_decay));
    }
    if (!(p.lfru_half_life > 0.0)) {
        throw Error(fmt::format("--lfru-half-life must be positive, got {}", p.lfru_half_life));
    }
    if (p.near_pick < 1) {
        throw Error(fmt::format("--near-pick must be at least 1, got {}", p.near_pick));
    }
}

std::unique_ptr<DecayedScore> make_decayed(const PolicySpec & s) {
    check_params(s.params);
    return std::make_unique<DecayedScore>(
        s.n_expert, s.capacity, DecayedScores(s.n_expert, effective_decay(s.name, s.params), policy_credit(s.name), s.params.near_pick),
        s.keys);
}

} // namespace

std::unique_ptr<CachePolicy> make_ema(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<CachePolicy> make_lfru(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<CachePolicy> make_near_pick_ema(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<CachePolicy> make_inverse_router_ema(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<StackPolicy> make_ema_stack(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<StackPolicy> make_lfru_stack(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<StackPolicy> make_near_pick_ema_stack(const PolicySpec & s) { return make_decayed(s); }
std::unique_ptr<StackPolicy> make_inverse_router_ema_stack(const PolicySpec & s) { return make_decayed(s); }

} // namespace moeprune::policies

namespace moeprune {


KeySchedule build_key_schedule(const std::string & name, int n_expert, const PolicyParams & p, uint64_t n_requests,
                               const std::function<Request(uint64_t, bool &)> & request_of) {
    using namespace policies;
    if (!policy_takes_key_schedule(name)) {
        throw Error(fmt::format("internal: {} has no key schedule", name));
    }
    check_params(p);
    DecayedScores scores(n_expert, effective_decay(name, p), policy_credit(name), p.near_pick);
    // The same marks and order as a cache's access(): chosen experts are passed over
    // as candidates and updated last.
    std::vector<uint64_t> chosen_at(size_t(n_expert), 0);
    KeySchedule ks;
    const auto update = [&](int32_t e, double credit, uint64_t now) {
        scores.add(e, credit, now);
        ks.ids.push_back(e);
        ks.keys.push_back(scores.key(e));
    };
    for (uint64_t i = 0; i < n_requests; ++i) {
        bool reset = false;
        const Request r = request_of(i, reset);
        if (reset) {
            scores.reset();
        }
        const uint64_t now = i + 1;
        for (int32_t e : r.chosen) {
            chosen_at[size_t(e)] = now;
        }
        scores.for_each_credit(r, [&](int32_t e) { return chosen_at[size_t(e)] == now; },
                               [&](int32_t e, double c) { update(e, c, now); });
        for (int32_t e : r.chosen) {
            update(e, 1.0, now);
        }
        ks.offsets.push_back(ks.ids.size());
    }
    return ks;
}

int64_t ema_key(double log_score, uint64_t t, double log_decay) {
    const double key = std::floor((log_score - double(t) * log_decay) * double(1 << 20) + 0.5);
    // Keys grow by -ln(decay) * 2^20 per request; the caches pack them with an expert id
    // into an int64 (keyed_cache.h). 2^46 is over 10^8 tokens at the default decay.
    if (!(std::fabs(key) < double(int64_t(1) << 46))) {
        throw Error(fmt::format("the ema family's key of an expert passed 2^46 after {} requests: the decay {} is too "
                                "strong for a trace this long",
                                t, std::exp(log_decay)));
    }
    return int64_t(key);
}

double effective_decay(const std::string & name, const PolicyParams & p) {
    const double per_token = policy_decay(name) == PolicyDecay::LfruHalfLife ? std::exp2(-1.0 / p.lfru_half_life) : p.ema_decay;
    return std::pow(per_token, 1.0 / double(p.requests_per_token));
}

} // namespace moeprune
