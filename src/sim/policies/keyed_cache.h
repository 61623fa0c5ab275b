#pragma once
// The base of the policies that evict by an integer key per expert (lfu, the ema
// family, belady): an indexed heap of residents with lazily refreshed keys.
#include "sim/policy.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace moeprune::policies {

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
// A policy derives as `class P : public KeyedCache<P>` and supplies on_chosen, and
// optionally current_key and credit_candidates (hiding the defaults here): calls
// resolved at compile time, since they run for every expert of every request.
// Keys are kept for every expert, resident or not, by rules that do not depend on the
// capacity, so every such policy is a stack algorithm: the same object also serves as
// the StackPolicy of every cache size up to `capacity` (one object serves one of the
// two uses).
template <class Policy>
class KeyedCache : public CachePolicy, public StackPolicy {
public:
    KeyedCache(int n_expert, int capacity, bool keys_only_grow)
        : capacity_(capacity), keys_only_grow_(keys_only_grow), slot_(size_t(n_expert)) {
        heap_.reserve(size_t(capacity));
    }

    int access(const Request & r) override {
        int misses = 0;
        for (int32_t e : r.chosen) {
            misses += slot_[size_t(e)].pos < 0;
        }
        update_keys(r);
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

    // Mattson's update, once per chosen expert: it goes on top, and the expert it
    // displaces sinks, at each depth i swapping with the expert there when that one
    // ranks lower (then that one is what a cache of i + 1 slots evicts), until it
    // takes the chosen expert's old place. Chosen experts rank above all others
    // during the request, so none is evicted for another, as in access().
    void depths(const Request & r, std::span<int32_t> depth) override {
        update_keys(r);
        if (stack_rank_.empty()) {
            stack_rank_.resize(slot_.size());
        }
        for (const std::span<const int32_t> touched : {r.ranked, r.chosen}) {
            for (int32_t e : touched) {
                stack_rank_[size_t(e)] = chosen_now(e) ? kChosenRank + e : rank_of(e);
            }
        }
        for (size_t j = 0; j < r.chosen.size(); ++j) {
            depth[j] = bring_to_top(r.chosen[j]);
        }
        for (int32_t e : r.chosen) {
            stack_rank_[size_t(e)] = rank_of(e);
        }
    }

    void reset() override {
        for (int64_t r : heap_) {
            slot_[size_t(id_of(r))].pos = -1;
        }
        heap_.clear();
        stack_.clear();
        std::fill(slot_.begin(), slot_.end(), Slot{});
    }

    bool resident(int32_t e) const override { return slot_[size_t(e)].pos >= 0; }

protected:
    // Everything the heap keeps per expert, together, so that a touch costs one cache line.
    struct Slot {
        int64_t key = 0;
        uint64_t chosen_at = 0;
        int32_t pos = -1;  // in heap_, or -1 when not resident
        bool stale = false;
    };
    Slot & slot(int32_t e) { return slot_[size_t(e)]; }
    const Slot & slot(int32_t e) const { return slot_[size_t(e)]; }
    // Policy::on_chosen(e, j) raises the key of e, which this request chose (e is
    // chosen[j]); |key| < 2^46.
    // Where keys only grow and cost something to compute, a policy can raise a key by
    // marking it stale: it is computed by current_key only when the heap needs it (the
    // expert reaches the top, or is inserted), never for the many raises in between.
    int64_t current_key(int32_t e) { return slot_[size_t(e)].key; }
    void mark_stale(int32_t e) { slot_[size_t(e)].stale = true; }
    // Candidates credited without being chosen call set_key.
    void credit_candidates(const Request &) {}
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
    Policy & self() { return static_cast<Policy &>(*this); }
    // A request's key updates: the candidates it credits, then its chosen experts.
    void update_keys(const Request & r) {
        ++t_;
        for (int32_t e : r.chosen) {
            slot_[size_t(e)].chosen_at = t_;
        }
        self().credit_candidates(r);
        for (size_t j = 0; j < r.chosen.size(); ++j) {
            self().on_chosen(r.chosen[j], j);
        }
    }
    // Above every key * 65536 + id, keys being below 2^46 in magnitude (ema_key refuses
    // more; counts and request numbers stay far below).
    static constexpr int64_t kChosenRank = std::numeric_limits<int64_t>::max() - 65535;
    int32_t bring_to_top(int32_t x) {
        if (stack_.empty()) {
            stack_.push_back(x);
            return capacity_;
        }
        int32_t sinking = stack_[0];
        stack_[0] = x;
        if (sinking == x) {
            return 0;
        }
        int64_t sinking_rank = stack_rank_[size_t(sinking)];
        for (size_t i = 1; i < stack_.size(); ++i) {
            const int32_t here = stack_[i];
            if (here == x) {
                stack_[i] = sinking;
                return int32_t(i);
            }
            // Without branches: which of the two sinks is unpredictable.
            const int64_t here_rank = stack_rank_[size_t(here)];
            const bool stays = here_rank > sinking_rank;
            stack_[i] = stays ? here : sinking;
            sinking = stays ? sinking : here;
            sinking_rank = stays ? sinking_rank : here_rank;
        }
        if (stack_.size() < size_t(capacity_)) {
            stack_.push_back(sinking);
        }
        return capacity_;
    }
    int64_t rank_of(int32_t e) {
        Slot & s = slot_[size_t(e)];
        if (s.stale) {
            s.key = self().current_key(e);
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
            } else if (const int64_t r = rank_of(e); heap_.front() != r) {
                heap_.front() = r;
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
    // The StackPolicy's stack, its top `capacity_` experts, and each expert's rank as
    // of the current request (stale for experts not in the stack).
    std::vector<int32_t> stack_;
    std::vector<int64_t> stack_rank_;
};

} // namespace moeprune::policies
