#include "plan/plan.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"
#include "formats/keep_map.h"
#include "gguf/model_file.h"
#include "inspect/inspect.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

struct Geometry {
    std::string source;
    int64_t n_expert = 0, used = 0;
    std::vector<double> bytes;  // one routed expert, per MoE layer
    double other = 0;
    bool other_known = false;
    double sum() const {
        double s = 0;
        for (const double b : bytes) {
            s += b;
        }
        return s;
    }
    double mean() const { return bytes.empty() ? 0 : sum() / double(bytes.size()); }
};

Geometry geometry(const PlanOptions & opt) {
    Geometry g;
    const bool by_hand = opt.expert_mb > 0 || opt.layers > 0 || opt.experts > 0;
    if (!opt.model.empty() && by_hand) {
        throw Error("give --model or --expert-mb/--layers/--experts, not both");
    }
    if (!opt.model.empty()) {
        const InspectReport r = inspect_model(GgufModel::open(opt.model), {});
        if (!r.problems.empty()) {
            fail_file(opt.model.string(), "inspect finds problems: " + r.problems.front());
        }
        for (const LayerInfo & l : r.layers) {
            if (!l.nextn) {
                g.bytes.push_back(double(l.expert_bytes));
            }
        }
        if (g.bytes.empty()) {
            fail_file(opt.model.string(), "has no routed experts to plan for");
        }
        g.n_expert = r.n_expert;
        g.used = r.n_expert_used;
        g.other = double(r.other_bytes);
        g.other_known = true;
        g.source = opt.model.string();
        if (opt.other_gb) {
            throw Error("--other-gb is read from the model when --model is given");
        }
        return g;
    }
    if (!(opt.expert_mb > 0) || opt.layers < 1 || opt.experts < 1 || opt.used < 1 || opt.used > opt.experts) {
        throw Error("without --model, give --expert-mb (> 0), --layers, --experts and --used (1..experts)");
    }
    g.bytes.assign(size_t(opt.layers), opt.expert_mb * 1e6);
    g.n_expert = opt.experts;
    g.used = opt.used;
    g.other_known = opt.other_gb.has_value();
    g.other = opt.other_gb.value_or(0) * 1e9;
    g.source = fmt::format("--expert-mb {} --layers {} --experts {} --used {}", opt.expert_mb, opt.layers, opt.experts, opt.used);
    return g;
}

std::string file_digest(const std::filesystem::path & p) {
    const std::string bytes = read_text_file(p);
    return fmt::format("xxh64:{:016x}", XXH64(bytes.data(), bytes.size(), 0));
}

// Criterion and K of a keep map: from the map itself, or from select's file name.
std::pair<std::string, int64_t> map_identity(const std::string & path, const std::string & name) {
    std::error_code ec;
    if (!path.empty() && std::filesystem::is_regular_file(path, ec)) {
        const KeepMap km = read_keep_map(path);
        return {km.metric.empty() ? std::filesystem::path(path).stem().string() : km.metric, km.k};
    }
    static const std::regex form(R"((.+)-k([0-9]+))");
    std::smatch m;
    const std::string stem = std::filesystem::path(name.empty() ? path : name).stem().string();
    if (std::regex_match(stem, m, form)) {
        return {m[1].str(), std::stoll(m[2].str())};
    }
    return {stem, 0};
}

double token_seconds(double bytes, double rounds, size_t layers, const ThroughputParams & p) {
    return p.compute_ms * 1e-3 + double(layers) * p.sync_us * 1e-6 + bytes / (p.ssd_gbps * 1e9) +
           rounds * p.read_latency_us * 1e-6;
}

json tok_per_s(double seconds) {
    return seconds > 0 ? json(1.0 / seconds) : json(nullptr);
}

double gb(double bytes) { return bytes / 1e9; }

} // namespace

double parse_size(const std::string & text, const std::string & what) {
    static const std::regex form(R"(\s*([0-9]+(\.[0-9]+)?)\s*([KMGT]?)(i?B?)\s*)", std::regex::icase);
    std::smatch m;
    if (!std::regex_match(text, m, form)) {
        throw Error(fmt::format("{} \"{}\" is not a size (24G, 24GiB, 24GB, 512M, or bytes)", what, text));
    }
    const double v = std::stod(m[1].str());
    const char unit = m[3].str().empty() ? ' ' : char(std::toupper(m[3].str()[0]));
    const std::string suffix = m[4].str();
    const bool decimal = suffix.size() == 1 && (suffix[0] == 'B' || suffix[0] == 'b');  // "GB": 10^9
    const int power = unit == 'K' ? 1 : unit == 'M' ? 2 : unit == 'G' ? 3 : unit == 'T' ? 4 : 0;
    return v * std::pow(decimal ? 1000.0 : 1024.0, power);
}

json make_plan(const PlanOptions & opt) {
    const Geometry g = geometry(opt);
    const ThroughputParams & tp = opt.throughput;
    const size_t L = g.bytes.size();
    const double budget = opt.ram_bytes > 0 ? opt.ram_bytes - opt.reserve_bytes : 0;
    if (opt.ram_bytes > 0 && budget < g.other) {
        throw Error(fmt::format("--ram {:.2f} GB minus the reserve of {:.2f} GB leaves {:.2f} GB, less than the {:.2f} GB "
                                "of weights that are not routed experts ({})",
                                gb(opt.ram_bytes), gb(opt.reserve_bytes), gb(budget), gb(g.other), g.source));
    }
    if (!opt.cache_experts.empty() && opt.cache_experts.size() != opt.misses_per_token.size()) {
        throw Error("--cache-experts needs one size per --misses-per-token value");
    }

    // Quality measured per (criterion, K).
    std::map<std::pair<std::string, int64_t>, double> kld;
    json eval_inputs = json::array();
    for (const auto & path : opt.evals) {
        const json r = parse_json(read_text_file(path), path.string());
        with_json_errors(path.string(), [&] {
            if (r.value("format", "") != "moeprune-eval") {
                fail_file(path.string(), "is not a moeprune-eval report (\"format\")");
            }
            for (const json & c : r.at("candidates")) {
                if (c.at("kind") != "keep") {
                    continue;
                }
                const auto [criterion, k] = map_identity(c.value("source", ""), c.at("name").get<std::string>());
                if (k > 0) {
                    kld[{criterion, k}] = c.at("all").at("kld_mean").get<double>();
                }
            }
        });
        eval_inputs.push_back({{"file", path.string()}, {"digest", file_digest(path)}});
    }
    const auto kld_of = [&](const std::string & criterion, int64_t k) -> std::pair<json, bool> {
        if (k == g.n_expert) {
            return {0.0, true};  // nothing removed: the base itself
        }
        if (auto it = kld.find({criterion, k}); it != kld.end()) {
            return {it->second, true};
        }
        // Linear in K between the nearest measured Ks of the same criterion.
        std::optional<std::pair<int64_t, double>> lo, hi;
        for (const auto & [key, v] : kld) {
            if (key.first != criterion) {
                continue;
            }
            if (key.second < k && (!lo || key.second > lo->first)) {
                lo = {key.second, v};
            }
            if (key.second > k && (!hi || key.second < hi->first)) {
                hi = {key.second, v};
            }
        }
        if (!hi && lo && k < g.n_expert) {
            hi = {g.n_expert, 0.0};  // the unpruned model is the base itself
        }
        if (lo && hi) {
            const double f = double(k - lo->first) / double(hi->first - lo->first);
            return {lo->second + f * (hi->second - lo->second), false};
        }
        return {nullptr, false};
    };

    json options = json::array();
    uint64_t infeasible = 0;
    const auto add = [&](json o) {
        const json & resident = o["resident_bytes"];
        o["feasible"] = budget <= 0 || resident.is_null() || resident.get<double>() <= budget;
        if (!o["feasible"].get<bool>()) {
            ++infeasible;
            return;
        }
        // Belady needs the future: a bound to compare with, never a choice.
        o["bound"] = o["policy"] == "belady";
        const auto [k_mean, measured] = kld_of(o["criterion"].get<std::string>(), o["k"].get<int64_t>());
        o["kld_mean"] = k_mean;
        o["kld_measured"] = k_mean.is_null() ? json(nullptr) : json(measured);
        options.push_back(std::move(o));
    };

    // Replayed caches.
    std::set<std::pair<std::string, int64_t>> planned;
    json replay_inputs = json::array();
    for (const auto & path : opt.replays) {
        const json r = parse_json(read_text_file(path), path.string());
        with_json_errors(path.string(), [&] {
            if (r.value("format", "") != "moeprune-replay") {
                fail_file(path.string(), "is not a moeprune-replay result (\"format\")");
            }
            const json & in = r.at("inputs");
            if (in.at("n_layer").get<size_t>() != L) {
                fail_file(path.string(), fmt::format("replays {} MoE layers, the plan's model has {}", in.at("n_layer").get<size_t>(), L));
            }
            const std::string keep = in.value("keep", json(nullptr)).is_string() ? in["keep"].get<std::string>() : "";
            auto [criterion, k] = keep.empty() ? std::pair<std::string, int64_t>{"none", g.n_expert} : map_identity(keep, keep);
            if (in.contains("n_expert_after_keep") && in["n_expert_after_keep"].is_number_integer()) {
                k = in["n_expert_after_keep"].get<int64_t>();
            }
            const bool global = in.value("cache_scope", "per-layer") == "global";
            planned.insert({criterion, k});
            for (const json & rec : r.at("records")) {
                const std::vector<int64_t> slots = rec.at("slots").get<std::vector<int64_t>>();
                double resident = g.other;
                if (global) {
                    resident += double(slots.at(0)) * g.mean();
                } else {
                    for (size_t l = 0; l < L; ++l) {
                        resident += double(slots.size() == 1 ? slots[0] : slots.at(l)) * g.bytes[l];
                    }
                }
                double bytes = 0, rounds = 0;
                const json per_layer = rec.value("misses_per_token_per_layer", json(nullptr));
                if (per_layer.is_array() && per_layer.size() == L) {
                    for (size_t l = 0; l < L; ++l) {
                        bytes += per_layer[l].get<double>() * g.bytes[l];
                        rounds += std::ceil(per_layer[l].get<double>() / tp.queue_depth);
                    }
                } else {
                    bytes = rec.at("misses_per_token").get<double>() * g.mean();
                    rounds = double(L) * std::ceil(rec.at("misses_per_token").get<double>() / double(L) / tp.queue_depth);
                }
                if (rec.contains("read_rounds_per_token") && rec["read_rounds_per_token"].is_number()) {
                    rounds = rec["read_rounds_per_token"].get<double>();
                }
                json o = {{"k", k},
                          {"criterion", criterion},
                          {"cache_experts", rec.value("cache", json(nullptr)).is_number_integer() ? rec["cache"].get<int64_t>() : slots.at(0)},
                          {"cache_scope", global ? "global" : "per-layer"},
                          {"policy", rec.at("policy")},
                          {"lambda", rec.value("lambda", 0.0)},
                          {"routed_bytes", double(k) * g.sum()},
                          {"resident_bytes", resident},
                          {"misses_per_token", rec.at("misses_per_token")},
                          {"read_bytes_per_token", bytes},
                          {"tok_per_s", tok_per_s(token_seconds(bytes, rounds, L, tp))},
                          {"source", "replay " + path.string()}};
                if (rec.value("cliff", false)) {
                    o["note"] = "global cache smaller than one token's experts";
                }
                add(std::move(o));
            }
        });
        replay_inputs.push_back({{"file", path.string()}, {"digest", file_digest(path)}});
    }

    // Every K: all of it resident, and the caches given by hand.
    std::set<int64_t> ks(opt.ks.begin(), opt.ks.end());
    for (const auto & [key, v] : kld) {
        ks.insert(key.second);
    }
    for (const auto & key : planned) {
        ks.insert(key.second);
    }
    if (ks.empty()) {
        throw Error("nothing to plan: give -k, a --replay result or an --eval report");
    }
    for (const int64_t k : ks) {
        if (k < g.used || k > g.n_expert) {
            throw Error(fmt::format("-k {}: K must be between the experts used per token ({}) and the experts ({})", k, g.used, g.n_expert));
        }
        std::set<std::string> criteria;
        for (const auto & [key, v] : kld) {
            if (key.second == k) {
                criteria.insert(key.first);
            }
        }
        for (const auto & key : planned) {
            if (key.second == k) {
                criteria.insert(key.first);
            }
        }
        if (criteria.empty()) {
            criteria.insert(k == g.n_expert ? "none" : "any");
        }
        for (const std::string & c : criteria) {
            add({{"k", k},
                 {"criterion", c},
                 {"cache_experts", k},
                 {"cache_scope", "per-layer"},
                 {"policy", "resident"},
                 {"lambda", 0.0},
                 {"routed_bytes", double(k) * g.sum()},
                 {"resident_bytes", g.other + double(k) * g.sum()},
                 {"misses_per_token", 0.0},
                 {"read_bytes_per_token", 0.0},
                 {"tok_per_s", tok_per_s(token_seconds(0, 0, L, tp))},
                 {"source", "every kept expert in RAM"}});
            for (size_t i = 0; i < opt.misses_per_token.size(); ++i) {
                const double m = opt.misses_per_token[i];
                const double bytes = m * g.mean();
                const double rounds = m > 0 ? double(L) * std::ceil(m / double(L) / tp.queue_depth) : 0;
                const json cache = opt.cache_experts.empty() ? json(nullptr) : json(opt.cache_experts[i]);
                add({{"k", k},
                     {"criterion", c},
                     {"cache_experts", cache},
                     {"cache_scope", "per-layer"},
                     {"policy", "given"},
                     {"lambda", 0.0},
                     {"routed_bytes", double(k) * g.sum()},
                     {"resident_bytes", cache.is_null() ? json(nullptr) : json(g.other + double(opt.cache_experts[i]) * g.sum())},
                     {"misses_per_token", m},
                     {"read_bytes_per_token", bytes},
                     {"tok_per_s", tok_per_s(token_seconds(bytes, rounds, L, tp))},
                     {"source", "--misses-per-token"}});
            }
        }
    }

    // Pareto front of tokens/s (higher; null is unbounded) against KLD (lower).
    const auto speed = [&](const json & o) {
        return o["tok_per_s"].is_null() ? std::numeric_limits<double>::infinity() : o["tok_per_s"].get<double>();
    };
    std::vector<size_t> order;
    for (size_t i = 0; i < options.size(); ++i) {
        if (!options[i]["kld_mean"].is_null() && !options[i]["bound"].get<bool>()) {
            order.push_back(i);
        }
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        if (speed(options[a]) != speed(options[b])) {
            return speed(options[a]) > speed(options[b]);
        }
        return options[a]["kld_mean"].get<double>() < options[b]["kld_mean"].get<double>();
    });
    json pareto = json::array();
    double best_kld = std::numeric_limits<double>::infinity();
    for (const size_t i : order) {
        if (options[i]["kld_mean"].get<double>() < best_kld) {
            best_kld = options[i]["kld_mean"].get<double>();
            pareto.push_back(i);
        }
    }

    json recommended = nullptr;
    std::string why;
    const auto describe = [&](const json & o) {
        const std::string cache = o["policy"] == "resident" ? "all kept experts resident"
                                  : o["cache_experts"].is_null()
                                      ? std::string(o["policy"].get<std::string>())
                                      : fmt::format("{} cache of {} experts{}, λ {}", o["policy"].get<std::string>(),
                                                    o["cache_experts"].get<int64_t>(), o["cache_scope"] == "global" ? " (global)" : " per layer",
                                                    o["lambda"].get<double>());
        const std::string speed_text = o["tok_per_s"].is_null() ? "unbounded tokens/s (no time per token in the model)"
                                                                : fmt::format("{:.2f} tokens/s", o["tok_per_s"].get<double>());
        return fmt::format("K {} by {}, {}: {}", o["k"].get<int64_t>(), o["criterion"].get<std::string>(), cache, speed_text);
    };
    if (!pareto.empty()) {
        if (opt.max_kld) {
            for (const json & i : pareto) {
                const json & o = options[i.get<size_t>()];
                if (o["kld_mean"].get<double>() <= *opt.max_kld) {
                    recommended = i;
                    why = fmt::format("the fastest option with mean KLD within --max-kld {}: {}, mean KLD {:.4g}{}", *opt.max_kld,
                                      describe(o), o["kld_mean"].get<double>(), o["kld_measured"].get<bool>() ? "" : " (interpolated)");
                    break;
                }
            }
            if (recommended.is_null()) {
                why = fmt::format("no feasible option has mean KLD within --max-kld {}", *opt.max_kld);
            }
        } else {
            const double fastest = speed(options[pareto[0].get<size_t>()]);
            for (const json & i : pareto) {
                const json & o = options[i.get<size_t>()];
                if (speed(o) >= opt.speed_share * fastest) {
                    recommended = i;  // the front is in falling speed and falling KLD: keep the last that is fast enough
                }
            }
            const json & o = options[recommended.get<size_t>()];
            why = fmt::format("the lowest mean KLD ({:.4g}{}) among options within {:.0f}% of the fastest feasible speed: {}",
                              o["kld_mean"].get<double>(), o["kld_measured"].get<bool>() ? "" : ", interpolated",
                              100 * opt.speed_share, describe(o));
        }
    } else if (!options.empty()) {
        size_t best = 0;
        for (size_t i = 1; i < options.size(); ++i) {
            if (options[i]["bound"].get<bool>()) {
                continue;
            }
            if (options[best]["bound"].get<bool>() || speed(options[i]) > speed(options[best]) ||
                (speed(options[i]) == speed(options[best]) && options[i]["k"].get<int64_t>() > options[best]["k"].get<int64_t>())) {
                best = i;
            }
        }
        recommended = best;
        why = "no quality was measured (no --eval): the fastest option that fits, " + describe(options[best]) +
              "; measure its KLD before trusting it";
    } else {
        why = "no option fits in the RAM budget";
    }
    if (!recommended.is_null() && budget > 0) {
        const json & o = options[recommended.get<size_t>()];
        if (!o["resident_bytes"].is_null()) {
            why += fmt::format("; {:.2f} GB resident of the {:.2f} GB budget", gb(o["resident_bytes"].get<double>()), gb(budget));
        }
    }

    json layer_bytes = json::array();
    for (const double b : g.bytes) {
        layer_bytes.push_back(b);
    }
    json throughput_inputs = to_json(tp);
    throughput_inputs["model"] = "t = compute + layers * sync + read_bytes / ssd + rounds * latency; tokens/s = 1 / t";
    return {{"format", "moeprune-plan"},
            {"version", 1},
            {"inputs",
             {{"geometry", {{"source", g.source}, {"moe_layers", L}, {"experts", g.n_expert}, {"used", g.used},
                            {"expert_bytes", layer_bytes}, {"routed_bytes_all", g.sum() * double(g.n_expert)},
                            {"other_bytes", g.other_known ? json(g.other) : json(nullptr)}}},
              {"ram_bytes", opt.ram_bytes > 0 ? json(opt.ram_bytes) : json(nullptr)},
              {"reserve_bytes", opt.reserve_bytes},
              {"budget_bytes", budget > 0 ? json(budget) : json(nullptr)},
              {"throughput", throughput_inputs},
              {"replays", replay_inputs},
              {"evals", eval_inputs},
              {"misses_per_token", opt.misses_per_token},
              {"cache_experts", opt.cache_experts},
              {"max_kld", opt.max_kld ? json(*opt.max_kld) : json(nullptr)},
              {"speed_share", opt.speed_share}}},
            {"options", options},
            {"infeasible", infeasible},
            {"pareto", pareto},
            {"recommended", recommended},
            {"why", why}};
}

std::string plan_text(const json & plan) {
    const json & in = plan["inputs"];
    const json & g = in["geometry"];
    std::string out = fmt::format("model: {} ({} MoE layers, {} experts, {} used; one expert {:.4f} MB", g["source"].get<std::string>(),
                                  g["moe_layers"].get<int>(), g["experts"].get<int64_t>(), g["used"].get<int64_t>(),
                                  g["expert_bytes"][0].get<double>() / 1e6);
    out += g["other_bytes"].is_null() ? "; other weights unknown)\n"
                                      : fmt::format("; other weights {:.3f} GB)\n", g["other_bytes"].get<double>() / 1e9);
    out += in["budget_bytes"].is_null()
               ? "RAM: no limit given\n"
               : fmt::format("RAM: {:.2f} GB - reserve {:.2f} GB = {:.2f} GB budget\n", in["ram_bytes"].get<double>() / 1e9,
                             in["reserve_bytes"].get<double>() / 1e9, in["budget_bytes"].get<double>() / 1e9);
    const json & t = in["throughput"];
    out += fmt::format("SSD {} GB/s, {} us per read round, queue depth {}, compute {} ms/token, sync {} us/layer\n",
                       t["ssd_gbps"].get<double>(), t["read_latency_us"].get<double>(), t["queue_depth"].get<int>(),
                       t["compute_ms"].get<double>(), t["sync_us"].get<double>());
    out += fmt::format("{:>2} {:>5} {:<14} {:<18} {:>8} {:>6} {:>10} {:>10} {:>9} {:>10} {:>10}\n", "", "K", "criterion", "policy",
                       "cache", "λ", "routed GB", "RAM GB", "miss/tok", "tok/s", "KLD");
    std::set<size_t> front;
    for (const json & i : plan["pareto"]) {
        front.insert(i.get<size_t>());
    }
    const json & opts = plan["options"];
    std::vector<size_t> order(opts.size());
    for (size_t i = 0; i < order.size(); ++i) {
        order[i] = i;
    }
    const auto num = [](const json & v, const char * f) { return v.is_null() ? std::string("-") : fmt::format(fmt::runtime(f), v.get<double>()); };
    // A long table shows the front, the recommendation and the fastest option of every
    // (K, criterion); the JSON has them all.
    std::set<size_t> shown_rows;
    if (opts.size() > 40) {
        std::map<std::pair<int64_t, std::string>, size_t> fastest;
        for (size_t i = 0; i < opts.size(); ++i) {
            if (opts[i].value("bound", false)) {
                continue;
            }
            const auto key = std::pair{opts[i]["k"].get<int64_t>(), opts[i]["criterion"].get<std::string>()};
            const auto speed = [&](size_t j) { return opts[j]["tok_per_s"].is_null() ? 1e300 : opts[j]["tok_per_s"].get<double>(); };
            if (!fastest.count(key) || speed(i) > speed(fastest[key])) {
                fastest[key] = i;
            }
        }
        for (const auto & [key, i] : fastest) {
            shown_rows.insert(i);
        }
    }
    size_t shown = 0;
    for (const size_t i : order) {
        const json & o = opts[i];
        const bool rec = !plan["recommended"].is_null() && plan["recommended"].get<size_t>() == i;
        if (opts.size() > 40 && !front.count(i) && !rec && !shown_rows.count(i)) {
            continue;
        }
        ++shown;
        std::string kld = num(o["kld_mean"], "{:.4f}");
        if (!o["kld_measured"].is_null() && !o["kld_measured"].get<bool>()) {
            kld += "~";
        }
        out += fmt::format("{:>2} {:>5} {:<14} {:<18} {:>8} {:>6} {:>10.3f} {:>10} {:>9} {:>10} {:>10}\n",
                           rec ? ">" : front.count(i) ? "*" : "", o["k"].get<int64_t>(), o["criterion"].get<std::string>(),
                           o["policy"].get<std::string>(), o["cache_experts"].is_null() ? "-" : std::to_string(o["cache_experts"].get<int64_t>()),
                           fmt::format("{:g}", o["lambda"].get<double>()), o["routed_bytes"].get<double>() / 1e9,
                           o["resident_bytes"].is_null() ? std::string("-") : fmt::format("{:.3f}", o["resident_bytes"].get<double>() / 1e9),
                           num(o["misses_per_token"], "{:.2f}"), num(o["tok_per_s"], "{:.2f}"), kld);
    }
    if (shown < opts.size()) {
        out += fmt::format("({} more options in the JSON; * Pareto front, > recommended, ~ interpolated KLD; belady is the "
                           "offline bound, never recommended)\n", opts.size() - shown);
    } else {
        out += "(* Pareto front, > recommended, ~ interpolated KLD)\n";
    }
    if (plan["infeasible"].get<uint64_t>() > 0) {
        out += fmt::format("{} options do not fit in the RAM budget\n", plan["infeasible"].get<uint64_t>());
    }
    out += "recommended: " + plan["why"].get<std::string>() + "\n";
    return out;
}

} // namespace moeprune
