#include "plan/plan.h"
#include "plan/planner.h"

#include "core/errors.h"
#include "core/json.h"
#include "formats/keep_map.h"
#include "formats/verify_summary.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace moeprune {

namespace plan_impl {

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

void Planner::check_settings() const {
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
void Planner::read_evals() {
    for (const auto & path : opt.evals) {
        const EvalFile report = read_eval_report(path);
        check_model(report.base, "this eval report");
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
                if (c.tasks) {
                    accuracy[{criterion, k}] = c.tasks->accuracy;
                }
                if (!c.source.empty()) {
                    keep_maps.emplace(std::pair{criterion, k}, c.source);
                }
                read_acceptance(c.all, {criterion, k}, path);
            }
        }
        if (report.base_tasks) {
            base_accuracy = report.base_tasks->accuracy;
            base_accuracy_stderr = report.base_tasks->stderr_;
            base_task_count = report.base_tasks->tasks;
        }
        if (report.base_mtp) {
            EvalFigures base;
            base.mtp_acceptance = report.base_mtp->acceptance;
            base.mtp_tokens_per_step = report.base_mtp->tokens_per_step;
            read_acceptance(base, {"none", g.n_expert}, path);
        }
        eval_inputs.push_back({{"file", path.string()}, {"digest", report.digest}});
    }
}

// The draft acceptance of (criterion, K): from the greedy continuations' accepted length
// per step where eval generated, else the teacher-forced share.
void Planner::read_acceptance(const EvalFigures & f, const std::pair<std::string, int64_t> & key,
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

double Planner::measured_kld(const EvalFileCandidate & c) {
    if (!c.all.kld_mean) {
        c.place.fail("all.kld_mean", "is null, not a number in [0, inf]");
    }
    return *c.all.kld_mean;
}

// Replayed caches.
void Planner::read_replays() {
    for (const auto & path : opt.replays) {
        const ReplayFile report = read_replay_report(path);
        if (report.trace_model) {
            check_model(*report.trace_model, "the trace this replay ran on");
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
void Planner::add_replayed_option(const ReplayRecordFigures & rec, const std::string & criterion, int64_t k, bool global,
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
void Planner::add_given_options() {
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
            resident.policy = kPolicyResident;
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
PlanOption Planner::option_of(int64_t k, const std::string & criterion) const {
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
void Planner::add_measured_options() {
    if (!measured) {
        return;
    }
    const MeasureReport & report = measured->report();
    check_model(measured->file.model, "this measurement");
    if (opt.model.empty()) {
        check_geometry(measured->file);
    }
    for (const MeasuredRun & r : report.runs) {
        const double limit = double(r.limit_bytes);
        PlanOption o = option_of(g.n_expert, "none");
        o.cache_scope = "global";
        o.policy = kPolicyPageCache;
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

// Sliced models streamed from disk under the limit, where every kept expert does not fit.
void Planner::add_streamed_options() {
    for (const StreamedSlice & s : opt.streamed) {
        if (s.k < g.used || s.k > g.n_expert) {
            throw Error(fmt::format("{}: a streamed slice of K {}, but the model has {} experts and uses {}",
                                    s.keep_map, s.k, g.n_expert, g.used));
        }
        PlanOption o = option_of(s.k, s.criterion);
        o.keep_map = s.keep_map;
        o.cache_scope = "global";
        o.policy = kPolicyPageCache;
        o.resident_bytes = std::min(g.other + double(s.k) * g.sum(), budget > 0 ? budget : s.limit_bytes);
        o.read_bytes_per_token = s.prediction.read_bytes_per_token;
        o.tok_per_s = s.prediction.tokens_per_second;
        o.read_ahead_kb = s.read_ahead_kb;
        o.source = fmt::format("predicted: the sliced model mapped by llama.cpp under {}{} (measure's page-cache "
                               "predictor over the held-out trace as it routes)", s.ram,
                               s.read_ahead_kb ? fmt::format(" at a read-ahead of {} KB", *s.read_ahead_kb) : "");
        if (!s.prediction.outside_model.empty()) {
            o.note = "the prediction is not an answer: " + s.prediction.outside_model;
            o.outside_model = s.prediction.outside_model;
        }
        add(std::move(o));
    }
}

// The shortlist's measurements replace the predictions of the options they ran.
void Planner::apply_shortlist() {
    for (const auto & path : opt.shortlist) {
        const VerifySummary v = read_verify_summary(path);
        const PlanOption ran = with_json_errors(path.string(), [&] {
            return read_plan_option(JsonFields(v.option, path.string(), "option"));
        });
        const auto same = [&](const PlanOption & o) {
            return o.k == ran.k && o.criterion == ran.criterion && o.policy == ran.policy &&
                   o.cache_experts == ran.cache_experts && o.cache_scope == ran.cache_scope && o.lambda == ran.lambda &&
                   o.read_ahead_kb == ran.read_ahead_kb && !o.measured;
        };
        const auto it = std::find_if(options.begin(), options.end(), same);
        if (it == options.end()) {
            fail_file(path.string(), fmt::format("measured {}, which is not an option of this plan (planned "
                                                 "with other inputs or another budget?)",
                                                 ran.describe()));
        }
        // The same option of another model or keep map would be a silent wrong answer.
        if (std::abs(ran.routed_bytes - it->routed_bytes) > 1e-6 * it->routed_bytes ||
            (ran.keep_map && it->keep_map && *ran.keep_map != *it->keep_map)) {
            fail_file(path.string(), fmt::format("measured {} of {} routed bytes from {}: this plan's has {} from {} "
                                                 "(another model or keep map)",
                                                 ran.describe(), ran.routed_bytes, ran.keep_map.value_or("no keep map"),
                                                 it->routed_bytes, it->keep_map.value_or("no keep map")));
        }
        it->shortlist = PlanShortlistFigures{v.ram, v.model, v.measure, v.measured_tok_per_s, it->tok_per_s};
        it->tok_per_s = v.measured_tok_per_s;
        it->source += fmt::format("; measured by llama.cpp under {} ({})", v.ram, path.string());
        shortlist_inputs.push_back({{"file", path.string()}, {"digest", v.digest}});
    }
}

// Planned by hand, a measurement must be of a model of the same geometry: its routed
// layers, their expert bytes (within 5%, for sizes given rounded) and, when given, the
// bytes outside the experts.
void Planner::check_geometry(const MeasureFile & measure) const {
    const ModelIdentity & model = measure.model;
    const std::vector<double> & bytes = model.routed_layer_expert_bytes;
    const auto near = [](double a, double b) { return std::abs(a - b) <= 0.05 * std::max(a, b); };
    bool same = bytes.size() == g.bytes.size();
    for (size_t i = 0; same && i < bytes.size(); ++i) {
        same = near(bytes[i], g.bytes[i]);
    }
    if (!same) {
        model.place.fail("routed_layer_expert_bytes",
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
void Planner::check_model(const ModelIdentity & identity, const char * what) {
    if (!identity.digest) {
        identity.place.fail("digest",
                            std::string("is missing: which model ") + what +
                                " was measured on cannot be checked (made by an older moeprune? measure it again)");
    }
    const std::string & d = *identity.digest;
    if (model_digest_seen.empty()) {
        model_digest_seen = d;
        model_digest_from = identity.where();
    } else if (d != model_digest_seen) {
        identity.place.fail("digest", fmt::format("is {}: {} was measured on another model than {} ({})", d, what,
                                                  model_digest_from, model_digest_seen));
    }
    if (identity.n_expert && *identity.n_expert != g.n_expert) {
        identity.place.fail("n_expert", fmt::format("is {}: {} was measured on a model of another shape than {} ({} experts)",
                                                    *identity.n_expert, what, g.source, g.n_expert));
    }
}

} // namespace plan_impl

nlohmann::json make_plan(const PlanOptions & given) {
    check_plan_options(given);
    PlanOptions opt = given;
    std::optional<Measured> measured;
    if (!given.measured.empty()) {
        measured = read_measured(given.measured);
        calibrate(opt, *measured);
    }
    plan_impl::Planner planner(opt, geometry(opt), std::move(measured));
    planner.check_settings();
    planner.read_evals();
    if (opt.min_accuracy && !planner.has_task_accuracy()) {
        throw Error("--min-accuracy: no --eval report has task accuracy (eval --hellaswag, --winogrande or "
                    "--multiple-choice, or run's choice tasks)");
    }
    planner.read_replays();
    planner.add_given_options();
    planner.add_measured_options();
    planner.add_streamed_options();
    planner.apply_shortlist();
    const std::vector<size_t> pareto_eligible = planner.pareto_front(true);
    const auto [recommended, why] = planner.recommend(pareto_eligible);
    return planner.to_plan_json(planner.pareto_front(false), pareto_eligible, recommended, why + planner.accuracy_noise());
}

} // namespace moeprune
