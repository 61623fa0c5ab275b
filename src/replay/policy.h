#pragma once
// Expert-cache eviction policies for one cache (one layer, or one shared cache).
// Every policy sees each token's chosen experts at once, so none can evict an
// expert the token needs, and every tie goes to the lowest expert id.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moeprune {

struct PolicyParams {
    double ema_decay = 0.9;     // ema: score <- score * decay + 1[chosen], for every expert each token
};

class CachePolicy {
public:
    virtual ~CachePolicy() = default;
    // Chosen experts of one token: distinct ids in ascending order (the order in which
    // a token's new experts enter a FIFO). Returns how many were not resident; they are
    // loaded, evicting residents that are not chosen.
    virtual int access(std::span<const int32_t> chosen) = 0;
    virtual void reset() = 0;
    virtual bool resident(int32_t expert) const = 0;
};

// `future` is Belady's view of the whole access sequence of this cache: one entry per
// token, exactly the spans access() will be given. Online policies ignore it.
std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const std::vector<std::vector<int32_t>> * future = nullptr);

const std::vector<std::string> & policy_names();

// ema's eviction key for an expert whose score is exp(log_score) after token t:
// ln(score) - t * ln(decay), which orders experts as their decayed scores do at any
// later time, rounded to multiples of 2^-20 so that scores equal to about one part
// in a million are ties (lowest id first) whether decay was applied eagerly or lazily.
int64_t ema_key(double log_score, uint64_t t, double decay);

} // namespace moeprune
