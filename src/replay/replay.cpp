// run_replay: the inputs read and checked, the configurations made, one sweep over the trace,
// and the counts gathered into the report.
#include "replay/replay.h"
#include "replay/internal.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "sim/moce.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

using nlohmann::json;
using namespace replay_impl;

PhaseCounts ReplayRecord::total() const {
    PhaseCounts t = prefill;
    t.add(decode);
    return t;
}

namespace {

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

// What every layer shares: k and J from the trace and the options, the keep map's
// renumbering (the map itself into `km`), and the bytes of an expert per layer.
Setup make_setup(const ReplayOptions & opt, const TraceSource & reader, const std::optional<GgufModel> & model, KeepMap & km) {
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
    km = apply_keep_map(opt, h, s);
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
    return s;
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
    KeepMap km;
    Setup s = make_setup(opt, reader, model, km);

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

} // namespace moeprune
