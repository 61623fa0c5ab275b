#include "formats/keep_map.h"
#include "core/digest.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>

#include <algorithm>
#include <regex>

namespace moeprune {

using nlohmann::json;

static int parse_layer_key(const std::string & key, const std::string & origin) {
    // One spelling per layer: "0" and "00" would otherwise both name layer 0.
    if (key.empty() || key.size() > 6 || key.find_first_not_of("0123456789") != std::string::npos ||
        (key.size() > 1 && key[0] == '0')) {
        fail_file(origin, "layer key \"" + key + "\" is not a layer number (decimal, no leading zeros)");
    }
    return std::stoi(key);
}

static std::vector<int32_t> parse_ids(const json & arr, const std::string & origin, int layer) {
    if (!arr.is_array()) {
        fail_file(origin, fmt::format("layer {}: expected an array of expert ids", layer));
    }
    std::vector<int32_t> ids;
    ids.reserve(arr.size());
    for (const auto & v : arr) {
        if (!v.is_number_integer()) {
            fail_file(origin, fmt::format("layer {}: expert id {} is not an integer", layer, v.dump()));
        }
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id > INT32_MAX) {
            fail_file(origin, fmt::format("layer {}: expert id {} is out of range", layer, id));
        }
        ids.push_back(int32_t(id));
    }
    return ids;
}

static KeepMap parse_keep_map_json(const std::string & text, const std::string & origin);

KeepMap parse_keep_map(const std::string & text, const std::string & origin) {
    return with_json_errors(origin, [&] { return parse_keep_map_json(text, origin); });
}

static KeepMap parse_keep_map_json(const std::string & text, const std::string & origin) {
    const json j = parse_json(text, origin);
    if (!j.is_object()) {
        fail_file(origin, "a keep map must be a JSON object");
    }
    KeepMap km;
    const json * layers = &j;
    if (j.contains("format")) {
        if (j["format"] != "moeprune-keep") {
            fail_file(origin, "format is " + j["format"].dump() + ", expected \"moeprune-keep\"");
        }
        if (!j.contains("version") || j["version"] != 1) {
            fail_file(origin, "unsupported moeprune-keep version " + j.value("version", json()).dump());
        }
        for (const char * key : {"n_expert", "k", "layers"}) {
            if (!j.contains(key)) {
                fail_file(origin, std::string("missing \"") + key + "\"");
            }
        }
        for (const char * key : {"n_expert", "k"}) {
            const json & v = j[key];
            if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > INT32_MAX : v.get<int64_t>() < 1)) {
                fail_file(origin, fmt::format("\"{}\" is {}; it must be an integer from 1 to {}", key, v.dump(), INT32_MAX));
            }
        }
        km.n_expert = j["n_expert"].get<int64_t>();
        km.k = j["k"].get<int64_t>();
        if (j.contains("metric") && !j["metric"].is_string()) {
            fail_file(origin, "\"metric\" must be a string");
        }
        km.metric = j.value("metric", "");
        km.source = j.value("source", json::object());
        layers = &j["layers"];
        if (!layers->is_object()) {
            fail_file(origin, "\"layers\" must be an object of layer number -> ids");
        }
    }
    for (const auto & [key, arr] : layers->items()) {
        const int layer = parse_layer_key(key, origin);
        km.layers[layer] = parse_ids(arr, origin, layer);
    }
    if (km.layers.empty()) {
        fail_file(origin, "the keep map lists no layers");
    }
    if (km.k == 0) {
        km.k = int64_t(km.layers.begin()->second.size());
    }
    validate_keep_map(km, origin);
    return km;
}

KeepMap read_keep_map(const std::filesystem::path & path) {
    return parse_keep_map(read_text_file(path), path.string());
}

void validate_keep_map(const KeepMap & km, const std::string & origin) {
    if (km.k <= 0) {
        fail_file(origin, fmt::format("k is {}; a keep map must keep at least one expert", km.k));
    }
    if (km.n_expert > 0 && km.k > km.n_expert) {
        fail_file(origin, fmt::format("k is {} but the model has only {} experts", km.k, km.n_expert));
    }
    for (const auto & [layer, ids] : km.layers) {
        if (int64_t(ids.size()) != km.k) {
            fail_file(origin, fmt::format("layer {} keeps {} experts but k is {}; every layer must keep the same number",
                                          layer, ids.size(), km.k));
        }
        for (size_t i = 0; i < ids.size(); ++i) {
            if (km.n_expert > 0 && ids[i] >= km.n_expert) {
                fail_file(origin, fmt::format("layer {}: expert id {} is not below n_expert {}", layer, ids[i], km.n_expert));
            }
            if (i > 0 && ids[i] == ids[i - 1]) {
                fail_file(origin, fmt::format("layer {}: expert id {} is listed twice", layer, ids[i]));
            }
            if (i > 0 && ids[i] < ids[i - 1]) {
                fail_file(origin, fmt::format("layer {}: ids are not in ascending order ({} after {})", layer, ids[i], ids[i - 1]));
            }
        }
    }
}

void validate_keep_map_for_model(const KeepMap & km, const std::string & origin, int64_t n_expert,
                                 const std::vector<int> & moe_layers) {
    if (km.n_expert != 0 && km.n_expert != n_expert) {
        fail_file(origin, fmt::format("made for a model with {} experts, this model has {}", km.n_expert, n_expert));
    }
    KeepMap checked = km;
    checked.n_expert = n_expert;
    validate_keep_map(checked, origin);
    for (int layer : moe_layers) {
        if (!km.layers.count(layer)) {
            fail_file(origin, fmt::format("layer {} is missing; the model has MoE layers {}..{}", layer,
                                          moe_layers.front(), moe_layers.back()));
        }
    }
    for (const auto & [layer, ids] : km.layers) {
        if (std::find(moe_layers.begin(), moe_layers.end(), layer) == moe_layers.end()) {
            fail_file(origin, fmt::format("layer {} is not a MoE layer of this model", layer));
        }
    }
}

json keep_map_to_json(const KeepMap & km) {
    json layers = json::object();
    for (const auto & [layer, ids] : km.layers) {
        layers[std::to_string(layer)] = ids;
    }
    return {{"format", "moeprune-keep"}, {"version", 1}, {"n_expert", km.n_expert}, {"k", km.k},
            {"metric", km.metric}, {"source", km.source}, {"layers", layers}};
}

void write_keep_map(const std::filesystem::path & path, const KeepMap & km) {
    validate_keep_map(km, path.string());
    write_file_atomic(path, keep_map_to_json(km).dump(1) + "\n");
}

std::string keep_map_digest(const KeepMap & km) {
    Xxh64 h;
    for (const auto & [layer, ids] : km.layers) {
        const int32_t header[2] = {layer, int32_t(ids.size())};
        h.update(header, sizeof(header)).update(ids.data(), ids.size() * sizeof(int32_t));
    }
    return h.named();
}

void require_top_k_room(const KeepMap & km, const std::string & origin, int64_t n_expert_used) {
    if (km.k < n_expert_used) {
        fail_file(origin, fmt::format("keeps {} experts per layer, fewer than the {} each token uses", km.k, n_expert_used));
    }
}

std::string expert_groups_problem(const KeepMap & km, const ExpertGroups & g) {
    if (g.n_group <= 1) {
        return "";
    }
    if (km.k % g.n_group != 0) {
        return fmt::format("keeps {} experts per layer, not a multiple of the model's {} expert groups; "
                           "group-limited routing needs every group to keep the same number",
                           km.k, g.n_group);
    }
    const int64_t per_group = km.k / g.n_group;
    if (per_group < 2) {
        return fmt::format("keeps {} experts per layer, {} in each of the model's {} expert groups; llama.cpp "
                           "needs at least 2 per group (it ranks groups by their two best experts)",
                           km.k, per_group, g.n_group);
    }
    if (g.n_group_used > 0 && g.n_used > g.n_group_used * per_group) {
        return fmt::format("keeps {} experts per group, so the {} groups a token may use hold {} experts, "
                           "fewer than the {} each token uses",
                           per_group, g.n_group_used, g.n_group_used * per_group, g.n_used);
    }
    const int64_t group_size = g.n_expert / g.n_group;
    for (const auto & [layer, ids] : km.layers) {
        std::vector<int64_t> kept(size_t(g.n_group), 0);
        for (int32_t id : ids) {
            kept[size_t(id / group_size)]++;
        }
        for (int64_t group = 0; group < g.n_group; ++group) {
            if (kept[size_t(group)] != per_group) {
                return fmt::format("layer {}: expert group {} (experts {}..{}) keeps {} experts, but every one of the "
                                   "{} groups must keep k / groups = {}",
                                   layer, group, group * group_size, (group + 1) * group_size - 1, kept[size_t(group)],
                                   g.n_group, per_group);
            }
        }
    }
    return "";
}

std::string keep_map_label(const std::string & criterion, int64_t k) { return fmt::format("{}-k{}", criterion, k); }

std::string keep_map_file_name(const std::string & criterion, int64_t k) { return keep_map_label(criterion, k) + ".json"; }

KeepMapName parse_keep_map_name(const std::filesystem::path & path) {
    const std::string stem = path.stem().string();
    // Up to 18 digits: every K fits an int64_t, and a longer run is no K select wrote.
    static const std::regex form(R"((.+)-k([0-9]{1,18}))");
    std::smatch m;
    if (std::regex_match(stem, m, form)) {
        return {m[1].str(), std::stoll(m[2].str())};
    }
    return {stem, 0};
}

} // namespace moeprune
