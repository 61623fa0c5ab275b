#pragma once
// Keep maps from saliency statistics: every criterion in use, computed per layer over
// one calibration pass, after the statistics have been validated; with the retention
// figures (in and out of sample) and the router-side substitution screen that tell the
// criteria apart. Criteria and formulas: docs/select.md.
#include "formats/keep_map.h"
#include "formats/stats.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moeprune {

struct SelectOptions {
    std::filesystem::path stats;
    std::vector<int64_t> ks;
    std::vector<std::string> metrics;
    std::filesystem::path out_dir;               // empty: no keep maps written
    std::filesystem::path heldout;               // optional held-out statistics
    std::filesystem::path trace;                 // optional: substitution screen
    std::map<std::string, double> domain_weights;  // domain-mix
    std::vector<std::string> hybrid_of{"reap", "soft-freq"};
    std::string domain_metric = "reap";          // what domain-max and domain-mix rank within a domain
    double lcb_z = 1.96;                         // reap-lcb: confidence as a normal quantile (97.5% one-sided)
    double lcb_prior = 10;                       // reap-lcb: pseudo-observations of the layer's pooled variance
    int64_t rare_hits = 10;                      // the report flags kept experts with fewer hits
    bool protect_super = false;
    int trace_examples = 20;                     // ran-out tokens listed per map
    uint64_t seed = 0;                           // random: the order's seed
};

// Every criterion's name, in the registry's order (select/criteria/registry.def).
std::vector<std::string> select_metrics();

// Per-layer scores of one criterion (higher keeps); `layer` indexes stats.layers.
std::vector<double> criterion_scores(const SaliencyStats & s, size_t layer, const std::string & metric,
                                     const SelectOptions & opt);

// Refuses statistics that cannot be trusted, naming the check, the layer and the numbers.
void validate_stats_for_selection(const SaliencyStats & s, const std::string & origin, const std::vector<int64_t> & ks);

// The kept experts of one layer, ascending: experts with hits before those without,
// then by score, prob_sum, count, lowest id; `forced` (super experts) first.
std::vector<int32_t> select_layer(const LayerStats & L, const std::vector<double> & score, int64_t k,
                                  const std::vector<int32_t> & forced, int64_t n_groups);

struct SubstitutionScreen {
    uint64_t token_layers = 0, slots = 0, replaced = 0, ran_out = 0;
    double moved_mass = 0;        // summed over token-layers
    double substitute_rank = 0;   // summed over substitutes: their rank in the trace's top-M
    uint64_t substitutes = 0;
    nlohmann::json ran_out_examples = nlohmann::json::array();  // {token, layer, survivors}
    nlohmann::json layers = nlohmann::json::array();            // {layer, replaced_share, moved_mass}
};

// Replays a keep map on a trace's top-M: per token and layer, the top-k is re-chosen
// among the survivors and the gates renormalized over the chosen (softmax of logits).
SubstitutionScreen substitution_screen(const std::filesystem::path & trace, const KeepMap & km, int k,
                                       int max_examples);

struct SelectReport {
    nlohmann::json json;   // inputs, super experts, per criterion and K: retention, screen, overlap
    std::string text;      // the terminal table
    std::vector<std::filesystem::path> written;
    // For the terminal's error stream too: a multimodal model calibrated without media.
    std::vector<std::string> warnings;
};

// `outputs`: files the caller writes from the report; with the keep maps, refused when one is an input.
SelectReport run_select(const SelectOptions & opt, const std::vector<std::filesystem::path> & outputs = {});

} // namespace moeprune
