#pragma once
// Saliency statistics: per layer, per expert sums collected over calibration tokens.
// Every field is additive over disjoint token sets (max_act takes the max), so
// runs over separate corpora merge into what one run over both would give.
// See docs/formats.md for the meaning of each field.
#include "core/atomic_file.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moeprune {

struct LayerStats {
    std::vector<uint64_t> count;       // tokens routed to the expert
    std::vector<double> prob_sum;      // router probability over all tokens
    std::vector<double> reap_sum;      // sum of g * ||f|| over routed tokens
    std::vector<double> reap_sq_sum;   // sum of (g * ||f||)^2
    std::vector<double> ean_sum;       // sum of ||f||
    std::vector<double> max_act;       // largest |activation| of f
    uint64_t nonfinite_drops = 0;      // routed rows whose f or g was not finite (counted, not summed)
    // Optional (--coact): tokens that chose both a and b, a < b, in row-major upper-
    // triangle order: pair (a, b) at a * n - a * (a + 1) / 2 + (b - a - 1).
    std::vector<uint64_t> coact;

    explicit LayerStats(size_t n_expert = 0);
    size_t n_expert() const { return count.size(); }
    static size_t pair_index(size_t n, size_t a, size_t b) { return a * n - a * (a + 1) / 2 + (b - a - 1); }
};

struct DomainStats {
    uint64_t n_tokens = 0;
    std::vector<LayerStats> layers;
};

struct SaliencyStats {
    int64_t n_layer = 0;
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    uint64_t n_tokens = 0;
    uint64_t nonfinite_drops = 0;
    nlohmann::json model = nlohmann::json::object();     // identity of the model the stats describe
    nlohmann::json settings = nlohmann::json::object();  // how they were collected
    std::vector<LayerStats> layers;
    std::map<std::string, DomainStats> domains;

    static SaliencyStats empty(int64_t n_layer, int64_t n_expert, int64_t n_expert_used);
};

SaliencyStats parse_stats(const std::string & text, const std::string & origin);
SaliencyStats read_stats(const std::filesystem::path & path);
nlohmann::json stats_to_json(const SaliencyStats & s);
void write_stats(const std::filesystem::path & path, const SaliencyStats & s);
// Into `out`'s temporary file, for the caller to commit.
void write_stats(const AtomicOutput & out, const SaliencyStats & s);

// Adds b into a. Refuses stats of different models or shapes; `a_origin`/`b_origin` name them.
// A checkpoint of an unfinished collect (settings.progress.complete false): its counts
// cover only the windows done so far.
bool is_checkpoint(const SaliencyStats & s);

void merge_stats(SaliencyStats & a, const SaliencyStats & b, const std::string & a_origin, const std::string & b_origin);

} // namespace moeprune
