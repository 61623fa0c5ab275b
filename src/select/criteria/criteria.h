#pragma once
// Selection criteria behind one registry (registry.def): each scores the experts of one
// layer, higher keeps; select_layer (select.h) turns scores into a keep list with the
// rules every criterion shares (never-routed experts last, groups, ties). Formulas:
// docs/select.md.
#include "formats/stats.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace moeprune {

struct SelectOptions;

// One layer of the statistics as a criterion sees it: `layer` indexes stats.layers and
// `layer_stats` is that layer of the whole run or of one domain.
struct CriterionInput {
    const SaliencyStats & stats;
    size_t layer;
    const LayerStats & layer_stats;
    const SelectOptions & opt;
};

using CriterionScores = std::vector<double> (*)(const CriterionInput &);
using CriterionSettings = nlohmann::json (*)(const SelectOptions &);

struct Criterion {
    std::string name;
    CriterionScores scores;
    CriterionSettings settings;   // keys a keep map's "source" records for this criterion
    bool per_expert;              // hybrid and the domain criteria may rank by it
    std::string rare_note;        // appended where the report lists rarely routed kept experts
};

const std::vector<Criterion> & criteria();
// Throws naming the known criteria.
const Criterion & criterion(const std::string & name);
// Throws unless `name` is a per-expert criterion; `use` names the option asking.
const Criterion & per_expert_criterion(const std::string & name, const std::string & use);

namespace criteria_impl {
nlohmann::json no_settings(const SelectOptions &);
#define MOEPRUNE_CRITERION(name, scores, settings, per_expert, rare_note)                                               \
    std::vector<double> scores(const CriterionInput &);                                                                 \
    nlohmann::json settings(const SelectOptions &);
#include "select/criteria/registry.def"
#undef MOEPRUNE_CRITERION
} // namespace criteria_impl

} // namespace moeprune
