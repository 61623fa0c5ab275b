// `moeprune plan`'s text: the plan.json it wrote, as a table for a terminal.
#include "plan/plan.h"

#include <fmt/format.h>

#include <set>

namespace moeprune {

using nlohmann::json;

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
    out += fmt::format("SSD {:.4g} GB/s, {:.4g} us per read round, queue depth {}, compute {:.4g} ms/token, sync {:.4g} us/layer\n",
                       t["ssd_gbps"].get<double>(), t["read_latency_us"].get<double>(), t["queue_depth"].get<int>(),
                       t["compute_ms"].get<double>(), t["sync_us"].get<double>());
    if (!in["measured"].is_null()) {
        out += fmt::format("from measurement ({}): {}\n", in["measured"]["file"].get<std::string>(),
                           fmt::join(in["measured"]["from_measurement"].get<std::vector<std::string>>(), ", "));
    }
    const bool mtp = g.value("mtp_layers", 0) > 0;
    out += fmt::format("{:>2} {:>5} {:<14} {:<18} {:>8} {:>6} {:>10} {:>10} {:>9} {:>10} {:>10}{}\n", "", "K", "criterion", "policy",
                       "cache", "λ", "routed GB", "RAM GB", "miss/tok", "tok/s", "KLD",
                       mtp ? fmt::format(" {:>8} {:>10}", "accept", "tok/s MTP") : std::string());
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
        std::string draft;
        if (mtp) {
            const json d = o.value("mtp_draft", json::object());
            const json a = d.value("acceptance", json()), t = d.value("tok_per_s", json());
            draft = fmt::format(" {:>8} {:>10}", a.is_null() ? std::string("-") : fmt::format("{:.1f}%", 100 * a.get<double>()),
                                num(t, "{:.2f}"));
        }
        out += fmt::format("{:>2} {:>5} {:<14} {:<18} {:>8} {:>6} {:>10.3f} {:>10} {:>9} {:>10} {:>10}{}\n",
                           rec ? ">" : front.count(i) ? "*" : "", o["k"].get<int64_t>(), o["criterion"].get<std::string>(),
                           o["policy"].get<std::string>(), o["cache_experts"].is_null() ? "-" : std::to_string(o["cache_experts"].get<int64_t>()),
                           fmt::format("{:g}", o["lambda"].get<double>()), o["routed_bytes"].get<double>() / 1e9,
                           o["resident_bytes"].is_null() ? std::string("-") : fmt::format("{:.3f}", o["resident_bytes"].get<double>() / 1e9),
                           num(o["misses_per_token"], "{:.2f}"), num(o["tok_per_s"], "{:.2f}"), kld, draft);
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
