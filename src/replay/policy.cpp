#include "replay/policy.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace moeprune {

namespace {

// Residents kept in a compact array, each with a rank: the policy's integer key and
// the expert id packed into one int64 (key * 65536 + id), so "lowest key, then lowest
// id" is one comparison. Keys change only for the experts a token chooses, after its
// loads; a token that misses m experts over capacity evicts the m lowest ranks among
// residents it does not need, found in one scan (the same victims as m evictions one
// after another, since no rank moves in between).
class KeyedCache : public CachePolicy {
public:
    KeyedCache(int n_expert, int capacity) : capacity_(capacity), slot_(size_t(n_expert), -1), key_(size_t(n_expert), 0) {
        ids_.reserve(size_t(capacity));
        rank_.reserve(size_t(capacity));
    }

    int access(std::span<const int32_t> chosen) override {
        ++t_;
        int misses = 0;
        for (int32_t e : chosen) {
            const int32_t s = slot_[size_t(e)];
            if (s < 0) {
                ++misses;
            } else {
                rank_[size_t(s)] = kProtected;  // rewritten below, once the token's loads are done
            }
        }
        const int excess = int(ids_.size()) + misses - capacity_;
        if (excess > 0) {
            evict_lowest(excess);
        }
        for (size_t j = 0; j < chosen.size(); ++j) {
            const int32_t e = chosen[j];
            key_[size_t(e)] = touched_key(e, j);
            int32_t s = slot_[size_t(e)];
            if (s < 0) {
                s = slot_[size_t(e)] = int32_t(ids_.size());
                ids_.push_back(e);
                rank_.push_back(0);
            }
            rank_[size_t(s)] = key_[size_t(e)] * 65536 + e;
        }
        return misses;
    }

    void reset() override {
        for (int32_t e : ids_) {
            slot_[size_t(e)] = -1;
        }
        ids_.clear();
        rank_.clear();
        std::fill(key_.begin(), key_.end(), 0);
        on_reset();
    }

    bool resident(int32_t e) const override { return slot_[size_t(e)] >= 0; }

protected:
    // The key of e after this token chose it (e is chosen[j]); |key| < 2^46.
    virtual int64_t touched_key(int32_t e, size_t j) = 0;
    virtual void on_reset() {}
    uint64_t now() const { return t_; }
    int64_t key(int32_t e) const { return key_[size_t(e)]; }

private:
    void evict_lowest(int n) {
        // victims_[0..n) holds the n lowest ranks seen so far, ascending.
        victims_.assign(size_t(n), kProtected);
        int64_t worst = kProtected;
        for (size_t s = 0; s < rank_.size(); ++s) {
            const int64_t r = rank_[s];
            if (r >= worst) {  // also skips the protected, whose rank is the largest there is
                continue;
            }
            size_t i = size_t(n) - 1;
            while (i > 0 && victims_[i - 1] > r) {
                victims_[i] = victims_[i - 1];
                --i;
            }
            victims_[i] = r;
            worst = victims_[size_t(n) - 1];
        }
        for (int64_t r : victims_) {
            const int32_t e = int32_t(((r % 65536) + 65536) % 65536);
            const int32_t s = slot_[size_t(e)];
            ids_[size_t(s)] = ids_.back();
            rank_[size_t(s)] = rank_.back();
            slot_[size_t(ids_[size_t(s)])] = s;
            ids_.pop_back();
            rank_.pop_back();
            slot_[size_t(e)] = -1;
        }
    }

    int capacity_;
    uint64_t t_ = 0;
    std::vector<int32_t> slot_, ids_;
    std::vector<int64_t> key_, rank_, victims_;
    static constexpr int64_t kProtected = std::numeric_limits<int64_t>::max();
};

// Frequency over the whole stream, resident or not: the key is simply the count.
class Lfu : public KeyedCache {
public:
    using KeyedCache::KeyedCache;
private:
    int64_t touched_key(int32_t e, size_t) override { return key(e) + 1; }
};

// Exponentially decayed frequency of every expert, decayed lazily: an expert's
// score s at its last use t0 is worth s * d^(t - t0) later. Comparing those at a
// common t is comparing ln(s) - t0 * ln(d), which no longer moves with time, so
// that (on a grid of 2^-20, see ema_key) is the key, and untouched experts never
// need updating.
class Ema : public KeyedCache {
public:
    Ema(int n_expert, int capacity, double decay)
        : KeyedCache(n_expert, capacity), decay_(decay), log_decay_(std::log(decay)), score_(size_t(n_expert), 0.0),
          stamp_(size_t(n_expert), 0) {
        for (size_t i = 0; i < decay_pow_.size(); ++i) {
            decay_pow_[i] = std::pow(decay, double(i));
        }
    }
private:
    int64_t touched_key(int32_t e, size_t) override {
        double & s = score_[size_t(e)];
        const uint64_t gap = now() - stamp_[size_t(e)];
        s = s * (gap < decay_pow_.size() ? decay_pow_[gap] : std::pow(decay_, double(gap))) + 1.0;
        stamp_[size_t(e)] = now();
        return ema_key(std::log(s), now(), log_decay_);
    }
    void on_reset() override {
        std::fill(score_.begin(), score_.end(), 0.0);
        std::fill(stamp_.begin(), stamp_.end(), 0);
    }
    double decay_, log_decay_;
    std::vector<double> score_;
    std::vector<uint64_t> stamp_;
    std::array<double, 1024> decay_pow_;
};

// Belady's MIN: evict the resident whose next use is farthest; never again is farthest.
class Belady : public KeyedCache {
public:
    Belady(int n_expert, int capacity, const AccessSequence & future) : KeyedCache(n_expert, capacity), future_(future) {}
private:
    int64_t touched_key(int32_t, size_t j) override {
        const uint64_t next = future_.next_use[size_t(now() - 1)][j];
        return next == AccessSequence::kNeverAgain ? -(int64_t(1) << 46) : -int64_t(next);
    }
    const AccessSequence & future_;
};

// LRU needs no scan: residents sit in a list from least to most recently used, and a
// token's experts go to the back in ascending id order, which keeps the list sorted
// by (last use, id), the order every keyed policy evicts in.
class Lru : public CachePolicy {
public:
    Lru(int n_expert, int capacity)
        : capacity_(capacity), sentinel_(n_expert), prev_(size_t(n_expert) + 1, -1), next_(size_t(n_expert) + 1, -1),
          in_(size_t(n_expert), 0) {
        prev_[size_t(sentinel_)] = next_[size_t(sentinel_)] = sentinel_;
    }

    int access(std::span<const int32_t> chosen) override {
        int misses = 0;
        for (int32_t e : chosen) {
            if (in_[size_t(e)]) {
                unlink(e);
            } else {
                ++misses;
            }
        }
        for (int excess = size_ + int(chosen.size()) - capacity_; excess > 0; --excess) {
            const int32_t victim = next_[size_t(sentinel_)];
            unlink(victim);
            in_[size_t(victim)] = 0;
        }
        for (int32_t e : chosen) {
            in_[size_t(e)] = 1;
            link_back(e);
        }
        return misses;
    }

    void reset() override {
        for (int32_t e = next_[size_t(sentinel_)]; e != sentinel_; e = next_[size_t(e)]) {
            in_[size_t(e)] = 0;
        }
        prev_[size_t(sentinel_)] = next_[size_t(sentinel_)] = sentinel_;
        size_ = 0;
    }

    bool resident(int32_t e) const override { return in_[size_t(e)] != 0; }

private:
    void unlink(int32_t e) {
        next_[size_t(prev_[size_t(e)])] = next_[size_t(e)];
        prev_[size_t(next_[size_t(e)])] = prev_[size_t(e)];
        --size_;
    }
    void link_back(int32_t e) {
        const int32_t last = prev_[size_t(sentinel_)];
        prev_[size_t(e)] = last;
        next_[size_t(e)] = sentinel_;
        next_[size_t(last)] = e;
        prev_[size_t(sentinel_)] = e;
        ++size_;
    }

    int capacity_;
    int size_ = 0;
    int32_t sentinel_;
    std::vector<int32_t> prev_, next_;
    std::vector<char> in_;
};

// SIEVE: a FIFO of residents with a visited bit per expert and a hand walking from
// the oldest toward the newest, clearing bits and evicting the first unvisited one.
// Experts the current token needs are passed over untouched; a token's new experts
// enter in ascending id order.
class Sieve : public CachePolicy {
public:
    Sieve(int n_expert, int capacity)
        : capacity_(capacity), newer_(size_t(n_expert), -1), older_(size_t(n_expert), -1), in_(size_t(n_expert), 0),
          visited_(size_t(n_expert), 0), protect_(size_t(n_expert), 0) {}

    int access(std::span<const int32_t> chosen) override {
        for (int32_t e : chosen) {
            protect_[size_t(e)] = 1;
            if (in_[size_t(e)]) {
                visited_[size_t(e)] = 1;
            }
        }
        int misses = 0;
        for (int32_t e : chosen) {
            if (in_[size_t(e)]) {
                continue;
            }
            ++misses;
            if (size_ == capacity_) {
                evict_one();
            }
            push_newest(e);
        }
        for (int32_t e : chosen) {
            protect_[size_t(e)] = 0;
        }
        return misses;
    }

    void reset() override {
        for (int32_t e = oldest_; e >= 0;) {
            const int32_t next = newer_[size_t(e)];
            in_[size_t(e)] = 0;
            visited_[size_t(e)] = 0;
            e = next;
        }
        oldest_ = newest_ = hand_ = -1;
        size_ = 0;
    }

    bool resident(int32_t e) const override { return in_[size_t(e)] != 0; }

private:
    void push_newest(int32_t e) {
        older_[size_t(e)] = newest_;
        newer_[size_t(e)] = -1;
        if (newest_ >= 0) {
            newer_[size_t(newest_)] = e;
        } else {
            oldest_ = e;
        }
        newest_ = e;
        in_[size_t(e)] = 1;
        visited_[size_t(e)] = 0;
        ++size_;
    }

    void evict_one() {
        for (;;) {
            if (hand_ < 0) {
                hand_ = oldest_;
            }
            const int32_t e = hand_;
            hand_ = newer_[size_t(e)];
            if (protect_[size_t(e)]) {
                continue;
            }
            if (visited_[size_t(e)]) {
                visited_[size_t(e)] = 0;
                continue;
            }
            unlink(e);
            return;
        }
    }

    void unlink(int32_t e) {
        const int32_t o = older_[size_t(e)], n = newer_[size_t(e)];
        (o >= 0 ? newer_[size_t(o)] : oldest_) = n;
        (n >= 0 ? older_[size_t(n)] : newest_) = o;
        in_[size_t(e)] = 0;
        --size_;
    }

    int capacity_;
    int size_ = 0;
    int32_t oldest_ = -1, newest_ = -1, hand_ = -1;
    std::vector<int32_t> newer_, older_;
    std::vector<char> in_, visited_, protect_;
};

} // namespace

AccessSequence::AccessSequence(std::vector<std::vector<int32_t>> chosen_ids, int n_expert, bool with_next_use)
    : chosen(std::move(chosen_ids)) {
    if (!with_next_use) {
        return;
    }
    std::vector<uint64_t> seen(size_t(n_expert), kNeverAgain);
    next_use.resize(chosen.size());
    for (size_t t = chosen.size(); t-- > 0;) {
        next_use[t].resize(chosen[t].size());
        for (size_t j = 0; j < chosen[t].size(); ++j) {
            next_use[t][j] = seen[size_t(chosen[t][j])];
        }
        for (int32_t e : chosen[t]) {
            seen[size_t(e)] = t + 1;
        }
    }
}

int64_t ema_key(double log_score, uint64_t t, double log_decay) {
    return int64_t(std::floor((log_score - double(t) * log_decay) * double(1 << 20) + 0.5));
}

const std::vector<std::string> & policy_names() {
    static const std::vector<std::string> names = {"lru", "lfu", "ema", "belady", "sieve"};
    return names;
}

std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const AccessSequence * future) {
    if (name == "lru") {
        return std::make_unique<Lru>(n_expert, capacity);
    }
    if (name == "lfu") {
        return std::make_unique<Lfu>(n_expert, capacity);
    }
    if (name == "ema") {
        if (!(p.ema_decay > 0.0 && p.ema_decay < 1.0)) {
            throw Error(fmt::format("ema decay must be in (0, 1), got {}", p.ema_decay));
        }
        return std::make_unique<Ema>(n_expert, capacity, p.ema_decay);
    }
    if (name == "belady") {
        if (!future || future->next_use.size() != future->chosen.size()) {
            throw Error("belady needs the whole access sequence with its next uses");
        }
        return std::make_unique<Belady>(n_expert, capacity, *future);
    }
    if (name == "sieve") {
        return std::make_unique<Sieve>(n_expert, capacity);
    }
    throw Error(fmt::format("unknown policy \"{}\" (known: {})", name, fmt::join(policy_names(), ", ")));
}

} // namespace moeprune
