#include "replay/policy.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace moeprune {

namespace {

// Residents kept in an indexed min-heap of ranks: the policy's integer key and the
// expert id packed into one int64 (key * 65536 + id), so "lowest key, then lowest id"
// is one comparison. A request first updates the keys of the candidates it credits
// and of the chosen residents (their keys only matter once they are no longer
// chosen), then evicts the lowest ranks, passing over chosen experts, then inserts
// its loads: the same victims as evicting among the non-chosen residents one by one.
// Where keys only grow (frequencies, decayed scores), a raised key leaves the heap
// entry stale, a lower bound that is corrected only if it reaches the top: hot
// experts are touched every few tokens and would otherwise sink through the heap each
// time.
class KeyedCache : public CachePolicy {
public:
    KeyedCache(int n_expert, int capacity, bool keys_only_grow)
        : capacity_(capacity), keys_only_grow_(keys_only_grow), slot_(size_t(n_expert)) {
        heap_.reserve(size_t(capacity));
    }

    int access(const Request & r) override {
        ++t_;
        int misses = 0;
        for (int32_t e : r.chosen) {
            slot_[size_t(e)].chosen_at = t_;
            misses += slot_[size_t(e)].pos < 0;
        }
        credit_candidates(r);
        for (size_t j = 0; j < r.chosen.size(); ++j) {
            on_chosen(r.chosen[j], j);
        }
        for (int excess = int(heap_.size()) + misses - capacity_; excess > 0; --excess) {
            evict_lowest_unchosen();
        }
        for (int32_t e : r.chosen) {
            if (slot_[size_t(e)].pos < 0) {
                heap_.push_back(rank_of(e));
                slot_[size_t(e)].pos = int32_t(heap_.size() - 1);
                sift_up(heap_.size() - 1);
            }
        }
        return misses;
    }

    void reset() override {
        for (int64_t r : heap_) {
            slot_[size_t(id_of(r))].pos = -1;
        }
        heap_.clear();
        std::fill(slot_.begin(), slot_.end(), Slot{});
    }

    bool resident(int32_t e) const override { return slot_[size_t(e)].pos >= 0; }

protected:
    // Everything kept per expert, together, so that a touch costs one cache line:
    // the heap's fields and, for the ema family, the decayed score.
    struct Slot {
        int64_t key = 0;
        uint64_t chosen_at = 0;
        int32_t pos = -1;  // in heap_, or -1 when not resident
        bool stale = false;
        double score = 0;    // ema family: score as of the request that last credited the expert
        uint64_t stamp = 0;  // that request
    };
    Slot & slot(int32_t e) { return slot_[size_t(e)]; }
    const Slot & slot(int32_t e) const { return slot_[size_t(e)]; }
    // Raises the key of e, which this request chose (e is chosen[j]); |key| < 2^46.
    virtual void on_chosen(int32_t e, size_t j) = 0;
    // Where keys only grow and cost something to compute, a policy can raise a key by
    // marking it stale: it is computed by current_key only when the heap needs it (the
    // expert reaches the top, or is inserted), never for the many raises in between.
    virtual int64_t current_key(int32_t e) { return slot_[size_t(e)].key; }
    void mark_stale(int32_t e) { slot_[size_t(e)].stale = true; }
    // Candidates credited without being chosen call set_key.
    virtual void credit_candidates(const Request &) {}
    uint64_t now() const { return t_; }
    int64_t key(int32_t e) const { return slot_[size_t(e)].key; }
    bool chosen_now(int32_t e) const { return slot_[size_t(e)].chosen_at == t_; }
    void set_key(int32_t e, int64_t k) {
        const int64_t old = slot_[size_t(e)].key;
        slot_[size_t(e)].key = k;
        if (keys_only_grow_) {
            return;
        }
        if (const int32_t p = slot_[size_t(e)].pos; p >= 0) {
            heap_[size_t(p)] = rank_of(e);
            if (k < old) {
                sift_up(size_t(p));
            } else {
                sift_down(size_t(p));
            }
        }
    }

private:
    int64_t rank_of(int32_t e) {
        Slot & s = slot_[size_t(e)];
        if (s.stale) {
            s.key = current_key(e);
            s.stale = false;
        }
        return s.key * 65536 + e;
    }
    // The low 16 bits of key * 65536 + id are the id, for negative keys too (two's complement).
    static int32_t id_of(int64_t rank) { return int32_t(uint64_t(rank) & 0xFFFF); }

    void place(size_t i, int64_t r) {
        heap_[i] = r;
        slot_[size_t(id_of(r))].pos = int32_t(i);
    }
    // Four children per node: half the levels of a binary heap, and siblings share a
    // cache line.
    static constexpr size_t kArity = 4;
    void sift_up(size_t i) {
        const int64_t r = heap_[i];
        while (i > 0) {
            const size_t parent = (i - 1) / kArity;
            if (heap_[parent] <= r) {
                break;
            }
            place(i, heap_[parent]);
            i = parent;
        }
        place(i, r);
    }
    void sift_down(size_t i) {
        const int64_t r = heap_[i];
        const size_t n = heap_.size();
        for (;;) {
            const size_t first = kArity * i + 1;
            if (first >= n) {
                break;
            }
            // The smallest child without branches: which one wins is unpredictable.
            size_t child = first;
            int64_t smallest = heap_[first];
            for (size_t c = first + 1; c < std::min(n, first + kArity); ++c) {
                const bool less = heap_[c] < smallest;
                smallest = less ? heap_[c] : smallest;
                child = less ? c : child;
            }
            if (smallest >= r) {
                break;
            }
            place(i, heap_[child]);
            i = child;
        }
        place(i, r);
    }
    void remove_at(size_t i) {
        slot_[size_t(id_of(heap_[i]))].pos = -1;
        const int64_t last = heap_.back();
        heap_.pop_back();
        if (i < heap_.size()) {
            heap_[i] = last;
            slot_[size_t(id_of(last))].pos = int32_t(i);
            if (i > 0 && heap_[(i - 1) / kArity] > last) {
                sift_up(i);
            } else {
                sift_down(i);
            }
        }
    }
    // Chosen experts on top of the heap are set aside and put back afterwards.
    void evict_lowest_unchosen() {
        set_aside_.clear();
        for (;;) {
            const int32_t e = id_of(heap_.front());
            if (chosen_now(e)) {
                set_aside_.push_back(rank_of(e));
                remove_at(0);
            } else if (heap_.front() != rank_of(e)) {
                heap_.front() = rank_of(e);
                sift_down(0);
            } else {
                remove_at(0);
                break;
            }
        }
        for (int64_t r : set_aside_) {
            heap_.push_back(r);
            slot_[size_t(id_of(r))].pos = int32_t(heap_.size() - 1);
            sift_up(heap_.size() - 1);
        }
    }

    int capacity_;
    bool keys_only_grow_;
    uint64_t t_ = 0;
    std::vector<Slot> slot_;
    std::vector<int64_t> heap_, set_aside_;
};

// Frequency over the whole stream, resident or not: the key is simply the count.
class Lfu : public KeyedCache {
public:
    Lfu(int n_expert, int capacity) : KeyedCache(n_expert, capacity, true) {}
private:
    void on_chosen(int32_t e, size_t) override { set_key(e, key(e) + 1); }
};

// How a candidate of the request that was not chosen earns credit in the ema family.
enum class Credit { ChosenOnly, NearPick, InverseRouter };

// Exponentially decayed credit of every expert, decayed lazily: an expert's score s
// at its last update t0 is worth s * d^(t - t0) later. Comparing those at a common t
// is comparing ln(s) - t0 * ln(d), which no longer moves with time, so that (on a
// grid of 2^-20, see ema_key) is the key, and untouched experts never need updating.
// Credit is positive, so a key only grows: heap entries may stay stale (see KeyedCache).
class DecayedScore : public KeyedCache {
public:
    DecayedScore(int n_expert, int capacity, double decay, Credit credit, int near_pick)
        : KeyedCache(n_expert, capacity, true), decay_(decay), log_decay_(std::log(decay)), credit_(credit),
          near_pick_(near_pick), decay_pow_(kDecayTable) {
        for (size_t i = 0; i < decay_pow_.size(); ++i) {
            decay_pow_[i] = std::pow(decay, double(i));
        }
    }
private:
    void add_score(int32_t e, double credit) {
        Slot & s = slot(e);
        const uint64_t gap = now() - s.stamp;
        s.score = s.score * (gap < decay_pow_.size() ? decay_pow_[gap] : std::pow(decay_, double(gap))) + credit;
        s.stamp = now();
    }
    // The key from the last update is the key at any later time (see above), so it
    // can be computed whenever the heap asks: one log per eviction or load, not per credit.
    int64_t current_key(int32_t e) override {
        const Slot & s = slot(e);
        return ema_key(std::log(s.score), s.stamp, log_decay_);
    }
    void on_chosen(int32_t e, size_t) override {
        add_score(e, 1.0);
        mark_stale(e);
    }
    void credit_candidates(const Request & r) override {
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
    // exp of a logit difference, remembered: logits come from fp16 trace values, so the
    // same few thousand differences recur, and a remembered exp is the same number.
    double exp_memo(double d) {
        uint64_t bits;
        std::memcpy(&bits, &d, sizeof(bits));
        auto & [arg, value] = exp_memo_[size_t((bits * 0x9E3779B97F4A7C15ull) >> (64 - kExpMemoBits))];
        if (arg != d) {  // NaN at first: never equal
            arg = d;
            value = std::exp(d);
        }
        return value;
    }
    double decay_, log_decay_;
    Credit credit_;
    int near_pick_;
    // Gaps between an expert's updates reach thousands of requests in a global cache
    // (one request per layer and token); beyond the table, pow.
    static constexpr size_t kDecayTable = size_t(1) << 14;
    std::vector<double> decay_pow_;
    static constexpr int kExpMemoBits = 14;
    std::vector<std::pair<double, double>> exp_memo_ =
        std::vector<std::pair<double, double>>(size_t(1) << kExpMemoBits, {std::numeric_limits<double>::quiet_NaN(), 0.0});
};

// Belady's MIN: evict the resident whose next use is farthest; never again is farthest.
class Belady : public KeyedCache {
public:
    Belady(int n_expert, int capacity, const AccessSequence & future)
        : KeyedCache(n_expert, capacity, false), future_(future) {}
private:
    void on_chosen(int32_t e, size_t j) override {
        const uint64_t next = future_.next_use[future_.offsets[now() - 1] + j];
        set_key(e, next == AccessSequence::kNeverAgain ? -(int64_t(1) << 46) : -int64_t(next));
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

    int access(const Request & r) override {
        const auto chosen = r.chosen;
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

    int access(const Request & r) override {
        const auto chosen = r.chosen;
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

// Several FIFO/recency lists over expert ids, each id in at most one of them, as one
// set of intrusive links (list i's sentinel is node n_expert + i). Front = oldest.
class IdLists {
public:
    static constexpr int8_t kNone = -1;
    IdLists(int n_expert, int n_lists)
        : n_expert_(n_expert), prev_(size_t(n_expert + n_lists)), next_(size_t(n_expert + n_lists)),
          where_(size_t(n_expert), kNone), size_(size_t(n_lists), 0) {
        clear();
    }
    void clear() {
        for (size_t i = 0; i < size_.size(); ++i) {
            const int32_t s = sentinel(int(i));
            prev_[size_t(s)] = next_[size_t(s)] = s;
            size_[i] = 0;
        }
        std::fill(where_.begin(), where_.end(), kNone);
    }
    int8_t where(int32_t e) const { return where_[size_t(e)]; }
    int size(int list) const { return size_[size_t(list)]; }
    void push_back(int list, int32_t e) {
        const int32_t s = sentinel(list), last = prev_[size_t(s)];
        prev_[size_t(e)] = last;
        next_[size_t(e)] = s;
        next_[size_t(last)] = e;
        prev_[size_t(s)] = e;
        where_[size_t(e)] = int8_t(list);
        ++size_[size_t(list)];
    }
    void remove(int32_t e) {
        next_[size_t(prev_[size_t(e)])] = next_[size_t(e)];
        prev_[size_t(next_[size_t(e)])] = prev_[size_t(e)];
        --size_[size_t(where_[size_t(e)])];
        where_[size_t(e)] = kNone;
    }
    void move_back(int list, int32_t e) {
        remove(e);
        push_back(list, e);
    }
    // The oldest member for which skip(e) is false, or -1. `skip` by reference: a
    // ChosenMarks holds one mark per id, and copying it would cost every request O(ids).
    template <class Skip> int32_t oldest(int list, const Skip & skip) const {
        const int32_t s = sentinel(list);
        for (int32_t e = next_[size_t(s)]; e != s; e = next_[size_t(e)]) {
            if (!skip(e)) {
                return e;
            }
        }
        return -1;
    }
    int32_t oldest(int list) const {
        return oldest(list, [](int32_t) { return false; });
    }
private:
    int32_t sentinel(int list) const { return n_expert_ + list; }
    int n_expert_;
    std::vector<int32_t> prev_, next_;
    std::vector<int8_t> where_;
    std::vector<int> size_;
};

// Marks the chosen experts of the current request so list walks can pass them over.
class ChosenMarks {
public:
    explicit ChosenMarks(int n_expert) : at_(size_t(n_expert), 0) {}
    // One mark per id: a copy per request would cost O(ids), so none is allowed.
    ChosenMarks(const ChosenMarks &) = delete;
    ChosenMarks & operator=(const ChosenMarks &) = delete;
    void mark(std::span<const int32_t> chosen) {
        ++now_;
        for (int32_t e : chosen) {
            at_[size_t(e)] = now_;
        }
    }
    bool operator()(int32_t e) const { return at_[size_t(e)] == now_; }
private:
    uint64_t now_ = 0;
    std::vector<uint64_t> at_;
};

// Segmented LRU: probationary and protected recency lists.
class Slru : public CachePolicy {
public:
    Slru(int n_expert, int capacity, double protected_share)
        : capacity_(capacity), protected_cap_(int(std::floor(protected_share * capacity))), lists_(n_expert, 2),
          chosen_(n_expert) {}

    int access(const Request & r) override {
        chosen_.mark(r.chosen);
        for (int32_t e : r.chosen) {
            if (lists_.where(e) == kProbation) {
                lists_.move_back(kProtectedList, e);
                if (lists_.size(kProtectedList) > protected_cap_) {
                    lists_.move_back(kProbation, lists_.oldest(kProtectedList));
                }
            } else if (lists_.where(e) == kProtectedList) {
                lists_.move_back(kProtectedList, e);
            }
        }
        int misses = 0;
        for (int32_t e : r.chosen) {
            if (lists_.where(e) != IdLists::kNone) {
                continue;
            }
            ++misses;
            if (lists_.size(kProbation) + lists_.size(kProtectedList) == capacity_) {
                int32_t victim = lists_.oldest(kProbation, chosen_);
                if (victim < 0) {
                    victim = lists_.oldest(kProtectedList, chosen_);
                }
                lists_.remove(victim);
            }
            lists_.push_back(kProbation, e);
        }
        return misses;
    }
    void reset() override { lists_.clear(); }
    bool resident(int32_t e) const override { return lists_.where(e) != IdLists::kNone; }
private:
    static constexpr int kProbation = 0, kProtectedList = 1;
    int capacity_, protected_cap_;
    IdLists lists_;
    ChosenMarks chosen_;
};

// ARC (Megiddo and Modha 2003), each chosen expert one request in ascending id order.
class Arc : public CachePolicy {
public:
    Arc(int n_expert, int capacity) : capacity_(capacity), lists_(n_expert, 4), chosen_(n_expert) {}

    int access(const Request & r) override {
        chosen_.mark(r.chosen);
        int misses = 0;
        const double c = capacity_;
        for (int32_t e : r.chosen) {
            const int8_t w = lists_.where(e);
            if (w == kT1 || w == kT2) {
                lists_.move_back(kT2, e);
                continue;
            }
            ++misses;
            if (w == kB1) {
                p_ = std::min(c, p_ + std::max(double(size(kB2)) / size(kB1), 1.0));
                replace_if_full(false);
                lists_.move_back(kT2, e);
            } else if (w == kB2) {
                p_ = std::max(0.0, p_ - std::max(double(size(kB1)) / size(kB2), 1.0));
                replace_if_full(true);
                lists_.move_back(kT2, e);
            } else {
                if (size(kT1) + size(kB1) == capacity_) {
                    if (size(kT1) < capacity_) {
                        lists_.remove(lists_.oldest(kB1));
                        replace_if_full(false);
                    } else {
                        lists_.remove(lists_.oldest(kT1, chosen_));
                    }
                } else if (const int total = size(kT1) + size(kT2) + size(kB1) + size(kB2); total >= capacity_) {
                    if (total == 2 * capacity_) {
                        lists_.remove(lists_.oldest(kB2));
                    }
                    replace_if_full(false);
                }
                lists_.push_back(kT1, e);
            }
        }
        return misses;
    }
    void reset() override {
        lists_.clear();
        p_ = 0;
    }
    bool resident(int32_t e) const override {
        const int8_t w = lists_.where(e);
        return w == kT1 || w == kT2;
    }
private:
    static constexpr int kT1 = 0, kT2 = 1, kB1 = 2, kB2 = 3;
    int size(int list) const { return lists_.size(list); }
    void replace_if_full(bool from_b2) {
        if (size(kT1) + size(kT2) < capacity_) {
            return;
        }
        const int32_t t1 = lists_.oldest(kT1, chosen_), t2 = lists_.oldest(kT2, chosen_);
        const bool prefer_t1 = size(kT1) >= 1 && (size(kT1) > p_ || (from_b2 && size(kT1) == p_));
        if ((prefer_t1 && t1 >= 0) || t2 < 0) {
            lists_.move_back(kB1, t1);
        } else {
            lists_.move_back(kB2, t2);
        }
    }
    int capacity_;
    double p_ = 0;
    IdLists lists_;
    ChosenMarks chosen_;
};

// S3-FIFO (Yang et al. 2023): small FIFO, main FIFO, ghost FIFO of evicted ids.
class S3Fifo : public CachePolicy {
public:
    S3Fifo(int n_expert, int capacity, double small_share)
        : capacity_(capacity), small_cap_(std::max(1, int(std::floor(small_share * capacity)))),
          ghost_cap_(capacity - small_cap_), lists_(n_expert, 3), freq_(size_t(n_expert), 0), chosen_(n_expert) {}

    int access(const Request & r) override {
        chosen_.mark(r.chosen);
        for (int32_t e : r.chosen) {
            if (resident(e)) {
                freq_[size_t(e)] = uint8_t(std::min(3, freq_[size_t(e)] + 1));
            }
        }
        int misses = 0;
        for (int32_t e : r.chosen) {
            if (resident(e)) {
                continue;
            }
            ++misses;
            if (size(kSmall) + size(kMain) == capacity_) {
                evict();
            }
            if (lists_.where(e) == kGhost) {
                lists_.move_back(kMain, e);
            } else {
                lists_.push_back(kSmall, e);
            }
            freq_[size_t(e)] = 0;
        }
        return misses;
    }
    void reset() override { lists_.clear(); }
    bool resident(int32_t e) const override {
        const int8_t w = lists_.where(e);
        return w == kSmall || w == kMain;
    }
private:
    static constexpr int kSmall = 0, kMain = 1, kGhost = 2;
    int size(int list) const { return lists_.size(list); }
    void evict() {
        for (;;) {
            int32_t s = size(kSmall) >= small_cap_ ? lists_.oldest(kSmall, chosen_) : -1;
            const int32_t m = s < 0 ? lists_.oldest(kMain, chosen_) : -1;
            if (s < 0 && m < 0) {
                s = lists_.oldest(kSmall, chosen_);
            }
            if (s >= 0) {
                if (freq_[size_t(s)] >= 1) {
                    freq_[size_t(s)] = 0;
                    lists_.move_back(kMain, s);
                    continue;
                }
                lists_.remove(s);
                if (ghost_cap_ > 0) {
                    if (size(kGhost) == ghost_cap_) {
                        lists_.remove(lists_.oldest(kGhost));
                    }
                    lists_.push_back(kGhost, s);
                }
                return;
            }
            if (freq_[size_t(m)] >= 1) {
                --freq_[size_t(m)];
                lists_.move_back(kMain, m);
                continue;
            }
            lists_.remove(m);
            return;
        }
    }
    int capacity_, small_cap_, ghost_cap_;
    IdLists lists_;
    std::vector<uint8_t> freq_;
    ChosenMarks chosen_;
};

} // namespace

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

int64_t ema_key(double log_score, uint64_t t, double log_decay) {
    return int64_t(std::floor((log_score - double(t) * log_decay) * double(1 << 20) + 0.5));
}

const std::vector<std::string> & policy_names() {
    static const std::vector<std::string> names = {"lru",    "lfu", "ema", "near-pick-ema", "inverse-router-ema", "lfru",
                                                   "belady", "slru", "arc", "s3fifo",        "sieve"};
    return names;
}

bool policy_reads_future(const std::string & name) { return name == "belady"; }

double effective_decay(const std::string & name, const PolicyParams & p) {
    const double per_token = name == "lfru" ? std::exp2(-1.0 / p.lfru_half_life) : p.ema_decay;
    return std::pow(per_token, 1.0 / double(p.requests_per_token));
}

std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const AccessSequence * future) {
    if (n_expert > 65536) {
        throw Error(fmt::format("a cache of {} expert ids is more than the 65536 the policies address", n_expert));
    }
    if (name == "lru") {
        return std::make_unique<Lru>(n_expert, capacity);
    }
    if (name == "lfu") {
        return std::make_unique<Lfu>(n_expert, capacity);
    }
    if (name == "ema" || name == "near-pick-ema" || name == "inverse-router-ema" || name == "lfru") {
        if (!(p.ema_decay > 0.0 && p.ema_decay < 1.0)) {
            throw Error(fmt::format("--ema-decay must be in (0, 1), got {}", p.ema_decay));
        }
        if (!(p.lfru_half_life > 0.0)) {
            throw Error(fmt::format("--lfru-half-life must be positive, got {}", p.lfru_half_life));
        }
        if (p.near_pick < 1) {
            throw Error(fmt::format("--near-pick must be at least 1, got {}", p.near_pick));
        }
        const Credit credit = name == "near-pick-ema"        ? Credit::NearPick
                              : name == "inverse-router-ema" ? Credit::InverseRouter
                                                             : Credit::ChosenOnly;
        return std::make_unique<DecayedScore>(n_expert, capacity, effective_decay(name, p), credit, p.near_pick);
    }
    if (name == "belady") {
        if (!future || future->next_use.size() != future->ids.size()) {
            throw Error("belady needs the whole request sequence with its next uses");
        }
        return std::make_unique<Belady>(n_expert, capacity, *future);
    }
    if (name == "slru") {
        if (!(p.slru_protected >= 0.0 && p.slru_protected < 1.0)) {
            throw Error(fmt::format("--slru-protected must be in [0, 1), got {}", p.slru_protected));
        }
        return std::make_unique<Slru>(n_expert, capacity, p.slru_protected);
    }
    if (name == "arc") {
        return std::make_unique<Arc>(n_expert, capacity);
    }
    if (name == "s3fifo") {
        if (!(p.s3fifo_small > 0.0 && p.s3fifo_small < 1.0)) {
            throw Error(fmt::format("--s3fifo-small must be in (0, 1), got {}", p.s3fifo_small));
        }
        return std::make_unique<S3Fifo>(n_expert, capacity, p.s3fifo_small);
    }
    if (name == "sieve") {
        return std::make_unique<Sieve>(n_expert, capacity);
    }
    throw Error(fmt::format("unknown policy \"{}\" (known: {})", name, fmt::join(policy_names(), ", ")));
}

} // namespace moeprune
