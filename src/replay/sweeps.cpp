// The two sweeps over the trace: per-layer caches with layers in parallel, and one cache
// shared by all layers with configurations in parallel.
#include "replay/internal.h"
#include "replay/runner.h"
#include "core/parallel.h"

#include <algorithm>
#include <mutex>

namespace moeprune::replay_impl {

namespace {

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

// Requests depend on the cache size only where a prefill batch's union is split.
int future_key(const ReplayOptions & opt, int slots) { return opt.prefill_union > 0 ? slots : 0; }

// An ema-family policy routed without looking at the cache sees the same
// requests at every cache size: its scores and keys are computed once here.
std::map<std::string, KeySchedule> shared_key_schedules(const ReplayOptions & opt, const Setup & s,
                                                        const std::vector<Config> & configs,
                                                        const std::vector<char> & in_all_sizes, const LayerData & d) {
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
            const uint64_t n_tok = s.meta.size();
            schedules.emplace(policy, build_key_schedule(policy, s.n_expert, s.params, n_tok, [&](uint64_t t, bool & reset) {
                reset = session_resets_at(s, opt, t);
                if (!credits) {
                    return Request{d.unbiased_of(t, s.k), {}, {}};
                }
                return Request{d.unbiased_of(t, s.k), d.cand_of(t), d.logit_of(t)};
            }));
        }
    }
    return schedules;
}

} // namespace

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
    by_layer.assign(configs.size(), std::vector<uint64_t>(h.n_layer, 0));
    // Each layer's counts, summed in layer order once all are done: summed as threads
    // finish, the floating-point sums (moved_mass) would depend on the thread count.
    std::vector<std::vector<std::array<PhaseCounts, 2>>> per_layer(h.n_layer);
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
        const auto schedules = shared_key_schedules(opt, s, configs, in_all_sizes, d);
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
        for (size_t c = 0; c < configs.size(); ++c) {
            for (const PhaseCounts & pc : local[c]) {
                by_layer[c][l] += pc.misses + pc.forced_misses;
            }
        }
        per_layer[l] = std::move(local);
    });
    Counts counts(configs.size());
    for (const auto & layer : per_layer) {
        for (size_t c = 0; c < configs.size(); ++c) {
            counts[c][0].add(layer[c][0]);
            counts[c][1].add(layer[c][1]);
        }
    }
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

} // namespace moeprune::replay_impl
