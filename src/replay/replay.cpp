#include "replay/replay.h"
#include "core/errors.h"
#include "formats/keep_map.h"
#include "formats/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <thread>

namespace moeprune {

using nlohmann::json;

PhaseCounts ReplayRecord::total() const {
    return {prefill.tokens + decode.tokens, prefill.picks + decode.picks, prefill.misses + decode.misses,
            prefill.forced_misses + decode.forced_misses};
}

static json phase_json(const PhaseCounts & c, int n_layer) {
    // Per token means per token of the whole model: all layers' misses together.
    const double per_token = c.tokens ? double(c.misses + c.forced_misses) / double(c.tokens) : 0.0;
    const double hit_rate = c.picks ? 1.0 - double(c.misses + c.forced_misses) / double(c.picks) : 0.0;
    return {{"tokens", c.tokens}, {"picks", c.picks}, {"misses", c.misses}, {"forced_misses", c.forced_misses},
            {"misses_per_token", per_token}, {"misses_per_token_per_layer", n_layer ? per_token / n_layer : 0.0},
            {"hit_rate", hit_rate}};
}

namespace {

// Trace layer l is the l-th MoE layer; a keep map names model layers, so its sorted
// layers are matched to trace layers in order (or through meta.moe_layers when the
// trace records them).
std::vector<const std::vector<int32_t> *> keep_per_trace_layer(const KeepMap & km, const TraceHeader & h,
                                                               const std::string & origin) {
    std::vector<int> model_layers;
    if (h.meta.contains("moe_layers") && h.meta["moe_layers"].is_array()) {
        model_layers = h.meta["moe_layers"].get<std::vector<int>>();
    } else {
        for (const auto & [layer, ids] : km.layers) {
            model_layers.push_back(layer);
        }
    }
    if (model_layers.size() != h.n_layer) {
        fail_file(origin, fmt::format("covers {} layers but the trace has {} MoE layers", model_layers.size(), h.n_layer));
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

// Each token's top-k among the candidates the keep map leaves (ids renumbered as in
// the sliced model, ascending as CachePolicy::access expects), read a chunk at a time;
// `forced` gets the slots the top-M could not fill.
std::vector<std::vector<int32_t>> choose_per_token(const TraceReader & reader, int k, const std::vector<int32_t> * keep,
                                                   uint32_t layer, const std::string & origin, std::vector<int> & forced) {
    const TraceHeader & h = reader.header();
    std::vector<int32_t> old_to_new(h.n_expert, -1);
    for (uint32_t e = 0; e < h.n_expert; ++e) {
        old_to_new[e] = keep ? -1 : int32_t(e);
    }
    if (keep) {
        for (size_t i = 0; i < keep->size(); ++i) {
            old_to_new[size_t((*keep)[i])] = int32_t(i);
        }
    }
    std::vector<std::vector<int32_t>> chosen(reader.n_tokens());
    forced.assign(reader.n_tokens(), 0);
    reader.for_each_layer_chunk(layer, [&](uint64_t first, uint32_t n, const uint16_t * ids, const float * logits) {
        for (uint32_t i = 0; i < n; ++i) {
            const uint64_t t = first + i;
            auto & c = chosen[t];
            c.reserve(size_t(k));
            for (uint32_t m = 0; m < h.top_m && c.size() < size_t(k); ++m) {
                if (std::isnan(logits[size_t(i) * h.top_m + m])) {
                    fail_file(origin, fmt::format("NaN logit at token {} layer {} rank {}", t, layer, m));
                }
                const int32_t id = old_to_new[ids[size_t(i) * h.top_m + m]];
                if (id >= 0) {
                    c.push_back(id);
                }
            }
            forced[t] = k - int(c.size());
            std::sort(c.begin(), c.end());
        }
    });
    return chosen;
}

} // namespace

ReplayReport run_replay(const ReplayOptions & opt) {
    const TraceReader reader = TraceReader::open(opt.trace);
    const TraceHeader & h = reader.header();
    const std::string trace_origin = opt.trace.string();
    ReplayReport rep;
    rep.n_layer = int(h.n_layer);
    rep.trace_tokens = reader.n_tokens();
    rep.k = opt.k;
    if (rep.k == 0) {
        if (!h.meta.contains("n_expert_used") || !h.meta["n_expert_used"].is_number_integer()) {
            fail_file(trace_origin, "does not record n_expert_used in its meta; give --k");
        }
        rep.k = h.meta["n_expert_used"].get<int>();
    }
    if (rep.k <= 0 || uint32_t(rep.k) > h.top_m) {
        fail_file(trace_origin, fmt::format("k = {} but the trace holds the top {} candidates per token", rep.k, h.top_m));
    }
    for (int c : opt.caches) {
        if (c < rep.k) {
            throw Error(fmt::format("cache of {} experts is smaller than k = {}: every token needs k resident at once",
                                    c, rep.k));
        }
    }
    if (opt.warmup >= reader.n_tokens()) {
        fail_file(trace_origin, fmt::format("has {} tokens, not more than the warm-up of {}: nothing would be counted",
                                            reader.n_tokens(), opt.warmup));
    }
    KeepMap km;
    std::vector<const std::vector<int32_t> *> keep;
    if (!opt.keep.empty()) {
        km = read_keep_map(opt.keep);
        if (km.n_expert != 0 && km.n_expert != int64_t(h.n_expert)) {
            fail_file(opt.keep.string(), fmt::format("made for {} experts per layer, the trace has {}", km.n_expert,
                                                     h.n_expert));
        }
        km.n_expert = h.n_expert;
        validate_keep_map(km, opt.keep.string());  // now also ids against the trace's experts
        keep = keep_per_trace_layer(km, h, opt.keep.string());
    }

    const std::vector<TraceTokenMeta> meta = reader.token_meta();
    const size_t n_tok = meta.size();
    for (const auto & policy : opt.policies) {
        for (int c : opt.caches) {
            rep.records.push_back({policy, c, {}, {}});
        }
    }
    const int n_expert = keep.empty() ? int(h.n_expert) : int(km.k);
    for (const ReplayRecord & rec : rep.records) {
        const AccessSequence none({}, 1, true);
        make_policy(rec.policy, 1, 1, opt.params, &none);  // unknown names fail before any work
        if (rec.cache > n_expert) {
            throw Error(fmt::format("cache of {} experts is larger than the {} experts per layer{}", rec.cache, n_expert,
                                    keep.empty() ? "" : " the keep map leaves"));
        }
    }

    const bool offline = std::any_of(rep.records.begin(), rep.records.end(),
                                     [](const ReplayRecord & r) { return r.policy == "belady"; });
    // Layers are independent caches: each worker takes whole layers and advances every
    // configuration in one pass over that layer's tokens.
    std::vector<std::vector<ReplayRecord>> per_layer(h.n_layer, rep.records);
    std::atomic<uint32_t> next_layer{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    const auto worker = [&] {
        for (uint32_t l = next_layer++; l < h.n_layer; l = next_layer++) {
            try {
                std::vector<int> forced;
                const AccessSequence seq(choose_per_token(reader, rep.k, keep.empty() ? nullptr : keep[l], l, trace_origin,
                                                          forced),
                                         n_expert, offline);
                const auto & chosen = seq.chosen;
                std::vector<std::unique_ptr<CachePolicy>> policies;
                for (const ReplayRecord & rec : per_layer[l]) {
                    policies.push_back(make_policy(rec.policy, n_expert, rec.cache, opt.params, &seq));
                }
                for (size_t t = 0; t < n_tok; ++t) {
                    const bool reset = opt.reset_on_session && t > 0 && meta[t].seq != meta[t - 1].seq;
                    const bool counted = t >= opt.warmup;
                    for (size_t c = 0; c < policies.size(); ++c) {
                        if (reset) {
                            policies[c]->reset();
                        }
                        const int misses = policies[c]->access(chosen[t]);
                        if (counted) {
                            PhaseCounts & pc = meta[t].phase == TracePhase::Decode ? per_layer[l][c].decode
                                                                                  : per_layer[l][c].prefill;
                            pc.picks += uint64_t(rep.k);
                            pc.misses += uint64_t(misses);
                            pc.forced_misses += uint64_t(forced[t]);
                        }
                    }
                }
            } catch (...) {
                std::lock_guard<std::mutex> lock(failure_mutex);
                if (!failure) {
                    failure = std::current_exception();
                }
                return;
            }
        }
    };
    const unsigned n_threads = std::max(1u, std::min<unsigned>(opt.threads > 0 ? unsigned(opt.threads)
                                                                                : std::thread::hardware_concurrency(),
                                                               h.n_layer));
    std::vector<std::thread> pool;
    for (unsigned i = 1; i < n_threads; ++i) {
        pool.emplace_back(worker);
    }
    worker();
    for (auto & th : pool) {
        th.join();
    }
    if (failure) {
        std::rethrow_exception(failure);
    }
    for (size_t t = opt.warmup; t < n_tok; ++t) {
        for (ReplayRecord & rec : rep.records) {
            ++(meta[t].phase == TracePhase::Decode ? rec.decode : rec.prefill).tokens;
        }
    }
    for (uint32_t l = 0; l < h.n_layer; ++l) {
        for (size_t c = 0; c < rep.records.size(); ++c) {
            for (auto [dst, src] : {std::pair{&rep.records[c].prefill, &per_layer[l][c].prefill},
                                    std::pair{&rep.records[c].decode, &per_layer[l][c].decode}}) {
                dst->picks += src->picks;
                dst->misses += src->misses;
                dst->forced_misses += src->forced_misses;
            }
        }
    }

    rep.inputs = {{"trace", opt.trace.string()},
                  {"trace_format", reader.format()},
                  {"trace_tokens", reader.n_tokens()},
                  {"trace_meta", h.meta},
                  {"n_layer", h.n_layer},
                  {"n_expert", h.n_expert},
                  {"top_m", h.top_m},
                  {"k", rep.k},
                  {"keep", opt.keep.empty() ? json() : json(opt.keep.string())},
                  {"keep_digest", opt.keep.empty() ? json() : json(keep_map_digest(km))},
                  {"warmup", opt.warmup},
                  {"reset_on_session", opt.reset_on_session},
                  {"ema_decay", opt.params.ema_decay},
                  {"cache_scope", "per-layer"}};
    return rep;
}

json to_json(const ReplayReport & r) {
    json records = json::array();
    for (const ReplayRecord & rec : r.records) {
        json j = phase_json(rec.total(), r.n_layer);
        j["policy"] = rec.policy;
        j["cache"] = rec.cache;
        j["prefill"] = phase_json(rec.prefill, r.n_layer);
        j["decode"] = phase_json(rec.decode, r.n_layer);
        records.push_back(j);
    }
    return {{"format", "moeprune-replay"}, {"version", 1}, {"inputs", r.inputs}, {"records", records}};
}

std::string to_text(const ReplayReport & r) {
    std::string s = fmt::format("{} tokens x {} layers, k = {}; misses per token count all layers\n", r.trace_tokens,
                                r.n_layer, r.k);
    s += fmt::format("{:<8} {:>6} {:>10} {:>12} {:>10} {:>16} {:>9}\n", "policy", "cache", "tokens", "misses", "forced",
                     "misses/token", "hit rate");
    for (const ReplayRecord & rec : r.records) {
        const PhaseCounts c = rec.total();
        const json j = phase_json(c, r.n_layer);
        s += fmt::format("{:<8} {:>6} {:>10} {:>12} {:>10} {:>16.3f} {:>9.4f}\n", rec.policy, rec.cache, c.tokens, c.misses,
                         c.forced_misses, j["misses_per_token"].get<double>(), j["hit_rate"].get<double>());
    }
    return s;
}

} // namespace moeprune
