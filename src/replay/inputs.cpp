// The inputs checked against each other: k from the trace, the keep map renumbered per
// trace layer, expert bytes from the model, and prefill tokens grouped into batches.
#include "replay/internal.h"
#include "formats/sliced_trace.h"
#include "core/errors.h"
#include "model/inspect.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace moeprune::replay_impl {

using nlohmann::json;

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

} // namespace moeprune::replay_impl
