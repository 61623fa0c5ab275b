#include "sim/policies/registry.h"
#include "sim/policies/keyed_cache.h"

namespace moeprune::policies {

namespace {

// Frequency over the whole stream, resident or not: the key is simply the count.
class Lfu : public KeyedCache<Lfu> {
public:
    Lfu(int n_expert, int capacity) : KeyedCache(n_expert, capacity, true) {}
private:
    friend class KeyedCache<Lfu>;
    void on_chosen(int32_t e, size_t) { set_key(e, key(e) + 1); }
};

} // namespace

std::unique_ptr<CachePolicy> make_lfu(const PolicySpec & s) {
    return std::make_unique<Lfu>(s.n_expert, s.capacity);
}

std::unique_ptr<StackPolicy> make_lfu_stack(const PolicySpec & s) {
    return std::make_unique<Lfu>(s.n_expert, s.capacity);
}

} // namespace moeprune::policies
