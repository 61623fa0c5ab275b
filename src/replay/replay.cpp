#include "replay/replay.h"
#include "sim/moce.h"
#include "sim/routing.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/parallel.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "model/inspect.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

namespace moeprune {

using nlohmann::json;

PhaseCounts ReplayRecord::total() const {
    PhaseCounts t = prefill;
    t.add(decode);
    return t;
}

namespace {

// One layer's tokens after the keep map, ids renumbered as in the sliced model.
struct LayerData {
    uint32_t width = 0;                 // candidate slots kept per token
    std::vector<uint16_t> n_cand;       // survivors kept (<= width)
    // [t * width + i], best first; left unwritten past n_cand (a global replay holds
    // every layer's, and writing them twice showed in its time)
    std::unique_ptr<int32_t[]> cand_ids;
    std::unique_ptr<float[]> cand_logits;
    std::vector<uint8_t> n_unbiased;    // min(k, survivors)
    std::vector<int32_t> unbiased;      // [t * k + j], ascending
    std::vector<uint8_t> forced;        // k - n_unbiased
    std::vector<double> prior_delta;    // MoCE prior: running mean of z_0 - z_{k-1}

    std::span<const int32_t> unbiased_of(uint64_t t, int k) const {
        return {unbiased.data() + t * uint64_t(k), n_unbiased[t]};
    }
    int32_t * cand(uint64_t t) const { return cand_ids.get() + t * width; }
    float * logit(uint64_t t) const { return cand_logits.get() + t * width; }
    std::span<const int32_t> cand_of(uint64_t t) const { return {cand(t), n_cand[t]}; }
    std::span<const float> logit_of(uint64_t t) const { return {logit(t), n_cand[t]}; }
};

struct Config {
    std::string policy;
    std::optional<int> cache;
    std::optional<double> cache_mib;
    std::vector<int> slots;
    double lambda = 0;
};

// What every layer of the run shares.
struct Setup {
    const TraceSource * reader = nullptr;
    std::string origin;
    int k = 0, n_expert = 0;            // n_expert: per layer, after the keep map
    int j = 0;                          // MoCE's J
    uint32_t n_layer = 0;
    std::vector<std::vector<int32_t>> old_to_new;   // per layer; empty without a keep map
    bool keep_candidates = false;
    bool moce_prior = false;
    std::vector<TraceTokenMeta> meta;
    std::vector<uint64_t> batch_first;  // first token of t's prefill batch (t itself when alone)
    std::vector<char> batch_last;       // t ends its batch (or is alone)
    std::vector<char> batched;          // t belongs to a prefill batch
    std::vector<double> expert_bytes;   // per layer; empty when unknown
    PolicyParams params;                // the options', with the requests per token of this scope
};

LayerData load_layer(const Setup & s, uint32_t layer) {
    const TraceHeader & h = s.reader->header();
    const uint64_t n_tok = s.reader->n_tokens();
    const int k = s.k;
    LayerData d;
    d.width = s.keep_candidates ? h.top_m : 0;  // plain replays need only the unbiased top-k
    d.n_cand.assign(n_tok, 0);
    d.cand_ids = std::make_unique_for_overwrite<int32_t[]>(n_tok * d.width);
    d.cand_logits = std::make_unique_for_overwrite<float[]>(n_tok * d.width);
    d.n_unbiased.assign(n_tok, 0);
    d.unbiased.assign(n_tok * uint64_t(k), -1);
    d.forced.assign(n_tok, 0);
    if (s.moce_prior) {
        d.prior_delta.assign(n_tok, 0.0);
    }
    const std::vector<int32_t> * remap = s.old_to_new.empty() ? nullptr : &s.old_to_new[layer];
    MocePrior prior;
    s.reader->for_each_layer_chunk(layer, [&](uint64_t first, uint32_t n, const uint16_t * ids, const float * logits) {
        for (uint32_t i = 0; i < n; ++i) {
            const uint64_t t = first + i;
            int32_t * u = d.unbiased.data() + t * uint64_t(k);
            int32_t * cand = d.cand(t);
            float * logit = d.logit(t);
            uint32_t survivors = 0;
            float z0 = 0, zk = 0;
            for (uint32_t m = 0; m < h.top_m; ++m) {
                const float z = logits[size_t(i) * h.top_m + m];
                if (std::isnan(z)) {
                    fail_file(s.origin, fmt::format("NaN logit at token {} layer {} rank {}", t, layer, m));
                }
                const uint16_t old = ids[size_t(i) * h.top_m + m];
                const int32_t id = remap ? (*remap)[old] : int32_t(old);
                if (id < 0) {
                    continue;
                }
                if (survivors < d.width) {
                    cand[survivors] = id;
                    logit[survivors] = z;
                }
                if (survivors < uint32_t(k)) {
                    u[survivors] = id;
                    z0 = survivors == 0 ? z : z0;
                    zk = z;
                }
                ++survivors;
            }
            d.n_cand[t] = uint16_t(std::min(survivors, d.width));
            const uint32_t nu = std::min<uint32_t>(survivors, uint32_t(k));
            d.n_unbiased[t] = uint8_t(nu);
            d.forced[t] = uint8_t(uint32_t(k) - nu);
            std::sort(u, u + nu);
            if (s.moce_prior) {
                d.prior_delta[t] = survivors >= uint32_t(k) ? prior.add(double(z0) - double(zk)) : prior.value();
            }
        }
    });
    return d;
}

// Layer l's experts predicted from layer l-1's unbiased routing by co-occurrence counts
// of earlier tokens: [t * n + i] with n_pred[t] valid, ascending.
struct Predictions {
    int n = 0;
    std::vector<uint8_t> n_pred;
    std::vector<int32_t> ids;
    std::span<const int32_t> of(uint64_t t) const { return {ids.data() + t * uint64_t(n), n_pred[t]}; }
};

Predictions predict_layer(const LayerData & prev, const LayerData & cur, int k, int n_expert, int n_predict,
                          uint64_t train_tokens) {
    const uint64_t n_tok = cur.n_unbiased.size();
    Predictions p;
    p.n = n_predict;
    p.n_pred.assign(n_tok, 0);
    p.ids.assign(n_tok * uint64_t(n_predict), -1);
    std::vector<uint32_t> together(size_t(n_expert) * size_t(n_expert), 0);
    std::vector<uint64_t> score(static_cast<size_t>(n_expert));
    std::vector<int32_t> order;
    for (uint64_t t = 0; t < n_tok; ++t) {
        std::fill(score.begin(), score.end(), 0);
        for (int32_t a : prev.unbiased_of(t, k)) {
            const uint32_t * row = together.data() + size_t(a) * size_t(n_expert);
            for (int b = 0; b < n_expert; ++b) {
                score[size_t(b)] += row[b];
            }
        }
        order.clear();
        for (int b = 0; b < n_expert; ++b) {
            if (score[size_t(b)] > 0) {
                order.push_back(b);
            }
        }
        const size_t take = std::min(order.size(), size_t(n_predict));
        std::partial_sort(order.begin(), order.begin() + long(take), order.end(), [&](int32_t x, int32_t y) {
            return score[size_t(x)] != score[size_t(y)] ? score[size_t(x)] > score[size_t(y)] : x < y;
        });
        std::sort(order.begin(), order.begin() + long(take));
        std::copy_n(order.begin(), take, p.ids.begin() + long(t * uint64_t(n_predict)));
        p.n_pred[t] = uint8_t(take);
        if (train_tokens > 0 && t >= train_tokens) {
            continue;
        }
        for (int32_t a : prev.unbiased_of(t, k)) {
            for (int32_t b : cur.unbiased_of(t, k)) {
                ++together[size_t(a) * size_t(n_expert) + size_t(b)];
            }
        }
    }
    return p;
}

// What storage must serve for `exposed` experts of layer l in one request: reads in
// rounds of the queue depth.
void count_exposed(const Setup & s, const ReplayOptions & opt, uint32_t l, uint64_t exposed, PhaseCounts & pc) {
    pc.add_exposed_reads(exposed, opt.throughput.queue_depth, s.expert_bytes.empty() ? 0.0 : s.expert_bytes[l]);
}

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

// The requests an unbiased routing makes of one cache, for Belady: per layer
// (layers = {l}, id bases 0) or global (all layers, id base l * n_expert).
AccessSequence unbiased_requests(const Setup & s, const std::vector<const LayerData *> & layers, int slots) {
    AccessSequence seq;
    const bool global = layers.size() > 1;
    std::vector<std::vector<int32_t>> pending(layers.size());
    std::vector<int32_t> ids;
    const uint64_t n_tok = s.meta.size();
    for (uint64_t t = 0; t < n_tok; ++t) {
        for (size_t l = 0; l < layers.size(); ++l) {
            const int32_t base = global ? int32_t(l) * s.n_expert : 0;
            ids.clear();
            for (int32_t e : layers[l]->unbiased_of(t, s.k)) {
                ids.push_back(base + e);
            }
            if (!s.batched[t]) {
                seq.push(ids);
                continue;
            }
            pending[l].insert(pending[l].end(), ids.begin(), ids.end());
            if (s.batch_last[t]) {
                auto & u = pending[l];
                std::sort(u.begin(), u.end());
                u.erase(std::unique(u.begin(), u.end()), u.end());
                for (size_t i = 0; i < u.size(); i += size_t(slots)) {
                    seq.push(std::span<const int32_t>(u.data() + i, std::min(u.size() - i, size_t(slots))));
                }
                u.clear();
            }
        }
    }
    seq.index_next_uses(s.n_expert * int(layers.size()));
    return seq;
}

bool session_resets_at(const Setup & s, const ReplayOptions & opt, uint64_t t) {
    return opt.reset_on_session && t > 0 && s.meta[t].seq != s.meta[t - 1].seq;
}

size_t phase_index(const Setup & s, uint64_t t) { return s.meta[t].phase == TracePhase::Decode ? 1 : 0; }

// Configurations `members` of one stack-algorithm policy (policy.h's StackPolicy) in
// one pass over layer l: each token's chosen experts are requested once, and each
// configuration counts those at least as deep as its slots as misses, the counters a
// Runner keeps. Only where the requests do not depend on the cache: unbiased routing
// of single tokens (lambda 0, no prefill unions) without prefetch.
void replay_all_sizes(const Setup & s, const ReplayOptions & opt, uint32_t l, const LayerData & d,
                      const std::vector<Config> & configs, const std::vector<size_t> & members,
                      const AccessSequence * future, std::vector<std::array<PhaseCounts, 2>> & local) {
    const std::string & policy = configs[members.front()].policy;
    std::vector<int> slots;
    for (size_t c : members) {
        slots.push_back(configs[c].slots[l]);
    }
    const auto stack = make_stack_policy(policy, s.n_expert, *std::max_element(slots.begin(), slots.end()), s.params, future);
    const bool credits = policy_credits_candidates(policy);
    std::vector<int32_t> depth(size_t(s.k));
    for (uint64_t t = 0; t < s.meta.size(); ++t) {
        if (session_resets_at(s, opt, t)) {
            stack->reset();
        }
        const std::span<const int32_t> chosen = d.unbiased_of(t, s.k);
        stack->depths(credits ? Request{chosen, d.cand_of(t), d.logit_of(t)} : Request{chosen, {}, {}}, depth);
        if (t < opt.warmup) {
            continue;
        }
        const uint64_t forced = d.forced[t];
        for (size_t m = 0; m < members.size(); ++m) {
            uint64_t misses = 0;
            for (size_t j = 0; j < chosen.size(); ++j) {
                misses += depth[j] >= slots[m];
            }
            PhaseCounts & pc = local[members[m]][phase_index(s, t)];
            pc.picks += uint64_t(s.k);
            pc.forced_misses += forced;
            pc.misses += misses;
            count_exposed(s, opt, l, misses + forced, pc);
        }
    }
}

// A 4096 x 4096 table of u32 pair counts is 64 MiB per worker.
constexpr uint32_t kMaxPrefetchExperts = 4096;

// Trace layer l is the l-th MoE layer; a keep map names model layers, so its sorted
// layers are matched to trace layers in order (or through meta.moe_layers when the
// trace records them).
std::vector<int> model_layers_of_trace(const TraceHeader & h, const std::vector<int> & fallback) {
    if (h.meta.contains("moe_layers") && h.meta["moe_layers"].is_array()) {
        return h.meta["moe_layers"].get<std::vector<int>>();
    }
    return fallback;
}

std::vector<const std::vector<int32_t> *> keep_per_trace_layer(const KeepMap & km, const TraceHeader & h,
                                                               const std::string & origin) {
    std::vector<int> keep_layers;
    for (const auto & [layer, ids] : km.layers) {
        keep_layers.push_back(layer);
    }
    const std::vector<int> model_layers = model_layers_of_trace(h, keep_layers);
    if (model_layers.size() != h.n_layer) {
        fail_file(origin, fmt::format("covers {} layers but the trace has {} MoE layers", model_layers.size(), h.n_layer));
    }
    for (const auto & [layer, ids] : km.layers) {
        if (std::find(model_layers.begin(), model_layers.end(), layer) == model_layers.end()) {
            fail_file(origin, fmt::format("names layer {}, which is not one of the trace's MoE layers", layer));
        }
    }
    std::vector<const std::vector<int32_t> *> out;
    for (int l : model_layers) {
        const auto it = km.layers.find(l);
        if (it == km.layers.end()) {
            fail_file(origin, fmt::format("layer {} is missing; the trace records it", l));
        }
        out.push_back(&it->second);
    }
    return out;
}

// Bytes of one routed expert per trace layer, from the model's tensor types.
std::vector<double> expert_bytes_from_model(const GgufModel & model, const TraceHeader & h) {
    const std::filesystem::path & path = model.shard_paths().front();
    const InspectReport r = inspect_model(model, {});
    if (r.n_expert != int64_t(h.n_expert)) {
        fail_file(path.string(), fmt::format("has {} experts per layer but the trace has {}: another model", r.n_expert,
                                             h.n_expert));
    }
    std::map<int, uint64_t> bytes;
    for (const LayerInfo & li : r.layers) {
        bytes[li.layer] = li.expert_bytes;
    }
    const std::vector<int> layers = model_layers_of_trace(h, r.routed_layers());
    if (layers.size() != h.n_layer) {
        fail_file(path.string(), fmt::format("has {} MoE layers but the trace has {}", layers.size(), h.n_layer));
    }
    std::vector<double> out;
    for (int l : layers) {
        if (!bytes.count(l)) {
            fail_file(path.string(), fmt::format("has no routed experts in layer {}, which the trace records", l));
        }
        out.push_back(double(bytes[l]));
    }
    return out;
}

// The warm-up must leave tokens to count, caches must hold a token's k experts, and
// counts must not exceed what there is to cache.
std::vector<Config> make_configs(const ReplayOptions & opt, const Setup & s, json & skipped, bool & mixed_sizes,
                                 double & min_bytes, double & max_bytes) {
    std::vector<Config> out;
    const uint32_t L = s.n_layer;
    mixed_sizes = false;
    min_bytes = max_bytes = 0;
    if (!s.expert_bytes.empty()) {
        min_bytes = *std::min_element(s.expert_bytes.begin(), s.expert_bytes.end());
        max_bytes = *std::max_element(s.expert_bytes.begin(), s.expert_bytes.end());
        mixed_sizes = min_bytes != max_bytes;
    }
    const int max_slots = opt.global ? s.n_expert * int(L) : s.n_expert;
    std::vector<Config> sizes;
    for (int c : opt.caches) {
        if (c < s.k) {
            throw Error(fmt::format("cache of {} experts is smaller than k = {}: every token needs k resident at once",
                                    c, s.k));
        }
        if (c > max_slots) {
            throw Error(fmt::format("cache of {} experts is larger than the {} experts {}", c, max_slots,
                                    opt.global ? "of all layers together" : "per layer"));
        }
        sizes.push_back({"", c, std::nullopt, std::vector<int>(opt.global ? 1 : L, c), 0});
    }
    for (double mib : opt.cache_mib) {
        if (s.expert_bytes.empty()) {
            throw Error("--cache-mib needs the bytes of an expert: give --model or --expert-mb");
        }
        if (!(mib > 0) || !std::isfinite(mib)) {
            throw Error(fmt::format("--cache-mib must be positive and finite, got {}", mib));
        }
        const double budget = mib * 1048576.0;
        Config c{"", std::nullopt, mib, {}, 0};
        if (opt.global) {
            const double mean = std::accumulate(s.expert_bytes.begin(), s.expert_bytes.end(), 0.0) / double(L);
            c.slots = {int(std::min(double(max_slots), std::floor(budget / mean)))};
        } else {
            for (uint32_t l = 0; l < L; ++l) {
                c.slots.push_back(int(std::min(double(max_slots), std::floor(budget / s.expert_bytes[l]))));
            }
        }
        for (size_t l = 0; l < c.slots.size(); ++l) {
            if (c.slots[l] < s.k) {
                throw Error(fmt::format("a budget of {} MiB holds {} experts{}, fewer than k = {}", mib, c.slots[l],
                                        opt.global ? "" : fmt::format(" of layer {}", l), s.k));
            }
        }
        sizes.push_back(c);
    }
    for (const std::string & policy : opt.policies) {
        for (double lambda : opt.lambdas) {
            if (!(lambda >= 0.0) || !std::isfinite(lambda)) {
                throw Error(fmt::format("--lambda must be finite and >= 0, got {}", lambda));
            }
            if (lambda > 0 && policy_reads_future(policy)) {
                skipped.push_back({{"policy", policy}, {"lambda", lambda},
                                   {"why", "offline optimum needs routing that does not depend on the cache"}});
                continue;
            }
            for (Config c : sizes) {
                c.policy = policy;
                c.lambda = lambda;
                out.push_back(c);
            }
        }
    }
    return out;
}

} // namespace

namespace {

// Experts per token: --k, or the trace's meta.n_expert_used.
int experts_per_token(const ReplayOptions & opt, const TraceHeader & h, const std::string & origin) {
    int k = opt.k;
    if (k == 0) {
        if (!h.meta.contains("n_expert_used") || !h.meta["n_expert_used"].is_number_integer()) {
            fail_file(origin, "does not record n_expert_used in its meta; give --k");
        }
        const json & used = h.meta["n_expert_used"];
        if (used.is_number_unsigned() ? used.get<uint64_t>() > h.top_m : used.get<int64_t>() < 1) {
            fail_file(origin, fmt::format("meta.n_expert_used is {}, not from 1 to the top {} candidates the trace holds",
                                            used.dump(), h.top_m));
        }
        k = used.get<int>();
    }
    if (k <= 0 || uint32_t(k) > h.top_m || k > 255) {
        fail_file(origin, fmt::format("k = {} but the trace holds the top {} candidates per token", k, h.top_m));
    }
    return k;
}

void check_replay_options(const ReplayOptions & opt, const Setup & s, const TraceSource & reader) {
    const TraceHeader & h = reader.header();
    refuse_inert_moce(s.j, s.k, opt.lambdas);
    if (opt.warmup >= reader.n_tokens()) {
        fail_file(s.origin, fmt::format("has {} tokens, not more than the warm-up of {}: nothing would be counted",
                                        reader.n_tokens(), opt.warmup));
    }
    if (opt.moce != "prior" && opt.moce != "topk-gap") {
        throw Error(fmt::format("--moce must be prior or topk-gap, got \"{}\"", opt.moce));
    }
    if (opt.prefill_union < 0) {
        throw Error(fmt::format("--prefill-union must be >= 0, got {}", opt.prefill_union));
    }
    if (opt.throughput.queue_depth < 1 || !(opt.throughput.ssd_gbps > 0) || !std::isfinite(opt.throughput.ssd_gbps)) {
        throw Error("--queue-depth must be >= 1 and the SSD bandwidth positive and finite");
    }
    for (const auto & [flag, v] : {std::pair{"--read-latency-us", opt.throughput.read_latency_us},
                                   std::pair{"--compute-ms", opt.throughput.compute_ms},
                                   std::pair{"--sync-us", opt.throughput.sync_us}}) {
        if (!(v >= 0) || !std::isfinite(v)) {
            throw Error(fmt::format("{} must be a finite number >= 0, got {}", flag, v));
        }
    }
    // Below a kilobyte an "expert" is a typo, and budgets would hold more slots than an int.
    if (opt.expert_mb != 0 && (!(opt.expert_mb >= 1e-3) || !std::isfinite(opt.expert_mb))) {
        throw Error(fmt::format("--expert-mb must be a finite size of at least 0.001 (1 kB), got {}", opt.expert_mb));
    }
    if (opt.threads < 0 || opt.prefetch_n < 0) {
        throw Error("-t and --prefetch-n must be >= 0");
    }
    // Next-layer prefetch counts every pair of experts of adjacent layers in each worker.
    if (opt.prefetch && h.n_expert > kMaxPrefetchExperts) {
        fail_file(s.origin, fmt::format("has {} experts per layer; --prefetch counts expert pairs and supports up to {}",
                                        h.n_expert, kMaxPrefetchExperts));
    }
}

// The keep map (read here, or given read by the caller) checked against the trace, its
// survivors renumbered per trace layer as in the sliced model.
KeepMap apply_keep_map(const ReplayOptions & opt, const TraceHeader & h, Setup & s) {
    KeepMap km;
    s.n_expert = int(h.n_expert);
    if (opt.keep.empty() && !opt.keep_map) {
        return km;
    }
    km = opt.keep_map ? *opt.keep_map : read_keep_map(opt.keep);
    if (km.n_expert != 0 && km.n_expert != int64_t(h.n_expert)) {
        fail_file(opt.keep.string(), fmt::format("made for {} experts per layer, the trace has {}", km.n_expert,
                                                 h.n_expert));
    }
    km.n_expert = h.n_expert;
    validate_keep_map(km, opt.keep.string());  // now also ids against the trace's experts
    require_top_k_room(km, opt.keep.string(), s.k);
    for (const std::vector<int32_t> * ids : keep_per_trace_layer(km, h, opt.keep.string())) {
        std::vector<int32_t> m(h.n_expert, -1);
        for (size_t i = 0; i < ids->size(); ++i) {
            m[size_t((*ids)[i])] = int32_t(i);
        }
        s.old_to_new.push_back(std::move(m));
    }
    s.n_expert = int(km.k);
    return km;
}

// Prefill tokens grouped into batches of --prefill-union, within one sequence.
void mark_prefill_batches(const ReplayOptions & opt, Setup & s) {
    const uint64_t n_tok = s.meta.size();
    s.batch_first.resize(n_tok);
    s.batch_last.assign(n_tok, 1);
    s.batched.assign(n_tok, 0);
    for (uint64_t t = 0; t < n_tok; ++t) {
        s.batch_first[t] = t;
        if (opt.prefill_union == 0 || s.meta[t].phase != TracePhase::Prefill) {
            continue;
        }
        s.batched[t] = 1;
        const bool continues = t > 0 && s.batched[t - 1] && s.meta[t - 1].seq == s.meta[t].seq &&
                               t - s.batch_first[t - 1] < uint64_t(opt.prefill_union);
        if (continues) {
            s.batch_first[t] = s.batch_first[t - 1];
            s.batch_last[t - 1] = 0;
        }
    }
}

// The configurations of each stack-algorithm policy whose requests do not depend on
// the cache, where enough sizes share one pass (per-layer caches). The pass scans
// the stack down to each chosen expert, as deep as the largest size, about as long
// as one heap update per 32 positions measures (bench/replay.sh): a few sizes far
// apart (thousands of storage objects) run faster one cache each.
std::map<std::string, std::vector<size_t>> stack_passes(const ReplayOptions & opt, const std::vector<Config> & configs,
                                                        int n_predict) {
    std::map<std::string, std::vector<size_t>> all_sizes;
    if (!opt.global && opt.prefill_union == 0 && n_predict == 0) {
        for (size_t c = 0; c < configs.size(); ++c) {
            if (configs[c].lambda == 0.0 && policy_is_stack_algorithm(configs[c].policy)) {
                all_sizes[configs[c].policy].push_back(c);
            }
        }
        std::erase_if(all_sizes, [&](const auto & group) {
            int largest = 0;
            for (size_t c : group.second) {
                largest = std::max(largest, *std::max_element(configs[c].slots.begin(), configs[c].slots.end()));
            }
            return group.second.size() < 2 || size_t(largest) > 32 * group.second.size();
        });
    }
    return all_sizes;
}

using Counts = std::vector<std::array<PhaseCounts, 2>>;  // [config][phase]
using LayerMisses = std::vector<std::vector<uint64_t>>;  // [config][layer]: misses and forced, both phases

// Requests depend on the cache size only where a prefill batch's union is split.
int future_key(const ReplayOptions & opt, int slots) { return opt.prefill_union > 0 ? slots : 0; }

// Per-layer caches: layers in parallel, each configuration through every token of a
// layer before the next.
Counts replay_per_layer(const ReplayOptions & opt, const Setup & s, const std::vector<Config> & configs, int n_predict,
                        LayerMisses & by_layer) {
    const TraceHeader & h = s.reader->header();
    const uint64_t n_tok = s.meta.size();
    const bool offline = std::any_of(configs.begin(), configs.end(), [](const Config & c) {
        return policy_reads_future(c.policy);
    });
    const auto session_reset = [&](uint64_t t) { return session_resets_at(s, opt, t); };
    const auto all_sizes = stack_passes(opt, configs, n_predict);
    std::vector<char> in_all_sizes(configs.size(), 0);
    for (const auto & [policy, members] : all_sizes) {
        for (size_t c : members) {
            in_all_sizes[c] = 1;
        }
    }
    Counts counts(configs.size());
    by_layer.assign(configs.size(), std::vector<uint64_t>(h.n_layer, 0));
    std::mutex counts_mutex;
    run_parallel(h.n_layer, opt.threads, [&](unsigned l) {
        const LayerData d = load_layer(s, l);
        Predictions pred;
        if (n_predict > 0 && l > 0) {
            pred = predict_layer(load_layer(s, l - 1), d, s.k, s.n_expert, n_predict, opt.prefetch_train);
        }
        std::map<int, AccessSequence> futures;
        if (offline) {
            for (const Config & c : configs) {
                if (policy_reads_future(c.policy) && !futures.count(future_key(opt, c.slots[l]))) {
                    futures.emplace(future_key(opt, c.slots[l]), unbiased_requests(s, {&d}, c.slots[l]));
                }
            }
        }
        // An ema-family policy routed without looking at the cache sees the same
        // requests at every cache size: its scores and keys are computed once here.
        std::map<std::string, KeySchedule> schedules;
        if (opt.prefill_union == 0) {
            std::map<std::string, int> sizes;
            for (size_t c = 0; c < configs.size(); ++c) {
                sizes[configs[c].policy] += configs[c].lambda == 0.0 && !in_all_sizes[c] &&
                                            policy_takes_key_schedule(configs[c].policy);
            }
            for (const auto & [policy, n] : sizes) {
                if (n < 2) {
                    continue;
                }
                const bool credits = policy_credits_candidates(policy);
                schedules.emplace(policy, build_key_schedule(policy, s.n_expert, s.params, n_tok, [&](uint64_t t, bool & reset) {
                    reset = session_reset(t);
                    if (!credits) {
                        return Request{d.unbiased_of(t, s.k), {}, {}};
                    }
                    return Request{d.unbiased_of(t, s.k), d.cand_of(t), d.logit_of(t)};
                }));
            }
        }
        std::vector<std::array<PhaseCounts, 2>> local(configs.size());
        for (const auto & [policy, members] : all_sizes) {
            const auto f = futures.find(0);
            replay_all_sizes(s, opt, l, d, configs, members, f == futures.end() ? nullptr : &f->second, local);
        }
        // One configuration through every token before the next: its cache state stays
        // in the core's own caches while the layer's requests stream past.
        for (size_t c = 0; c < configs.size(); ++c) {
            if (in_all_sizes[c]) {
                continue;
            }
            const auto f = futures.find(future_key(opt, configs[c].slots[l]));
            const auto ks = configs[c].lambda == 0.0 ? schedules.find(configs[c].policy) : schedules.end();
            Runner runner(s, opt, configs[c], configs[c].slots[l], f == futures.end() ? nullptr : &f->second, s.n_expert,
                          ks == schedules.end() ? nullptr : &ks->second);
            for (uint64_t t = 0; t < n_tok; ++t) {
                if (session_reset(t)) {
                    runner.reset();
                }
                const std::span<const int32_t> predicted =
                    pred.n && !s.batched[t] ? pred.of(t) : std::span<const int32_t>{};
                runner.token(t, l, d, 0, predicted, local[c][phase_index(s, t)]);
            }
        }
        std::lock_guard<std::mutex> lock(counts_mutex);
        for (size_t c = 0; c < configs.size(); ++c) {
            counts[c][0].add(local[c][0]);
            counts[c][1].add(local[c][1]);
            for (const PhaseCounts & pc : local[c]) {
                by_layer[c][l] += pc.misses + pc.forced_misses;
            }
        }
    });
    return counts;
}

// One cache shared by all layers: configurations in parallel, each through every token
// and layer.
Counts replay_global(const ReplayOptions & opt, const Setup & s, const std::vector<Config> & configs, int n_predict) {
    const TraceHeader & h = s.reader->header();
    const uint64_t n_tok = s.meta.size();
    const auto session_reset = [&](uint64_t t) { return session_resets_at(s, opt, t); };
    Counts counts(configs.size());
    std::mutex counts_mutex;
    std::vector<LayerData> layers(h.n_layer);
    run_parallel(h.n_layer, opt.threads, [&](unsigned l) { layers[l] = load_layer(s, l); });
    std::vector<Predictions> preds(h.n_layer);
    if (n_predict > 0) {
        run_parallel(h.n_layer - 1, opt.threads, [&](unsigned i) {
            preds[i + 1] = predict_layer(layers[i], layers[i + 1], s.k, s.n_expert, n_predict, opt.prefetch_train);
        });
    }
    std::vector<const LayerData *> all;
    for (const LayerData & d : layers) {
        all.push_back(&d);
    }
    std::map<int, AccessSequence> futures;
    for (const Config & c : configs) {
        if (policy_reads_future(c.policy) && !futures.count(future_key(opt, c.slots[0]))) {
            futures.emplace(future_key(opt, c.slots[0]), unbiased_requests(s, all, c.slots[0]));
        }
    }
    run_parallel(unsigned(configs.size()), opt.threads, [&](unsigned c) {
        const auto f = futures.find(future_key(opt, configs[c].slots[0]));
        Runner runner(s, opt, configs[c], configs[c].slots[0], f == futures.end() ? nullptr : &f->second, s.n_expert * int(h.n_layer));
        std::array<PhaseCounts, 2> local{};
        for (uint64_t t = 0; t < n_tok; ++t) {
            if (session_reset(t)) {
                runner.reset();
            }
            for (uint32_t l = 0; l < h.n_layer; ++l) {
                // Each layer's rows are a stream of their own, 48 apart: fetched a
                // token ahead, a credit of candidates does not wait for them.
                if (layers[l].width > 0 && t + 1 < n_tok) {
                    for (uint32_t i = 0; i < layers[l].width; i += 16) {
                        __builtin_prefetch(layers[l].cand(t + 1) + i);
                        __builtin_prefetch(layers[l].logit(t + 1) + i);
                    }
                }
                const std::span<const int32_t> predicted =
                    preds[l].n && !s.batched[t] ? preds[l].of(t) : std::span<const int32_t>{};
                runner.token(t, l, layers[l], int32_t(l) * s.n_expert, predicted,
                             local[phase_index(s, t)]);
            }
        }
        std::lock_guard<std::mutex> lock(counts_mutex);
        counts[c][0].add(local[0]);
        counts[c][1].add(local[1]);
    });
    return counts;
}

std::vector<ReplayRecord> records_of(const ReplayOptions & opt, const Setup & s, const std::vector<Config> & configs,
                                     const Counts & counts, const LayerMisses & by_layer) {
    const TraceHeader & h = s.reader->header();
    const uint64_t n_tok = s.meta.size();
    std::vector<ReplayRecord> records;
    for (size_t c = 0; c < configs.size(); ++c) {
        ReplayRecord rec;
        rec.policy = configs[c].policy;
        rec.cache = configs[c].cache;
        rec.cache_mib = configs[c].cache_mib;
        rec.slots = configs[c].slots;
        rec.lambda = configs[c].lambda;
        rec.cliff = opt.global && rec.slots[0] < int(h.n_layer) * s.k;
        rec.prefill = counts[c][0];
        rec.decode = counts[c][1];
        rec.prefill.tokens = rec.decode.tokens = 0;
        for (uint64_t t = opt.warmup; t < n_tok; ++t) {
            ++(phase_index(s, t) ? rec.decode : rec.prefill).tokens;
        }
        if (!by_layer.empty()) {
            rec.missed_by_layer = by_layer[c];
        }
        records.push_back(std::move(rec));
    }
    return records;
}

} // namespace

ReplayReport run_replay(const ReplayOptions & opt, const std::vector<std::filesystem::path> & outputs) {
    std::optional<GgufModel> model;
    std::vector<std::filesystem::path> inputs{opt.trace, opt.keep};
    if (!opt.model.empty()) {
        model = GgufModel::open(opt.model);
        inputs.insert(inputs.end(), model->shard_paths().begin(), model->shard_paths().end());
    }
    refuse_output_clashes(outputs, inputs);
    std::optional<TraceReader> file;
    if (!opt.trace_source) {
        file.emplace(TraceReader::open(opt.trace));
    }
    const TraceSource & reader = opt.trace_source ? *opt.trace_source : *file;
    const TraceHeader & h = reader.header();
    Setup s;
    s.reader = &reader;
    s.origin = opt.trace_source ? std::string("the base pass's trace") : opt.trace.string();
    s.n_layer = h.n_layer;
    s.k = experts_per_token(opt, h, s.origin);
    s.j = moce_j(opt.j, s.k);
    if (s.j < 0) {
        throw Error(fmt::format("--j must be >= 0, got {}", s.j));
    }
    check_replay_options(opt, s, reader);
    const KeepMap km = apply_keep_map(opt, h, s);
    if (!opt.model.empty()) {
        s.expert_bytes = expert_bytes_from_model(*model, h);
    } else if (opt.expert_mb > 0) {
        s.expert_bytes.assign(h.n_layer, opt.expert_mb * 1e6);
    }
    s.params = opt.params;
    s.params.requests_per_token = opt.global ? int(h.n_layer) : 1;
    const bool any_moce = std::any_of(opt.lambdas.begin(), opt.lambdas.end(), [](double l) { return l > 0; });
    s.keep_candidates = any_moce || std::any_of(opt.policies.begin(), opt.policies.end(), policy_credits_candidates);
    s.moce_prior = any_moce && opt.moce == "prior";

    json skipped = json::array();
    bool mixed_sizes = false;
    double min_bytes = 0, max_bytes = 0;
    const std::vector<Config> configs = make_configs(opt, s, skipped, mixed_sizes, min_bytes, max_bytes);
    AccessSequence no_future;
    no_future.index_next_uses(1);
    for (const Config & c : configs) {
        make_policy(c.policy, s.n_expert, c.slots[0], s.params, &no_future);  // bad names and knobs fail before any work
    }
    s.meta = reader.token_meta();
    mark_prefill_batches(opt, s);
    const int n_predict = opt.prefetch ? (opt.prefetch_n > 0 ? opt.prefetch_n : s.k) : 0;
    if (n_predict > 255) {
        throw Error(fmt::format("--prefetch-n {} is more than 255", n_predict));
    }
    LayerMisses by_layer;
    const Counts counts =
        opt.global ? replay_global(opt, s, configs, n_predict) : replay_per_layer(opt, s, configs, n_predict, by_layer);

    ReplayReport rep;
    rep.n_layer = int(h.n_layer);
    rep.trace_tokens = reader.n_tokens();
    rep.k = s.k;
    rep.records = records_of(opt, s, configs, counts, by_layer);
    rep.bytes_known = !s.expert_bytes.empty();
    rep.inputs = {{"trace", opt.trace_source ? json(nullptr) : json(opt.trace.string())},
                  {"trace_format", reader.format()},
                  {"trace_tokens", reader.n_tokens()},
                  {"trace_meta", h.meta},
                  {"n_layer", h.n_layer},
                  {"n_expert", h.n_expert},
                  {"top_m", h.top_m},
                  {"k", s.k},
                  {"keep", opt.keep.empty() ? json() : json(opt.keep.string())},
                  {"keep_digest", opt.keep.empty() ? json() : json(keep_map_digest(km))},
                  {"n_expert_after_keep", s.n_expert},
                  {"warmup", opt.warmup},
                  {"reset_on_session", opt.reset_on_session},
                  {"prefill_union", opt.prefill_union},
                  {"cache_scope", opt.global ? "global" : "per-layer"},
                  {"policy_params", to_json(opt.params)},
                  {"moce", {{"mode", opt.moce}, {"j", s.j}, {"lambdas", opt.lambdas}}},
                  {"prefetch", opt.prefetch ? json{{"mode", "next-layer"}, {"n", n_predict}, {"train", opt.prefetch_train}}
                                            : json()},
                  {"skipped", skipped}};
    if (rep.bytes_known) {
        rep.inputs["expert_bytes"] = s.expert_bytes;
        rep.inputs["expert_bytes_source"] = opt.model.empty() ? fmt::format("--expert-mb {}", opt.expert_mb)
                                                              : opt.model.string();
        if (opt.global && mixed_sizes) {
            rep.inputs["global_slots_note"] =
                fmt::format("slots from the mean expert size; layers' experts range from {} to {} bytes", min_bytes,
                            max_bytes);
        }
        rep.inputs["throughput"] = to_json(opt.throughput);
        rep.inputs["throughput"]["model"] = "docs/replay.md#throughput-model";
    }
    rep.throughput = opt.throughput;
    return rep;
}

namespace {

json counts_json(const PhaseCounts & c, int n_layer, const ReplayReport & r) {
    const double missed = double(c.misses + c.forced_misses);
    const double chosen = double(c.picks - c.forced_misses);
    json j = {{"tokens", c.tokens},
              {"picks", c.picks},
              {"misses", c.misses},
              {"forced_misses", c.forced_misses},
              {"misses_per_token", c.tokens ? missed / double(c.tokens) : 0.0},
              {"misses_per_token_per_layer", c.tokens ? missed / double(c.tokens) / n_layer : 0.0},
              {"hit_rate", c.picks ? 1.0 - missed / double(c.picks) : 0.0},
              {"swap_rate", c.picks ? double(c.swaps) / double(c.picks) : 0.0},
              {"moved_mass", c.tokens ? c.moved_mass / (double(c.tokens) * n_layer) : 0.0}};
    if (c.predicted > 0 || r.inputs.value("prefetch", json()).is_object()) {
        j["prefetch"] = {{"predicted", c.predicted},
                         {"precision", c.predicted ? double(c.predicted_chosen) / double(c.predicted) : 0.0},
                         {"recall", chosen > 0 ? double(c.predicted_chosen) / chosen : 0.0},
                         {"hidden", c.hidden},
                         {"prefetch_loads", c.prefetch_loads}};
    }
    if (r.bytes_known) {
        j["read_bytes_per_token"] = c.tokens ? c.exposed_bytes / double(c.tokens) : 0.0;
        j["read_rounds_per_token"] = c.tokens ? double(c.rounds) / double(c.tokens) : 0.0;
        j["tokens_per_s"] = tokens_per_second(c, n_layer, r.throughput);
    }
    return j;
}

std::string cache_label(const ReplayRecord & rec) {
    return rec.cache ? fmt::format("{}", *rec.cache) : fmt::format("{}MiB", *rec.cache_mib);
}

} // namespace

json to_json(const ReplayReport & r) {
    json records = json::array();
    for (const ReplayRecord & rec : r.records) {
        json j = counts_json(rec.total(), r.n_layer, r);
        j["policy"] = rec.policy;
        j["cache"] = rec.cache ? json(*rec.cache) : json();
        j["cache_mib"] = rec.cache_mib ? json(*rec.cache_mib) : json();
        j["slots"] = rec.slots;
        j["lambda"] = rec.lambda;
        j["j"] = r.inputs["moce"]["j"];
        if (r.inputs["cache_scope"] == "global") {
            j["cliff"] = rec.cliff;
        }
        if (!rec.missed_by_layer.empty()) {
            const double tokens = double(rec.total().tokens);
            json per_layer = json::array();
            for (const uint64_t m : rec.missed_by_layer) {
                per_layer.push_back(tokens > 0 ? double(m) / tokens : 0.0);
            }
            j["misses_per_token_by_layer"] = per_layer;
        }
        j["prefill"] = counts_json(rec.prefill, r.n_layer, r);
        j["decode"] = counts_json(rec.decode, r.n_layer, r);
        records.push_back(j);
    }
    return {{"format", "moeprune-replay"}, {"version", 2}, {"inputs", r.inputs}, {"records", records}};
}

std::string to_text(const ReplayReport & r) {
    std::string s = fmt::format("{} tokens x {} layers, k = {}, {} caches; misses per token count all layers\n",
                                r.trace_tokens, r.n_layer, r.k, r.inputs["cache_scope"].get<std::string>());
    if (r.bytes_known) {
        const ThroughputParams & p = r.throughput;
        const auto bytes = r.inputs["expert_bytes"].get<std::vector<double>>();
        s += fmt::format("throughput model: {} GB/s, {} us per read round, queue depth {}, compute {} ms/token, "
                         "sync {} us/layer; one expert is {:.0f}..{:.0f} bytes ({})\n",
                         p.ssd_gbps, p.read_latency_us, p.queue_depth, p.compute_ms, p.sync_us,
                         *std::min_element(bytes.begin(), bytes.end()), *std::max_element(bytes.begin(), bytes.end()),
                         r.inputs["expert_bytes_source"].get<std::string>());
    }
    s += fmt::format("{:<19} {:>9} {:>6} {:>10} {:>12} {:>9} {:>13} {:>9} {:>7}", "policy", "cache", "lambda", "tokens",
                     "misses", "forced", "misses/token", "hit rate", "swaps");
    s += r.bytes_known ? fmt::format(" {:>9}\n", "tokens/s") : "\n";
    for (const ReplayRecord & rec : r.records) {
        const PhaseCounts c = rec.total();
        const json j = counts_json(c, r.n_layer, r);
        s += fmt::format("{:<19} {:>9} {:>6} {:>10} {:>12} {:>9} {:>13.3f} {:>9.4f} {:>7.4f}", rec.policy,
                         cache_label(rec) + (rec.cliff ? "!" : ""), rec.lambda, c.tokens, c.misses, c.forced_misses,
                         j["misses_per_token"].get<double>(), j["hit_rate"].get<double>(), j["swap_rate"].get<double>());
        s += r.bytes_known ? fmt::format(" {:>9.2f}\n", j["tokens_per_s"].get<double>()) : "\n";
    }
    if (std::any_of(r.records.begin(), r.records.end(), [](const ReplayRecord & x) { return x.cliff; })) {
        s += "! below the cliff: the shared cache holds fewer experts than one token needs across all layers\n";
    }
    for (const json & skip : r.inputs["skipped"]) {
        s += fmt::format("skipped {} at lambda {}: {}\n", skip["policy"].get<std::string>(), skip["lambda"].get<double>(),
                         skip["why"].get<std::string>());
    }
    return s;
}

std::string to_csv(const ReplayReport & r) {
    std::string s = "policy,cache,cache_mib,lambda,j,phase,tokens,picks,misses,forced_misses,misses_per_token,hit_rate,"
                    "swap_rate,moved_mass,prefetch_precision,prefetch_recall,prefetch_hidden,tokens_per_s\n";
    for (const ReplayRecord & rec : r.records) {
        for (const auto & [phase, c] : {std::pair<const char *, PhaseCounts>{"all", rec.total()},
                                        {"prefill", rec.prefill}, {"decode", rec.decode}}) {
            const json j = counts_json(c, r.n_layer, r);
            const json pf = j.value("prefetch", json::object());
            s += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", rec.policy,
                             rec.cache ? fmt::format("{}", *rec.cache) : "",
                             rec.cache_mib ? fmt::format("{}", *rec.cache_mib) : "", rec.lambda,
                             r.inputs["moce"]["j"].get<int>(), phase, c.tokens, c.picks, c.misses, c.forced_misses,
                             j["misses_per_token"].get<double>(), j["hit_rate"].get<double>(),
                             j["swap_rate"].get<double>(), j["moved_mass"].get<double>(),
                             pf.contains("precision") ? fmt::format("{}", pf["precision"].get<double>()) : "",
                             pf.contains("recall") ? fmt::format("{}", pf["recall"].get<double>()) : "",
                             pf.contains("hidden") ? fmt::format("{}", pf["hidden"].get<uint64_t>()) : "",
                             r.bytes_known ? fmt::format("{}", j["tokens_per_s"].get<double>()) : "");
        }
    }
    return s;
}

} // namespace moeprune
