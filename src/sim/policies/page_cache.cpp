#include "sim/page_cache.h"
#include "sim/policies/registry.h"

namespace moeprune::policies {

namespace {

// The kernel's page cache over experts of one size (sim/page_cache.h): what a model
// mapped from disk gets from Linux instead of an expert cache.
class PageCache : public CachePolicy {
public:
    PageCache(int n_expert, int capacity) : cache_(uint64_t(capacity), 1) {
        for (int e = 0; e < n_expert; ++e) {
            cache_.add_unit(1);
        }
    }

    int access(const Request & r) override {
        units_.assign(r.chosen.begin(), r.chosen.end());
        cache_.access(units_);
        return cache_.last_misses();
    }
    void reset() override { cache_.reset(); }
    bool resident(int32_t e) const override { return cache_.resident(uint32_t(e)); }

private:
    PageCacheModel cache_;
    std::vector<uint32_t> units_;
};

} // namespace

std::unique_ptr<CachePolicy> make_page_cache(const PolicySpec & s) {
    return std::make_unique<PageCache>(s.n_expert, s.capacity);
}

} // namespace moeprune::policies
