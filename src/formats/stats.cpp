#include "formats/stats.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace moeprune {

using nlohmann::json;

LayerStats::LayerStats(size_t n)
    : count(n, 0), prob_sum(n, 0.0), reap_sum(n, 0.0), reap_sq_sum(n, 0.0), ean_sum(n, 0.0), max_act(n, 0.0) {}

SaliencyStats SaliencyStats::empty(int64_t n_layer, int64_t n_expert, int64_t n_expert_used) {
    SaliencyStats s;
    s.n_layer = n_layer;
    s.n_expert = n_expert;
    s.n_expert_used = n_expert_used;
    s.layers.assign(size_t(n_layer), LayerStats(size_t(n_expert)));
    return s;
}

namespace {

// The per-expert real-valued fields, in one table so parsing, writing and merging cannot drift apart.
struct DoubleField {
    const char * key;
    std::vector<double> LayerStats::*member;
    bool is_max;  // merged by max instead of sum
};
constexpr DoubleField kDoubleFields[] = {
    {"prob_sum", &LayerStats::prob_sum, false},
    {"reap_sum", &LayerStats::reap_sum, false},
    {"reap_sq_sum", &LayerStats::reap_sq_sum, false},
    {"ean_sum", &LayerStats::ean_sum, false},
    {"max_act", &LayerStats::max_act, true},
};

int64_t require_int(const json & j, const char * key, const std::string & where) {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 0) {
        fail_file(where, std::string("missing or invalid \"") + key + "\" (a non-negative integer)");
    }
    return j[key].get<int64_t>();
}

std::vector<LayerStats> parse_layers(const json & arr, int64_t n_layer, int64_t n_expert, const std::string & origin,
                                     const std::string & where) {
    if (!arr.is_array() || int64_t(arr.size()) != n_layer) {
        fail_file(origin, fmt::format("{}layers must be an array of {} layers", where, n_layer));
    }
    std::vector<LayerStats> layers;
    for (size_t il = 0; il < arr.size(); ++il) {
        const json & jl = arr[il];
        LayerStats L{size_t(n_expert)};
        const auto array_of = [&](const char * key) -> const json & {
            if (!jl.is_object() || !jl.contains(key) || !jl[key].is_array() || int64_t(jl[key].size()) != n_expert) {
                fail_file(origin, fmt::format("{}layer {}: \"{}\" must be an array of {} numbers", where, il, key, n_expert));
            }
            return jl[key];
        };
        const json & count = array_of("count");
        for (int64_t e = 0; e < n_expert; ++e) {
            if (!count[e].is_number_unsigned() && !(count[e].is_number_integer() && count[e].get<int64_t>() >= 0)) {
                fail_file(origin, fmt::format("{}layer {}: count[{}] is not a non-negative integer", where, il, e));
            }
            L.count[e] = count[e].get<uint64_t>();
        }
        for (const auto & field : kDoubleFields) {
            const json & a = array_of(field.key);
            std::vector<double> & v = L.*field.member;
            for (int64_t e = 0; e < n_expert; ++e) {
                if (!a[e].is_number() || !std::isfinite(a[e].get<double>())) {
                    fail_file(origin, fmt::format("{}layer {}: {}[{}] is not a finite number", where, il, field.key, e));
                }
                v[e] = a[e].get<double>();
            }
        }
        if (jl.contains("nonfinite_drops")) {
            L.nonfinite_drops = uint64_t(require_int(jl, "nonfinite_drops", fmt::format("{}: {}layer {}", origin, where, il)));
        }
        if (jl.contains("coact")) {
            const size_t pairs = size_t(n_expert) * size_t(n_expert - 1) / 2;
            if (!jl["coact"].is_array() || jl["coact"].size() != pairs) {
                fail_file(origin, fmt::format("{}layer {}: \"coact\" must be an array of {} pair counts", where, il, pairs));
            }
            for (const json & c : jl["coact"]) {
                if (!c.is_number_unsigned()) {
                    fail_file(origin, fmt::format("{}layer {}: coact holds a value that is not a count", where, il));
                }
                L.coact.push_back(c.get<uint64_t>());
            }
        }
        if (!layers.empty() && layers.front().coact.empty() != L.coact.empty()) {
            fail_file(origin, fmt::format("{}layer {} {} \"coact\" but layer 0 {}: co-activation counts cover every "
                                          "layer or none", where, il, L.coact.empty() ? "lacks" : "has",
                                          L.coact.empty() ? "has it" : "does not"));
        }
        layers.push_back(std::move(L));
    }
    return layers;
}

json layers_to_json(const std::vector<LayerStats> & layers) {
    json arr = json::array();
    for (const auto & L : layers) {
        json jl = {{"count", L.count}};
        for (const auto & field : kDoubleFields) {
            jl[field.key] = L.*field.member;
        }
        jl["nonfinite_drops"] = L.nonfinite_drops;
        if (!L.coact.empty()) {
            jl["coact"] = L.coact;
        }
        arr.push_back(std::move(jl));
    }
    return arr;
}

// Counts are u64 sums; a merge that would wrap is refused rather than made small.
void add_count(uint64_t & a, uint64_t b, const std::string & what) {
    if (__builtin_add_overflow(a, b, &a)) {
        throw Error(fmt::format("merging overflows {} (more than 2^64 - 1)", what));
    }
}

void add_layers(std::vector<LayerStats> & a, const std::vector<LayerStats> & b) {
    for (size_t il = 0; il < a.size(); ++il) {
        if (a[il].coact.size() != b[il].coact.size()) {
            throw Error(fmt::format("layer {}: one file has co-activation counts and the other does not", il));
        }
        for (size_t e = 0; e < a[il].n_expert(); ++e) {
            add_count(a[il].count[e], b[il].count[e], fmt::format("layer {} count[{}]", il, e));
        }
        add_count(a[il].nonfinite_drops, b[il].nonfinite_drops, fmt::format("layer {} nonfinite_drops", il));
        for (size_t i = 0; i < a[il].coact.size(); ++i) {
            add_count(a[il].coact[i], b[il].coact[i], fmt::format("layer {} coact[{}]", il, i));
        }
        for (const auto & field : kDoubleFields) {
            std::vector<double> & v = a[il].*field.member;
            const std::vector<double> & w = b[il].*field.member;
            for (size_t e = 0; e < v.size(); ++e) {
                v[e] = field.is_max ? std::max(v[e], w[e]) : v[e] + w[e];
            }
        }
    }
}

} // namespace

static SaliencyStats parse_stats_json(const std::string & text, const std::string & origin);

SaliencyStats parse_stats(const std::string & text, const std::string & origin) {
    return with_json_errors(origin, [&] { return parse_stats_json(text, origin); });
}

static SaliencyStats parse_stats_json(const std::string & text, const std::string & origin) {
    const json j = parse_json(text, origin);
    if (!j.is_object() || j.value("format", json()) != "moeprune-stats") {
        fail_file(origin, "not a moeprune-stats file (\"format\" must be \"moeprune-stats\")");
    }
    if (j.value("version", json()) != 1) {
        fail_file(origin, "unsupported moeprune-stats version " + j.value("version", json()).dump());
    }
    SaliencyStats s;
    s.n_layer = require_int(j, "n_layer", origin);
    s.n_expert = require_int(j, "n_expert", origin);
    s.n_expert_used = require_int(j, "n_expert_used", origin);
    s.n_tokens = uint64_t(require_int(j, "n_tokens", origin));
    s.nonfinite_drops = uint64_t(require_int(j, "nonfinite_drops", origin));
    // Every layer lists six numbers per expert, each at least two characters ("0,"): a
    // header claiming more than the text can hold is refused before anything is allocated.
    if (s.n_expert == 0 || s.n_layer == 0 || s.n_expert > INT32_MAX || s.n_layer > INT32_MAX ||
        double(s.n_layer) * double(s.n_expert) * 12 > double(text.size())) {
        fail_file(origin, fmt::format("n_layer {} x n_expert {} cannot be the shape of a file of {} bytes", s.n_layer,
                                      s.n_expert, text.size()));
    }
    if (s.n_expert_used < 1 || s.n_expert_used > s.n_expert) {
        fail_file(origin, fmt::format("n_expert_used {} is not between 1 and n_expert {}", s.n_expert_used, s.n_expert));
    }
    for (const char * key : {"model", "settings"}) {
        if (j.contains(key) && !j[key].is_object()) {
            fail_file(origin, fmt::format("\"{}\" must be an object", key));
        }
    }
    s.model = j.value("model", json::object());
    s.settings = j.value("settings", json::object());
    s.layers = parse_layers(j.value("layers", json()), s.n_layer, s.n_expert, origin, "");
    if (j.contains("domains")) {
        if (!j["domains"].is_object()) {
            fail_file(origin, "\"domains\" must be an object of name -> {n_tokens, layers}");
        }
        for (const auto & [name, jd] : j["domains"].items()) {
            DomainStats d;
            const std::string where = "domain " + name + ": ";
            d.n_tokens = uint64_t(require_int(jd, "n_tokens", origin + ": " + where));
            d.layers = parse_layers(jd.value("layers", json()), s.n_layer, s.n_expert, origin, where);
            s.domains.emplace(name, std::move(d));
        }
    }
    return s;
}

SaliencyStats read_stats(const std::filesystem::path & path) {
    return parse_stats(read_text_file(path), path.string());
}

json stats_to_json(const SaliencyStats & s) {
    json domains = json::object();
    for (const auto & [name, d] : s.domains) {
        domains[name] = {{"n_tokens", d.n_tokens}, {"layers", layers_to_json(d.layers)}};
    }
    return {{"format", "moeprune-stats"}, {"version", 1},
            {"n_layer", s.n_layer}, {"n_expert", s.n_expert}, {"n_expert_used", s.n_expert_used},
            {"n_tokens", s.n_tokens}, {"nonfinite_drops", s.nonfinite_drops},
            {"model", s.model}, {"settings", s.settings},
            {"layers", layers_to_json(s.layers)}, {"domains", domains}};
}

void write_stats(const std::filesystem::path & path, const SaliencyStats & s) {
    write_file_atomic(path, stats_to_json(s).dump() + "\n");
}

void write_stats(const AtomicOutput & out, const SaliencyStats & s) {
    write_temp_file(out, stats_to_json(s).dump() + "\n");
}

bool is_checkpoint(const SaliencyStats & s) {
    const auto it = s.settings.find("progress");
    return it != s.settings.end() && it->is_object() && !it->value("complete", true);
}

void merge_stats(SaliencyStats & a, const SaliencyStats & b, const std::string & a_origin, const std::string & b_origin) {
    for (const auto & [s, origin] : {std::pair<const SaliencyStats &, const std::string &>{a, a_origin}, {b, b_origin}}) {
        if (is_checkpoint(s)) {
            fail_file(origin, "is a checkpoint of an unfinished collect (resume it with --resume); merging it would count "
                              "only the windows done so far");
        }
    }
    if (a.n_layer != b.n_layer || a.n_expert != b.n_expert || a.n_expert_used != b.n_expert_used) {
        throw Error(fmt::format("{} and {} describe different models: {}x{} experts (top-{}) vs {}x{} (top-{})", a_origin,
                                b_origin, a.n_layer, a.n_expert, a.n_expert_used, b.n_layer, b.n_expert, b.n_expert_used));
    }
    for (const auto & [s, origin] : {std::pair<const SaliencyStats &, const std::string &>{a, a_origin}, {b, b_origin}}) {
        if (!s.model.contains("digest") || !s.model["digest"].is_string()) {
            fail_file(origin, "model.digest: missing, so which model the statistics come from cannot be checked (collect "
                              "them again with this moeprune)");
        }
    }
    if (a.model != b.model) {
        throw Error(fmt::format("{} and {} come from different models: {} vs {}", a_origin, b_origin, a.model.dump(),
                                b.model.dump()));
    }
    const bool a_coact = !a.layers.empty() && !a.layers[0].coact.empty();
    const bool b_coact = !b.layers.empty() && !b.layers[0].coact.empty();
    if (a_coact != b_coact) {
        throw Error(fmt::format("{} has co-activation counts and {} does not: collect both with --coact or neither",
                                a_coact ? a_origin : b_origin, a_coact ? b_origin : a_origin));
    }
    add_count(a.n_tokens, b.n_tokens, "n_tokens");
    add_count(a.nonfinite_drops, b.nonfinite_drops, "nonfinite_drops");
    add_layers(a.layers, b.layers);
    for (const auto & [name, db] : b.domains) {
        auto it = a.domains.find(name);
        if (it == a.domains.end()) {
            a.domains.emplace(name, db);
        } else {
            add_count(it->second.n_tokens, db.n_tokens, "domain " + name + " n_tokens");
            add_layers(it->second.layers, db.layers);
        }
    }
}

} // namespace moeprune
