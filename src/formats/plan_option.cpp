#include "formats/plan_option.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace moeprune {

using nlohmann::json;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

json or_null(const std::optional<double> & v) { return v ? json(*v) : json(nullptr); }

std::optional<double> optional_number(const JsonFields & f, const std::string & key, double lo, double hi) {
    return f.has(key) ? std::optional(f.number(key, lo, hi)) : std::nullopt;
}

std::string optional_text(const JsonFields & f, const std::string & key) {
    return f.has(key) ? f.string(key) : std::string();
}

json draft_json(const PlanDraft & d) {
    json out = {{"draft_tokens", 1},
                {"acceptance", or_null(d.acceptance)},
                {"acceptance_source", d.acceptance_source ? json(*d.acceptance_source) : json(nullptr)},
                {"tokens_per_step", or_null(d.tokens_per_step)},
                {"mtp_read_bytes_per_token", or_null(d.mtp_read_bytes_per_token)},
                {"resident_bytes", or_null(d.resident_bytes)},
                {"feasible", d.feasible},
                {"step_ms", or_null(d.step_ms)},
                {"tok_per_s", or_null(d.tok_per_s)},
                {"speedup", or_null(d.speedup)}};
    if (!d.note.empty()) {
        out["note"] = d.note;
    }
    return out;
}

PlanDraft read_draft(const JsonFields & d) {
    PlanDraft out;
    out.acceptance = optional_number(d, "acceptance", 0, 1);
    if (d.has("acceptance_source")) {
        out.acceptance_source = d.string("acceptance_source");
    }
    out.tokens_per_step = optional_number(d, "tokens_per_step", 1, kInf);
    out.mtp_read_bytes_per_token = optional_number(d, "mtp_read_bytes_per_token", 0, kInf);
    out.resident_bytes = optional_number(d, "resident_bytes", 0, kInf);
    out.feasible = !d.has("feasible") || d.boolean("feasible");
    out.step_ms = optional_number(d, "step_ms", 0, kInf);
    out.tok_per_s = optional_number(d, "tok_per_s", 0, kInf);
    out.speedup = optional_number(d, "speedup", 0, kInf);
    out.note = optional_text(d, "note");
    return out;
}

} // namespace

std::optional<double> PlanShortlistFigures::error() const {
    if (!predicted_tok_per_s || !(measured_tok_per_s > 0)) {
        return std::nullopt;
    }
    return std::abs(*predicted_tok_per_s - measured_tok_per_s) / measured_tok_per_s;
}

const char * runs_on_of(const std::string & policy) {
    return policy == kPolicyResident || policy == kPolicyPageCache ? kRunsOnLlamaCpp : kRunsOnExpertCache;
}

const char * runs_on_name(RunsOn r) { return r == RunsOn::Any ? "any" : kRunsOnLlamaCpp; }

std::optional<RunsOn> parse_runs_on(const std::string & name) {
    if (name == kRunsOnLlamaCpp) {
        return RunsOn::LlamaCpp;
    }
    if (name == "any") {
        return RunsOn::Any;
    }
    return std::nullopt;
}

double PlanOption::speed() const { return tok_per_s ? *tok_per_s : std::numeric_limits<double>::infinity(); }

std::string PlanOption::describe() const {
    if (measured) {
        return fmt::format("all {} experts mapped under a {} limit{} (llama.cpp, measured): {:.2f} tokens/s", k,
                           measured->ram,
                           measured->read_ahead_kb ? fmt::format(" at a read-ahead of {} KB", *measured->read_ahead_kb) : "",
                           tok_per_s.value_or(0));
    }
    const std::string cache = policy == kPolicyResident    ? "all kept experts resident"
                              : policy == kPolicyPageCache ? "sliced and mapped from disk, the page cache its only expert cache"
                              : !cache_experts      ? policy
                                                    : fmt::format("{} cache of {} experts{}, λ {}", policy, *cache_experts,
                                                                  cache_scope == "global" ? " (global)" : " per layer", lambda);
    std::string speed_text = tok_per_s ? fmt::format("{:.2f} tokens/s", *tok_per_s)
                                       : "unbounded tokens/s (no time per token in the model)";
    if (shortlist) {
        speed_text += fmt::format(" measured by llama.cpp under {}", shortlist->ram);
    }
    const std::string read_ahead = read_ahead_kb ? fmt::format(" at a read-ahead of {} KB", *read_ahead_kb) : "";
    return fmt::format("K {} by {}, {}{}: {}", k, criterion, cache, read_ahead, speed_text);
}

json to_json(const PlanOption & o) {
    json out = {{"k", o.k},
                {"criterion", o.criterion},
                {"cache_experts", o.cache_experts ? json(*o.cache_experts) : json(nullptr)},
                {"cache_scope", o.cache_scope},
                {"policy", o.policy},
                {"lambda", o.lambda},
                {"routed_bytes", o.routed_bytes},
                {"resident_bytes", or_null(o.resident_bytes)},
                {"misses_per_token", or_null(o.misses_per_token)},
                {"read_bytes_per_token", or_null(o.read_bytes_per_token)},
                {"tok_per_s", or_null(o.tok_per_s)},
                {"source", o.source},
                {"runs_on", o.runs_on},
                {"feasible", o.feasible},
                {"bound", o.bound},
                {"kld_mean", or_null(o.kld_mean)},
                {"kld_measured", o.kld_measured ? json(*o.kld_measured) : json(nullptr)},
                {"kld_loop", o.kld_loop},
                {"task_accuracy", or_null(o.task_accuracy)}};
    if (!o.note.empty()) {
        out["note"] = o.note;
    }
    if (!o.runs_on_note.empty()) {
        out["runs_on_note"] = o.runs_on_note;
    }
    if (o.keep_map) {
        out["keep_map"] = *o.keep_map;
    }
    if (o.read_ahead_kb) {
        out["read_ahead_kb"] = *o.read_ahead_kb;
    }
    if (!o.outside_model.empty()) {
        out["outside_model"] = o.outside_model;
    }
    if (o.measured) {
        out["measured_ram"] = o.measured->ram;
        out["measured_limit_bytes"] = o.measured->limit_bytes;
        out["major_faults_per_token"] = o.measured->major_faults_per_token;
        out["predicted_tok_per_s"] = or_null(o.measured->predicted_tok_per_s);
        out["measured_read_ahead_kb"] = o.measured->read_ahead_kb ? json(*o.measured->read_ahead_kb) : json(nullptr);
    }
    if (o.shortlist) {
        const PlanShortlistFigures & s = *o.shortlist;
        out["shortlist"] = {{"ram", s.ram},
                            {"model", s.model},
                            {"measure", s.measure},
                            {"measured_tok_per_s", s.measured_tok_per_s},
                            {"predicted_tok_per_s", or_null(s.predicted_tok_per_s)},
                            {"error", or_null(s.error())}};
    }
    if (!o.kld_note.empty()) {
        out["kld_note"] = o.kld_note;
    }
    if (o.mtp_draft) {
        out["mtp_draft"] = draft_json(*o.mtp_draft);
    }
    return out;
}

PlanOption read_plan_option(const JsonFields & f) {
    PlanOption o;
    o.k = f.integer("k", 1, 65536);
    o.criterion = f.string("criterion");
    if (f.has("cache_experts")) {
        o.cache_experts = f.integer("cache_experts", 1, std::numeric_limits<int64_t>::max());
    }
    if (f.has("cache_scope")) {
        o.cache_scope = f.string("cache_scope");
        if (o.cache_scope != "per-layer" && o.cache_scope != "global") {
            f.fail("cache_scope", fmt::format("is \"{}\", not per-layer or global", o.cache_scope));
        }
    }
    o.policy = f.string("policy");
    o.lambda = f.has("lambda") ? f.number("lambda", 0, kInf) : 0.0;
    o.routed_bytes = f.has("routed_bytes") ? f.number("routed_bytes", 0, kInf) : 0.0;
    o.resident_bytes = optional_number(f, "resident_bytes", 0, kInf);
    o.misses_per_token = optional_number(f, "misses_per_token", 0, kInf);
    o.read_bytes_per_token = optional_number(f, "read_bytes_per_token", 0, kInf);
    o.tok_per_s = optional_number(f, "tok_per_s", 0, kInf);
    o.source = optional_text(f, "source");
    o.note = optional_text(f, "note");
    // Plans written before options named what runs them: it follows from the policy.
    o.runs_on = f.has("runs_on") ? f.string("runs_on") : runs_on_of(o.policy);
    if (o.runs_on != kRunsOnLlamaCpp && o.runs_on != kRunsOnExpertCache) {
        f.fail("runs_on", fmt::format("is \"{}\", not \"{}\" or \"{}\"", o.runs_on, kRunsOnLlamaCpp, kRunsOnExpertCache));
    }
    o.runs_on_note = optional_text(f, "runs_on_note");
    if (f.has("keep_map")) {
        o.keep_map = f.string("keep_map");
    }
    if (f.has("read_ahead_kb")) {
        o.read_ahead_kb = uint64_t(f.integer("read_ahead_kb", 0, int64_t(1) << 40));
    }
    o.outside_model = optional_text(f, "outside_model");
    if (f.has("measured_ram")) {
        o.measured = PlanMeasuredFigures{f.string("measured_ram"),
                                         f.has("measured_limit_bytes") ? f.number("measured_limit_bytes", 0, kInf) : 0.0,
                                         f.has("major_faults_per_token") ? f.number("major_faults_per_token", 0, kInf) : 0.0,
                                         optional_number(f, "predicted_tok_per_s", 0, kInf), std::nullopt};
        if (f.has("measured_read_ahead_kb")) {
            o.measured->read_ahead_kb = uint64_t(f.integer("measured_read_ahead_kb", 0, int64_t(1) << 40));
        }
    }
    if (f.has("shortlist")) {
        const JsonFields s = f.object("shortlist");
        o.shortlist = PlanShortlistFigures{s.string("ram"), s.string("model"), s.string("measure"),
                                           s.number("measured_tok_per_s", 0, kInf),
                                           optional_number(s, "predicted_tok_per_s", 0, kInf)};
        if (o.tok_per_s != o.shortlist->measured_tok_per_s) {
            f.fail("tok_per_s", "is not shortlist.measured_tok_per_s: a measured option's speed is what was measured");
        }
    }
    o.feasible = !f.has("feasible") || f.boolean("feasible");
    o.bound = f.has("bound") && f.boolean("bound");
    o.kld_mean = optional_number(f, "kld_mean", 0, kInf);
    if (f.has("kld_measured")) {
        o.kld_measured = f.boolean("kld_measured");
    }
    o.kld_loop = f.has("kld_loop") ? f.string("kld_loop") : "open";
    o.task_accuracy = optional_number(f, "task_accuracy", 0, 1);
    o.kld_note = optional_text(f, "kld_note");
    if (f.has("mtp_draft")) {
        o.mtp_draft = read_draft(f.object("mtp_draft"));
    }
    return o;
}

json to_json(const PlanCommands & c) {
    return {{"model", c.model},
            {"slice", c.slice},
            {"memory_limit", c.memory_limit},
            {"read_ahead", c.read_ahead},
            {"llama_completion", c.llama_completion},
            {"llama_server", c.llama_server},
            {"lines", c.lines},
            {"notes", c.notes}};
}

PlanCommands read_plan_commands(const JsonFields & c) {
    PlanCommands out;
    out.model = c.string("model");
    out.slice = c.strings("slice");
    out.memory_limit = c.strings("memory_limit");
    if (c.has("read_ahead")) {
        out.read_ahead = c.strings("read_ahead");
    }
    out.llama_completion = c.strings("llama_completion");
    out.llama_server = c.strings("llama_server");
    out.lines = c.strings("lines");
    out.notes = c.strings("notes");
    if (out.llama_completion.empty()) {
        c.fail("llama_completion", "is empty: a recommendation's commands run it");
    }
    return out;
}

std::string shell_line(const std::vector<std::string> & argv) {
    std::string line;
    for (const std::string & a : argv) {
        // A first word with `=` would be read as an assignment (a=b/llama-completion runs its first flag).
        const bool plain = !a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                             "0123456789-_./=:,+%@") == std::string::npos &&
                           !(line.empty() && a.find('=') != std::string::npos);
        std::string quoted = "'";
        for (const char ch : a) {
            quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
        }
        line += (line.empty() ? "" : " ") + (plain ? a : quoted + "'");
    }
    return line;
}

} // namespace moeprune
