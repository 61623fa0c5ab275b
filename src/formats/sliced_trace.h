#pragma once
// A router trace of a model read as the model sliced by a keep map would have routed it:
// each token's candidates that the map keeps, renumbered as the sliced model numbers its
// experts (their rank among the kept ones of the layer), the best `k` of them.
#include "formats/keep_map.h"
#include "formats/trace.h"

#include <string>
#include <vector>

namespace moeprune {

// The model layer of every trace layer: meta.moe_layers where the trace records them,
// else `fallback` (the model's routed layers, or a keep map's), matched in order.
std::vector<int> model_layers_of_trace(const TraceHeader & h, const std::vector<int> & fallback);

// The kept ids of every trace layer; refuses by `origin` a map that does not cover
// exactly the trace's MoE layers.
std::vector<const std::vector<int32_t> *> keep_per_trace_layer(const KeepMap & km, const TraceHeader & h,
                                                               const std::string & origin);

class SlicedTrace : public TraceSource {
public:
    // `keep` must outlive this; `origin` names the keep map in refusals, among them a token
    // whose top candidates hold fewer than `k` kept experts (trace more with a larger top).
    SlicedTrace(const TraceSource & trace, const KeepMap & keep, uint32_t k, std::string origin);

    const TraceHeader & header() const override { return header_; }
    uint64_t n_tokens() const override { return trace_.n_tokens(); }
    const std::string & format() const override { return trace_.format(); }
    std::vector<TraceTokenMeta> token_meta() const override { return trace_.token_meta(); }
    void for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const override;

private:
    const TraceSource & trace_;
    TraceHeader header_;
    uint32_t k_;
    std::string origin_;
    std::vector<std::vector<int32_t>> old_to_new_;   // per trace layer; -1: dropped
};

} // namespace moeprune
