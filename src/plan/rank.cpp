// The options' quality (measured, interpolated or closed-loop), their MTP draft, the
// Pareto fronts and the recommendation.
#include "plan/planner.h"

#include "sim/policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace moeprune::plan_impl {

// Pareto front of tokens/s (higher; unknown is unbounded) against KLD (lower), of every
// option or of the eligible ones.
std::vector<size_t> Planner::pareto_front(bool eligible_only) const {
    std::vector<size_t> order;
    for (size_t i = 0; i < options.size(); ++i) {
        if (options[i].kld_mean && !options[i].bound && (!eligible_only || eligible(options[i]))) {
            order.push_back(i);
        }
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        if (options[a].speed() != options[b].speed()) {
            return options[a].speed() > options[b].speed();
        }
        return *options[a].kld_mean < *options[b].kld_mean;
    });
    std::vector<size_t> pareto;
    double best_kld = std::numeric_limits<double>::infinity();
    for (const size_t i : order) {
        if (*options[i].kld_mean < best_kld) {
            best_kld = *options[i].kld_mean;
            pareto.push_back(i);
        }
    }
    return pareto;
}

// From the front of the eligible options: the fastest within --max-kld, else the most
// accurate within --speed-share of the fastest; without quality, the fastest.
std::pair<std::optional<size_t>, std::string> Planner::recommend(const std::vector<size_t> & pareto) const {
    std::optional<size_t> recommended;
    std::string why;
    const auto kld_text = [](const PlanOption & o) {
        return fmt::format("{:.4g}{}", *o.kld_mean, o.kld_measured.value_or(false) ? "" : ", interpolated");
    };
    if (!pareto.empty()) {
        if (opt.max_kld) {
            for (const size_t i : pareto) {
                if (*options[i].kld_mean <= *opt.max_kld) {
                    recommended = i;
                    why = fmt::format("the fastest option{} with mean KLD within --max-kld {}: {}, mean KLD {}",
                                      accuracy_words(), *opt.max_kld, options[i].describe(), kld_text(options[i]));
                    break;
                }
            }
            if (!recommended) {
                why = fmt::format("no feasible option{} has mean KLD within --max-kld {}", runs_on_words(),
                                  *opt.max_kld);
            }
        } else {
            const double fastest = options[pareto[0]].speed();
            for (const size_t i : pareto) {
                // The front is in falling speed and falling KLD: keep the last that is fast enough.
                if (options[i].speed() >= opt.speed_share * fastest) {
                    recommended = i;
                }
            }
            const PlanOption & o = options[*recommended];
            why = fmt::format("the lowest mean KLD ({}) among options{} within {:.0f}% of the fastest feasible speed: {}",
                              kld_text(o), runs_on_words(), 100 * opt.speed_share, o.describe());
        }
    } else {
        for (size_t i = 0; i < options.size(); ++i) {
            const PlanOption & o = options[i];
            if (o.bound || !eligible(o)) {
                continue;
            }
            if (!recommended || o.speed() > options[*recommended].speed() ||
                (o.speed() == options[*recommended].speed() && o.k > options[*recommended].k)) {
                recommended = i;
            }
        }
        if (recommended) {
            why = "no quality was measured (no --eval): the fastest option" + runs_on_words() + " that fits, " +
                  options[*recommended].describe() + "; measure its KLD before trusting it";
        } else if (!options.empty()) {
            why = "no option that stock llama.cpp runs (every kept expert resident, or a limit --measured) fits in "
                  "the RAM budget; the expert-cache options need a runtime that implements them (--runs-on any "
                  "recommends among them)";
        } else {
            why = "no option fits in the RAM budget";
        }
    }
    if (recommended) {
        why += recommendation_details(options[*recommended]);
    }
    const size_t unanswered = size_t(std::count_if(options.begin(), options.end(), [&](const PlanOption & o) {
        return !answered(o) && !o.bound && (opt.runs_on == RunsOn::Any || o.runs_on == kRunsOnLlamaCpp);
    }));
    if (unanswered > 0) {
        why += fmt::format("; {} predicted option{} outside what measure's predictor models left out (the note of each "
                           "says why): measured (moeprune run --measure), {} may be recommended",
                           unanswered, unanswered == 1 ? "" : "s", unanswered == 1 ? "it" : "they");
    }
    why += "; " + timing_source(opt, measured);
    return {recommended, why};
}

// What the recommendation's sentence adds: its RAM, its draft, and what runs it.
std::string Planner::recommendation_details(const PlanOption & o) const {
    std::string out;
    if (budget > 0 && o.resident_bytes) {
        out += fmt::format("; {:.2f} GB resident of the {:.2f} GB budget", gb(*o.resident_bytes), gb(budget));
    }
    if (o.mtp_draft && o.mtp_draft->tok_per_s) {
        out += fmt::format("; with the MTP head drafting one token ({:.1f}% accepted, {}): {:.2f} tokens/s",
                           100 * *o.mtp_draft->acceptance, *o.mtp_draft->acceptance_source, *o.mtp_draft->tok_per_s);
    }
    if (o.runs_on == kRunsOnExpertCache) {
        out += "; " + o.runs_on_note;
    }
    if (o.shortlist) {
        out += o.shortlist->predicted_tok_per_s
                   ? fmt::format("; predicted {:.2f} tokens/s before it was measured (error {:.0f}%)",
                                 *o.shortlist->predicted_tok_per_s, 100 * *o.shortlist->error())
                   : "; predicted unbounded before it was measured";
    }
    return out;
}

// Which runtime would run a simulated cache.
std::string Planner::runs_on_note(const PlanOption & o) {
    if (o.runs_on != kRunsOnExpertCache) {
        return "";
    }
    std::string note = "simulated, unmeasured: no llama.cpp release at moeprune's pin runs an expert cache";
    if (o.policy == "lru" && o.cache_scope == "per-layer" && o.lambda == 0) {
        note += "; a per-layer LRU of expert slots in GPU memory is proposed for llama.cpp (pull request 27861, "
                "--moe-expert-cache N slots per layer, not merged when this was written)";
    }
    return note;
}

// Measured KLD of (criterion, K), or interpolated linearly in K between the nearest
// measured Ks of the same criterion; the flag says which.
std::pair<std::optional<double>, bool> Planner::kld_of(const std::string & criterion, int64_t k) const {
    if (k == g.n_expert) {
        return {0.0, true}; // nothing removed: the base itself
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
        hi = {g.n_expert, 0.0}; // the unpruned model is the base itself
    }
    if (lo && hi) {
        const double f = double(k - lo->first) / double(hi->first - lo->first);
        return {lo->second + f * (hi->second - lo->second), false};
    }
    return {std::nullopt, false};
}

double Planner::mtp_sum() const {
    double s = 0;
    for (const double b : g.mtp_bytes) {
        s += b;
    }
    return s;
}

// The option with one draft token per step (sim/throughput.h), beside it without.
PlanDraft Planner::draft_option(const PlanOption & o, const TokenTraffic & trunk, const DraftTraffic & d) const {
    std::optional<std::pair<double, std::string>> a;
    if (opt.mtp_acceptance) {
        a = {*opt.mtp_acceptance, "--mtp-acceptance"};
    } else {
        const auto it = acceptance.find({o.k == g.n_expert ? "none" : o.criterion, o.k});
        if (it != acceptance.end()) {
            a = it->second;
        }
    }
    PlanDraft out;
    if (a) {
        out.acceptance = a->first;
        out.acceptance_source = a->second;
        out.tokens_per_step = tokens_per_step(a->first, 1);
    }
    if (d.unknown.empty()) {
        out.mtp_read_bytes_per_token = d.mtp.exposed_bytes;
    }
    out.resident_bytes = d.resident_bytes;
    out.feasible = budget <= 0 || !d.resident_bytes || *d.resident_bytes <= budget;
    if (!d.unknown.empty()) {
        out.note = d.unknown;
    } else if (!a) {
        out.note = "no draft acceptance measured for this keep map (eval it with the MTP head, or give "
                   "--mtp-acceptance)";
    } else {
        const DraftStep step{a->first, 1, g.mtp_bytes.size(), d.mtp};
        const double seconds = speculative_step_seconds(trunk, L, step, tp);
        if (seconds > 0) {
            out.step_ms = seconds * 1e3;
            out.tok_per_s = speculative_tokens_per_second(trunk, L, step, tp);
            if (o.tok_per_s) {
                out.speedup = *out.tok_per_s / *o.tok_per_s;
            }
        }
    }
    return out;
}

void Planner::add(PlanOption o, const TokenTraffic & trunk, const DraftTraffic & d) {
    if (!g.mtp_bytes.empty()) {
        o.mtp_draft = draft_option(o, trunk, d);
    }
    add(std::move(o));
}

void Planner::add(PlanOption o) {
    o.feasible = budget <= 0 || !o.resident_bytes || *o.resident_bytes <= budget;
    if (!o.feasible) {
        ++infeasible;
        return;
    }
    o.runs_on = runs_on_of(o.policy);
    o.runs_on_note = runs_on_note(o);
    // Belady needs the future: a bound to compare with, never a choice.
    o.bound = policy_reads_future(o.policy);
    if (o.lambda > 0) {
        const ClosedKey key{o.criterion, o.k, o.policy, o.cache_experts.value_or(-1), o.lambda};
        const auto it = o.cache_scope == "per-layer" ? closed_kld.find(key) : closed_kld.end();
        o.kld_loop = "closed";
        if (it != closed_kld.end()) {
            o.kld_mean = it->second;
            o.kld_measured = true;
        } else {
            o.kld_note = "unmeasured: cache-aware routing (λ > 0) changes the output; only the closed loop "
                         "(eval --cache-policy --cache --lambda) measures its KLD";
        }
    } else {
        const auto [k_mean, measured] = kld_of(o.criterion, o.k);
        o.kld_mean = k_mean;
        if (k_mean) {
            o.kld_measured = measured;
        }
        o.kld_loop = "open";
        if (o.k == g.n_expert) {
            o.task_accuracy = base_accuracy;
        } else if (const auto it = accuracy.find({o.criterion, o.k}); it != accuracy.end()) {
            o.task_accuracy = it->second;
        }
    }
    options.push_back(std::move(o));
}

std::string Planner::accuracy_noise() const {
    if (!opt.min_accuracy || !base_accuracy) {
        return "";
    }
    const double allowed = (1 - *opt.min_accuracy) * *base_accuracy, noise = 2 * base_accuracy_stderr;
    if (allowed >= noise) {
        return "";
    }
    return fmt::format(" (--min-accuracy {}: it allows {:.1f} points of task accuracy lost, but the base's {:.1f}% has "
                       "a standard error of {:.1f} points over {} tasks, so differences under {:.1f} points are noise: "
                       "accuracy cannot tell these options apart; more tasks, or KLD, can)",
                       *opt.min_accuracy, 100 * allowed, 100 * *base_accuracy, 100 * base_accuracy_stderr,
                       base_task_count, 100 * noise);
}

} // namespace moeprune::plan_impl
