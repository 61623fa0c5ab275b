// What runs today in llama.cpp, apart from what a simulated expert cache would add.
#include "report/html.h"
#include "report/section.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

std::string option_row(const PlanOption & o, const std::string & label, const std::optional<double> & base_speed) {
    const std::string measured =
        o.shortlist  ? fmt::format("measured under {}{}", o.shortlist->ram,
                                   o.shortlist->predicted_tok_per_s
                                       ? fmt::format(" (predicted {:.4g})", *o.shortlist->predicted_tok_per_s)
                                       : std::string())
        : o.measured ? "measured under " + o.measured->ram
        : o.runs_on == kRunsOnExpertCache ? "simulated"
        : o.policy == kPolicyResident          ? "predicted (every kept expert in RAM)"
                                          : "predicted (measure's page-cache predictor)";
    const json speedup = base_speed && o.tok_per_s && *base_speed > 0 ? json(*o.tok_per_s / *base_speed) : json();
    return "<tr><td>" + html_escape(label) + "</td><td>" + cell(or_null(o.tok_per_s)) + "</td><td>" +
           html_escape(measured) + "</td><td>" + cell(or_null(o.resident_bytes ? std::optional(*o.resident_bytes / 1e9)
                                                                                 : std::nullopt)) +
           "</td><td>" + cell(or_null(o.kld_mean)) + "</td><td>" + cell(speedup) + "</td></tr>";
}

std::string label_of(const PlanOption & o) {
    if (o.measured) {
        return fmt::format("all {} experts, page cache{}", o.k,
                           o.measured->read_ahead_kb ? fmt::format(", read-ahead {} KB", *o.measured->read_ahead_kb) : "");
    }
    if (o.policy == kPolicyPageCache) {
        return fmt::format("K {} by {}, sliced and mapped from disk{}", o.k, o.criterion,
                           o.read_ahead_kb ? fmt::format(", read-ahead {} KB", *o.read_ahead_kb) : "");
    }
    return o.policy == kPolicyResident ? fmt::format("K {} by {}, resident", o.k, o.criterion)
                                  : fmt::format("K {} by {}, {} of {} experts{}{}", o.k, o.criterion, o.policy,
                                                o.cache_experts.value_or(0), o.cache_scope == "global" ? " (global)" : "",
                                                o.lambda > 0 ? fmt::format(", MoCE λ {}", o.lambda) : "");
}

// What cache-aware routing (MoCE) adds to a cache: its fastest option with a KLD, against
// the same cache routing as trained.
std::string moce_html(const PlanFile & plan) {
    const PlanOption * best = nullptr;
    for (const PlanOption & o : plan.options) {
        if (o.lambda > 0 && o.feasible && !o.bound && o.kld_mean && o.tok_per_s && (!best || *o.tok_per_s > *best->tok_per_s)) {
            best = &o;
        }
    }
    if (!best) {
        return "<p>Cache-aware routing (MoCE: the router favours experts the cache holds among its top candidates) "
               "was not replayed: a <code>lambdas</code> value above 0 in run.toml (<code>--lambda</code>) adds it, "
               "its KLD measured with the cache in the loop.</p>\n";
    }
    const auto plain = std::find_if(plan.options.begin(), plan.options.end(), [&](const PlanOption & o) {
        return o.lambda == 0 && o.k == best->k && o.criterion == best->criterion && o.policy == best->policy &&
               o.cache_experts == best->cache_experts && o.cache_scope == best->cache_scope;
    });
    std::string out = fmt::format("<p>Cache-aware routing (MoCE, λ {}) on {}: {:.4g} tokens/s at mean KLD {:.4g} "
                                  "({} loop)", best->lambda, html_escape(label_of(*best)), *best->tok_per_s,
                                  *best->kld_mean, best->kld_loop);
    if (plain != plan.options.end() && plain->tok_per_s && *plain->tok_per_s > 0) {
        out += fmt::format(", against {:.4g} tokens/s (× {:.2f}) at mean KLD {} routed as trained", *plain->tok_per_s,
                           *best->tok_per_s / *plain->tok_per_s,
                           plain->kld_mean ? fmt::format("{:.4g}", *plain->kld_mean) : std::string("unknown"));
    }
    return out + ". Simulated, as the caches are: no llama.cpp release routes by what is cached.</p>\n";
}

std::string runs_on_html(const PlanFile & plan) {
    const std::string head = "<tr><th>option</th><th>tokens/s</th><th>figure</th><th>RAM GB</th><th>mean KLD</th>"
                             "<th>× the recommendation</th></tr>";
    const PlanOption * rec = plan.recommendation();
    const std::optional<double> base = rec ? rec->tok_per_s : std::nullopt;
    std::string today, cache;
    std::set<size_t> shown(plan.pareto.begin(), plan.pareto.end());
    shown.insert(plan.pareto_runs_on.begin(), plan.pareto_runs_on.end());
    if (plan.recommended) {
        shown.insert(*plan.recommended);
    }
    const PlanOption * bound = nullptr;
    for (size_t i = 0; i < plan.options.size(); ++i) {
        const PlanOption & o = plan.options[i];
        if (o.bound && (!bound || o.speed() > bound->speed())) {
            bound = &o;
        }
        if (!shown.count(i) && !o.measured) {
            continue;
        }
        const std::string label = label_of(o) + (plan.recommended == i ? " (recommended)" : "");
        (o.runs_on == kRunsOnLlamaCpp ? today : cache) += option_row(o, label, base);
    }
    std::string body = "<h2>Runs today in llama.cpp</h2>\n<p>What a stock llama.cpp release runs: a sliced model in "
                       "RAM, or the model mapped from disk with the kernel's page cache as its only expert cache. "
                       "These are the options on the front and the limits measured.</p>\n<table>" + head + today +
                       "</table>\n";
    body += "<h2>What an expert cache would add</h2>\n<p>The simulated policies: an expert cache of N slots that no "
            "llama.cpp release at moeprune's pin runs (plan.json's runs_on). Their tokens/s are the replay's "
            "prediction, not a measurement; they show which cache a runtime should implement.</p>\n<table>" + head +
            cache + "</table>\n";
    if (bound) {
        body += "<p>Belady's offline optimum, the most any cache could do: " + html_escape(label_of(*bound)) + ", " +
                cell(or_null(bound->tok_per_s)) + " tokens/s.</p>\n";
    }
    return body + moce_html(plan);
}

} // namespace

ReportSection runs_on_section() {
    return {.id = "runs_on", .html = [](const ReportData & d) { return runs_on_html(d.plan); }};
}

} // namespace moeprune
