// Eval's report as text (to_text): the KLD table, then MTP drafts, the closed loop,
// behaviour and the largest-KLD tokens where the run has them.
#include "eval/eval.h"

#include <fmt/format.h>

#include <algorithm>
#include <sstream>

namespace moeprune {

using nlohmann::json;

namespace {

void kld_table(std::ostringstream & o, const EvalReport & r) {
    o << fmt::format("base {} ({}), {} scored tokens in {} windows, KLD {}\n", r.base.value("file", ""),
                     r.base.value("arch", ""), r.base.value("scored_tokens", uint64_t(0)), r.base.value("windows", uint64_t(0)),
                     r.inputs.value("kld", ""));
    const auto row = [&](const std::string & name, const std::string & scope, const EvalStats & s) {
        o << fmt::format("{:<24} {:<10} {:>7} {:>10.6f} ±{:<9.6f} {:>9.6f} {:>9.6f} {:>9.6f} {:>8.3f}% {:>7.3f}% {:>+9.5f} ±{:.5f}\n",
                         name, scope, s.tokens, s.kld_mean, s.kld_stderr, s.kld_median, s.kld_p99, s.kld_max,
                         100 * s.same_top1, 100 * s.dp_rms, s.ln_ppl_ratio, s.ln_ppl_ratio_stderr);
    };
    o << fmt::format("{:<24} {:<10} {:>7} {:>21} {:>9} {:>9} {:>9} {:>9} {:>8} {:>19}\n", "candidate", "domain", "tokens",
                     "Mean KLD", "median", "99.0%", "max", "same top", "Δp RMS", "ln(PPL(Q)/PPL(base))");
    for (const EvalCandidate & c : r.candidates) {
        row(c.name, "all", c.all);
        for (const auto & [name, s] : c.domains) {
            if (s.tokens > 0) {
                row("", name, s);
            }
        }
    }
}

void mtp_table(std::ostringstream & o, const EvalReport & r) {
    o << fmt::format("\nMTP drafts (one draft token per step: tokens per step = 1 + acceptance):\n{:<24} {:<10} {:>7} "
                     "{:>11} {:>14}\n", "model", "domain", "tokens", "acceptance", "draft KLD");
    if (r.base.contains("mtp")) {
        o << fmt::format("{:<24} {:<10} {:>7} {:>10.2f}% {:>14}\n", "base", "all", r.base["mtp"]["tokens"].get<uint64_t>(),
                         100 * r.base["mtp"]["acceptance"].get<double>(), "-");
    }
    const auto mtp_row = [&](const std::string & name, const std::string & scope, const EvalStats & s) {
        o << fmt::format("{:<24} {:<10} {:>7} {:>10.2f}% {:>14}\n", name, scope, s.mtp_tokens, 100 * s.mtp_acceptance,
                         s.mtp_kld_tokens ? fmt::format("{:.6f}", s.mtp_kld_mean) : std::string("-"));
    };
    for (const EvalCandidate & c : r.candidates) {
        if (c.all.mtp_tokens > 0) {
            mtp_row(c.name, "all", c.all);
            for (const auto & [name, s] : c.domains) {
                if (s.mtp_tokens > 0) {
                    mtp_row("", name, s);
                }
            }
        }
    }
}

void closed_loop_table(std::ostringstream & o, const EvalReport & r) {
    o << fmt::format("\nclosed loop (cache-aware routing inside the forward pass) vs. open loop (replay of the base "
                     "pass's trace):\n{:<32} {:>10} {:>9} {:>13} {:>13} {:>9} {:>8} {:>11} {:>10} {:>10}\n",
                     "candidate", "Mean KLD", "same top", "misses/token", "open-loop", "hit rate", "swaps",
                     "moved mass", "tok/s", "open tok/s");
    for (const EvalCandidate & c : r.candidates) {
        if (c.closed) {
            const ClosedLoopStats & k = *c.closed;
            o << fmt::format("{:<32} {:>10.6f} {:>8.3f}% {:>13.3f} {:>13.3f} {:>8.2f}% {:>7.2f}% {:>11.4f} {:>10.2f} "
                             "{:>10.2f}\n",
                             c.name, c.all.kld_mean, 100 * c.all.same_top1, k.misses_per_token,
                             k.open_loop_misses_per_token, 100 * k.hit_rate, 100 * k.swap_rate, k.moved_gate_mass,
                             k.tok_per_s, k.open_loop_tok_per_s);
        }
    }
}

void behaviour_table(std::ostringstream & o, const EvalReport & r) {
    const auto pct = [](const std::optional<double> & v) { return v ? fmt::format("{:.1f}%", 100 * *v) : std::string("-"); };
    o << fmt::format("\nbehaviour: greedy continuations of {} prompts, at most {} tokens (base terminated {:.1f}%):\n"
                     "{:<32} {:<10} {:>7} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9}\n",
                     r.generation["prompts"].get<uint64_t>(), r.generation["max_tokens"].get<int>(),
                     100 * r.generation["base_terminated"].get<double>(), "candidate", "domain", "exact",
                     "diverge", "median", "terminate", "tool call", "think", "repeat");
    if (r.generation.contains("base_mtp_tokens_per_step")) {
        o << fmt::format("{:<32} {:<10} MTP draft: {:.3f} tokens per step\n", "base", "all",
                         r.generation["base_mtp_tokens_per_step"].get<double>());
    }
    const auto row = [&](const std::string & name, const std::string & scope, const BehaviourStats & b) {
        o << fmt::format("{:<32} {:<10} {:>6.1f}% {:>9.1f} {:>9.1f} {:>10} {:>10} {:>9} {:>8.1f}%\n", name, scope,
                         100 * b.exact_match, b.divergence_mean, b.divergence_median, pct(b.clean_termination),
                         pct(b.tool_call_ok), pct(b.think_balanced), 100 * b.repeat_4gram);
        if (b.mtp_tokens_per_step) {
            o << fmt::format("{:<32} {:<10} MTP draft: {:.3f} tokens per step\n", "", "", *b.mtp_tokens_per_step);
        }
    };
    for (const EvalCandidate & c : r.candidates) {
        if (c.behaviour) {
            row(c.name, "all", *c.behaviour);
            for (const auto & [name, b] : c.behaviour_domains) {
                row("", name, b);
            }
        }
    }
    for (const EvalCandidate & c : r.candidates) {
        for (const json & w : c.behaviour_worst) {
            o << fmt::format("\n{} departs after {} tokens on {}:\n  base:      {:?}\n  candidate: {:?}\n", c.name,
                             w["divergence"].get<size_t>(), w["prompt"].get<std::string>(),
                             w["base"].get<std::string>(), w["candidate"].get<std::string>());
        }
    }
}

void task_table(std::ostringstream & o, const EvalReport & r) {
    const json & base = r.tasks["base"];
    o << fmt::format("\ntasks: {} of the {} in {} ({}, as llama-perplexity scores it):\n"
                     "{:<32} {:>8} {:>10} {:>8} {:>12} {:>8}\n{:<32} {:>8} {:>9.2f}% {:>7.2f}%\n",
                     r.tasks["tasks"].get<uint64_t>(), r.tasks["tasks_in_file"].get<uint64_t>(),
                     r.tasks["file"].get<std::string>(),
                     r.tasks["format"] == "hellaswag"    ? "HellaSwag, acc_norm"
                     : r.tasks["format"] == "winogrande" ? "WinoGrande, the words after the choice"
                                                         : "multiple choice, acc_norm",
                     "candidate", "correct", "accuracy", "stderr", "kept of base",
                     "new", "base", base["correct"].get<uint64_t>(), 100 * base["accuracy"].get<double>(),
                     100 * base["stderr"].get<double>());
    const auto row = [&](const std::string & name, const TaskFigures & f) {
        o << fmt::format("{:<32} {:>8} {:>9.2f}% {:>7.2f}% {:>12} {:>8}\n", name, f.correct, 100 * f.accuracy,
                         100 * f.stderr_, f.kept_base_correct, f.new_correct);
    };
    for (const EvalCandidate & c : r.candidates) {
        if (c.tasks) {
            row(c.name, *c.tasks);
        }
    }
    if (!base.contains("domains")) {
        return;
    }
    o << "per domain (chance 25%):\n";
    for (const json & d : base["domains"]) {
        o << fmt::format("{:<32} {:>8} {:>9.2f}% {:>7.2f}%\n", "base " + d["domain"].get<std::string>(),
                         d["correct"].get<uint64_t>(), 100 * d["accuracy"].get<double>(), 100 * d["stderr"].get<double>());
    }
    for (const EvalCandidate & c : r.candidates) {
        if (c.tasks) {
            for (const TaskDomainFigures & d : c.tasks->domains) {
                row(c.name + " " + d.domain, d.figures);
            }
        }
    }
}

void worst_tokens(std::ostringstream & o, const EvalReport & r) {
    for (const EvalCandidate & c : r.candidates) {
        if (c.worst.empty()) {
            continue;
        }
        o << fmt::format("\nlargest KLD, {}:\n", c.name);
        for (const json & w : c.worst) {
            o << fmt::format("  {:>10.6f}  {:?} after {:?}\n", w["kld"].get<double>(), w["text"].get<std::string>(),
                             w["context"].get<std::string>());
        }
    }
}

} // namespace

std::string to_text(const EvalReport & r) {
    std::ostringstream o;
    kld_table(o, r);
    if (r.base.contains("mtp") || std::any_of(r.candidates.begin(), r.candidates.end(),
                                              [](const EvalCandidate & c) { return c.all.mtp_tokens > 0; })) {
        mtp_table(o, r);
    }
    if (std::any_of(r.candidates.begin(), r.candidates.end(), [](const EvalCandidate & c) { return c.closed.has_value(); })) {
        closed_loop_table(o, r);
    }
    if (!r.generation.is_null()) {
        behaviour_table(o, r);
    }
    if (!r.tasks.is_null()) {
        task_table(o, r);
    }
    worst_tokens(o, r);
    return o.str();
}

} // namespace moeprune
