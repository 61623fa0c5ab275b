#include "replay/reference_policy.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace moeprune::test {

namespace {

// Resident set plus the eviction loop every policy shares: a policy only says how
// good a resident is to keep (lower is evicted first).
class ScoredCache : public CachePolicy {
public:
    ScoredCache(int n_expert, int capacity) : n_expert_(n_expert), capacity_(capacity), resident_(size_t(n_expert), 0) {}

    int access(std::span<const int32_t> chosen) override {
        ++t_;
        chosen_.assign(size_t(n_expert_), 0);
        for (int32_t e : chosen) {
            chosen_[size_t(e)] = 1;
        }
        int misses = 0;
        for (int32_t e : chosen) {
            if (!resident_[size_t(e)]) {
                ++misses;
                if (n_resident_ == capacity_) {
                    evict_one();
                }
                resident_[size_t(e)] = 1;
                ++n_resident_;
                on_insert(e);
            }
        }
        on_token(chosen);
        return misses;
    }

    void reset() override {  // time runs on: Belady's future is indexed by it
        std::fill(resident_.begin(), resident_.end(), 0);
        n_resident_ = 0;
        on_reset();
    }

    bool resident(int32_t e) const override { return resident_[size_t(e)] != 0; }

protected:
    virtual double keep_score(int32_t e) const = 0;  // lower = evicted first
    virtual void on_insert(int32_t) {}
    virtual void on_token(std::span<const int32_t> chosen) = 0;  // after the token's loads
    virtual void on_reset() = 0;
    uint64_t now() const { return t_; }

    int n_expert_;

private:
    void evict_one() {
        int32_t victim = -1;
        double worst = std::numeric_limits<double>::infinity();
        for (int32_t e = 0; e < n_expert_; ++e) {
            if (resident_[size_t(e)] && !chosen_[size_t(e)]) {
                const double s = keep_score(e);
                if (victim < 0 || s < worst) {  // strict: ties keep the lowest id
                    victim = e;
                    worst = s;
                }
            }
        }
        resident_[size_t(victim)] = 0;
        --n_resident_;
    }

    int capacity_;
    int n_resident_ = 0;
    uint64_t t_ = 0;
    std::vector<char> resident_, chosen_;
};

class Lru : public ScoredCache {
public:
    using ScoredCache::ScoredCache;
private:
    double keep_score(int32_t e) const override { return double(last_[size_t(e)]); }
    void on_token(std::span<const int32_t> chosen) override {
        for (int32_t e : chosen) {
            last_[size_t(e)] = now();
        }
    }
    void on_reset() override { std::fill(last_.begin(), last_.end(), 0); }
    std::vector<uint64_t> last_ = std::vector<uint64_t>(size_t(n_expert_), 0);
};

// Frequency over the whole stream, resident or not (an expert that returns keeps its count).
class Lfu : public ScoredCache {
public:
    using ScoredCache::ScoredCache;
private:
    double keep_score(int32_t e) const override { return double(count_[size_t(e)]); }
    void on_token(std::span<const int32_t> chosen) override {
        for (int32_t e : chosen) {
            ++count_[size_t(e)];
        }
    }
    void on_reset() override { std::fill(count_.begin(), count_.end(), 0); }
    std::vector<uint64_t> count_ = std::vector<uint64_t>(size_t(n_expert_), 0);
};

// Exponentially decayed frequency of every expert, decayed eagerly: every score is
// multiplied each token (the engine decays lazily and must agree). Long double keeps
// scores of long-unused experts from underflowing to 0 within a benchmark's length.
class Ema : public ScoredCache {
public:
    Ema(int n_expert, int capacity, double decay) : ScoredCache(n_expert, capacity), decay_(decay), score_(size_t(n_expert), 0.0L) {}
private:
    double keep_score(int32_t e) const override {
        const long double s = score_[size_t(e)];
        return s == 0.0L ? 0.0 : double(ema_key(double(std::log(s)), now() - 1, std::log(decay_)));
    }
    void on_token(std::span<const int32_t> chosen) override {
        for (long double & s : score_) {
            s *= decay_;
        }
        for (int32_t e : chosen) {
            score_[size_t(e)] += 1.0L;
        }
    }
    void on_reset() override { std::fill(score_.begin(), score_.end(), 0.0L); }
    double decay_;
    std::vector<long double> score_;
};

// Belady's MIN: evict the resident whose next use is farthest (never = infinitely far).
class Belady : public ScoredCache {
public:
    Belady(int n_expert, int capacity, const std::vector<std::vector<int32_t>> & future)
        : ScoredCache(n_expert, capacity) {
        uses_.resize(size_t(n_expert));
        for (size_t t = 0; t < future.size(); ++t) {
            for (int32_t e : future[t]) {
                uses_[size_t(e)].push_back(t + 1);  // access() numbers tokens from 1
            }
        }
        next_.assign(size_t(n_expert), 0);
    }
private:
    double keep_score(int32_t e) const override {
        const auto & u = uses_[size_t(e)];
        size_t i = next_[size_t(e)];
        while (i < u.size() && u[i] <= now()) {
            ++i;
        }
        return i < u.size() ? -double(u[i]) : -std::numeric_limits<double>::infinity();
    }
    void on_token(std::span<const int32_t> chosen) override {
        for (int32_t e : chosen) {
            auto & i = next_[size_t(e)];
            while (i < uses_[size_t(e)].size() && uses_[size_t(e)][i] <= now()) {
                ++i;
            }
        }
    }
    void on_reset() override {
        // A reset mid-stream keeps the positions: the future is still the future.
    }
    std::vector<std::vector<uint64_t>> uses_;
    std::vector<size_t> next_;
};

// SIEVE: a FIFO of residents with a visited bit and a hand that walks from the oldest
// toward the newest, clearing bits, and evicts the first unvisited resident it meets.
// Experts the token needs are passed over untouched.
class Sieve : public CachePolicy {
public:
    Sieve(int n_expert, int capacity) : capacity_(capacity), visited_(size_t(n_expert), 0) {}
    int access(std::span<const int32_t> chosen) override {
        std::vector<int32_t> sorted(chosen.begin(), chosen.end());
        std::sort(sorted.begin(), sorted.end());
        int misses = 0;
        for (int32_t e : sorted) {
            if (std::find(queue_.begin(), queue_.end(), e) != queue_.end()) {
                visited_[size_t(e)] = 1;
            }
        }
        for (int32_t e : sorted) {
            if (std::find(queue_.begin(), queue_.end(), e) != queue_.end()) {
                continue;
            }
            ++misses;
            if (int(queue_.size()) == capacity_) {
                evict(sorted);
            }
            queue_.push_back(e);  // newest at the back
            visited_[size_t(e)] = 0;
        }
        return misses;
    }
    void reset() override {
        queue_.clear();
        hand_ = 0;
        std::fill(visited_.begin(), visited_.end(), 0);
    }
    bool resident(int32_t e) const override { return std::find(queue_.begin(), queue_.end(), e) != queue_.end(); }
private:
    void evict(const std::vector<int32_t> & protect) {
        for (;;) {
            if (hand_ >= queue_.size()) {
                hand_ = 0;  // wrap to the oldest
            }
            const int32_t e = queue_[hand_];
            if (std::binary_search(protect.begin(), protect.end(), e)) {
                ++hand_;
            } else if (visited_[size_t(e)]) {
                visited_[size_t(e)] = 0;
                ++hand_;
            } else {
                queue_.erase(queue_.begin() + long(hand_));  // the hand now points at the next newer one,
                if (hand_ == queue_.size()) {                 // or past the newest: back to the oldest
                    hand_ = 0;
                }
                return;
            }
        }
    }
    int capacity_;
    std::vector<int32_t> queue_;  // oldest first
    size_t hand_ = 0;
    std::vector<char> visited_;
};

} // namespace

std::vector<int> reference_misses(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                  const std::vector<std::vector<int32_t>> & chosen, const std::vector<char> & reset_before) {
    std::unique_ptr<CachePolicy> policy;
    if (name == "lru") {
        policy = std::make_unique<Lru>(n_expert, capacity);
    } else if (name == "lfu") {
        policy = std::make_unique<Lfu>(n_expert, capacity);
    } else if (name == "ema") {
        policy = std::make_unique<Ema>(n_expert, capacity, p.ema_decay);
    } else if (name == "belady") {
        policy = std::make_unique<Belady>(n_expert, capacity, chosen);
    } else if (name == "sieve") {
        policy = std::make_unique<Sieve>(n_expert, capacity);
    } else {
        throw Error("reference: unknown policy " + name);
    }
    std::vector<int> misses;
    for (size_t t = 0; t < chosen.size(); ++t) {
        if (reset_before[t]) {
            policy->reset();
        }
        misses.push_back(policy->access(chosen[t]));
    }
    return misses;
}

} // namespace moeprune::test
