// Eval's report: the statistics of every candidate, what the run read and how, the
// report's JSON and the per-token rows.
#include "eval/eval_run.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "eval/behaviour.h"

#include <algorithm>
#include <sstream>

namespace moeprune {

namespace eval_impl {

// Statistics, whole and per domain, and the worst tokens with their context.
void EvalRun::score_statistics() {
    std::vector<bool> media_domain(rep.domains.size());
    for (size_t d = 0; d < rep.domains.size(); ++d) {
        media_domain[d] = rep.domains[d] == modality_name(Modality::Image) || rep.domains[d] == modality_name(Modality::Audio);
    }
    for (EvalCandidate & c : rep.candidates) {
        std::vector<const TokenScore *> all;
        std::vector<std::vector<const TokenScore *>> per_domain(rep.domains.size());
        for (const TokenScore & t : c.tokens) {
            all.push_back(&t);
            if (t.domain >= 0) {
                per_domain[size_t(t.domain)].push_back(&t);
            }
        }
        c.all = eval_stats(all);
        for (size_t d = 0; d < rep.domains.size(); ++d) {
            c.domains.emplace_back(rep.domains[d], eval_stats(per_domain[d]));
        }
        if (!corpus.media_modalities.empty()) {
            std::vector<const TokenScore *> text;
            for (const TokenScore * t : all) {
                if (t->domain < 0 || !media_domain[size_t(t->domain)]) {
                    text.push_back(t);
                }
            }
            c.modalities.emplace_back(modality_name(Modality::Text), eval_stats(text));
            for (const Modality m : corpus.media_modalities) {
                const auto it = std::find(rep.domains.begin(), rep.domains.end(), modality_name(m));
                if (it != rep.domains.end()) {
                    c.modalities.emplace_back(modality_name(m), eval_stats(per_domain[size_t(it - rep.domains.begin())]));
                }
            }
        }
        std::vector<const TokenScore *> worst = all;
        const size_t n_worst = std::min(worst.size(), size_t(opt.top_tokens));
        std::partial_sort(worst.begin(), worst.begin() + long(n_worst), worst.end(),
                          [](const TokenScore * a, const TokenScore * b) { return a->kld > b->kld; });
        for (size_t i = 0; i < n_worst; ++i) {
            const TokenScore & t = *worst[i];
            const Window & w = windows[t.window];
            std::string context;
            for (int p = std::max(0, t.pos - 7); p <= t.pos; ++p) {
                context += piece(vocab, w.tokens[size_t(p)]);
            }
            c.worst.push_back({{"kld", t.kld},
                               {"token", t.target},
                               {"text", piece(vocab, t.target)},
                               {"context", context},
                               {"pos", t.pos},
                               {"document", w.doc},
                               {"domain", t.domain >= 0 ? json(rep.domains[size_t(t.domain)]) : json()}});
        }
    }
}

// The base and every input and setting, as the report records them.
void EvalRun::describe_run() {
    rep.base = base_identity;
    rep.base["file"] = opt.model.string();
    rep.base["scored_tokens"] = n_scored;
    rep.base["windows"] = windows.size();
    if (base_file) {
        rep.base["top"] = top;
        rep.base["tail_mass_mean"] = base_tail_mass / double(n_scored);
    }
    if (!base_accept.empty()) {
        const auto acceptance = [&](int domain) {
            uint64_t n = 0, accepted = 0;
            for (size_t i = 0; i < base_accept.size(); ++i) {
                if (base_accept[i] >= 0 && (domain < 0 || base_accept_domain[i] == domain)) {
                    ++n;
                    accepted += uint64_t(base_accept[i]);
                }
            }
            return json{{"tokens", n}, {"acceptance", n ? double(accepted) / double(n) : 0.0}};
        };
        json mtp = acceptance(-1);
        mtp["layers"] = info.mtp_layers();
        if (base_tokens_per_step) {
            mtp["tokens_per_step"] = *base_tokens_per_step;
        }
        for (size_t d = 0; d < rep.domains.size(); ++d) {
            mtp["domains"][rep.domains[d]] = acceptance(int(d));
        }
        rep.base["mtp"] = mtp;
    }
    rep.inputs = {{"model", opt.model.string()},
                  {"corpus", opt.corpus.string()},
                  {"corpus_digest", corpus.digest},
                  {"keep", [&] {
                       json a = json::array();
                       for (const auto & [p, km] : maps) {
                           a.push_back({{"file", p.string()}, {"digest", keep_map_digest(km)}, {"k", km.k}});
                       }
                       return a;
                   }()},
                  {"candidates", [&] {
                       json a = json::array();
                       for (const auto & p : opt.candidates) {
                           a.push_back(p.string());
                       }
                       return a;
                   }()},
                  {"base", opt.base_in.empty() ? json() : json(opt.base_in.string())},
                  {"base_out", opt.base_out.empty() ? json() : json(opt.base_out.string())},
                  {"kld", base_file ? "top-T plus tail (lower bound)" : "exact"},
                  {"against", opt.against.empty() ? json() : json(opt.against.string())},
                  {"top", top},
                  {"settings", settings},
                  {"batch", opt.batch},
                  {"ubatch", opt.ubatch},
                  {"threads", threads},
                  {"gpu_layers", opt.gpu_layers},
                  {"rpc", opt.rpc},
                  {"version", MOEPRUNE_VERSION}};
    if (opt.generate > 0) {
        rep.inputs["generate"] = opt.generate;
        rep.inputs["prompts"] = (opt.prompts.empty() ? opt.corpus : opt.prompts).string();
    }
    if (!opt.mmproj.empty()) {
        rep.inputs["mmproj"] = opt.mmproj.string();
    }
    for (const auto & [key, file] : {std::pair{"hellaswag", opt.hellaswag}, {"winogrande", opt.winogrande},
                                     {"multiple_choice", opt.multiple_choice}}) {
        if (!file.empty()) {
            rep.inputs[key] = {{"file", file.string()},
                               {"digest", content_digest(read_text_file(file))},
                               {"tasks", opt.tasks},
                               {"domains", opt.task_domains.empty() ? json(nullptr) : json(opt.task_domains.string())},
                               {"parallel", std::max(4, opt.parallel)}};
        }
    }
    if (opt.text_only) {
        rep.inputs["text_only"] = true;
        rep.inputs["media_documents_left_out"] = media_documents_left_out;
    }
    if (closed_loop) {
        rep.inputs["closed_loop"] = {
            {"policies", opt.cache_policies},
            {"caches", opt.caches},
            {"lambdas", opt.lambdas},
            {"j", *opt.j},
            {"moce", opt.moce},
            {"trace_top", trace_top},
            {"trace_out", opt.trace_out.empty() ? json() : json(opt.trace_out.string())},
            {"params", to_json(opt.policy_params)},
            {"throughput", to_json(opt.throughput)},
            {"expert_bytes", expert_bytes}};
    }
}

// The report (--json) and every scored token (--per-token).
void EvalRun::write_outputs() {
    if (!opt.json_out.empty()) {
        // Token pieces can be parts of a UTF-8 character: those bytes become U+FFFD.
        write_file_atomic(opt.json_out, to_json(rep).dump(1, ' ', false, json::error_handler_t::replace) + "\n");
    }
    if (!opt.per_token_out.empty()) {
        std::ostringstream o;
        for (const EvalCandidate & c : rep.candidates) {
            for (const TokenScore & t : c.tokens) {
                json row = {{"candidate", c.name},
                            {"window", t.window},
                            {"pos", t.pos},
                            {"token", t.target},
                            {"domain", t.domain >= 0 ? json(rep.domains[size_t(t.domain)]) : json()},
                            {"kld", t.kld},
                            {"same_top1", t.same_top1},
                            {"nll", t.nll},
                            {"nll_base", t.nll_base}};
                if (t.mtp_accept >= 0) {
                    row["mtp_draft"] = t.mtp_draft;
                    row["mtp_accept"] = bool(t.mtp_accept);
                }
                if (t.mtp_kld >= 0) {
                    row["mtp_kld"] = t.mtp_kld;
                }
                o << row.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
            }
        }
        write_file_atomic(opt.per_token_out, o.str());
    }
}

} // namespace eval_impl

using nlohmann::json;

namespace {

json stats_json(const EvalStats & s) {
    json j = {{"tokens", s.tokens},
            {"kld_mean", s.kld_mean},
            {"kld_stderr", s.kld_stderr},
            {"kld_median", s.kld_median},
            {"kld_p90", s.kld_p90},
            {"kld_p99", s.kld_p99},
            {"kld_p999", s.kld_p999},
            {"kld_max", s.kld_max},
            {"same_top1", s.same_top1},
            {"same_top1_stderr", s.same_top1_stderr},
            {"dp_rms", s.dp_rms},
            {"ln_ppl_ratio", s.ln_ppl_ratio},
            {"ln_ppl_ratio_stderr", s.ln_ppl_ratio_stderr},
            {"ppl", s.ppl},
            {"ppl_base", s.ppl_base}};
    if (s.mtp_tokens > 0) {
        j["mtp_tokens"] = s.mtp_tokens;
        j["mtp_acceptance"] = s.mtp_acceptance;
        j["mtp_acceptance_stderr"] = s.mtp_acceptance_stderr;
    }
    if (s.mtp_kld_tokens > 0) {
        j["mtp_kld_mean"] = s.mtp_kld_mean;
    }
    return j;
}

void add_behaviour(json & j, const BehaviourStats & b) {
    const auto opt = [](const std::optional<double> & v) { return v ? json(*v) : json(); };
    j["gen_prompts"] = b.prompts;
    j["gen_exact_match"] = b.exact_match;
    j["gen_divergence_mean"] = b.divergence_mean;
    j["gen_divergence_median"] = b.divergence_median;
    j["gen_clean_termination"] = opt(b.clean_termination);
    j["gen_tool_call_ok"] = opt(b.tool_call_ok);
    j["gen_think_balanced"] = opt(b.think_balanced);
    j["gen_repeat_4gram"] = b.repeat_4gram;
    if (b.mtp_tokens_per_step) {
        j["gen_mtp_tokens_per_step"] = *b.mtp_tokens_per_step;
    }
}

} // namespace

json to_json(const EvalReport & r) {
    json cands = json::array();
    for (const EvalCandidate & c : r.candidates) {
        json domains = json::object();
        for (const auto & [name, s] : c.domains) {
            domains[name] = stats_json(s);
        }
        json all = stats_json(c.all);
        json cand = {{"name", c.name}, {"kind", c.kind}, {"source", c.source}};
        if (c.closed) {
            const ClosedLoopStats & k = *c.closed;
            all["misses_per_token"] = k.misses_per_token;
            all["hit_rate"] = k.hit_rate;
            all["swap_rate"] = k.swap_rate;
            all["moved_gate_mass"] = k.moved_gate_mass;
            all["tok_per_s"] = k.tok_per_s;
            all["open_loop_misses_per_token"] = k.open_loop_misses_per_token;
            all["open_loop_tok_per_s"] = k.open_loop_tok_per_s;
            cand.update(c.config);
        }
        if (c.behaviour) {
            add_behaviour(all, *c.behaviour);
            for (const auto & [name, b] : c.behaviour_domains) {
                add_behaviour(domains[name], b);
            }
            cand["behaviour_worst"] = c.behaviour_worst;
        }
        cand["all"] = all;
        cand["domains"] = domains;
        if (!c.modalities.empty()) {
            json modalities = json::object();
            for (const auto & [name, st] : c.modalities) {
                modalities[name] = stats_json(st);
            }
            cand["modalities"] = modalities;
        }
        if (c.tasks) {
            cand["tasks"] = to_json(*c.tasks);
        }
        cand["worst_tokens"] = c.worst;
        cands.push_back(cand);
    }
    json out = {{"format", "moeprune-eval"}, {"version", 1}, {"base", r.base}, {"inputs", r.inputs}, {"candidates", cands}};
    if (!r.generation.is_null()) {
        out["generation"] = r.generation;
    }
    if (!r.tasks.is_null()) {
        out["tasks"] = r.tasks;
    }
    return out;
}

} // namespace moeprune
