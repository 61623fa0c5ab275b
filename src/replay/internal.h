#pragma once
// Private to replay: the types its files share and the phases run_replay chains. Other
// stages include replay/replay.h.
#include "replay/replay.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "sim/policy.h"
#include "sim/throughput.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moeprune::replay_impl {

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

// Layer l's experts predicted from layer l-1's unbiased routing by co-occurrence counts
// of earlier tokens: [t * n + i] with n_pred[t] valid, ascending.
struct Predictions {
    int n = 0;
    std::vector<uint8_t> n_pred;
    std::vector<int32_t> ids;
    std::span<const int32_t> of(uint64_t t) const { return {ids.data() + t * uint64_t(n), n_pred[t]}; }
};

using Counts = std::vector<std::array<PhaseCounts, 2>>;  // [config][phase]
using LayerMisses = std::vector<std::vector<uint64_t>>;  // [config][layer]: misses and forced, both phases

// A 4096 x 4096 table of u32 pair counts is 64 MiB per worker.
constexpr uint32_t kMaxPrefetchExperts = 4096;

inline bool session_resets_at(const Setup & s, const ReplayOptions & opt, uint64_t t) {
    return opt.reset_on_session && t > 0 && s.meta[t].seq != s.meta[t - 1].seq;
}

inline size_t phase_index(const Setup & s, uint64_t t) { return s.meta[t].phase == TracePhase::Decode ? 1 : 0; }

// What storage must serve for `exposed` experts of layer l in one request: reads in
// rounds of the queue depth.
inline void count_exposed(const Setup & s, const ReplayOptions & opt, uint32_t l, uint64_t exposed, PhaseCounts & pc) {
    pc.add_exposed_reads(exposed, opt.throughput.queue_depth, s.expert_bytes.empty() ? 0.0 : s.expert_bytes[l]);
}

// The trace, keep map and model checked against each other, into the setup (inputs.cpp).
int experts_per_token(const ReplayOptions & opt, const TraceHeader & h, const std::string & origin);
KeepMap apply_keep_map(const ReplayOptions & opt, const TraceHeader & h, Setup & s);
std::vector<double> expert_bytes_from_model(const GgufModel & model, const TraceHeader & h);
void mark_prefill_batches(const ReplayOptions & opt, Setup & s);

// The options checked, and expanded into one configuration per policy, size and lambda (configs.cpp).
void check_replay_options(const ReplayOptions & opt, const Setup & s, const TraceSource & reader);
std::vector<Config> make_configs(const ReplayOptions & opt, const Setup & s, nlohmann::json & skipped,
                                 bool & mixed_sizes, double & min_bytes, double & max_bytes);

// One layer's routing from the trace, and next-layer prefetch's predictions of it (layer_data.cpp).
LayerData load_layer(const Setup & s, uint32_t layer);
Predictions predict_layer(const LayerData & prev, const LayerData & cur, int k, int n_expert, int n_predict,
                          uint64_t train_tokens);

// Every size of a stack-algorithm policy in one pass (stack_pass.cpp).
std::map<std::string, std::vector<size_t>> stack_passes(const ReplayOptions & opt, const std::vector<Config> & configs,
                                                        int n_predict);
void replay_all_sizes(const Setup & s, const ReplayOptions & opt, uint32_t l, const LayerData & d,
                      const std::vector<Config> & configs, const std::vector<size_t> & members,
                      const AccessSequence * future, std::vector<std::array<PhaseCounts, 2>> & local);

// The sweeps over the trace, one per cache scope (sweeps.cpp).
Counts replay_per_layer(const ReplayOptions & opt, const Setup & s, const std::vector<Config> & configs, int n_predict,
                        LayerMisses & by_layer);
Counts replay_global(const ReplayOptions & opt, const Setup & s, const std::vector<Config> & configs, int n_predict);

} // namespace moeprune::replay_impl
