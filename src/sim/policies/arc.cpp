#include "sim/policies/registry.h"
#include "sim/policies/id_lists.h"

#include <algorithm>

namespace moeprune::policies {

namespace {

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

} // namespace

std::unique_ptr<CachePolicy> make_arc(const PolicySpec & s) {
    return std::make_unique<Arc>(s.n_expert, s.capacity);
}

} // namespace moeprune::policies
