#pragma once
// Keep map: which routed experts each layer keeps. Written by select, read by slice,
// replay and eval. See docs/formats.md.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moeprune {

struct KeepMap {
    int64_t n_expert = 0;   // experts in the source model; 0 when read from the seed's bare form
    int64_t k = 0;          // experts kept in every layer
    std::string metric;
    nlohmann::json source = nlohmann::json::object();
    std::map<int, std::vector<int32_t>> layers;  // ascending expert ids
};

// Parses the moeprune-keep form or the seed pipeline's bare {"0": [...], ...} form.
// `origin` names the input in errors.
KeepMap parse_keep_map(const std::string & text, const std::string & origin);
KeepMap read_keep_map(const std::filesystem::path & path);

// Checks ids sorted, unique, in range and the same K in every layer; errors name the layer.
void validate_keep_map(const KeepMap & km, const std::string & origin);
// Also checks the map against a model: its expert count and exactly its MoE layers.
void validate_keep_map_for_model(const KeepMap & km, const std::string & origin, int64_t n_expert,
                                 const std::vector<int> & moe_layers);

// Refuses a map that keeps fewer experts per layer than each token uses: masked or
// sliced, every token's top-k must find that many survivors.
void require_top_k_room(const KeepMap & km, const std::string & origin, int64_t n_expert_used);

// Group-limited routing (DeepSeek-V3 style): a token picks `n_group_used` of `n_group`
// equal groups, then its top-k within them. A pruned router still does so only when
// every group keeps k / groups experts, at least 2 (llama.cpp ranks a group by its two
// best), and the groups a token may use hold its top-k. Returns the first rule `km`
// breaks, or "" (also for a model without groups).
struct ExpertGroups {
    int64_t n_expert = 0, n_group = 0, n_group_used = 0, n_used = 0;
};
std::string expert_groups_problem(const KeepMap & km, const ExpertGroups & g);

nlohmann::json keep_map_to_json(const KeepMap & km);
void write_keep_map(const std::filesystem::path & path, const KeepMap & km);

// select's label of a criterion's map at K, "{criterion}-k{K}", and its file name, the
// label plus ".json". Report rows and plan options name maps by the label.
std::string keep_map_label(const std::string & criterion, int64_t k);
std::string keep_map_file_name(const std::string & criterion, int64_t k);

struct KeepMapName {
    std::string criterion;
    int64_t k = 0;   // 0: the name carries no K
};
// What a file name carries: "reap-k8.json" is reap at K 8; any other name (my-keep.json)
// is its stem with K 0.
KeepMapName parse_keep_map_name(const std::filesystem::path & path);

// Order-independent digest of the layers, recorded by consumers as provenance.
std::string keep_map_digest(const KeepMap & km);

} // namespace moeprune
