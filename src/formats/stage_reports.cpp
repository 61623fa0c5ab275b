#include "formats/stage_reports.h"

#include "core/digest.h"
#include "core/atomic_file.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <limits>
#include <map>

namespace moeprune {

namespace {

using nlohmann::json;
constexpr double kInf = std::numeric_limits<double>::infinity();
// A share summed in another order than its total can pass 1 by rounding.
constexpr double kShareMax = 1.0 + 1e-9;

std::optional<double> optional_number(const JsonFields & f, const std::string & key, double lo, double hi) {
    return f.has(key) ? std::optional(f.number(key, lo, hi)) : std::nullopt;
}

std::optional<std::string> optional_string(const JsonFields & f, const std::string & key) {
    return f.has(key) ? std::optional(f.string(key)) : std::nullopt;
}

// The document of `path` when its "format" is `format`; `digest`, when given, gets the
// content digest of the bytes read, so that no reader reads a file twice to name it.
json read_report(const std::filesystem::path & path, const char * format, const char * what,
                 std::string * digest = nullptr) {
    const std::string bytes = read_text_file(path);
    if (digest) {
        *digest = content_digest(bytes);
    }
    json r = parse_json(bytes, path.string());
    if (!r.is_object() || r.value("format", json()) != format) {
        fail_file(path.string(), fmt::format("is not {} (\"format\")", what));
    }
    return r;
}

EvalFigures figures_of(const JsonFields & f) {
    EvalFigures e;
    e.kld_mean = optional_number(f, "kld_mean", 0, kInf);
    e.kld_p99 = optional_number(f, "kld_p99", 0, kInf);
    e.same_top1 = optional_number(f, "same_top1", 0, 1);
    e.tokens = f.has("tokens") ? f.integer("tokens", 0, std::numeric_limits<int64_t>::max()) : 0;
    e.mtp_acceptance = optional_number(f, "mtp_acceptance", 0, 1);
    e.mtp_tokens_per_step = optional_number(f, "gen_mtp_tokens_per_step", 1, 65536);
    return e;
}

EvalTaskFigures task_figures_of(const JsonFields & t) {
    EvalTaskFigures f;
    f.tasks = t.integer("tasks", 1, int64_t(1) << 40);
    f.correct = t.integer("correct", 0, f.tasks);
    f.kept_base_correct = t.integer("kept_base_correct", 0, f.correct);
    f.new_correct = t.integer("new_correct", 0, f.correct - f.kept_base_correct);
    f.accuracy = t.number("accuracy", 0, 1);
    f.stderr_ = t.number("stderr", 0, 1);
    if (std::abs(f.accuracy - double(f.correct) / double(f.tasks)) > 1e-9) {
        t.fail("accuracy", fmt::format("is {}, but {} of {} tasks right make {}: the report was edited", f.accuracy,
                                       f.correct, f.tasks, double(f.correct) / double(f.tasks)));
    }
    if (t.has("domains")) {
        int64_t tasks = 0, correct = 0;
        for (const JsonFields & d : t.objects("domains")) {
            f.domains.push_back({d.string("domain"), task_figures_of(d)});
            tasks += f.domains.back().figures.tasks;
            correct += f.domains.back().figures.correct;
        }
        if (tasks != f.tasks || correct != f.correct) {
            t.fail("domains", fmt::format("add up to {} right of {} tasks, not the {} of {} of the whole", correct, tasks,
                                          f.correct, f.tasks));
        }
    }
    return f;
}

EvalFileCandidate candidate_of(const JsonFields & c) {
    EvalFileCandidate out;
    out.place = c.place();
    out.kind = c.string("kind");
    if (out.kind == "closed-loop") {
        out.keep = optional_string(c, "keep");
        out.policy = c.string("policy");
        out.cache = c.integer("cache", 1, std::numeric_limits<int64_t>::max());
        out.lambda = c.number("lambda", 0, kInf);
        const JsonFields all = c.object("all");
        out.all = figures_of(all);
        out.loop = {optional_number(all, "misses_per_token", 0, kInf),
                    optional_number(all, "open_loop_misses_per_token", 0, kInf), optional_number(all, "tok_per_s", 0, kInf),
                    optional_number(all, "open_loop_tok_per_s", 0, kInf)};
    } else if (out.kind == "keep") {
        out.name = c.string("name");
        out.source = c.has("source") ? c.string("source") : "";
        out.all = figures_of(c.object("all"));
        if (c.has("domains")) {
            const JsonFields domains = c.object("domains");
            for (const auto & [domain, unused] : c.any("domains").items()) {
                out.domains.emplace_back(domain, figures_of(domains.object(domain)));
            }
        }
        if (c.has("modalities")) {
            const JsonFields modalities = c.object("modalities");
            for (const auto & [modality, unused] : c.any("modalities").items()) {
                out.modalities.emplace_back(modality, figures_of(modalities.object(modality)));
            }
        }
        if (c.has("tasks")) {
            out.tasks = task_figures_of(c.object("tasks"));
        }
    }
    return out;
}

ReplayRecordFigures record_of(const JsonFields & rec) {
    ReplayRecordFigures out;
    out.place = rec.place();
    out.policy = rec.string("policy");
    out.slots = rec.integers("slots", 1, std::numeric_limits<int64_t>::max());
    if (rec.has("cache")) {
        out.cache = rec.integer("cache", 1, std::numeric_limits<int64_t>::max());
    }
    out.lambda = rec.has("lambda") ? rec.number("lambda", 0, kInf) : 0.0;
    out.cliff = rec.has("cliff") && rec.boolean("cliff");
    out.misses_per_token = rec.number("misses_per_token", 0, kInf);
    if (rec.has("misses_per_token_by_layer")) {
        out.misses_per_token_by_layer = rec.numbers("misses_per_token_by_layer", 0, kInf);
    }
    out.read_rounds_per_token = optional_number(rec, "read_rounds_per_token", 0, kInf);
    out.hit_rate = optional_number(rec, "hit_rate", 0, 1);
    out.tokens_per_s = optional_number(rec, "tokens_per_s", 0, kInf);
    return out;
}

SelectResultFigures result_of(const JsonFields & r) {
    SelectResultFigures out;
    out.criterion = r.string("metric");
    out.k = r.integer("k", 1, 65536);
    std::map<int64_t, JsonFields> screen;   // by layer
    if (r.has("screen") && r.object("screen").has("layers")) {
        for (const JsonFields & l : r.object("screen").objects("layers")) {
            screen.emplace(l.integer("layer", 0, 1 << 20), l);
        }
    }
    for (const JsonFields & l : r.objects("layers")) {
        SelectLayerFigures f;
        f.layer = l.integer("layer", 0, 1 << 20);
        f.reap_share = l.number("reap_share", 0, kShareMax);
        f.count_share = l.number("count_share", 0, kShareMax);
        if (l.has("heldout")) {
            f.heldout_reap_share = l.object("heldout").number("reap_share", 0, kShareMax);
        }
        if (const auto s = screen.find(f.layer); s != screen.end()) {
            f.replaced_share = s->second.number("replaced_share", 0, kShareMax);
            f.moved_mass = s->second.number("moved_mass", 0, kShareMax);
        }
        out.layers.push_back(f);
    }
    return out;
}

ThroughputFigures throughput_of(const JsonFields & t) {
    ThroughputFigures f;
    f.ssd_gbps = t.number("ssd_gbps", 0, kInf);
    f.read_latency_us = t.number("read_latency_us", 0, kInf);
    f.queue_depth = t.integer("queue_depth", 1, std::numeric_limits<int>::max());
    f.compute_ms = t.number("compute_ms", 0, kInf);
    return f;
}

} // namespace

ThroughputFigures read_throughput(const json & settings, const JsonPlace & where) {
    return throughput_of(JsonFields(settings, where.file, where.path));
}

PlanInputFigures read_plan_inputs(const PlanFile & plan) {
    const JsonFields in(plan.inputs, plan.path, "inputs");
    PlanInputFigures f;
    const JsonFields g = in.object("geometry");
    f.source = g.string("source");
    f.moe_layers = g.integer("moe_layers", 1, 100000);
    f.experts = g.integer("experts", 1, 65536);
    f.used = g.integer("used", 1, f.experts);
    f.mtp_layers = g.has("mtp_layers") ? g.integer("mtp_layers", 0, 100000) : 0;
    f.expert_bytes = g.numbers("expert_bytes", 0, kInf);
    if (f.expert_bytes.empty()) {
        g.fail("expert_bytes", "is empty: a plan has at least one MoE layer");
    }
    f.other_bytes = optional_number(g, "other_bytes", 0, kInf);
    f.budget_bytes = optional_number(in, "budget_bytes", 0, kInf);
    const JsonFields t = in.object("throughput");
    f.throughput = throughput_of(t);
    f.throughput_model = t.string("model");
    f.measured = in.has("measured");
    if (f.measured) {
        const JsonFields m = in.object("measured");
        f.measured_median_error = optional_number(m, "median_error", 0, kInf);
        f.measured_max_error = optional_number(m, "max_error", 0, kInf);
    }
    return f;
}

namespace {

} // namespace

PlanFile read_plan_report(const std::filesystem::path & path) {
    return read_plan_document(read_report(path, "moeprune-plan", "a moeprune-plan report"), path.string());
}

PlanFile read_plan_document(const json & r, const std::string & origin) {
    if (!r.is_object() || r.value("format", json()) != "moeprune-plan") {
        fail_file(origin, "is not a moeprune-plan report (\"format\")");
    }
    const JsonFields report(r, origin);
    PlanFile out;
    out.path = origin;
    out.document = r;
    out.n_expert = report.object("inputs").object("geometry").integer("experts", 1, 65536);
    out.inputs = r.at("inputs");
    if (report.object("inputs").has("runs_on")) {
        const std::string runs_on = report.object("inputs").string("runs_on");
        const std::optional<RunsOn> parsed = parse_runs_on(runs_on);
        if (!parsed) {
            fail_file(origin, fmt::format("inputs.runs_on is \"{}\", not \"llama.cpp\" or \"any\"", runs_on));
        }
        out.runs_on = *parsed;
    }
    for (const JsonFields & o : report.objects("options")) {
        out.options.push_back(read_plan_option(o));
    }
    const int64_t last = int64_t(out.options.size()) - 1;
    for (const int64_t i : report.integers("pareto", 0, last)) {
        out.pareto.push_back(size_t(i));
    }
    if (report.has("pareto_runs_on")) {
        for (const int64_t i : report.integers("pareto_runs_on", 0, last)) {
            out.pareto_runs_on.push_back(size_t(i));
        }
    } else {
        out.pareto_runs_on = out.pareto;
    }
    if (report.has("recommended")) {
        out.recommended = size_t(report.integer("recommended", 0, last));
    }
    if (report.has("commands")) {
        out.commands = read_plan_commands(report.object("commands"));
    }
    if (report.has("infeasible")) {
        out.infeasible = uint64_t(report.integer("infeasible", 0, std::numeric_limits<int64_t>::max()));
    }
    out.why = report.string("why");
    return out;
}

SelectFile read_select_report(const std::filesystem::path & path) {
    const json r = read_report(path, "moeprune-select", "a moeprune-select report");
    const JsonFields report(r, path.string());
    SelectFile out;
    out.path = path.string();
    for (const JsonFields & result : report.objects("results")) {
        out.results.push_back(result_of(result));
    }
    if (report.has("warnings")) {
        out.warnings = report.strings("warnings");
    }
    return out;
}

EvalFile read_eval_report(const std::filesystem::path & path) {
    EvalFile out;
    const json r = read_report(path, "moeprune-eval", "a moeprune-eval report", &out.digest);
    const JsonFields report(r, path.string());
    out.path = path.string();
    const JsonFields base = report.object("base");
    out.base = read_model_identity(base);
    if (base.has("mtp") && base.any("mtp").is_object()) {
        const JsonFields mtp = base.object("mtp");
        out.base_mtp = EvalMtpFigures{mtp.number("acceptance", 0, 1), optional_number(mtp, "tokens_per_step", 1, 65536)};
    }
    for (const JsonFields & c : report.objects("candidates")) {
        out.candidates.push_back(candidate_of(c));
    }
    if (report.has("tasks")) {
        const JsonFields tasks = report.object("tasks");
        out.task_format = tasks.string("format");
        out.task_file = tasks.string("file");
        out.base_tasks = task_figures_of(tasks.object("base"));
    }
    return out;
}

ReplayFile read_replay_report(const std::filesystem::path & path) {
    ReplayFile out;
    const json r = read_report(path, "moeprune-replay", "a moeprune-replay result", &out.digest);
    const JsonFields report(r, path.string());
    const JsonFields in = report.object("inputs");
    out.path = path.string();
    out.inputs_place = in.place();
    const JsonFields meta = in.object("trace_meta");
    if (meta.has("model")) {
        out.trace_model = read_model_identity(meta.object("model"));
    }
    if (meta.has("mtp_layers")) {
        out.trace_mtp_layers = meta.integers("mtp_layers", 0, 1 << 20);
    }
    out.n_layer = in.integer("n_layer", 1, 100000);
    out.n_expert = in.integer("n_expert", 1, 65536);
    out.keep = optional_string(in, "keep");
    if (out.keep && out.keep->empty()) {
        out.keep.reset();  // no keep map, as null says
    }
    if (in.has("n_expert_after_keep")) {
        out.n_expert_after_keep = in.integer("n_expert_after_keep", 1, 65536);
    }
    out.global = in.has("cache_scope") && in.string("cache_scope") == "global";
    out.throughput = r.at("inputs").value("throughput", json(nullptr));
    for (const JsonFields & rec : report.objects("records")) {
        out.records.push_back(record_of(rec));
    }
    return out;
}

} // namespace moeprune
