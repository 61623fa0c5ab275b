#include "sim/policies/registry.h"
#include "sim/policies/id_lists.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cmath>

namespace moeprune::policies {

namespace {

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

} // namespace

std::unique_ptr<CachePolicy> make_slru(const PolicySpec & s) {
    if (!(s.params.slru_protected >= 0.0 && s.params.slru_protected < 1.0)) {
        throw Error(fmt::format("--slru-protected must be in [0, 1), got {}", s.params.slru_protected));
    }
    return std::make_unique<Slru>(s.n_expert, s.capacity, s.params.slru_protected);
}

} // namespace moeprune::policies
