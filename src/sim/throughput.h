#pragma once
// The one time model of a decoded token (docs/replay.md#throughput-model), used by
// replay's records, eval's closed loop and plan's options alike:
//   t = compute + layers * sync + exposed_bytes / bandwidth + rounds * latency
//       + max(0, prefetched_bytes / bandwidth - compute)
// Prefetched bytes overlap compute; only what outlasts it is paid.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>

namespace moeprune {

struct ThroughputParams {
    double ssd_gbps = 6.8;        // sequential read bandwidth, 10^9 bytes/s
    double read_latency_us = 80;  // per round of reads
    int queue_depth = 32;         // reads in flight per round
    double compute_ms = 0;        // per token, all layers
    double sync_us = 0;           // per layer and token
};

// What storage serves for one token, averaged over the tokens counted.
struct TokenTraffic {
    double exposed_bytes = 0;     // read while the token waits
    double rounds = 0;            // rounds of reads, each paying the latency once
    double prefetched_bytes = 0;  // staged ahead, hidden behind compute where it fits
};

double token_seconds(const TokenTraffic & io, size_t n_layer, const ThroughputParams & p);

// Rounds of reads one layer's `misses` take at `queue_depth` reads in flight: a round is
// paid whole however few reads it holds.
double read_rounds(double misses, int queue_depth);

// The same for `misses` counted over all `n_layer` layers of a token without their split:
// spread evenly, each layer's rounds rounded up.
double read_rounds_spread(double misses, size_t n_layer, int queue_depth);

// Speculative decoding with an MTP (nextn) head, as llama.cpp's draft-mtp runs it: each
// step the head drafts `draft_tokens` tokens, the trunk verifies them in one batch with the
// last accepted token, and emits the accepted drafts plus one token of its own. Draft i is
// accepted only when every draft before it was, each with the same probability, so a step
// emits 1 + a + a^2 + ... + a^n tokens; n = 1: 1 + a.
double tokens_per_step(double acceptance, int draft_tokens);

// One speculative step (docs/replay.md#speculative-decoding): the trunk's one pass over its
// 1 + n positions (one compute: decode is bound by reading weights, which a batch reads
// once; each position's expert traffic, counted without overlap), and the head's pass over
// the tokens it catches up on, one per token emitted (its share of compute is its layers'
// share of all layers).
struct DraftStep {
    double acceptance = 0;           // share of drafts the trunk accepts
    int draft_tokens = 1;
    size_t mtp_layers = 0;
    TokenTraffic mtp;                // what the head's layers read per token it runs on
};
double speculative_step_seconds(const TokenTraffic & trunk, size_t n_layer, const DraftStep & d,
                                const ThroughputParams & p);
// tokens_per_step over speculative_step_seconds.
double speculative_tokens_per_second(const TokenTraffic & trunk, size_t n_layer, const DraftStep & d,
                                     const ThroughputParams & p);

// What a simulated cache counts over the requests of one phase (prefill or decode):
// replay's records and the closed loop's alike.
struct PhaseCounts {
    uint64_t tokens = 0, picks = 0, misses = 0, forced_misses = 0, swaps = 0;
    double moved_mass = 0;                // summed over counted (token, layer) requests
    uint64_t predicted = 0, predicted_chosen = 0, hidden = 0, prefetch_loads = 0, rounds = 0;
    double exposed_bytes = 0, prefetch_bytes = 0;
    void add(const PhaseCounts & o);
    // Misses a request waits for: read `queue_depth` at a time, each round paying the
    // latency once, `expert_bytes` each.
    void add_exposed_reads(uint64_t exposed, int queue_depth, double expert_bytes);
};

// tokens/s from the counters: their per-token averages through token_seconds.
double tokens_per_second(const PhaseCounts & c, int n_layer, const ThroughputParams & p);

// The settings as every result file records them (replay, eval, plan).
nlohmann::json to_json(const ThroughputParams & p);

} // namespace moeprune
