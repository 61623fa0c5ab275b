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

// The whole access sequence of one cache, for offline policies: every token's chosen
// ids (as access() will be given them) and, for each, the token (counted from 1, as
// policies count) that next chooses that expert, or kNeverAgain. Built once and
// shared by every configuration replaying the same layer; next_use (8 bytes a pick)
// only when an offline policy will read it.
struct AccessSequence {
    static constexpr uint64_t kNeverAgain = UINT64_MAX;
    AccessSequence(std::vector<std::vector<int32_t>> chosen, int n_expert, bool with_next_use);
    std::vector<std::vector<int32_t>> chosen;
    std::vector<std::vector<uint64_t>> next_use;
};

// `future` is needed by belady only; it must outlive the policy.
std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const AccessSequence * future = nullptr);

const std::vector<std::string> & policy_names();

// ema's eviction key for an expert whose score is exp(log_score) after token t:
// ln(score) - t * ln(decay) (log_decay = ln(decay)), which orders experts as their decayed scores do at any
// later time, rounded to multiples of 2^-20 so that scores equal to about one part
// in a million are ties (lowest id first) whether decay was applied eagerly or lazily.
int64_t ema_key(double log_score, uint64_t t, double log_decay);

} // namespace moeprune
