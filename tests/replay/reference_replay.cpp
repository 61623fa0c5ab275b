#include "replay/reference_replay.h"
#include "core/errors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>

// Every policy here scans all experts (or the whole list) for each decision and keeps
// its state in the most obvious form. Nothing is shared with the engine except
// ema_key() and effective_decay(), so that a bug in the engine's data structures
// cannot be mirrored here.

namespace moeprune::test {

namespace {

using Ids = std::vector<int32_t>;
constexpr int64_t kMinKey = std::numeric_limits<int64_t>::min();

struct Req {
    const Ids * chosen;           // ascending, distinct
    const Ids * ranked;           // empty for a prefill-union request
    const std::vector<float> * logits;
};

class RefPolicy {
public:
    virtual ~RefPolicy() = default;
    virtual int access(const Req & r) = 0;   // misses
    virtual void reset() = 0;
    virtual bool resident(int32_t e) const = 0;
};

// Resident set and the shared eviction loop: a subclass only ranks residents
// (lower key is evicted first; ties go to the lowest id by scanning ids upward with a
// strict comparison).
class ScoredCache : public RefPolicy {
public:
    ScoredCache(int n_expert, int capacity)
        : n_(n_expert), cap_(capacity), resident_(size_t(n_expert), 0), chosen_(size_t(n_expert), 0) {}

    int access(const Req & r) override {
        ++t_;
        for (int32_t e : *r.chosen) {
            chosen_[size_t(e)] = t_;
        }
        update(r);  // before the evictions: credited non-chosen candidates rank by their new score
        int misses = 0;
        for (int32_t e : *r.chosen) {
            if (!resident_[size_t(e)]) {
                ++misses;
                if (n_res_ == cap_) {
                    evict_one();
                }
                resident_[size_t(e)] = 1;
                ++n_res_;
            }
        }
        return misses;
    }

    void reset() override {  // time runs on: the ema grid and belady's future are indexed by it
        std::fill(resident_.begin(), resident_.end(), 0);
        n_res_ = 0;
        on_reset();
    }

    bool resident(int32_t e) const override { return resident_[size_t(e)] != 0; }

protected:
    virtual void update(const Req & r) = 0;
    virtual int64_t key(int32_t e) = 0;
    virtual void on_reset() = 0;
    uint64_t now() const { return t_; }
    int n_;

private:
    void evict_one() {
        int32_t victim = -1;
        int64_t worst = 0;
        for (int32_t e = 0; e < n_; ++e) {
            if (resident_[size_t(e)] && chosen_[size_t(e)] != t_) {
                const int64_t k = key(e);
                if (victim < 0 || k < worst) {
                    victim = e;
                    worst = k;
                }
            }
        }
        if (victim < 0) {
            throw Error("reference: nothing evictable (cache smaller than a request)");
        }
        resident_[size_t(victim)] = 0;
        --n_res_;
    }

    int cap_;
    int n_res_ = 0;
    uint64_t t_ = 0;
    std::vector<char> resident_;
    std::vector<uint64_t> chosen_;   // request that last chose the expert
};

class Lru : public ScoredCache {
public:
    using ScoredCache::ScoredCache;
private:
    void update(const Req & r) override {
        for (int32_t e : *r.chosen) {
            last_[size_t(e)] = int64_t(now());
        }
    }
    int64_t key(int32_t e) override { return last_[size_t(e)]; }
    void on_reset() override { std::fill(last_.begin(), last_.end(), 0); }
    std::vector<int64_t> last_ = std::vector<int64_t>(size_t(n_), 0);
};

// Counts every request that chooses the expert, resident or not.
class Lfu : public ScoredCache {
public:
    using ScoredCache::ScoredCache;
private:
    void update(const Req & r) override {
        for (int32_t e : *r.chosen) {
            ++count_[size_t(e)];
        }
    }
    int64_t key(int32_t e) override { return count_[size_t(e)]; }
    void on_reset() override { std::fill(count_.begin(), count_.end(), 0); }
    std::vector<int64_t> count_ = std::vector<int64_t>(size_t(n_), 0);
};

enum class Credit { Chosen, NearPick, InverseRouter };

// ema, lfru, near-pick-ema, inverse-router-ema: every score decays eagerly each
// request. A score is kept as s * 2^ex with s renormalized before it leaves double
// range, so that no score of a long-idle resident underflows to 0 (which would make
// two such residents tie here while the engine, decaying lazily, still orders them).
class Ema : public ScoredCache {
public:
    Ema(int n_expert, int capacity, double decay, Credit credit, int near_pick)
        : ScoredCache(n_expert, capacity), decay_(decay), log_decay_(std::log(decay)), credit_(credit),
          near_pick_(near_pick), s_(size_t(n_expert), 0.0L), ex_(size_t(n_expert), 0), key_(size_t(n_expert), 0),
          key_t_(size_t(n_expert), 0) {}

private:
    static constexpr int kRenorm = 512;

    void add(int32_t e, long double c) {
        if (c <= 0) {
            return;
        }
        const long double v = std::ldexp(s_[size_t(e)], int(std::max<int64_t>(ex_[size_t(e)], -20000))) + c;
        s_[size_t(e)] = v;
        ex_[size_t(e)] = 0;
    }

    void update(const Req & r) override {
        const long double d = decay_;
        const long double tiny = std::ldexp(1.0L, -kRenorm);
        for (size_t e = 0; e < s_.size(); ++e) {
            long double & s = s_[e];
            s *= d;
            if (s != 0 && s < tiny) {
                s = std::ldexp(s, kRenorm);
                ex_[e] -= kRenorm;
            }
        }
        const Ids & chosen = *r.chosen;
        for (int32_t e : chosen) {
            add(e, 1.0L);
        }
        const Ids & ranked = *r.ranked;
        for (size_t i = 0; i < ranked.size(); ++i) {
            const int32_t e = ranked[i];
            if (std::binary_search(chosen.begin(), chosen.end(), e)) {
                continue;
            }
            if (credit_ == Credit::NearPick && int64_t(i) < int64_t(near_pick_)) {
                add(e, 1.0L - (long double)(double(i) / double(near_pick_)));
            } else if (credit_ == Credit::InverseRouter) {
                add(e, (long double)std::exp(double((*r.logits)[i]) - double((*r.logits)[0])));
            }
        }
    }

    int64_t key(int32_t e) override {
        if (key_t_[size_t(e)] != now()) {  // scores do not move between the evictions of one request
            const long double s = s_[size_t(e)];
            key_[size_t(e)] = s == 0 ? kMinKey
                                     : ema_key(std::log(double(s)) + double(ex_[size_t(e)]) * std::log(2.0), now(), log_decay_);
            key_t_[size_t(e)] = now();
        }
        return key_[size_t(e)];
    }

    void on_reset() override {
        std::fill(s_.begin(), s_.end(), 0.0L);
        std::fill(ex_.begin(), ex_.end(), 0);
        std::fill(key_t_.begin(), key_t_.end(), 0);
    }

    double decay_, log_decay_;
    Credit credit_;
    int near_pick_;
    std::vector<long double> s_;
    std::vector<int64_t> ex_;
    std::vector<int64_t> key_;
    std::vector<uint64_t> key_t_;
};

// MIN over this cache's whole request sequence (request numbers from 1).
class Belady : public ScoredCache {
public:
    Belady(int n_expert, int capacity, const std::vector<Ids> & future) : ScoredCache(n_expert, capacity) {
        uses_.resize(size_t(n_expert));
        for (size_t i = 0; i < future.size(); ++i) {
            for (int32_t e : future[i]) {
                uses_[size_t(e)].push_back(int64_t(i) + 1);
            }
        }
    }
private:
    void update(const Req &) override {}
    int64_t key(int32_t e) override {
        const auto & u = uses_[size_t(e)];
        const auto it = std::upper_bound(u.begin(), u.end(), int64_t(now()));
        return it == u.end() ? kMinKey : -*it;
    }
    void on_reset() override {}
    std::vector<std::vector<int64_t>> uses_;
};

// List-based policies keep each expert's list membership and a stamp from one counter
// that ticks per list operation: "oldest" of a list is its smallest stamp, "move to the
// newest end" is a fresh stamp.
class Stamped : public RefPolicy {
public:
    Stamped(int n_expert, int capacity)
        : n_(n_expert), cap_(capacity), where_(size_t(n_expert), kNone), stamp_(size_t(n_expert), 0),
          chosen_(size_t(n_expert), 0) {}

    bool resident(int32_t e) const override { return is_resident(where_[size_t(e)]); }

    int access(const Req & r) override {
        ++t_;
        for (int32_t e : *r.chosen) {
            chosen_[size_t(e)] = t_;
        }
        return run(*r.chosen);
    }

    void reset() override {
        std::fill(where_.begin(), where_.end(), kNone);
        std::fill(count_.begin(), count_.end(), 0);
        on_reset();
    }

protected:
    static constexpr int kNone = 0;
    virtual bool is_resident(int list) const = 0;
    virtual int run(const Ids & chosen) = 0;
    virtual void on_reset() {}

    bool chosen_now(int32_t e) const { return chosen_[size_t(e)] == t_; }
    int list_of(int32_t e) const { return where_[size_t(e)]; }
    int size(int list) const { return count_[size_t(list)]; }
    int resident_count() const {
        int n = 0;
        for (int l = 1; l < int(count_.size()); ++l) {
            n += is_resident(l) ? count_[size_t(l)] : 0;
        }
        return n;
    }
    void put(int32_t e, int list) {  // to the newest end of list (kNone: remove)
        --count_[size_t(where_[size_t(e)])];
        where_[size_t(e)] = list;
        ++count_[size_t(list)];
        stamp_[size_t(e)] = ++clock_;
    }
    int32_t oldest(int list, bool skip_chosen) const {
        int32_t best = -1;
        for (int32_t e = 0; e < n_; ++e) {
            if (where_[size_t(e)] == list && !(skip_chosen && chosen_now(e)) &&
                (best < 0 || stamp_[size_t(e)] < stamp_[size_t(best)])) {
                best = e;
            }
        }
        return best;
    }

    int n_, cap_;

private:
    std::vector<int> where_;
    std::vector<uint64_t> stamp_;
    std::vector<uint64_t> chosen_;
    std::vector<int> count_ = std::vector<int>(8, 0);   // per list; index 0 (kNone) is not meaningful
    uint64_t clock_ = 0, t_ = 0;
};

class Slru : public Stamped {
public:
    Slru(int n_expert, int capacity, double q) : Stamped(n_expert, capacity), protected_cap_(int(std::floor(q * capacity))) {}
private:
    enum { kProb = 1, kProt = 2 };
    bool is_resident(int l) const override { return l == kProb || l == kProt; }
    int run(const Ids & chosen) override {
        for (int32_t e : chosen) {
            if (list_of(e) == kProb) {
                put(e, kProt);
                if (size(kProt) > protected_cap_) {
                    put(oldest(kProt, false), kProb);  // demotion evicts nothing, so chosen experts may move
                }
            } else if (list_of(e) == kProt) {
                put(e, kProt);
            }
        }
        int misses = 0;
        for (int32_t e : chosen) {
            if (is_resident(list_of(e))) {
                continue;
            }
            ++misses;
            if (resident_count() == cap_) {
                int32_t v = oldest(kProb, true);
                if (v < 0) {
                    v = oldest(kProt, true);
                }
                put(v, kNone);
            }
            put(e, kProb);
        }
        return misses;
    }
    int protected_cap_;
};

class Arc : public Stamped {
public:
    using Stamped::Stamped;
private:
    enum { kT1 = 1, kT2 = 2, kB1 = 3, kB2 = 4 };
    bool is_resident(int l) const override { return l == kT1 || l == kT2; }
    void on_reset() override { p_ = 0; }

    void replace(bool from_b2) {
        if (size(kT1) + size(kT2) < cap_) {
            return;
        }
        const double t1 = size(kT1);
        const bool use_t1 = size(kT1) > 0 && (t1 > p_ || (from_b2 && t1 == p_));
        int32_t v = oldest(use_t1 ? kT1 : kT2, true);
        bool took_t1 = use_t1;
        if (v < 0) {
            took_t1 = !use_t1;
            v = oldest(took_t1 ? kT1 : kT2, true);
        }
        put(v, took_t1 ? kB1 : kB2);
    }

    int run(const Ids & chosen) override {
        int misses = 0;
        for (int32_t x : chosen) {
            const int l = list_of(x);
            if (l == kT1 || l == kT2) {
                put(x, kT2);
                continue;
            }
            ++misses;
            const double b1 = size(kB1), b2 = size(kB2);
            if (l == kB1) {
                p_ = std::min(double(cap_), p_ + std::max(b2 / b1, 1.0));
                replace(false);
                put(x, kT2);
            } else if (l == kB2) {
                p_ = std::max(0.0, p_ - std::max(b1 / b2, 1.0));
                replace(true);
                put(x, kT2);
            } else {
                if (size(kT1) + size(kB1) == cap_) {
                    if (size(kT1) < cap_) {
                        put(oldest(kB1, false), kNone);
                        replace(false);
                    } else {
                        put(oldest(kT1, true), kNone);
                    }
                } else {
                    const int total = size(kT1) + size(kT2) + size(kB1) + size(kB2);
                    if (total >= cap_) {
                        if (total == 2 * cap_) {
                            put(oldest(kB2, false), kNone);
                        }
                        replace(false);
                    }
                }
                put(x, kT1);
            }
        }
        return misses;
    }
    double p_ = 0;
};

class S3Fifo : public Stamped {
public:
    S3Fifo(int n_expert, int capacity, double s)
        : Stamped(n_expert, capacity), small_(std::max(1, int(std::floor(s * capacity)))), ghost_cap_(capacity - small_),
          freq_(size_t(n_expert), 0) {}
private:
    enum { kS = 1, kM = 2, kG = 3 };
    bool is_resident(int l) const override { return l == kS || l == kM; }

    void make_room() {
        for (;;) {
            int32_t from_s = oldest(kS, true), from_m = oldest(kM, true);
            const bool use_s = (size(kS) >= small_ && from_s >= 0) || from_m < 0;
            if (use_s) {
                const int32_t e = from_s;
                if (freq_[size_t(e)] >= 1) {
                    freq_[size_t(e)] = 0;
                    put(e, kM);
                    continue;
                }
                put(e, kG);
                if (size(kG) > ghost_cap_) {
                    put(oldest(kG, false), kNone);
                }
                return;
            }
            const int32_t e = from_m;
            if (freq_[size_t(e)] >= 1) {
                --freq_[size_t(e)];
                put(e, kM);
                continue;
            }
            put(e, kNone);
            return;
        }
    }

    int run(const Ids & chosen) override {
        for (int32_t e : chosen) {
            if (is_resident(list_of(e))) {
                freq_[size_t(e)] = std::min(3, freq_[size_t(e)] + 1);
            }
        }
        int misses = 0;
        for (int32_t e : chosen) {
            if (is_resident(list_of(e))) {
                continue;
            }
            ++misses;
            if (resident_count() == cap_) {
                make_room();
            }
            freq_[size_t(e)] = 0;
            put(e, list_of(e) == kG ? kM : kS);
        }
        return misses;
    }
    void on_reset() override { std::fill(freq_.begin(), freq_.end(), 0); }

    int small_, ghost_cap_;
    std::vector<int> freq_;
};

// SIEVE as a vector, oldest first; the hand is an index into it.
// The kernel's two-list reclaim of file pages over experts (sim/page_cache.h), with the
// inactive list kept at least as large as the active one: lists by stamp, full scans.
class PageCacheRef : public Stamped {
public:
    PageCacheRef(int n_expert, int capacity) : Stamped(n_expert, capacity) { on_reset(); }
private:
    enum { kInactive = 1, kActive = 2 };
    bool is_resident(int l) const override { return l == kInactive || l == kActive; }
    void on_reset() override {
        young_.assign(size_t(n_), 0);
        referenced_.assign(size_t(n_), 0);
        shadow_.assign(size_t(n_), -1);
        clock_ = 0;
    }
    void deactivate(int32_t e) {
        young_[size_t(e)] = 0;
        put(e, kInactive);
    }
    int run(const Ids & chosen) override {
        int misses = 0;
        for (int32_t e : chosen) {
            young_[size_t(e)] = 1;
            if (is_resident(list_of(e))) {
                continue;
            }
            ++misses;
            const bool refault = shadow_[size_t(e)] >= 0 && clock_ - shadow_[size_t(e)] <= size(kActive);
            shadow_[size_t(e)] = -1;
            referenced_[size_t(e)] = 0;
            clock_ += refault ? 1 : 0;
            put(e, refault ? kActive : kInactive);
        }
        while (resident_count() > cap_) {
            while (size(kInactive) < size(kActive)) {
                deactivate(oldest(kActive, false));
            }
            const int32_t v = oldest(kInactive, true);
            if (v < 0) {
                const int32_t a = oldest(kActive, true);
                if (a < 0) {
                    break;
                }
                deactivate(a);
            } else if (young_[size_t(v)] && referenced_[size_t(v)]) {
                young_[size_t(v)] = referenced_[size_t(v)] = 0;
                put(v, kActive);
            } else if (young_[size_t(v)]) {
                young_[size_t(v)] = 0;
                referenced_[size_t(v)] = 1;
                put(v, kInactive);
            } else {
                referenced_[size_t(v)] = 0;
                shadow_[size_t(v)] = clock_++;
                put(v, kNone);
            }
        }
        return misses;
    }
    std::vector<char> young_, referenced_;
    std::vector<int64_t> shadow_;
    int64_t clock_ = 0;
};

class Sieve : public RefPolicy {
public:
    Sieve(int n_expert, int capacity) : cap_(capacity), visited_(size_t(n_expert), 0), in_(size_t(n_expert), 0) {}
    int access(const Req & r) override {
        const Ids & chosen = *r.chosen;
        for (int32_t e : chosen) {
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
            if (int(queue_.size()) == cap_) {
                evict(chosen);
            }
            queue_.push_back(e);
            in_[size_t(e)] = 1;
            visited_[size_t(e)] = 0;
        }
        return misses;
    }
    void reset() override {
        queue_.clear();
        hand_ = 0;
        std::fill(visited_.begin(), visited_.end(), 0);
        std::fill(in_.begin(), in_.end(), 0);
    }
    bool resident(int32_t e) const override { return in_[size_t(e)] != 0; }
private:
    void evict(const Ids & protect) {
        for (;;) {
            if (hand_ >= queue_.size()) {
                hand_ = 0;
            }
            const int32_t e = queue_[hand_];
            if (std::binary_search(protect.begin(), protect.end(), e)) {
                ++hand_;  // passed over with its bit untouched
            } else if (visited_[size_t(e)]) {
                visited_[size_t(e)] = 0;
                ++hand_;
            } else {
                queue_.erase(queue_.begin() + long(hand_));  // the hand now rests on the next newer expert,
                if (hand_ == queue_.size()) {                 // or, past the newest, wraps to the oldest
                    hand_ = 0;                                // (not onto the expert about to be appended)
                }
                in_[size_t(e)] = 0;
                return;
            }
        }
    }
    int cap_;
    Ids queue_;
    size_t hand_ = 0;
    std::vector<char> visited_, in_;
};

// Records the request sequence of one cache (first pass for belady); caches nothing.
class Recorder : public RefPolicy {
public:
    int access(const Req & r) override {
        seq.push_back(*r.chosen);
        return int(r.chosen->size());
    }
    void reset() override {}
    bool resident(int32_t) const override { return false; }
    std::vector<Ids> seq;
};

std::unique_ptr<RefPolicy> make(const RefConfig & c, int n_expert, int capacity, const std::vector<Ids> * future) {
    const std::string & p = c.policy;
    if (p == "lru") {
        return std::make_unique<Lru>(n_expert, capacity);
    }
    if (p == "lfu") {
        return std::make_unique<Lfu>(n_expert, capacity);
    }
    if (p == "ema" || p == "lfru" || p == "near-pick-ema" || p == "inverse-router-ema") {
        const Credit credit = p == "near-pick-ema" ? Credit::NearPick
                              : p == "inverse-router-ema" ? Credit::InverseRouter
                                                          : Credit::Chosen;
        return std::make_unique<Ema>(n_expert, capacity, effective_decay(p, c.params), credit, c.params.near_pick);
    }
    if (p == "belady") {
        if (future == nullptr) {
            return std::make_unique<Recorder>();
        }
        return std::make_unique<Belady>(n_expert, capacity, *future);
    }
    if (p == "slru") {
        return std::make_unique<Slru>(n_expert, capacity, c.params.slru_protected);
    }
    if (p == "arc") {
        return std::make_unique<Arc>(n_expert, capacity);
    }
    if (p == "s3fifo") {
        return std::make_unique<S3Fifo>(n_expert, capacity, c.params.s3fifo_small);
    }
    if (p == "sieve") {
        return std::make_unique<Sieve>(n_expert, capacity);
    }
    if (p == "page-cache") {
        return std::make_unique<PageCacheRef>(n_expert, capacity);
    }
    throw Error("reference: unknown policy " + p);
}

struct Routed {
    Ids unbiased;   // U, in rank order
    Ids chosen;     // ascending, ids as in the trace (no global offset)
    int forced = 0, swaps = 0;
    double moved_mass = 0;
};

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

class Replay {
public:
    Replay(const RefTrace & tr, const RefConfig & c, std::vector<std::unique_ptr<RefPolicy>> & caches)
        : tr_(tr), c_(c), caches_(caches), prior_sum_(size_t(tr.n_layer), 0.0),
          prior_n_(size_t(tr.n_layer), 0) {
        if (c.prefetch_n > 0 && tr.n_layer > 1) {
            cooc_.assign(size_t(tr.n_layer - 1) * size_t(tr.n_expert) * size_t(tr.n_expert), 0);
        }
        res_.prefill.exposed_per_layer.assign(size_t(tr.n_layer), 0);
        res_.decode.exposed_per_layer.assign(size_t(tr.n_layer), 0);
    }

    RefResult run() {
        const size_t T = tr_.ranked.size();
        size_t t = 0;
        while (t < T) {
            if (c_.reset_on_session && t > 0 && tr_.seq[t] != tr_.seq[t - 1]) {
                for (auto & cache : caches_) {
                    cache->reset();
                }
            }
            size_t end = t + 1;
            const bool batch = c_.prefill_union > 0 && !tr_.decode[t];
            if (batch) {
                while (end < T && !tr_.decode[end] && tr_.seq[end] == tr_.seq[t] && end - t < size_t(c_.prefill_union)) {
                    ++end;
                }
            }
            for (size_t u = t; u < end; ++u) {
                if (u >= c_.warmup) {
                    RefCounts & ph = phase(u);
                    ph.tokens += 1;
                    ph.picks += uint64_t(tr_.n_layer) * uint64_t(tr_.k);
                }
            }
            std::vector<std::vector<Ids>> unbiased(end - t, std::vector<Ids>(size_t(tr_.n_layer)));
            if (batch) {
                run_batch(t, end, unbiased);
            } else {
                run_token(t, unbiased[0]);
            }
            if (!cooc_.empty()) {
                for (size_t i = 0; i < unbiased.size(); ++i) {
                    if (c_.prefetch_train == 0 || t + i < c_.prefetch_train) {
                        learn(unbiased[i]);
                    }
                }
            }
            t = end;
        }
        return res_;
    }

private:
    RefCounts & phase(size_t t) { return tr_.decode[t] ? res_.decode : res_.prefill; }
    int cache_of(int l) const { return c_.global ? 0 : l; }
    int32_t offset(int l) const { return c_.global ? int32_t(l) * tr_.n_expert : 0; }
    int capacity(int l) const { return c_.capacity[size_t(cache_of(l))]; }
    bool resident(int l, int32_t e) const { return caches_[size_t(cache_of(l))]->resident(offset(l) + e); }

    Routed route(size_t t, int l) {
        const Ids & ranked = tr_.ranked[t][size_t(l)];
        const std::vector<float> & z = tr_.logits[t][size_t(l)];
        const size_t k = size_t(tr_.k);
        const size_t n = ranked.size();
        Routed r;
        r.forced = int(k - std::min(k, n));
        r.unbiased.assign(ranked.begin(), ranked.begin() + long(std::min(k, n)));
        if (n >= k && k > 0) {  // the prior covers every token that has a k-th candidate, warm-up included
            prior_sum_[size_t(l)] += double(z[0]) - double(z[k - 1]);
            ++prior_n_[size_t(l)];
        }
        if (c_.lambda == 0 || n <= k) {
            r.chosen = r.unbiased;
        } else {
            const double delta = c_.moce == "topk-gap" ? double(z[0]) - double(z[k - 1])
                                                       : prior_sum_[size_t(l)] / double(prior_n_[size_t(l)]);
            std::vector<double> zp(n);
            for (size_t i = 0; i < n; ++i) {
                const bool bonus = int64_t(i) < int64_t(c_.j) || resident(l, ranked[i]);
                zp[i] = double(z[i]) + (bonus ? c_.lambda * delta : 0.0);
            }
            std::vector<size_t> order(n);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return zp[a] > zp[b]; });
            for (size_t i = 0; i < k; ++i) {
                r.chosen.push_back(ranked[order[i]]);
            }
            double all = 0, moved = 0;
            for (size_t i = 0; i < r.unbiased.size(); ++i) {
                const double w = std::exp(double(z[i]) - double(z[0]));
                all += w;
                if (std::find(r.chosen.begin(), r.chosen.end(), ranked[i]) == r.chosen.end()) {
                    moved += w;
                }
            }
            r.moved_mass = moved / all;
            for (int32_t e : r.chosen) {
                if (std::find(r.unbiased.begin(), r.unbiased.end(), e) == r.unbiased.end()) {
                    ++r.swaps;
                }
            }
        }
        std::sort(r.chosen.begin(), r.chosen.end());
        return r;
    }

    void count_routing(size_t t, const Routed & r) {
        if (t >= c_.warmup) {
            RefCounts & ph = phase(t);
            ph.forced += uint64_t(r.forced);
            ph.swaps += uint64_t(r.swaps);
            ph.moved_mass += r.moved_mass;
        }
    }

    int request(int l, const Ids & chosen, const Ids & ranked, const std::vector<float> & logits) {
        Ids c = chosen, rk = ranked;
        for (int32_t & e : c) {
            e += offset(l);
        }
        for (int32_t & e : rk) {
            e += offset(l);
        }
        return caches_[size_t(cache_of(l))]->access(Req{&c, &rk, &logits});
    }

    void expose(RefCounts & ph, int l, uint64_t exposed) {
        ph.exposed_per_layer[size_t(l)] += exposed;
        ph.rounds += ceil_div(exposed, uint64_t(c_.queue_depth));
    }

    void run_token(size_t t, std::vector<Ids> & unbiased) {
        const bool counted = t >= c_.warmup;
        for (int l = 0; l < tr_.n_layer; ++l) {
            const Routed r = route(t, l);
            count_routing(t, r);
            unbiased[size_t(l)] = r.unbiased;
            Ids predicted;
            if (c_.prefetch_n > 0 && l > 0) {
                predicted = predict(l, unbiased[size_t(l) - 1]);
            }
            int expected_misses = 0, hidden = 0, predicted_chosen = 0, prefetch_loads = 0;
            for (int32_t e : r.chosen) {
                const bool staged = std::find(predicted.begin(), predicted.end(), e) != predicted.end();
                predicted_chosen += staged;
                if (!resident(l, e)) {
                    ++expected_misses;
                    hidden += staged;
                }
            }
            for (int32_t e : predicted) {
                prefetch_loads += !resident(l, e);
            }
            const int misses = request(l, r.chosen, tr_.ranked[t][size_t(l)], tr_.logits[t][size_t(l)]);
            if (misses != expected_misses) {
                throw Error("reference: a policy's miss count disagrees with residency");
            }
            if (counted) {
                RefCounts & ph = phase(t);
                ph.misses += uint64_t(misses);
                ph.predicted += predicted.size();
                ph.predicted_chosen += uint64_t(predicted_chosen);
                ph.prefetch_loads += uint64_t(prefetch_loads);
                ph.hidden += uint64_t(hidden);
                expose(ph, l, uint64_t(misses - hidden + r.forced));
            }
        }
    }

    void run_batch(size_t t0, size_t t1, std::vector<std::vector<Ids>> & unbiased) {
        static const Ids kNoRanked;
        static const std::vector<float> kNoLogits;
        for (int l = 0; l < tr_.n_layer; ++l) {
            Ids all;
            uint64_t forced = 0;
            for (size_t t = t0; t < t1; ++t) {  // all routed before the layer's first request: the state at batch start
                const Routed r = route(t, l);
                count_routing(t, r);
                unbiased[t - t0][size_t(l)] = r.unbiased;
                all.insert(all.end(), r.chosen.begin(), r.chosen.end());
                forced += uint64_t(r.forced);
            }
            std::sort(all.begin(), all.end());
            all.erase(std::unique(all.begin(), all.end()), all.end());
            const size_t cap = size_t(capacity(l));
            uint64_t misses = 0;
            size_t i = 0;
            do {
                const Ids piece(all.begin() + long(i), all.begin() + long(std::min(all.size(), i + cap)));
                misses += uint64_t(request(l, piece, kNoRanked, kNoLogits));
                i += cap;
            } while (i < all.size());
            if (t0 >= c_.warmup) {
                RefCounts & ph = phase(t0);
                ph.misses += misses;
                expose(ph, l, misses + forced);
            }
        }
    }

    Ids predict(int l, const Ids & prev_unbiased) const {
        const size_t E = size_t(tr_.n_expert);
        const uint32_t * cnt = cooc_.data() + size_t(l - 1) * E * E;
        std::vector<uint64_t> score(E, 0);
        for (int32_t a : prev_unbiased) {
            for (size_t b = 0; b < E; ++b) {
                score[b] += cnt[size_t(a) * E + b];
            }
        }
        Ids out;
        std::vector<char> taken(E, 0);
        for (int n = 0; n < c_.prefetch_n; ++n) {
            int32_t best = -1;
            for (size_t b = 0; b < E; ++b) {
                if (!taken[b] && score[b] > 0 && (best < 0 || score[b] > score[size_t(best)])) {
                    best = int32_t(b);
                }
            }
            if (best < 0) {
                break;
            }
            taken[size_t(best)] = 1;
            out.push_back(best);
        }
        return out;
    }

    void learn(const std::vector<Ids> & unbiased) {
        const size_t E = size_t(tr_.n_expert);
        for (int l = 0; l + 1 < tr_.n_layer; ++l) {
            uint32_t * cnt = cooc_.data() + size_t(l) * E * E;
            for (int32_t a : unbiased[size_t(l)]) {
                for (int32_t b : unbiased[size_t(l) + 1]) {
                    ++cnt[size_t(a) * E + size_t(b)];
                }
            }
        }
    }

    const RefTrace & tr_;
    const RefConfig & c_;
    std::vector<std::unique_ptr<RefPolicy>> & caches_;
    std::vector<double> prior_sum_;
    std::vector<uint64_t> prior_n_;
    std::vector<uint32_t> cooc_;   // [layer pair][a][b]
    RefResult res_;
};

void validate(const RefTrace & tr, const RefConfig & c) {
    if (tr.n_layer <= 0 || tr.n_expert <= 0 || tr.k <= 0) {
        throw Error("reference: n_layer, n_expert and k must be positive");
    }
    const size_t T = tr.ranked.size();
    if (tr.logits.size() != T || tr.seq.size() != T || tr.decode.size() != T) {
        throw Error("reference: trace arrays differ in length");
    }
    for (size_t t = 0; t < T; ++t) {
        if (tr.ranked[t].size() != size_t(tr.n_layer) || tr.logits[t].size() != size_t(tr.n_layer)) {
            throw Error("reference: a token does not have n_layer rows");
        }
        for (int l = 0; l < tr.n_layer; ++l) {
            if (tr.ranked[t][size_t(l)].size() != tr.logits[t][size_t(l)].size()) {
                throw Error("reference: ranked and logits differ in length");
            }
            for (int32_t e : tr.ranked[t][size_t(l)]) {
                if (e < 0 || e >= tr.n_expert) {
                    throw Error("reference: expert id out of range");
                }
            }
        }
    }
    if (c.capacity.size() != (c.global ? 1u : size_t(tr.n_layer))) {
        throw Error("reference: capacity needs one entry per layer, or one with global");
    }
    for (int cap : c.capacity) {
        if (cap < tr.k) {
            throw Error("reference: a cache smaller than k is refused");
        }
    }
    if (c.moce != "prior" && c.moce != "topk-gap") {
        throw Error("reference: unknown moce mode " + c.moce);
    }
    if (c.policy == "belady" && c.lambda > 0) {
        throw Error("reference: belady runs at lambda 0 only");
    }
    if (c.queue_depth <= 0) {
        throw Error("reference: queue depth must be positive");
    }
}

std::vector<std::unique_ptr<RefPolicy>> make_caches(const RefTrace & tr, const RefConfig & c,
                                                    const std::vector<std::vector<Ids>> * futures) {
    std::vector<std::unique_ptr<RefPolicy>> caches;
    const int n_expert = c.global ? tr.n_layer * tr.n_expert : tr.n_expert;
    for (size_t i = 0; i < c.capacity.size(); ++i) {
        caches.push_back(make(c, n_expert, c.capacity[i], futures ? &(*futures)[i] : nullptr));
    }
    return caches;
}

} // namespace

RefResult reference_replay(const RefTrace & trace, const RefConfig & config) {
    validate(trace, config);
    if (config.policy != "belady") {
        auto caches = make_caches(trace, config, nullptr);
        return Replay(trace, config, caches).run();
    }
    // At lambda 0 routing never looks at the cache, so a first pass with caches that
    // only record yields each cache's exact request sequence (pieces and all).
    std::vector<std::unique_ptr<RefPolicy>> recorders = make_caches(trace, config, nullptr);
    Replay(trace, config, recorders).run();
    std::vector<std::vector<Ids>> futures;
    for (auto & r : recorders) {
        futures.push_back(std::move(static_cast<Recorder &>(*r).seq));
    }
    auto caches = make_caches(trace, config, &futures);
    return Replay(trace, config, caches).run();
}

} // namespace moeprune::test
