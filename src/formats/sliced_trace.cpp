#include "formats/sliced_trace.h"

#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

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

SlicedTrace::SlicedTrace(const TraceSource & trace, const KeepMap & keep, uint32_t k, std::string origin)
    : trace_(trace), header_(trace.header()), k_(k), origin_(std::move(origin)) {
    for (const std::vector<int32_t> * ids : keep_per_trace_layer(keep, header_, origin_)) {
        std::vector<int32_t> m(header_.n_expert, -1);
        for (size_t i = 0; i < ids->size(); ++i) {
            if ((*ids)[i] < 0 || uint32_t((*ids)[i]) >= header_.n_expert) {
                fail_file(origin_, fmt::format("keeps expert {}, but the trace's model has {}", (*ids)[i], header_.n_expert));
            }
            m[size_t((*ids)[i])] = int32_t(i);
        }
        old_to_new_.push_back(std::move(m));
    }
    if (k_ == 0 || int64_t(k_) > keep.k) {
        fail_file(origin_, fmt::format("keeps {} experts per layer; the model uses {} per token", keep.k, k_));
    }
    header_.n_expert = uint32_t(keep.k);
    header_.top_m = k_;
}

void SlicedTrace::for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const {
    const std::vector<int32_t> & map = old_to_new_.at(layer);
    const uint32_t top_m = trace_.header().top_m;
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    trace_.for_each_layer_chunk(layer, [&](uint64_t first, uint32_t n, const uint16_t * in_ids, const float * in_logits) {
        ids.assign(size_t(n) * k_, 0);
        logits.assign(size_t(n) * k_, 0.0f);
        for (uint32_t t = 0; t < n; ++t) {
            uint32_t got = 0;
            for (uint32_t j = 0; j < top_m && got < k_; ++j) {
                const int32_t kept = map[in_ids[size_t(t) * top_m + j]];
                if (kept >= 0) {
                    ids[size_t(t) * k_ + got] = uint16_t(kept);
                    logits[size_t(t) * k_ + got] = in_logits[size_t(t) * top_m + j];
                    ++got;
                }
            }
            if (got < k_) {
                fail_file(origin_, fmt::format("keeps {} of token {}'s top {} candidates in trace layer {}, fewer than "
                                               "the {} it routes to: trace it with a larger top",
                                               got, first + t, top_m, layer, k_));
            }
        }
        fn(first, n, ids.data(), logits.data());
    });
}

} // namespace moeprune
