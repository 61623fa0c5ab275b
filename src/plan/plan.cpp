#include "plan/plan.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/json.h"
#include "formats/keep_map.h"
#include "formats/stage_reports.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

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

struct Geometry {
    std::string source;
    std::string digest;  // the model's content (model_digest); empty when planned by hand
    int64_t n_expert = 0, used = 0;
    std::vector<double> bytes;  // one routed expert, per MoE layer
    std::vector<double> mtp_bytes;  // one routed expert, per MTP (nextn) layer
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
        const GgufModel model = GgufModel::open(opt.model);
        g.digest = model_digest(model.shard_paths());
        const InspectReport r = inspect_model(model, {});
        if (!r.problems.empty()) {
            fail_file(opt.model.string(), "inspect finds problems: " + r.problems.front());
        }
        g.bytes = r.routed_layer_expert_bytes();
        for (const LayerInfo & l : r.layers) {
            if (l.nextn) {
                g.mtp_bytes.push_back(double(l.expert_bytes));
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
    if (!(opt.expert_mb > 0) || !std::isfinite(opt.expert_mb) || opt.layers < 1 || opt.experts < 1 || opt.used < 1 ||
        opt.used > opt.experts) {
        throw Error("without --model, give --expert-mb (> 0), --layers, --experts and --used (1..experts)");
    }
    // As many as a router trace can hold: a geometry past them is a typing error, and
    // would be allocated per layer.
    if (opt.layers > 100000 || opt.experts > 65536 || opt.expert_mb > 1e9) {
        throw Error(fmt::format("--layers {} --experts {} --expert-mb {}: at most 100000 layers of 65536 experts of 10^9 MB",
                                opt.layers, opt.experts, opt.expert_mb));
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
    const KeepMapName n = parse_keep_map_name(name.empty() ? path : name);
    return {n.criterion, n.k};
}

json tok_per_s(double seconds) {
    return seconds > 0 ? json(1.0 / seconds) : json(nullptr);
}

double gb(double bytes) { return bytes / 1e9; }

// The settings a plan is made with, each possible before anything is read.
void check_plan_options(const PlanOptions & opt) {
    if (!std::isfinite(opt.ram_bytes) || opt.ram_bytes < 0 || opt.ram_bytes >= 0x1p64) {
        throw Error(fmt::format("--ram {} bytes is not a RAM size (0 < size < 2^64 bytes)", opt.ram_bytes));
    }
    if (!std::isfinite(opt.reserve_bytes) || opt.reserve_bytes < 0 || opt.reserve_bytes >= 0x1p64) {
        throw Error(fmt::format("--reserve {} bytes is not a size (0 <= size < 2^64 bytes)", opt.reserve_bytes));
    }
    if (!(opt.speed_share > 0 && opt.speed_share <= 1)) {
        throw Error(fmt::format("--speed-share {} must be a share in (0, 1]", opt.speed_share));
    }
    if (opt.mtp_acceptance && !(*opt.mtp_acceptance >= 0 && *opt.mtp_acceptance <= 1)) {
        throw Error(fmt::format("--mtp-acceptance {} must be a share of drafts in [0, 1]", *opt.mtp_acceptance));
    }
    if (opt.max_kld && !(std::isfinite(*opt.max_kld) && *opt.max_kld >= 0)) {
        throw Error(fmt::format("--max-kld {} must be a finite KLD >= 0", *opt.max_kld));
    }
    for (const double m : opt.misses_per_token) {
        if (!(std::isfinite(m) && m >= 0)) {
            throw Error(fmt::format("--misses-per-token {} must be a finite count >= 0", m));
        }
    }
    const ThroughputParams & t = opt.throughput;
    if (!(std::isfinite(t.ssd_gbps) && t.ssd_gbps > 0) || !(std::isfinite(t.read_latency_us) && t.read_latency_us >= 0) ||
        !(std::isfinite(t.compute_ms) && t.compute_ms >= 0) || !(std::isfinite(t.sync_us) && t.sync_us >= 0) ||
        t.queue_depth < 1) {
        throw Error("--ssd must be > 0, --read-latency-us, --compute-ms and --sync-us finite and >= 0, --queue-depth >= 1");
    }
}

// What `moeprune measure` found, as far as a plan uses it (docs/formats.md, "Measure").
struct Measured {
    std::string file, digest;
    json report;                       // the whole report: the model's identity is checked against the plan's
    double compute_ms = 0;             // the resident run's mean time per token
    double effective_gbps = 0;         // bytes needed per second, random experts through page faults
    std::optional<double> read_gbps, amplification;
    double fault_latency_us = 0;
    double process_bytes = 0;          // KV cache, compute buffers, code: the resident run's RssAnon
    struct Run {
        std::string ram;
        double limit_bytes = 0, tok_per_s = 0, faults_per_token = 0;
        std::optional<double> read_bytes_per_token, predicted_tok_per_s, error;
    };
    std::vector<Run> runs;
    std::optional<double> median_error, max_error;
    std::vector<std::string> taken;    // the plan's parameters that came from it
};

// Each figure of a measure report is checked against the others it was computed from,
// so a report edited by hand (or forged) with figures each in range but impossible
// together is refused by name instead of priced.
void check_speed(const JsonFields & run, double tok_per_s) {
    const JsonFields decode = run.object("decode");
    const nlohmann::json * wall_us = nullptr;
    if (run.has("detail") && run.any("detail").is_object()) {
        const nlohmann::json & d = run.any("detail");
        if (d.contains("per_token") && d.at("per_token").is_object() && d.at("per_token").contains("wall_us")) {
            wall_us = &d.at("per_token").at("wall_us");
        }
    }
    const double ms_mean = decode.object("ms_per_token").number("mean", 0, 1e9);
    if (std::abs(tok_per_s * ms_mean / 1000 - 1) > 1e-3) {
        decode.fail("tokens_per_second", fmt::format("is {}, but the mean of {} ms per token makes {:.6g}: the report "
                                                     "was edited", tok_per_s, ms_mean, 1000 / ms_mean));
    }
    if (wall_us && wall_us->is_array() && !wall_us->empty()) {
        double total = 0;
        for (const nlohmann::json & t : *wall_us) {
            total += t.is_number() ? t.get<double>() : 0;
        }
        const double from_wall = double(wall_us->size()) * 1e6 / total;
        if (!(total > 0) || std::abs(tok_per_s / from_wall - 1) > 1e-3) {
            decode.fail("tokens_per_second", fmt::format("is {}, but its {} tokens took {} us in all ({:.6g} tokens/s): "
                                                         "the report was edited", tok_per_s, wall_us->size(), total,
                                                         from_wall));
        }
    }
}

Measured read_measured(const std::filesystem::path & path) {
    Measured m;
    m.file = path.string();
    m.report = parse_json(read_text_file(path), m.file);
    const JsonFields r(m.report, m.file);
    if (!m.report.is_object() || m.report.value("format", json()) != "moeprune-measure") {
        fail_file(m.file, "is not a moeprune-measure report (\"format\")");
    }
    if (r.integer("version", 0, std::numeric_limits<int64_t>::max()) != 1) {
        r.fail("version", "is not 1, the version of moeprune-measure this moeprune reads");
    }
    if (r.has("busy") && !r.any("busy").is_null()) {
        r.fail("busy", "says the machine was busy while it measured (" + r.string("busy") +
                           "): nothing can be calibrated on it; measure again on a quiet machine");
    }
    m.digest = file_digest(path);
    // Physical bounds, far outside any machine: a token in at most 1000 s, at most 10^6
    // tokens/s, 2^50 bytes of memory, storage between 1 kB/s and 10 TB/s.
    constexpr double most_bytes = 0x1p50, most_tok_per_s = 1e6;
    const JsonFields resident = r.object("resident").object("decode");
    m.compute_ms = resident.object("ms_per_token").number("mean", 1e-6, 1e6);
    check_speed(r.object("resident"), resident.number("tokens_per_second", 1e-3, most_tok_per_s));
    m.process_bytes = r.number("process_bytes", 0, most_bytes);
    const double weights = r.number("resident_weight_bytes", 0, most_bytes);
    const double need = r.number("resident_need_bytes", 0, most_bytes);
    if (need != weights + m.process_bytes) {
        r.fail("resident_need_bytes", fmt::format("is {}, not resident_weight_bytes {} + process_bytes {}: the report "
                                                  "was edited", need, weights, m.process_bytes));
    }
    if (!r.has("probe") || r.any("probe").is_null()) {
        r.fail("probe", "is null: the storage was not probed (measure --probe-mib 0), so nothing calibrates the reads; "
                        "measure again with a probe");
    }
    const JsonFields probe = r.object("probe");
    m.effective_gbps = probe.number("effective_gbps", 0, 1e4);
    if (!(m.effective_gbps >= 1e-6)) {
        probe.fail("effective_gbps", fmt::format("is {}: the probe read nothing, or under 1 kB/s", m.effective_gbps));
    }
    if (probe.has("seconds") && probe.has("bytes_needed")) {
        const double seconds = probe.number("seconds", 0, 1e9), needed = probe.number("bytes_needed", 0, most_bytes);
        if (!(seconds > 0) || std::abs(needed / seconds / 1e9 / m.effective_gbps - 1) > 1e-3) {
            probe.fail("effective_gbps", fmt::format("is {}, but {} bytes in {} s make {:.6g} GB/s: the report was edited",
                                                     m.effective_gbps, needed, seconds, needed / seconds / 1e9));
        }
    }
    if (probe.has("read_gbps") && !probe.any("read_gbps").is_null()) {
        m.read_gbps = probe.number("read_gbps", 0, 1e4);
        m.amplification = probe.number("readahead_amplification", 0, 1e6);
    }
    m.fault_latency_us = probe.number("fault_latency_us", 0, 1e9);
    for (const JsonFields & run : r.objects("runs")) {
        Measured::Run x;
        x.ram = run.string("ram");
        // Printed in the plan: a limit as measure reads one, never terminal codes.
        if (x.ram.empty() || x.ram.find_first_not_of("0123456789.%KMGTkmgtiBb") != std::string::npos) {
            run.fail("ram", "is not a limit as measure --ram reads one (2G, 768M, 50%)");
        }
        x.limit_bytes = run.number("limit_bytes", 1, most_bytes);
        if (x.limit_bytes < need) {
            run.fail("limit_bytes", fmt::format("is {}, below the {} bytes the report says must stay resident: no run "
                                                "could have decoded under it", x.limit_bytes, need));
        }
        const JsonFields decode = run.object("decode");
        x.tok_per_s = decode.number("tokens_per_second", 1e-3, most_tok_per_s);
        check_speed(run, x.tok_per_s);
        x.faults_per_token = decode.number("major_faults_per_token", 0, 1e12);
        if (decode.has("read_bytes_per_token") && !decode.any("read_bytes_per_token").is_null()) {
            x.read_bytes_per_token = decode.number("read_bytes_per_token", 0, most_bytes);
        }
        if (run.has("predicted") && !run.any("predicted").is_null()) {
            x.predicted_tok_per_s = run.object("predicted").number("tokens_per_second", 0, most_tok_per_s);
            x.error = run.number("error", 0, 1e12);
        }
        m.runs.push_back(std::move(x));
    }
    if (r.has("median_error") && !r.any("median_error").is_null()) {
        m.median_error = r.number("median_error", 0, 1e12);
        m.max_error = r.number("max_error", 0, 1e12);
    }
    return m;
}

// The guesses the measurement replaces, unless given by hand. The probe's bandwidth is of
// bytes needed, read as a decode reads them (page faults at its thread count, readahead
// and fault latency included), so no latency per round is added on top of it.
void calibrate(PlanOptions & opt, Measured & m) {
    const auto by_hand = [&](const char * flag) {
        return std::find(opt.by_hand.begin(), opt.by_hand.end(), flag) != opt.by_hand.end();
    };
    if (!by_hand("--compute-ms")) {
        opt.throughput.compute_ms = m.compute_ms;
        m.taken.push_back("compute_ms");
    }
    if (!by_hand("--ssd")) {
        opt.throughput.ssd_gbps = m.effective_gbps;
        m.taken.push_back("ssd_gbps");
    }
    if (!by_hand("--read-latency-us")) {
        opt.throughput.read_latency_us = 0;
        m.taken.push_back("read_latency_us");
    }
    if (!by_hand("--reserve")) {
        opt.reserve_bytes = m.process_bytes;
        m.taken.push_back("reserve_bytes");
    }
}

// Where the time per token came from, for `why`.
std::string timing_source(const PlanOptions & opt, const std::optional<Measured> & m) {
    const ThroughputParams & t = opt.throughput;
    if (!m) {
        return fmt::format("tokens/s rest on guesses, as nothing was measured: --ssd {} GB/s, --compute-ms {}, "
                           "--read-latency-us {} (moeprune measure, then plan --measured, replaces them)",
                           t.ssd_gbps, t.compute_ms, t.read_latency_us);
    }
    std::vector<std::string> from;
    const auto taken = [&](const char * p) { return std::find(m->taken.begin(), m->taken.end(), p) != m->taken.end(); };
    if (taken("compute_ms")) {
        from.push_back(fmt::format("compute {:.3g} ms per token (resident run)", t.compute_ms));
    }
    if (taken("ssd_gbps")) {
        std::string s = fmt::format("storage {:.3g} GB/s of experts through page faults", t.ssd_gbps);
        if (m->amplification) {
            s += fmt::format(" (device {:.3g} GB/s, readahead x{:.2f}, {:.0f} us per fault)", *m->read_gbps,
                             *m->amplification, m->fault_latency_us);
        }
        from.push_back(s + " (probe)");
    }
    if (taken("reserve_bytes")) {
        from.push_back(fmt::format("reserve {:.3f} GB of process memory (resident run)", gb(opt.reserve_bytes)));
    }
    std::string out = from.empty() ? "every timing parameter was given by hand, though " + m->file + " was measured"
                                   : "measured by " + m->file + ": " + fmt::format("{}", fmt::join(from, ", "));
    if (m->median_error) {
        out += fmt::format("; that calibration predicted the measured limits with median error {:.0f}% (max {:.0f}%)",
                           100 * *m->median_error, 100 * *m->max_error);
    }
    std::vector<std::string> hand;
    for (const auto & [flag, p] : {std::pair{"--compute-ms", "compute_ms"}, {"--ssd", "ssd_gbps"},
                                   {"--read-latency-us", "read_latency_us"}, {"--reserve", "reserve_bytes"}}) {
        if (!taken(p)) {
            hand.push_back(flag);
        }
    }
    if (!hand.empty()) {
        out += fmt::format("; given by hand: {}", fmt::join(hand, ", "));
    }
    return out;
}

// The fastest an option decodes: null tokens/s is unbounded.
double speed(const json & o) {
    return o["tok_per_s"].is_null() ? std::numeric_limits<double>::infinity() : o["tok_per_s"].get<double>();
}

std::string describe(const json & o) {
    const std::string cache = o["policy"] == "resident" ? "all kept experts resident"
                              : o["cache_experts"].is_null()
                                  ? std::string(o["policy"].get<std::string>())
                                  : fmt::format("{} cache of {} experts{}, λ {}", o["policy"].get<std::string>(),
                                                o["cache_experts"].get<int64_t>(), o["cache_scope"] == "global" ? " (global)" : " per layer",
                                                o["lambda"].get<double>());
    if (o.contains("measured_ram")) {
        return fmt::format("all {} experts mapped under a {} limit (llama.cpp, measured): {:.2f} tokens/s", o["k"].get<int64_t>(),
                           o["measured_ram"].get<std::string>(), o["tok_per_s"].get<double>());
    }
    const std::string speed_text = o["tok_per_s"].is_null() ? "unbounded tokens/s (no time per token in the model)"
                                                            : fmt::format("{:.2f} tokens/s", o["tok_per_s"].get<double>());
    return fmt::format("K {} by {}, {}: {}", o["k"].get<int64_t>(), o["criterion"].get<std::string>(), cache, speed_text);
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
            eval_inputs.push_back({{"file", path.string()}, {"digest", file_digest(path)}});
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
            for (const ReplayRecordFigures & rec : report.records) {
                add_replayed_option(rec, criterion, k, report.global, with_mtp, path);
            }
            replay_inputs.push_back({{"file", path.string()}, {"digest", file_digest(path)}});
        }
    }

    // One replayed cache of the map (criterion, K), priced.
    void add_replayed_option(const ReplayRecordFigures & rec, const std::string & criterion, int64_t k, bool global,
                             bool with_mtp, const std::filesystem::path & path) {
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
        double rounds = double(L) * std::ceil(misses / double(L) / tp.queue_depth);
        TokenTraffic mtp;
        if (rec.misses_per_token_by_layer && rec.misses_per_token_by_layer->size() == layers) {
            const std::vector<double> & per_layer = *rec.misses_per_token_by_layer;
            misses = bytes = rounds = 0;
            for (size_t l = 0; l < L; ++l) {
                misses += per_layer[l];
                bytes += per_layer[l] * g.bytes[l];
                rounds += std::ceil(per_layer[l] / tp.queue_depth);
            }
            for (size_t m = 0; m < M; ++m) {
                mtp.exposed_bytes += per_layer[L + m] * g.mtp_bytes[m];
                mtp.rounds += std::ceil(per_layer[L + m] / tp.queue_depth);
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
        json o = {{"k", k},
                  {"criterion", criterion},
                  {"cache_experts", rec.cache ? *rec.cache : rec.slots[0]},
                  {"cache_scope", global ? "global" : "per-layer"},
                  {"policy", rec.policy},
                  {"lambda", rec.lambda},
                  {"routed_bytes", double(k) * g.sum()},
                  {"resident_bytes", resident},
                  {"misses_per_token", misses},
                  {"read_bytes_per_token", bytes},
                  {"tok_per_s", tok_per_s(token_seconds({bytes, rounds, 0}, L, tp))},
                  {"source", "replay " + path.string()}};
        if (rec.cliff) {
            o["note"] = "global cache smaller than one token's experts";
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
                     {"tok_per_s", tok_per_s(token_seconds({}, L, tp))},
                     {"source", "every kept expert in RAM"}},
                    {}, DraftTraffic{{}, g.other + double(k) * (g.sum() + mtp_sum()), ""});
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
                         {"resident_bytes",
                          cache.is_null() ? json(nullptr) : json(g.other + double(opt.cache_experts[i]) * g.sum())},
                         {"misses_per_token", m},
                         {"read_bytes_per_token", bytes},
                         {"tok_per_s", tok_per_s(token_seconds({bytes, rounds, 0}, L, tp))},
                         {"source", "--misses-per-token"}},
                        {bytes, rounds, 0}, DraftTraffic{{}, std::nullopt,
                                     "--misses-per-token counts the trunk's misses: the draft's expert traffic is unknown"});
                }
            }
        }
    }

    // Every limit measure ran the whole model under: an option measured, not modelled.
    void add_measured_options() {
        if (!measured) {
            return;
        }
        const JsonFields report(measured->report, measured->file);
        check_model(report.object("model"), "this measurement");
        if (opt.model.empty()) {
            check_geometry(report);
        }
        for (const Measured::Run & r : measured->runs) {
            json o = {{"k", g.n_expert},
                      {"criterion", "none"},
                      {"cache_experts", nullptr},
                      {"cache_scope", "global"},
                      {"policy", "page-cache"},
                      {"lambda", 0.0},
                      {"routed_bytes", double(g.n_expert) * g.sum()},
                      {"resident_bytes", std::max(0.0, r.limit_bytes - measured->process_bytes)},
                      {"misses_per_token", nullptr},
                      {"major_faults_per_token", r.faults_per_token},
                      {"read_bytes_per_token", r.read_bytes_per_token ? json(*r.read_bytes_per_token) : json(nullptr)},
                      {"tok_per_s", r.tok_per_s},
                      {"measured_ram", r.ram},
                      {"predicted_tok_per_s", r.predicted_tok_per_s ? json(*r.predicted_tok_per_s) : json(nullptr)},
                      {"source", fmt::format("measured: llama.cpp under a {:.3f} GB memory limit ({})", gb(r.limit_bytes),
                                             measured->file)}};
            if (!g.mtp_bytes.empty()) {
                o["mtp_draft"] = {{"draft_tokens", 1},          {"acceptance", nullptr},
                                  {"acceptance_source", nullptr}, {"tokens_per_step", nullptr},
                                  {"tok_per_s", nullptr},         {"note", "measured: llama.cpp decoded without a draft"}};
            }
            add(std::move(o));
        }
    }

    // Pareto front of tokens/s (higher; null is unbounded) against KLD (lower).
    json pareto_front() const {
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
        return pareto;
    }

    std::pair<json, std::string> recommend(const json & pareto) const {
        json recommended = nullptr;
        std::string why;
        if (!pareto.empty()) {
            if (opt.max_kld) {
                for (const json & i : pareto) {
                    const json & o = options[i.get<size_t>()];
                    if (o["kld_mean"].get<double>() <= *opt.max_kld) {
                        recommended = i;
                        why = fmt::format("the fastest option with mean KLD within --max-kld {}: {}, mean KLD {:.4g}{}",
                                          *opt.max_kld, describe(o), o["kld_mean"].get<double>(),
                                          o["kld_measured"].get<bool>() ? "" : " (interpolated)");
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
                    // The front is in falling speed and falling KLD: keep the last that is fast enough.
                    if (speed(o) >= opt.speed_share * fastest) {
                        recommended = i;
                    }
                }
                const json & o = options[recommended.get<size_t>()];
                why = fmt::format(
                    "the lowest mean KLD ({:.4g}{}) among options within {:.0f}% of the fastest feasible speed: {}",
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
                    (speed(options[i]) == speed(options[best]) &&
                     options[i]["k"].get<int64_t>() > options[best]["k"].get<int64_t>())) {
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
                why += fmt::format("; {:.2f} GB resident of the {:.2f} GB budget",
                                   gb(o["resident_bytes"].get<double>()), gb(budget));
            }
        }
        if (!recommended.is_null()) {
            const json & o = options[recommended.get<size_t>()];
            if (o.contains("mtp_draft") && !o["mtp_draft"]["tok_per_s"].is_null()) {
                why += fmt::format("; with the MTP head drafting one token ({:.1f}% accepted, {}): {:.2f} tokens/s",
                                   100 * o["mtp_draft"]["acceptance"].get<double>(),
                                   o["mtp_draft"]["acceptance_source"].get<std::string>(),
                                   o["mtp_draft"]["tok_per_s"].get<double>());
            }
        }
        why += "; " + timing_source(opt, measured);
        return {recommended, why};
    }

    json to_plan_json(const json & pareto, const json & recommended, const std::string & why) const {
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
                  {"speed_share", opt.speed_share}}},
                {"options", options},
                {"infeasible", infeasible},
                {"pareto", pareto},
                {"recommended", recommended},
                {"why", why}};
    }

private:
    json measured_inputs() const {
        const Measured & m = *measured;
        return {{"file", m.file},
                {"digest", m.digest},
                {"compute_ms", m.compute_ms},
                {"effective_gbps", m.effective_gbps},
                {"read_gbps", m.read_gbps ? json(*m.read_gbps) : json(nullptr)},
                {"readahead_amplification", m.amplification ? json(*m.amplification) : json(nullptr)},
                {"fault_latency_us", m.fault_latency_us},
                {"process_bytes", m.process_bytes},
                {"median_error", m.median_error ? json(*m.median_error) : json(nullptr)},
                {"max_error", m.max_error ? json(*m.max_error) : json(nullptr)},
                {"from_measurement", m.taken}};
    }

    // Planned by hand, a measurement must be of a model of the same geometry: its routed
    // layers, their expert bytes (within 5%, for sizes given rounded) and, when given, the
    // bytes outside the experts.
    void check_geometry(const JsonFields & report) const {
        const JsonFields model = report.object("model");
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
        const double other = report.number("resident_weight_bytes", 0, 0x1p50);
        if (g.other_known && !near(other, g.other)) {
            report.fail("resident_weight_bytes", fmt::format("is {:.3f} GB outside the experts: this measurement is of "
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
    std::pair<json, bool> kld_of(const std::string & criterion, int64_t k) const {
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
        return {nullptr, false};
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
    json draft_option(const json & o, const TokenTraffic & trunk, const DraftTraffic & d) const {
        std::optional<std::pair<double, std::string>> a;
        if (opt.mtp_acceptance) {
            a = {*opt.mtp_acceptance, "--mtp-acceptance"};
        } else {
            const int64_t k = o["k"].get<int64_t>();
            const auto it = acceptance.find({k == g.n_expert ? "none" : o["criterion"].get<std::string>(), k});
            if (it != acceptance.end()) {
                a = it->second;
            }
        }
        json out = {{"draft_tokens", 1},
                    {"acceptance", a ? json(a->first) : json(nullptr)},
                    {"acceptance_source", a ? json(a->second) : json(nullptr)},
                    {"tokens_per_step", a ? json(tokens_per_step(a->first, 1)) : json(nullptr)},
                    {"mtp_read_bytes_per_token", d.unknown.empty() ? json(d.mtp.exposed_bytes) : json(nullptr)},
                    {"resident_bytes", d.resident_bytes ? json(*d.resident_bytes) : json(nullptr)},
                    {"feasible", budget <= 0 || !d.resident_bytes || *d.resident_bytes <= budget},
                    {"step_ms", nullptr},
                    {"tok_per_s", nullptr},
                    {"speedup", nullptr}};
        if (!d.unknown.empty()) {
            out["note"] = d.unknown;
        } else if (!a) {
            out["note"] = "no draft acceptance measured for this keep map (eval it with the MTP head, or give "
                          "--mtp-acceptance)";
        } else {
            const DraftStep step{a->first, 1, g.mtp_bytes.size(), d.mtp};
            const double seconds = speculative_step_seconds(trunk, L, step, tp);
            if (seconds > 0) {
                out["step_ms"] = seconds * 1e3;
                out["tok_per_s"] = speculative_tokens_per_second(trunk, L, step, tp);
                if (!o["tok_per_s"].is_null()) {
                    out["speedup"] = out["tok_per_s"].get<double>() / o["tok_per_s"].get<double>();
                }
            }
        }
        return out;
    }

    void add(json o, const TokenTraffic & trunk, const DraftTraffic & d) {
        if (!g.mtp_bytes.empty()) {
            o["mtp_draft"] = draft_option(o, trunk, d);
        }
        add(std::move(o));
    }

    void add(json o) {
        const json & resident = o["resident_bytes"];
        o["feasible"] = budget <= 0 || resident.is_null() || resident.get<double>() <= budget;
        if (!o["feasible"].get<bool>()) {
            ++infeasible;
            return;
        }
        // Belady needs the future: a bound to compare with, never a choice.
        o["bound"] = policy_reads_future(o["policy"].get<std::string>());
        const double lambda = o["lambda"].get<double>();
        if (lambda > 0) {
            const ClosedKey key{o["criterion"].get<std::string>(), o["k"].get<int64_t>(),
                                o["policy"].get<std::string>(),
                                o["cache_experts"].is_null() ? -1 : o["cache_experts"].get<int64_t>(), lambda};
            const auto it = o["cache_scope"] == "per-layer" ? closed_kld.find(key) : closed_kld.end();
            o["kld_mean"] = it == closed_kld.end() ? json(nullptr) : json(it->second);
            o["kld_measured"] = it == closed_kld.end() ? json(nullptr) : json(true);
            o["kld_loop"] = "closed";
            if (it == closed_kld.end()) {
                o["kld_note"] = "unmeasured: cache-aware routing (λ > 0) changes the output; only the closed loop "
                                "(eval --cache-policy --cache --lambda) measures its KLD";
            }
        } else {
            const auto [k_mean, measured] = kld_of(o["criterion"].get<std::string>(), o["k"].get<int64_t>());
            o["kld_mean"] = k_mean;
            o["kld_measured"] = k_mean.is_null() ? json(nullptr) : json(measured);
            o["kld_loop"] = "open";
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
    json options = json::array();
    uint64_t infeasible = 0;
    json eval_inputs = json::array(), replay_inputs = json::array();
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
    const json pareto = planner.pareto_front();
    const auto [recommended, why] = planner.recommend(pareto);
    return planner.to_plan_json(pareto, recommended, why);
}

ThroughputParams measured_throughput(const std::filesystem::path & measure_json, const ThroughputParams & guesses,
                                     const std::vector<std::string> & by_hand) {
    PlanOptions opt;
    opt.throughput = guesses;
    opt.by_hand = by_hand;
    Measured m = read_measured(measure_json);
    calibrate(opt, m);
    return opt.throughput;
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
