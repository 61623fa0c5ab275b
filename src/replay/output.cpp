// The replay report as JSON, text and CSV.
#include "replay/replay.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

using nlohmann::json;

namespace {

json counts_json(const PhaseCounts & c, int n_layer, const ReplayReport & r) {
    const double missed = double(c.misses + c.forced_misses);
    const double chosen = double(c.picks - c.forced_misses);
    json j = {{"tokens", c.tokens},
              {"picks", c.picks},
              {"misses", c.misses},
              {"forced_misses", c.forced_misses},
              {"misses_per_token", c.tokens ? missed / double(c.tokens) : 0.0},
              {"misses_per_token_per_layer", c.tokens ? missed / double(c.tokens) / n_layer : 0.0},
              {"hit_rate", c.picks ? 1.0 - missed / double(c.picks) : 0.0},
              {"swap_rate", c.picks ? double(c.swaps) / double(c.picks) : 0.0},
              {"moved_mass", c.tokens ? c.moved_mass / (double(c.tokens) * n_layer) : 0.0}};
    if (c.predicted > 0 || r.inputs.value("prefetch", json()).is_object()) {
        j["prefetch"] = {{"predicted", c.predicted},
                         {"precision", c.predicted ? double(c.predicted_chosen) / double(c.predicted) : 0.0},
                         {"recall", chosen > 0 ? double(c.predicted_chosen) / chosen : 0.0},
                         {"hidden", c.hidden},
                         {"prefetch_loads", c.prefetch_loads}};
    }
    if (r.bytes_known) {
        j["read_bytes_per_token"] = c.tokens ? c.exposed_bytes / double(c.tokens) : 0.0;
        j["read_rounds_per_token"] = c.tokens ? double(c.rounds) / double(c.tokens) : 0.0;
        j["tokens_per_s"] = tokens_per_second(c, n_layer, r.throughput);
    }
    return j;
}

std::string cache_label(const ReplayRecord & rec) {
    return rec.cache ? fmt::format("{}", *rec.cache) : fmt::format("{}MiB", *rec.cache_mib);
}

} // namespace

json to_json(const ReplayReport & r) {
    json records = json::array();
    for (const ReplayRecord & rec : r.records) {
        json j = counts_json(rec.total(), r.n_layer, r);
        j["policy"] = rec.policy;
        j["cache"] = rec.cache ? json(*rec.cache) : json();
        j["cache_mib"] = rec.cache_mib ? json(*rec.cache_mib) : json();
        j["slots"] = rec.slots;
        j["lambda"] = rec.lambda;
        j["j"] = r.inputs["moce"]["j"];
        if (r.inputs["cache_scope"] == "global") {
            j["cliff"] = rec.cliff;
        }
        if (!rec.missed_by_layer.empty()) {
            const double tokens = double(rec.total().tokens);
            json per_layer = json::array();
            for (const uint64_t m : rec.missed_by_layer) {
                per_layer.push_back(tokens > 0 ? double(m) / tokens : 0.0);
            }
            j["misses_per_token_by_layer"] = per_layer;
        }
        j["prefill"] = counts_json(rec.prefill, r.n_layer, r);
        j["decode"] = counts_json(rec.decode, r.n_layer, r);
        records.push_back(j);
    }
    return {{"format", "moeprune-replay"}, {"version", 2}, {"inputs", r.inputs}, {"records", records}};
}

std::string to_text(const ReplayReport & r) {
    std::string s = fmt::format("{} tokens x {} layers, k = {}, {} caches; misses per token count all layers\n",
                                r.trace_tokens, r.n_layer, r.k, r.inputs["cache_scope"].get<std::string>());
    if (r.bytes_known) {
        const ThroughputParams & p = r.throughput;
        const auto bytes = r.inputs["expert_bytes"].get<std::vector<double>>();
        s += fmt::format("throughput model: {} GB/s, {} us per read round, queue depth {}, compute {} ms/token, "
                         "sync {} us/layer; one expert is {:.0f}..{:.0f} bytes ({})\n",
                         p.ssd_gbps, p.read_latency_us, p.queue_depth, p.compute_ms, p.sync_us,
                         *std::min_element(bytes.begin(), bytes.end()), *std::max_element(bytes.begin(), bytes.end()),
                         r.inputs["expert_bytes_source"].get<std::string>());
    }
    s += fmt::format("{:<19} {:>9} {:>6} {:>10} {:>12} {:>9} {:>13} {:>9} {:>7}", "policy", "cache", "lambda", "tokens",
                     "misses", "forced", "misses/token", "hit rate", "swaps");
    s += r.bytes_known ? fmt::format(" {:>9}\n", "tokens/s") : "\n";
    for (const ReplayRecord & rec : r.records) {
        const PhaseCounts c = rec.total();
        const json j = counts_json(c, r.n_layer, r);
        s += fmt::format("{:<19} {:>9} {:>6} {:>10} {:>12} {:>9} {:>13.3f} {:>9.4f} {:>7.4f}", rec.policy,
                         cache_label(rec) + (rec.cliff ? "!" : ""), rec.lambda, c.tokens, c.misses, c.forced_misses,
                         j["misses_per_token"].get<double>(), j["hit_rate"].get<double>(), j["swap_rate"].get<double>());
        s += r.bytes_known ? fmt::format(" {:>9.2f}\n", j["tokens_per_s"].get<double>()) : "\n";
    }
    if (std::any_of(r.records.begin(), r.records.end(), [](const ReplayRecord & x) { return x.cliff; })) {
        s += "! below the cliff: the shared cache holds fewer experts than one token needs across all layers\n";
    }
    for (const json & skip : r.inputs["skipped"]) {
        s += fmt::format("skipped {} at lambda {}: {}\n", skip["policy"].get<std::string>(), skip["lambda"].get<double>(),
                         skip["why"].get<std::string>());
    }
    return s;
}

std::string to_csv(const ReplayReport & r) {
    std::string s = "policy,cache,cache_mib,lambda,j,phase,tokens,picks,misses,forced_misses,misses_per_token,hit_rate,"
                    "swap_rate,moved_mass,prefetch_precision,prefetch_recall,prefetch_hidden,tokens_per_s\n";
    for (const ReplayRecord & rec : r.records) {
        for (const auto & [phase, c] : {std::pair<const char *, PhaseCounts>{"all", rec.total()},
                                        {"prefill", rec.prefill}, {"decode", rec.decode}}) {
            const json j = counts_json(c, r.n_layer, r);
            const json pf = j.value("prefetch", json::object());
            s += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", rec.policy,
                             rec.cache ? fmt::format("{}", *rec.cache) : "",
                             rec.cache_mib ? fmt::format("{}", *rec.cache_mib) : "", rec.lambda,
                             r.inputs["moce"]["j"].get<int>(), phase, c.tokens, c.picks, c.misses, c.forced_misses,
                             j["misses_per_token"].get<double>(), j["hit_rate"].get<double>(),
                             j["swap_rate"].get<double>(), j["moved_mass"].get<double>(),
                             pf.contains("precision") ? fmt::format("{}", pf["precision"].get<double>()) : "",
                             pf.contains("recall") ? fmt::format("{}", pf["recall"].get<double>()) : "",
                             pf.contains("hidden") ? fmt::format("{}", pf["hidden"].get<uint64_t>()) : "",
                             r.bytes_known ? fmt::format("{}", j["tokens_per_s"].get<double>()) : "");
        }
    }
    return s;
}

} // namespace moeprune
