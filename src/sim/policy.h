#pragma once
// Expert-cache eviction policies for one cache (one layer, or one cache shared by all
// layers). Every policy sees a request's chosen experts at once, so none can evict an
// expert the request needs, and every tie goes to the lowest expert id. The exact
// rules are in docs/replay.md.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moeprune {

struct PolicyParams {
    double ema_decay = 0.9;        // ema family: score <- score * decay + credit, per token
    int near_pick = 48;            // near-pick-ema: candidates ranked below this earn credit
    double lfru_half_life = 128;   // lfru: tokens after which a use counts half
    double slru_protected = 0.8;   // slru: share of the slots in the protected segment
    double s3fifo_small = 0.1;     // s3fifo: share of the slots in the small FIFO
    int requests_per_token = 1;    // a global cache sees one request per layer and token
};

// The settings as every result file records them (replay, eval, plan).
nlohmann::json to_json(const PolicyParams & p);

// One request to one cache.
struct Request {
    std::span<const int32_t> chosen;   // distinct ids, ascending
    std::span<const int32_t> ranked;   // the router's candidates, best first (unbiased order)
    std::span<const float> logits;     // logits of `ranked`
};

class CachePolicy {
public:
    virtual ~CachePolicy() = default;
    // Returns how many chosen experts were not resident; they are loaded, evicting
    // residents that are not chosen.
    virtual int access(const Request & r) = 0;
    virtual void reset() = 0;
    virtual bool resident(int32_t expert) const = 0;
};

// Every cache size of one policy at once, for the policies that are stack algorithms
// (Mattson et al., 1970): those that evict the resident lowest in an order of all
// experts whose rules do not depend on the cache size (lru, lfu, the ema family,
// belady). A cache of C slots then always holds the top C of one list of experts, the
// stack, so one pass gives the misses of every C: a chosen expert is a miss for
// exactly the sizes up to its depth. docs/replay.md shows why the batched requests
// (a token's experts at once, none evicted for another) keep the property.
class StackPolicy {
public:
    virtual ~StackPolicy() = default;
    // depth[j] is where r.chosen[j] stood in the stack when its turn came (the chosen
    // experts go on top one after another), or the largest capacity when it stood
    // deeper or was never seen: a cache of C slots (k <= C <= largest) missed it iff
    // depth[j] >= C.
    virtual void depths(const Request & r, std::span<int32_t> depth) = 0;
    virtual void reset() = 0;
};

// The whole request sequence of one cache for offline policies: the chosen ids of
// every request, flat, and for each pick the request (counted from 1, as policies
// count) that next chooses that expert, or kNeverAgain.
struct AccessSequence {
    static constexpr uint64_t kNeverAgain = UINT64_MAX;
    std::vector<uint64_t> offsets{0};   // request i's picks are [offsets[i], offsets[i+1])
    std::vector<int32_t> ids;
    std::vector<uint64_t> next_use;     // filled by index_next_uses()

    void push(std::span<const int32_t> chosen) {
        ids.insert(ids.end(), chosen.begin(), chosen.end());
        offsets.push_back(ids.size());
    }
    size_t size() const { return offsets.size() - 1; }
    std::span<const int32_t> chosen(size_t i) const {
        return {ids.data() + offsets[i], size_t(offsets[i + 1] - offsets[i])};
    }
    void index_next_uses(int n_expert);
};

// The ema family's key after every score update of a request sequence that does not
// depend on the cache (unbiased routing): the same for every cache size, so a sweep
// computes the scores and their logarithms once per layer and policy, and each cache
// only orders its residents by them. Request i's updates, in the order a cache applies
// them (credited candidates by rank, then the chosen experts in request order), are
// [offsets[i], offsets[i+1]).
struct KeySchedule {
    std::vector<uint64_t> offsets{0};
    std::vector<int32_t> ids;
    std::vector<int64_t> keys;
    size_t size() const { return offsets.size() - 1; }
};

// Whether `name` is an ema-family policy, which can follow a KeySchedule.
bool policy_takes_key_schedule(const std::string & name);

// The schedule of `n_requests` requests: request_of(i, reset) gives request i and sets
// `reset` when the cache is emptied before it (as CachePolicy::reset() does).
KeySchedule build_key_schedule(const std::string & name, int n_expert, const PolicyParams & p, uint64_t n_requests,
                               const std::function<Request(uint64_t, bool &)> & request_of);

// `future` is needed by belady only; `keys`, optional for the ema family, must be the
// schedule of exactly the requests (and resets) the policy will see. Both must outlive
// the policy.
std::unique_ptr<CachePolicy> make_policy(const std::string & name, int n_expert, int capacity, const PolicyParams & p,
                                         const AccessSequence * future = nullptr, const KeySchedule * keys = nullptr);

// nullptr when `name` is not a stack algorithm; `largest` is the largest cache size
// the depths must tell apart.
std::unique_ptr<StackPolicy> make_stack_policy(const std::string & name, int n_expert, int largest,
                                               const PolicyParams & p, const AccessSequence * future = nullptr);
bool policy_is_stack_algorithm(const std::string & name);

const std::vector<std::string> & policy_names();
// Reads the future request sequence: an offline bound (belady), not a policy to deploy.
bool policy_reads_future(const std::string & name);
// What a policy credits on a request: the chosen experts only, or the router's ranked
// candidates beyond them too (needs Request::ranked): the top near_pick with a linear
// weight, or every candidate by its router probability.
enum class PolicyCredit { Chosen, NearPick, InverseRouter };
PolicyCredit policy_credit(const std::string & name);
bool policy_credits_candidates(const std::string & name);
// The decay the ema family's scores follow per token: --ema-decay, or lfru's half-life
// (--lfru-half-life) turned into one; None for a policy without decayed scores.
enum class PolicyDecay { None, EmaDecay, LfruHalfLife };
PolicyDecay policy_decay(const std::string & name);

// The ema family's eviction key for an expert whose score is exp(log_score) after
// request t: ln(score) - t * ln(decay), which orders experts as their decayed scores
// do at any later time, rounded to multiples of 2^-20 so that scores equal to about
// one part in a million are ties (lowest id first) whether decay was applied eagerly
// or lazily.
int64_t ema_key(double log_score, uint64_t t, double log_decay);

// Per-request decay of each ema-family policy (lfru's half-life turned into one).
double effective_decay(const std::string & name, const PolicyParams & p);

} // namespace moeprune
