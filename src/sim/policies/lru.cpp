#include "sim/policies/registry.h"
#include "sim/policies/keyed_cache.h"

namespace moeprune::policies {

namespace {

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

// The same order as keys (the request that last chose an expert), for the one pass
// over every cache size, where a key per expert is what the stack compares.
class LruOrder : public KeyedCache<LruOrder> {
public:
    LruOrder(int n_expert, int capacity) : KeyedCache(n_expert, capacity, true) {}
private:
    friend class KeyedCache<LruOrder>;
    void on_chosen(int32_t e, size_t) { set_key(e, int64_t(now())); }
};

} // namespace

std::unique_ptr<CachePolicy> make_lru(const PolicySpec & s) {
    return std::make_unique<Lru>(s.n_expert, s.capacity);
}

std::unique_ptr<StackPolicy> make_lru_stack(const PolicySpec & s) {
    return std::make_unique<LruOrder>(s.n_expert, s.capacity);
}

} // namespace moeprune::policies
