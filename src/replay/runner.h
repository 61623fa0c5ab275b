#pragma once
// Private to replay: one configuration's cache as both sweeps run it, token by token. Its
// methods stay inline because the sweeps call them once per token and configuration.
#include "replay/internal.h"
#include "sim/routing.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace moeprune::replay_impl {

// One configuration's cache (one layer's, or the global one) and its counters.
class Runner {
public:
    Runner(const Setup & s, const ReplayOptions & opt, const Config & c, int slots, const AccessSequence * future,
           int n_ids, const KeySchedule * keys = nullptr)
        : s_(s), opt_(opt), lambda_(c.lambda), slots_(slots),
          policy_(make_policy(c.policy, n_ids, slots, s.params, future, keys)),
          step_(*policy_, c.lambda, s.j, policy_credits_candidates(c.policy)), in_union_(size_t(n_ids), 0) {}

    void reset() { policy_->reset(); }

    // Token t of layer l (this cache's ids start at id_base); `predicted` are the
    // staged experts (layer ids). Counters of tokens after the warm-up go to `pc`, the
    // counters of t's phase. A prefill batch passes each layer together: its tokens are
    // routed and their union requested when its last token arrives, and its loads count
    // when its first token does.
    void token(uint64_t t, uint32_t l, const LayerData & d, int32_t id_base, std::span<const int32_t> predicted,
               PhaseCounts & pc) {
        if (s_.batched[t]) {
            if (s_.batch_last[t]) {
                request_batch(s_.batch_first[t], t, l, d, id_base, pc);
            }
            return;
        }
        const bool counted = t >= opt_.warmup;
        if (!step_.reads_candidates() && predicted.empty() && id_base == 0) {  // most of a sweep: nothing but the policy
            const int misses = step_.request(d.unbiased_of(t, s_.k), {}, {});
            if (counted) {
                const int forced = d.forced[t];
                pc.picks += uint64_t(s_.k);
                pc.forced_misses += uint64_t(forced);
                pc.misses += uint64_t(misses);
                expose(l, uint64_t(misses + forced), pc);
            }
            return;
        }
        const std::span<const int32_t> chosen = route(t, d, id_base, counted, pc);
        const int forced = d.forced[t];
        if (counted) {
            pc.picks += uint64_t(s_.k);
            pc.forced_misses += uint64_t(forced);
        }
        uint64_t hidden = 0, loads = 0;
        if (!predicted.empty()) {
            size_t j = 0;
            uint64_t hit = 0;
            for (int32_t p : predicted) {
                const int32_t e = id_base + p;
                while (j < chosen.size() && chosen[j] < e) {
                    ++j;
                }
                const bool is_chosen = j < chosen.size() && chosen[j] == e;
                const bool is_resident = policy_->resident(e);
                hit += is_chosen;
                hidden += is_chosen && !is_resident;
                loads += !is_resident;
            }
            if (counted) {
                pc.predicted += predicted.size();
                pc.predicted_chosen += hit;
                pc.hidden += hidden;
                pc.prefetch_loads += loads;
                pc.prefetch_bytes += double(loads) * bytes(l);
            }
        }
        const int misses = step_.request(chosen, ranked_, d.logit_of(t));
        if (counted) {
            pc.misses += uint64_t(misses);
            expose(l, uint64_t(misses) - hidden + uint64_t(forced), pc);
        }
    }

private:

    double bytes(uint32_t l) const { return s_.expert_bytes.empty() ? 0.0 : s_.expert_bytes[l]; }

    void expose(uint32_t l, uint64_t exposed, PhaseCounts & pc) { count_exposed(s_, opt_, l, exposed, pc); }

    void request_batch(uint64_t first, uint64_t last, uint32_t l, const LayerData & d, int32_t id_base,
                       PhaseCounts & pc) {
        union_.clear();
        uint64_t forced = 0;
        for (uint64_t t = first; t <= last; ++t) {
            const bool counted = t >= opt_.warmup;
            for (int32_t e : route(t, d, id_base, counted, pc)) {
                if (in_union_[size_t(e)] != first + 1) {  // + 1: 0 marks no batch
                    in_union_[size_t(e)] = first + 1;
                    union_.push_back(e);
                }
            }
            forced += d.forced[t];
            if (counted) {
                pc.picks += uint64_t(s_.k);
                pc.forced_misses += d.forced[t];
            }
        }
        std::sort(union_.begin(), union_.end());
        uint64_t misses = 0;
        for (size_t i = 0; i < union_.size(); i += size_t(slots_)) {
            const size_t n = std::min(union_.size() - i, size_t(slots_));
            misses += uint64_t(policy_->access({std::span<const int32_t>(union_.data() + i, n), {}, {}}));
        }
        if (first >= opt_.warmup) {
            pc.misses += misses;
            expose(l, misses + forced, pc);
        }
    }

    // Token t's candidates and top-k as this cache's ids (layer ids + id_base), routed
    // by the shared step; ranked_ holds the candidates until the next call.
    std::span<const int32_t> route(uint64_t t, const LayerData & d, int32_t id_base, bool counted, PhaseCounts & pc) {
        const int k = s_.k;
        ranked_ = step_.reads_candidates() ? with_base(d.cand_of(t), id_base, ranked_buf_) : std::span<const int32_t>{};
        const bool moce = lambda_ > 0.0 && d.n_cand[t] > uint32_t(k);
        const double delta = !moce ? 0.0 : s_.moce_prior ? d.prior_delta[t] : double(d.logit(t)[0]) - double(d.logit(t)[k - 1]);
        return step_.choose(ranked_, d.logit_of(t), with_base(d.unbiased_of(t, k), id_base, unbiased_buf_), k, delta,
                            counted ? pc : uncounted_);
    }

    static std::span<const int32_t> with_base(std::span<const int32_t> ids, int32_t id_base, std::vector<int32_t> & buf) {
        if (id_base == 0) {
            return ids;
        }
        buf.assign(ids.begin(), ids.end());
        for (int32_t & e : buf) {
            e += id_base;
        }
        return buf;
    }

    const Setup & s_;
    const ReplayOptions & opt_;
    double lambda_;
    int slots_;
    std::unique_ptr<CachePolicy> policy_;
    RoutingStep step_;
    PhaseCounts uncounted_;   // MoCE's counts during the warm-up
    std::span<const int32_t> ranked_;
    std::vector<uint64_t> in_union_;   // per expert: 1 + first token of the batch whose union holds it
    std::vector<int32_t> ranked_buf_, unbiased_buf_, union_;
};

} // namespace moeprune::replay_impl
