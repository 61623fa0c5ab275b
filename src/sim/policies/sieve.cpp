#include "sim/policies/registry.h"

namespace moeprune::policies {

namespace {

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

} // namespace

std::unique_ptr<CachePolicy> make_sieve(const PolicySpec & s) {
    return std::make_unique<Sieve>(s.n_expert, s.capacity);
}

} // namespace moeprune::policies
