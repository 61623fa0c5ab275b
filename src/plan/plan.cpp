#include "plan/plan.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/json.h"
#include "formats/keep_map.h"
#include "formats/measure_report.h"
#include "formats/plan_option.h"
#include "formats/stage_reports.h"
#include "formats/verify_summary.h"
#include "plan/calibration.h"
#include "plan/commands.h"
#include "plan/geometry.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <tuple>

namespace moeprune {

using nlohmann::json;

namespace {

// Criterion and K of a keep map: from the map itself, or from select's file name.
std::pair<std::string, int64_t> map_identity(const std::string & path, const std::string & name) {
    std::error_code ec;
    if (!path.empty() && std::filesystem::is_regular_file(path, ec)) {
        const KeepMap km = read_keep_map(path);
        return {km.metric.empty() ? std::filesystem::path(path).stem().string() : km.metric, km.k};
    }
    const KeepMapName n = parse_keep_map_name(name.empty() ? path : name);
    return {n.criterion, n.k};
}

std::optional<double> tok_per_s(double seconds) {
    return seconds > 0 ? std::optional(1.0 / seconds) : std::nullopt;
}

// One plan in the making: the options priced so far and the quality measured for them.
class Planner {
public:
    Planner(const PlanOptions & opt, Geometry g, std::optional<Measured> measured)
        : opt(opt), g(std::move(g)), measured(std::move(measured)), tp(opt.throughput), L(this->g.bytes.size()),
          budget(opt.ram_bytes > 0 ? opt.ram_bytes - opt.reserve_bytes : 0), model_digest_seen(this->g.digest),
          model_digest_from(this->g.source) {}

    void check_settings() const {
        if (opt.mtp_acceptance && g.mtp_bytes.empty()) {
            throw Error(fmt::format("--mtp-acceptance: {} has no MTP (nextn) layers to draft with", g.source));
        }
        for (const int64_t c : opt.cache_experts) {
            if (c < 1 || c > g.n_expert) {
                throw Error(fmt::format("--cache-experts {}: a per-layer cache holds 1 to {} experts ({})", c,
                                        g.n_expert, g.source));
            }
        }
        if (opt.ram_bytes > 0 && budget < g.other) {
            throw Error(
                fmt::format("--ram {:.2f} GB minus the reserve of {:.2f} GB leaves {:.2f} GB, less than the {:.2f} GB "
                            "of weights that are not routed experts ({})",
                            gb(opt.ram_bytes), gb(opt.reserve_bytes), gb(budget), gb(g.other), g.source));
        }
        if (!opt.cache_experts.empty() && opt.cache_experts.size() != opt.misses_per_token.size()) {
            throw Error("--cache-experts needs one size per --misses-per-token value");
        }
    }

    // Quality measured per (criterion, K), and per (criterion, K, policy, cache, λ) in the
    // closed loop: an option that reroutes (λ > 0) has only the closed loop's KLD.
    void read_evals() {
        for (const auto & path : opt.evals) {
            const EvalFile report = read_eval_report(path);
            check_model(JsonFields(report.base, report.path, "base"), "this eval report");
            for (const EvalFileCandidate & c : report.candidates) {
                if (c.kind == "closed-loop") {
                    auto [criterion, k] =
                        c.keep ? map_identity(*c.keep, *c.keep) : std::pair<std::string, int64_t>{"none", g.n_expert};
                    if (k <= 0 || k > g.n_expert) {
                        c.place.fail("keep", fmt::format("names K {}, but the model has {} experts", k, g.n_expert));
                    }
                    if (c.cache > g.n_expert) {
                        c.place.fail("cache", fmt::format("is {}, not an integer in [1, {}]", c.cache, g.n_expert));
                    }
                    closed_kld[{criterion, k, c.policy, c.cache, c.lambda}] = measured_kld(c);
                    continue;
                }
                if (c.kind != "keep") {
                    continue;
                }
                const auto [criterion, k] = map_identity(c.source, c.name);
                if (k > 0) {
                    if (k < g.used || k > g.n_expert) {
                        c.place.fail("name", fmt::format("names K {}, but the model has {} experts and uses {} per token",
                                                         k, g.n_expert, g.used));
                    }
                    kld[{criterion, k}] = measured_kld(c);
                    if (!c.source.empty()) {
                        keep_maps.emplace(std::pair{criterion, k}, c.source);
                    }
                    read_acceptance(c.all, {criterion, k}, path);
                }
            }
            if (report.base.contains("mtp") && report.base["mtp"].is_object()) {
                const JsonFields mtp(report.base["mtp"], report.path, "base.mtp");
                EvalFigures base;
                base.mtp_acceptance = mtp.number("acceptance", 0, 1);
                if (mtp.has("tokens_per_step")) {
                    base.mtp_tokens_per_step = mtp.number("tokens_per_step", 1, 65536);
                }
                read_acceptance(base, {"none", g.n_expert}, path);
            }
            eval_inputs.push_back({{"file", path.string()}, {"digest", report.digest}});
        }
    }

    // The draft acceptance of (criterion, K): from the greedy continuations' accepted length
    // per step where eval generated, else the teacher-forced share.
    void read_acceptance(const EvalFigures & f, const std::pair<std::string, int64_t> & key,
                         const std::filesystem::path & path) {
        if (g.mtp_bytes.empty()) {
            return;
        }
        if (f.mtp_tokens_per_step) {
            acceptance[key] = {*f.mtp_tokens_per_step - 1.0,
                               fmt::format("eval {}: accepted length per step of greedy continuations", path.string())};
        } else if (f.mtp_acceptance) {
            acceptance[key] = {*f.mtp_acceptance, fmt::format("eval {}: teacher-forced draft acceptance", path.string())};
        }
    }

    static double measured_kld(const EvalFileCandidate & c) {
        if (!c.all.kld_mean) {
            c.place.fail("all.kld_mean", "is null, not a number in [0, inf]");
        }
        return *c.all.kld_mean;
    }

    // Replayed caches.
    void read_replays() {
        for (const auto & path : opt.replays) {
            const ReplayFile report = read_replay_report(path);
            if (report.trace_model) {
                check_model(JsonFields(*report.trace_model, report.path, "inputs.trace_meta.model"),
                            "the trace this replay ran on");
            } else {
                std::fprintf(stderr,
                             "moeprune plan: %s: the trace it replayed names no model (not made by moeprune collect "
                             "or eval): it is taken to be of %s\n",
                             path.c_str(), g.source.c_str());
            }
            const JsonPlace & in = report.inputs_place;
            const size_t M = g.mtp_bytes.size();
            const bool with_mtp = M > 0 && size_t(report.n_layer) == L + M && report.trace_mtp_layers.size() == M;
            if (size_t(report.n_layer) != L && !with_mtp) {
                in.fail("n_layer", fmt::format("is {}: it replays {} MoE layers, the plan's model has {}{}", report.n_layer,
                                               report.n_layer, L,
                                               M > 0 ? fmt::format(" and {} MTP layer(s)", M) : std::string()));
            }
            if (with_mtp && report.global) {
                in.fail("cache_scope", "is global over a trace with the MTP layers: the trunk's misses without a draft "
                                       "cannot be told apart; replay a per-layer cache, or a trace collected with --no-mtp");
            }
            if (report.n_expert != g.n_expert) {
                in.fail("n_expert", fmt::format("is {}: the plan's model has {} experts", report.n_expert, g.n_expert));
            }
            auto [criterion, k] =
                report.keep ? map_identity(*report.keep, *report.keep) : std::pair<std::string, int64_t>{"none", g.n_expert};
            if (report.n_expert_after_keep) {
                k = *report.n_expert_after_keep;
                if (k < g.used || k > g.n_expert) {
                    in.fail("n_expert_after_keep",
                            fmt::format("is {}, not an integer in [{}, {}]", k, g.used, g.n_expert));
                }
            }
            if (k < g.used || k > g.n_expert) {
                in.fail("keep", fmt::format("keeps {} experts, but the model has {} and uses {} per token", k,
                                            g.n_expert, g.used));
            }
            planned.insert({criterion, k});
            if (report.keep) {
                keep_maps.emplace(std::pair{criterion, k}, *report.keep);
            }
            for (const ReplayRecordFigures & rec : report.records) {
                add_replayed_option(rec, criterion, k, report.global, with_mtp, path, report.keep);
            }
            replay_inputs.push_back({{"file", path.string()}, {"digest", report.digest}});
        }
    }

    // One replayed cache of the map (criterion, K), priced.
    void add_replayed_option(const ReplayRecordFigures & rec, const std::string & criterion, int64_t k, bool global,
                             bool with_mtp, const std::filesystem::path & path,
                             const std::optional<std::string> & keep_map) {
        const auto & known = policy_names();
        if (std::find(known.begin(), known.end(), rec.policy) == known.end()) {
            rec.place.fail("policy", fmt::format("is \"{}\", not a cache policy of this moeprune", rec.policy));
        }
        const int64_t slot_max = global ? k * int64_t(L) : k;
        for (size_t i = 0; i < rec.slots.size(); ++i) {
            if (rec.slots[i] > slot_max) {
                rec.place.fail(fmt::format("slots[{}]", i),
                               fmt::format("is {}, not an integer in [1, {}]", rec.slots[i], slot_max));
            }
        }
        const size_t M = with_mtp ? g.mtp_bytes.size() : 0, layers = L + M;
        if (rec.slots.empty() || (!global && rec.slots.size() != 1 && rec.slots.size() != layers) ||
            (global && rec.slots.size() != 1)) {
            rec.place.fail("slots", fmt::format("holds {} sizes: one, or one per MoE layer ({}) of a per-layer cache",
                                                rec.slots.size(), layers));
        }
        if (with_mtp && !(rec.misses_per_token_by_layer && rec.misses_per_token_by_layer->size() == layers)) {
            rec.place.fail("misses_per_token_by_layer",
                           fmt::format("is missing or not {} numbers: the trunk's misses and the MTP layers' must be told apart",
                                       layers));
        }
        if (rec.cache && *rec.cache > slot_max) {
            rec.place.fail("cache", fmt::format("is {}, not an integer in [1, {}]", *rec.cache, slot_max));
        }
        double resident = g.other;
        if (global) {
            resident += double(rec.slots[0]) * g.mean();
        } else {
            for (size_t l = 0; l < L; ++l) {
                resident += double(rec.slots.size() == 1 ? rec.slots[0] : rec.slots[l]) * g.bytes[l];
            }
        }
        double misses = rec.misses_per_token;
        double bytes = misses * g.mean();
        double rounds = read_rounds_spread(misses, L, tp.queue_depth);
        TokenTraffic mtp;
        if (rec.misses_per_token_by_layer && rec.misses_per_token_by_layer->size() == layers) {
            const std::vector<double> & per_layer = *rec.misses_per_token_by_layer;
            misses = bytes = rounds = 0;
            for (size_t l = 0; l < L; ++l) {
                misses += per_layer[l];
                bytes += per_layer[l] * g.bytes[l];
                rounds += read_rounds(per_layer[l], tp.queue_depth);
            }
            for (size_t m = 0; m < M; ++m) {
                mtp.exposed_bytes += per_layer[L + m] * g.mtp_bytes[m];
                mtp.rounds += read_rounds(per_layer[L + m], tp.queue_depth);
            }
        }
        // Counted rounds are of every layer replayed: with the MTP layers, the trunk's are
        // estimated from its misses.
        if (rec.read_rounds_per_token && !with_mtp) {
            rounds = *rec.read_rounds_per_token;
        }
        double mtp_resident = 0;
        for (size_t m = 0; m < M; ++m) {
            mtp_resident += double(rec.slots.size() == 1 ? rec.slots[0] : rec.slots[L + m]) * g.mtp_bytes[m];
        }
        PlanOption o;
        o.k = k;
        o.criterion = criterion;
        o.cache_experts = rec.cache ? *rec.cache : rec.slots[0];
        o.cache_scope = global ? "global" : "per-layer";
        o.policy = rec.policy;
        o.lambda = rec.lambda;
        o.routed_bytes = double(k) * g.sum();
        o.resident_bytes = resident;
        o.misses_per_token = misses;
        o.read_bytes_per_token = bytes;
        o.tok_per_s = tok_per_s(token_seconds({bytes, rounds, 0}, L, tp));
        o.source = "replay " + path.string();
        o.keep_map = keep_map;
        if (rec.cliff) {
            o.note = "global cache smaller than one token's experts";
        }
        add(std::move(o), {bytes, rounds, 0},
            with_mtp ? DraftTraffic{mtp, resident + mtp_resident, ""}
                     : DraftTraffic{{}, std::nullopt,
                                    "the replayed trace has no MTP layer (collected with --no-mtp): the draft's expert "
                                    "traffic is unknown"});
    }

    // Every K: all of it resident, and the caches given by hand.
    void add_given_options() {
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
                throw Error(fmt::format("-k {}: K must be between the experts used per token ({}) and the experts ({})",
                                        k, g.used, g.n_expert));
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
                PlanOption resident = option_of(k, c);
                resident.cache_experts = k;
                resident.policy = "resident";
                resident.resident_bytes = g.other + double(k) * g.sum();
                resident.misses_per_token = 0.0;
                resident.read_bytes_per_token = 0.0;
                resident.tok_per_s = tok_per_s(token_seconds({}, L, tp));
                resident.source = "every kept expert in RAM";
                add(std::move(resident), {}, DraftTraffic{{}, g.other + double(k) * (g.sum() + mtp_sum()), ""});
                for (size_t i = 0; i < opt.misses_per_token.size(); ++i) {
                    const double m = opt.misses_per_token[i];
                    const double bytes = m * g.mean();
                    const double rounds = m > 0 ? read_rounds_spread(m, L, tp.queue_depth) : 0;
                    PlanOption given = option_of(k, c);
                    given.policy = "given";
                    if (!opt.cache_experts.empty()) {
                        given.cache_experts = opt.cache_experts[i];
                        given.resident_bytes = g.other + double(opt.cache_experts[i]) * g.sum();
                    }
                    given.misses_per_token = m;
                    given.read_bytes_per_token = bytes;
                    given.tok_per_s = tok_per_s(token_seconds({bytes, rounds, 0}, L, tp));
                    given.source = "--misses-per-token";
                    add(std::move(given), {bytes, rounds, 0},
                        DraftTraffic{{}, std::nullopt,
                                     "--misses-per-token counts the trunk's misses: the draft's expert traffic is unknown"});
                }
            }
        }
    }

    // An option of (K, criterion) with the keep map it was read from, when one was.
    PlanOption option_of(int64_t k, const std::string & criterion) const {
        PlanOption o;
        o.k = k;
        o.criterion = criterion;
        o.routed_bytes = double(k) * g.sum();
        if (const auto it = keep_maps.find({criterion, k}); it != keep_maps.end()) {
            o.keep_map = it->second;
        }
        return o;
    }

    // Every limit measure ran the whole model under: an option measured, not modelled.
    void add_measured_options() {
        if (!measured) {
            return;
        }
        const MeasureReport & report = measured->report();
        check_model(JsonFields(report.model, measured->file.path, "model"), "this measurement");
        if (opt.model.empty()) {
            check_geometry(measured->file);
        }
        for (const MeasuredRun & r : report.runs) {
            const double limit = double(r.limit_bytes);
            PlanOption o = option_of(g.n_expert, "none");
            o.cache_scope = "global";
            o.policy = "page-cache";
            o.resident_bytes = std::max(0.0, limit - double(report.process_bytes));
            if (r.decode.read_bytes_per_token >= 0) {
                o.read_bytes_per_token = r.decode.read_bytes_per_token;
            }
            o.tok_per_s = r.decode.tokens_per_second;
            o.measured = PlanMeasuredFigures{r.ram, limit, r.decode.major_faults_per_token,
                                             r.predicted ? std::optional(r.prediction.tokens_per_second) : std::nullopt,
                                             r.read_ahead_kb};
            o.source = fmt::format("measured: llama.cpp under a {:.3f} GB memory limit ({})", gb(limit), measured->file.path);
            if (r.predicted && !r.prediction.outside_model.empty()) {
                o.note = "measure's prediction of this limit is not an answer: " + r.prediction.outside_model;
            }
            if (!g.mtp_bytes.empty()) {
                o.mtp_draft = PlanDraft{.note = "measured: llama.cpp decoded without a draft"};
            }
            add(std::move(o));
        }
    }

    // The shortlist's measurements replace the predictions of the options they ran.
    void apply_shortlist() {
        for (const auto & path : opt.shortlist) {
            const VerifySummary v = read_verify_summary(path);
            const PlanOption ran = with_json_errors(path.string(), [&] {
                return read_plan_option(JsonFields(v.option, path.string(), "option"));
            });
            const auto same = [&](const PlanOption & o) {
                return o.k == ran.k && o.criterion == ran.criterion && o.policy == ran.policy &&
                       o.cache_experts == ran.cache_experts && o.cache_scope == ran.cache_scope && o.lambda == ran.lambda &&
                       !o.measured;
            };
            const auto it = std::find_if(options.begin(), options.end(), same);
            if (it == options.end()) {
                fail_file(path.string(), fmt::format("measured {}, which is not an option of this plan (planned "
                                                     "with other inputs or another budget?)",
                                                     ran.describe()));
            }
            it->shortlist = PlanShortlistFigures{v.ram, v.model, v.measure, v.measured_tok_per_s, it->tok_per_s};
            it->tok_per_s = v.measured_tok_per_s;
            it->source += fmt::format("; measured by llama.cpp under {} ({})", v.ram, path.string());
            shortlist_inputs.push_back({{"file", path.string()}, {"digest", v.digest}});
        }
    }

    // Whether the recommendation may be `o`: with --runs-on llama.cpp, only what stock
    // llama.cpp runs.
    bool eligible(const PlanOption & o) const { return opt.runs_on == "any" || o.runs_on == kRunsOnLlamaCpp; }

    // Pareto front of tokens/s (higher; unknown is unbounded) against KLD (lower), of every
    // option or of the eligible ones.
    std::vector<size_t> pareto_front(bool eligible_only) const {
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
    std::pair<std::optional<size_t>, std::string> recommend(const std::vector<size_t> & pareto) const {
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
                        why = fmt::format("the fastest option with mean KLD within --max-kld {}: {}, mean KLD {}",
                                          *opt.max_kld, options[i].describe(), kld_text(options[i]));
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
        why += "; " + timing_source(opt, measured);
        return {recommended, why};
    }

    json to_plan_json(const std::vector<size_t> & pareto, const std::vector<size_t> & pareto_eligible,
                      const std::optional<size_t> & recommended, const std::string & why) const {
        json options_json = json::array();
        for (const PlanOption & o : options) {
            options_json.push_back(to_json(o));
        }
        json layer_bytes = json::array();
        for (const double b : g.bytes) {
            layer_bytes.push_back(b);
        }
        json throughput_inputs = to_json(tp);
        throughput_inputs["model"] =
            "t = compute + layers * sync + read_bytes / ssd + rounds * latency; tokens/s = 1 / t";
        if (!g.mtp_bytes.empty()) {
            throughput_inputs["mtp_draft_model"] =
                "one draft token per step: the step's t has compute * (1 + mtp_layers / layers), (layers + mtp_layers) * "
                "sync, the trunk's reads of 2 positions and the head's of 1 + a; tokens/s = (1 + a) / t";
        }
        return {{"format", "moeprune-plan"},
                {"version", 1},
                {"inputs",
                 {{"geometry",
                   {{"source", g.source},
                    {"model_digest", g.digest.empty() ? json(nullptr) : json(g.digest)},
                    {"moe_layers", L},
                    {"experts", g.n_expert},
                    {"used", g.used},
                    {"expert_bytes", layer_bytes},
                    {"routed_bytes_all", g.sum() * double(g.n_expert)},
                    {"other_bytes", g.other_known ? json(g.other) : json(nullptr)},
                    {"mtp_layers", g.mtp_bytes.size()},
                    {"mtp_expert_bytes", g.mtp_bytes}}},
                  {"mtp_acceptance", opt.mtp_acceptance ? json(*opt.mtp_acceptance) : json(nullptr)},
                  {"ram_bytes", opt.ram_bytes > 0 ? json(opt.ram_bytes) : json(nullptr)},
                  {"reserve_bytes", opt.reserve_bytes},
                  {"budget_bytes", budget > 0 ? json(budget) : json(nullptr)},
                  {"throughput", throughput_inputs},
                  {"measured", measured ? measured_inputs() : json(nullptr)},
                  {"replays", replay_inputs},
                  {"evals", eval_inputs},
                  {"misses_per_token", opt.misses_per_token},
                  {"cache_experts", opt.cache_experts},
                  {"max_kld", opt.max_kld ? json(*opt.max_kld) : json(nullptr)},
                  {"speed_share", opt.speed_share},
                  {"runs_on", opt.runs_on},
                  {"shortlist", shortlist_inputs}}},
                {"options", options_json},
                {"infeasible", infeasible},
                {"pareto", pareto},
                {"pareto_runs_on", pareto_eligible},
                {"recommended", recommended ? json(*recommended) : json(nullptr)},
                {"commands", recommended ? to_json(commands_of(options[*recommended], opt, g, measured)) : json(nullptr)},
                {"why", why}};
    }

private:
    std::string runs_on_words() const { return opt.runs_on == "any" ? "" : " that stock llama.cpp runs"; }

    // What the recommendation's sentence adds: its RAM, its draft, and what runs it.
    std::string recommendation_details(const PlanOption & o) const {
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
        } else if (!o.measured && !opt.shortlist.empty()) {
            out += "; predicted, not measured";
        }
        return out;
    }

    // Which runtime would run a simulated cache.
    static std::string runs_on_note(const PlanOption & o) {
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

    json measured_inputs() const {
        const Measured & m = *measured;
        const MeasureReport & r = m.report();
        const auto or_null = [](double v) { return v < 0 ? json(nullptr) : json(v); };
        return {{"file", m.file.path},
                {"digest", m.file.digest},
                {"compute_ms", r.resident.decode.ms_mean},
                {"effective_gbps", r.probe.effective_gbps},
                {"read_gbps", or_null(r.probe.read_gbps)},
                {"readahead_amplification", or_null(r.probe.readahead_amplification)},
                {"fault_latency_us", r.probe.fault_latency_us},
                {"process_bytes", double(r.process_bytes)},
                {"median_error", or_null(r.median_error)},
                {"max_error", or_null(r.max_error)},
                {"from_measurement", m.taken}};
    }

    // Planned by hand, a measurement must be of a model of the same geometry: its routed
    // layers, their expert bytes (within 5%, for sizes given rounded) and, when given, the
    // bytes outside the experts.
    void check_geometry(const MeasureFile & measure) const {
        const JsonFields model(measure.report.model, measure.path, "model");
        const std::vector<double> bytes = model.any("routed_layer_expert_bytes").is_array()
                                              ? model.any("routed_layer_expert_bytes").get<std::vector<double>>()
                                              : std::vector<double>{};
        const auto near = [](double a, double b) { return std::abs(a - b) <= 0.05 * std::max(a, b); };
        bool same = bytes.size() == g.bytes.size();
        for (size_t i = 0; same && i < bytes.size(); ++i) {
            same = near(bytes[i], g.bytes[i]);
        }
        if (!same) {
            model.fail("routed_layer_expert_bytes",
                       fmt::format("is {} routed layers of {:.3f} MB experts (first layer): this measurement is of "
                                   "another model than {} ({} layers of {:.3f} MB)", bytes.size(),
                                   bytes.empty() ? 0.0 : bytes[0] / 1e6, g.source, g.bytes.size(), g.bytes[0] / 1e6));
        }
        const double other = double(measure.report.resident_weight_bytes);
        if (g.other_known && !near(other, g.other)) {
            measure.place().fail("resident_weight_bytes", fmt::format("is {:.3f} GB outside the experts: this measurement is of "
                                                             "another model than --other-gb {:.3f}", other / 1e9, g.other / 1e9));
        }
    }

    // Which model every input was measured on: the plan's model by content, or, planned
    // by hand, the first input that names one.
    void check_model(const JsonFields & identity, const char * what) {
        if (!identity.has("digest")) {
            identity.fail("digest",
                          std::string("is missing: which model ") + what +
                              " was measured on cannot be checked (made by an older moeprune? measure it again)");
        }
        const std::string d = identity.string("digest");
        if (model_digest_seen.empty()) {
            model_digest_seen = d;
            model_digest_from = identity.where();
        } else if (d != model_digest_seen) {
            identity.fail("digest", fmt::format("is {}: {} was measured on another model than {} ({})", d, what,
                                                model_digest_from, model_digest_seen));
        }
        if (identity.has("n_expert") && identity.integer("n_expert", 1, 65536) != g.n_expert) {
            identity.fail("n_expert",
                          fmt::format("is {}: {} was measured on a model of another shape than {} ({} experts)",
                                      identity.integer("n_expert", 1, 65536), what, g.source, g.n_expert));
        }
    }

    // Measured KLD of (criterion, K), or interpolated linearly in K between the nearest
    // measured Ks of the same criterion; the flag says which.
    std::pair<std::optional<double>, bool> kld_of(const std::string & criterion, int64_t k) const {
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

    // What an option's speculative decoding with the MTP head reads beyond the trunk.
    struct DraftTraffic {
        TokenTraffic mtp;                     // per token the head runs on
        std::optional<double> resident_bytes; // the option's RAM with the head's experts
        std::string unknown;                  // why the head's traffic is unknown, if it is
    };

    double mtp_sum() const {
        double s = 0;
        for (const double b : g.mtp_bytes) {
            s += b;
        }
        return s;
    }

    // The option with one draft token per step (sim/throughput.h), beside it without.
    PlanDraft draft_option(const PlanOption & o, const TokenTraffic & trunk, const DraftTraffic & d) const {
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

    void add(PlanOption o, const TokenTraffic & trunk, const DraftTraffic & d) {
        if (!g.mtp_bytes.empty()) {
            o.mtp_draft = draft_option(o, trunk, d);
        }
        add(std::move(o));
    }

    void add(PlanOption o) {
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
        }
        options.push_back(std::move(o));
    }

    const PlanOptions & opt;
    const Geometry g;
    const std::optional<Measured> measured;
    const ThroughputParams & tp;
    const size_t L;
    const double budget;
    std::string model_digest_seen, model_digest_from;
    std::map<std::pair<std::string, int64_t>, double> kld;
    std::map<std::pair<std::string, int64_t>, std::pair<double, std::string>> acceptance;  // and where it came from
    using ClosedKey = std::tuple<std::string, int64_t, std::string, int64_t, double>;
    std::map<ClosedKey, double> closed_kld;
    std::set<std::pair<std::string, int64_t>> planned;
    std::map<std::pair<std::string, int64_t>, std::string> keep_maps;   // the file each (criterion, K) was read from
    std::vector<PlanOption> options;
    uint64_t infeasible = 0;
    json eval_inputs = json::array(), replay_inputs = json::array(), shortlist_inputs = json::array();
};

} // namespace

json make_plan(const PlanOptions & given) {
    check_plan_options(given);
    PlanOptions opt = given;
    std::optional<Measured> measured;
    if (!given.measured.empty()) {
        measured = read_measured(given.measured);
        calibrate(opt, *measured);
    }
    Planner planner(opt, geometry(opt), std::move(measured));
    planner.check_settings();
    planner.read_evals();
    planner.read_replays();
    planner.add_given_options();
    planner.add_measured_options();
    planner.apply_shortlist();
    const std::vector<size_t> pareto_eligible = planner.pareto_front(true);
    const auto [recommended, why] = planner.recommend(pareto_eligible);
    return planner.to_plan_json(planner.pareto_front(false), pareto_eligible, recommended, why);
}

} // namespace moeprune
