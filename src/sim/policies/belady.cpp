#include "sim/policies/registry.h"
#include "sim/policies/keyed_cache.h"
#include "core/errors.h"

namespace moeprune::policies {

namespace {

// Belady's MIN: evict the resident whose next use is farthest; never again is farthest.
class Belady : public KeyedCache<Belady> {
public:
    Belady(int n_expert, int capacity, const AccessSequence & future)
        : KeyedCache(n_expert, capacity, false), future_(future) {}
private:
    friend class KeyedCache<Belady>;
    void on_chosen(int32_t e, size_t j) {
        const uint64_t next = future_.next_use[future_.offsets[now() - 1] + j];
        set_key(e, next == AccessSequence::kNeverAgain ? -(int64_t(1) << 46) : -int64_t(next));
    }
    const AccessSequence & future_;
};

const AccessSequence & future_of(const PolicySpec & s) {
    if (!s.future || s.future->next_use.size() != s.future->ids.size()) {
        throw Error("belady needs the whole request sequence with its next uses");
    }
    return *s.future;
}

} // namespace

std::unique_ptr<CachePolicy> make_belady(const PolicySpec & s) {
    return std::make_unique<Belady>(s.n_expert, s.capacity, future_of(s));
}

std::unique_ptr<StackPolicy> make_belady_stack(const PolicySpec & s) {
    return std::make_unique<Belady>(s.n_expert, s.capacity, future_of(s));
}

} // namespace moeprune::policies
