#include "sim/policies/registry.h"
#include "sim/policies/id_lists.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace moeprune::policies {

namespace {

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

std::unique_ptr<CachePolicy> make_s3fifo(const PolicySpec & s) {
    if (!(s.params.s3fifo_small > 0.0 && s.params.s3fifo_small < 1.0)) {
        throw Error(fmt::format("--s3fifo-small must be in (0, 1), got {}", s.params.s3fifo_small));
    }
    return std::make_unique<S3Fifo>(s.n_expert, s.capacity, s.params.s3fifo_small);
}

} // namespace moeprune::policies
