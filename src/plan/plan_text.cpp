// `moeprune plan`'s text: the plan.json it wrote, as a table for a terminal.
#include "formats/stage_reports.h"
#include "plan/plan.h"

#include <fmt/format.h>

#include <map>
#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

std::string commands_text(const PlanFile & plan) {
    if (!plan.commands) {
        const bool simulated = plan.recommended && *plan.recommended < plan.options.size() &&
                               plan.options[*plan.recommended].runs_on != kRunsOnLlamaCpp;
        return simulated ? "no command runs it: no llama.cpp release runs an expert cache; --runs-on llama.cpp "
                           "recommends among what llama.cpp runs, with its commands\n"
                         : "";
    }
    std::string out = "to run it:\n";
    for (const std::string & line : plan.commands->lines) {
        out += "  " + line + "\n";
    }
    for (const std::string & note : plan.commands->notes) {
        out += "  # " + note + "\n";
    }
    return out;
}

} // namespace

std::string plan_text(const PlanFile & plan) {
    const json & in = plan.inputs;
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
    const std::set<size_t> front(plan.pareto.begin(), plan.pareto.end());
    const std::set<size_t> front_runs_on(plan.pareto_runs_on.begin(), plan.pareto_runs_on.end());
    const std::vector<PlanOption> & opts = plan.options;
    const auto num = [](const std::optional<double> & v, const char * f) {
        return v ? fmt::format(fmt::runtime(f), *v) : std::string("-");
    };
    // A long table shows the fronts, the recommendation and the fastest option of every
    // (K, criterion); the JSON has them all.
    std::set<size_t> shown_rows;
    if (opts.size() > 40) {
        std::map<std::pair<int64_t, std::string>, size_t> fastest;
        for (size_t i = 0; i < opts.size(); ++i) {
            if (opts[i].bound) {
                continue;
            }
            const auto key = std::pair{opts[i].k, opts[i].criterion};
            if (!fastest.count(key) || opts[i].speed() > opts[fastest[key]].speed()) {
                fastest[key] = i;
            }
        }
        for (const auto & [key, i] : fastest) {
            shown_rows.insert(i);
        }
    }
    size_t shown = 0;
    for (size_t i = 0; i < opts.size(); ++i) {
        const PlanOption & o = opts[i];
        const bool rec = plan.recommended == i;
        if (opts.size() > 40 && !front.count(i) && !front_runs_on.count(i) && !rec && !shown_rows.count(i)) {
            continue;
        }
        ++shown;
        std::string kld = num(o.kld_mean, "{:.4f}");
        if (o.kld_measured && !*o.kld_measured) {
            kld += "~";
        }
        std::string draft;
        if (mtp) {
            const std::optional<double> a = o.mtp_draft ? o.mtp_draft->acceptance : std::nullopt;
            draft = fmt::format(" {:>8} {:>10}", a ? fmt::format("{:.1f}%", 100 * *a) : std::string("-"),
                                num(o.mtp_draft ? o.mtp_draft->tok_per_s : std::nullopt, "{:.2f}"));
        }
        out += fmt::format("{:>2} {:>5} {:<14} {:<18} {:>8} {:>6} {:>10.3f} {:>10} {:>9} {:>10} {:>10}{}{}\n",
                           rec ? ">" : front_runs_on.count(i) ? "*" : front.count(i) ? "+" : "", o.k, o.criterion,
                           o.policy, o.cache_experts ? std::to_string(*o.cache_experts) : "-", fmt::format("{:g}", o.lambda),
                           o.routed_bytes / 1e9,
                           o.resident_bytes ? fmt::format("{:.3f}", *o.resident_bytes / 1e9) : std::string("-"),
                           num(o.misses_per_token, "{:.2f}"), num(o.tok_per_s, "{:.2f}"), kld, draft,
                           o.runs_on == kRunsOnLlamaCpp ? "" : "  (simulated)");
    }
    const std::string legend = plan.runs_on == RunsOn::Any
                                   ? "* Pareto front, > recommended, ~ interpolated KLD, (simulated) an expert cache no "
                                     "llama.cpp release runs"
                                   : "* Pareto front of what llama.cpp runs, + on the front only with the simulated "
                                     "expert caches, > recommended, ~ interpolated KLD";
    if (shown < opts.size()) {
        out += fmt::format("({} more options in the JSON; {}; belady is the offline bound, never recommended)\n",
                           opts.size() - shown, legend);
    } else {
        out += "(" + legend + ")\n";
    }
    if (plan.infeasible > 0) {
        out += fmt::format("{} options do not fit in the RAM budget\n", plan.infeasible);
    }
    return out + "recommended: " + plan.why + "\n" + commands_text(plan);
}

} // namespace moeprune
