// An eval run's passes: every window decoded by the reference and each candidate in turn
// and scored, with what the passes write as they go (the base's trace and --base-out).
#include "eval/eval_run.h"
#include "core/errors.h"
#include "core/parallel.h"

#include <fmt/format.h>

#include <cmath>

namespace moeprune::eval_impl {

// What the passes write as they go: the base pass's trace and the base of --base-out.
void EvalRun::open_outputs() {
    // The base pass's trace, as collect writes one; also written to --trace-out when given.
    if (closed_loop) {
        TraceHeader h;
        h.n_layer = uint32_t(facts.moe_layers.size());
        h.n_expert = uint32_t(info.n_expert);
        h.top_m = uint32_t(trace_top);
        h.domains = {""};
        h.domains.insert(h.domains.end(), corpus.domains.begin(), corpus.domains.end());
        h.meta = {{"n_expert_used", info.n_expert_used}, {"moe_layers", facts.moe_layers}, {"model", base_identity},
                  {"corpus", opt.corpus.string()},          {"settings", settings},
                  {"producer", "moeprune eval (base pass)"}};
        if (!opt.trace_out.empty()) {
            trace_file.emplace(opt.trace_out);
            trace.emplace(trace_file->temp_path(), h);
        }
        base_trace.emplace(std::move(h));
    }

    const json base_header = {{"format", "moeprune-eval-base"},
                              {"model", base_identity},
                              {"model_file", opt.model.string()},
                              {"corpus", {{"file", opt.corpus.string()}, {"digest", corpus.digest}}},
                              {"mmproj", mmproj_identity},
                              {"settings", settings},
                              {"top", top},
                              {"n_vocab", n_vocab},
                              {"n_scored", n_scored}};
    if (!opt.base_out.empty()) {
        base_out.emplace(opt.base_out);
        base_out_file.emplace(File::create_new(base_out->temp_path()));
        base_writer.emplace(*base_out_file, base_header, top);
    }
}

// Every window, decoded by the reference and every candidate in turn, and scored.
void EvalRun::score_windows() {
    uint64_t total_tokens = 0;
    for (const Window & w : windows) {
        total_tokens += w.tokens.size();
    }
    const size_t passes = (base_live || closed_loop ? 1 : 0) + maps.size() + files.size() + runs.size();
    Progress progress("eval", total_tokens * passes, "tokens");
    for (size_t wi = 0; wi < windows.size(); ++wi) {
        const Window & w = windows[wi];
        if (closed_loop && !base_live) {
            observe_base(wi, w);
            progress.advance(w.tokens.size());
        }
        reference_pass(wi, w, progress);
        candidate_passes(wi, w, progress);
    }
    progress.finish();
}

// The base's pass under the observer, its routing appended to the trace.
void EvalRun::observe_base(size_t wi, const Window & w) {
    observer->begin_window(uint32_t(wi), w.tokens.size());
    decode_window(base.ctx.get(), w, [&] { observer->rethrow_failure(); }, true);
    observer->end_window();
    const size_t per_token = facts.moe_layers.size() * size_t(trace_top);
    for (size_t i = 0; i < w.tokens.size(); ++i) {
        TraceTokenMeta meta;
        meta.token = w.tokens[i];
        meta.pos = int32_t(i);
        meta.seq = int32_t(wi);
        meta.domain = uint16_t(w.domain + 1);
        base_trace->append(meta, observer->window_ids().data() + i * per_token,
                           observer->window_logits().data() + i * per_token);
        if (trace) {
            trace->append(meta, observer->window_ids().data() + i * per_token,
                          observer->window_logits().data() + i * per_token);
        }
    }
}

// The reference: live base logits, or the records of --base.
void EvalRun::reference_pass(size_t wi, const Window & w, Progress & progress) {
    const int n = w.n_scored();
    if (base_file) {
        records = base_file->read(w.first_record, uint64_t(n));
        for (int i = 0; i < n; ++i) {
            const BaseRecord & r = records[size_t(i)];
            if (r.target != w.tokens[size_t(w.first + i + 1)]) {
                fail_file(opt.base_in.string(), fmt::format("record {} predicts token {}, the text has {} there",
                                                            w.first_record + uint64_t(i), r.target,
                                                            w.tokens[size_t(w.first + i + 1)]));
            }
            base_tail_mass += std::exp(double(r.ln_tail));
        }
    } else {
        // File candidates decode first: each keeps its logits in its own context, so one
        // of them can be the reference (--against).
        for (Model & f : files) {
            decode_window(f.ctx.get(), w);
            if (f.head) {
                draft_window(f.head.get(), w);
            }
            progress.advance(w.tokens.size());
        }
        llama_context * ref = against >= 0 ? files[size_t(against)].ctx.get() : base.ctx.get();
        if (against < 0) {
            if (closed_loop) {
                observe_base(wi, w);
            } else {
                decode_window(ref, w);
            }
            if (base.head) {
                draft_window(base.head.get(), w);
                base_accept.resize(n_scored, -1);
                base_accept_domain.resize(n_scored, -1);
                for (int i = 0; i < n; ++i) {
                    base_accept_domain[w.first_record + uint64_t(i)] = w.domain;
                    base_accept[w.first_record + uint64_t(i)] =
                        int8_t(top1(base.head->logits(w.first + i), n_vocab) == top1(llama_get_logits_ith(ref, w.first + i), n_vocab));
                }
            }
            progress.advance(w.tokens.size());
        }
        rows.assign(size_t(n), {});
        records.assign(base_writer ? size_t(n) : 0, {});
        run_parallel(size_t(n), threads, [&](size_t i) {
            thread_local std::vector<float> exps;
            rows[size_t(i)] = base_row(llama_get_logits_ith(ref, w.first + i), n_vocab, base_writer ? &exps : nullptr);
            if (base_writer) {
                records[size_t(i)] = compact_record(rows[size_t(i)], exps, top, w.tokens[size_t(w.first + i + 1)]);
            }
        });
        for (const BaseRecord & r : records) {
            base_writer->append(r);
        }
    }
}

// Every scored position of `w` as decoded in `ctx`, compared with the reference.
void EvalRun::score_window(const Model & m, EvalCandidate & cand, size_t wi, const Window & w) {
    llama_context * ctx = m.ctx.get();
    const Model * ref = reference_model();
    const MtpHead * ref_head = ref && ref->head ? ref->head.get() : nullptr;
    if (m.head) {
        m.head->logits(w.first);  // llama.cpp orders its outputs on the first read: not in parallel
    }
    run_parallel(size_t(w.n_scored()), threads, [&](size_t i) {
        const float * c = llama_get_logits_ith(ctx, w.first + i);
        const int32_t target = w.tokens[size_t(w.first + i + 1)];
        thread_local std::vector<uint8_t> mark;
        if (mark.size() != size_t(n_vocab)) {
            mark.assign(size_t(n_vocab), 0);
        }
        TokenScore s = base_file ? score_compact(records[size_t(i)], c, n_vocab, mark)
                                 : score_exact(rows[size_t(i)], c, n_vocab, target);
        s.window = uint32_t(wi);
        s.pos = w.first + i;
        s.domain = w.domain;
        if (m.head) {
            const float * draft = m.head->logits(w.first + int(i));
            s.mtp_draft = top1(draft, n_vocab);
            s.mtp_accept = int8_t(s.mtp_draft == top1(c, n_vocab));
            if (ref_head) {
                s.mtp_kld = kld_of_logits(ref_head->logits(w.first + int(i)), draft, n_vocab);
            }
        }
        cand.tokens[w.first_record + uint64_t(i)] = s;
    });
}

// The candidates' passes over one window: keep maps, files, closed-loop configurations.
void EvalRun::candidate_passes(size_t wi, const Window & w, Progress & progress) {
    for (size_t k = 0; k < maps.size(); ++k) {
        mask->set(maps[k].second, maps[k].first.string());
        decode_window(masked.ctx.get(), w, [&] { mask->rethrow_failure(); });
        if (masked.head) {
            draft_window(masked.head.get(), w, [&] { mask->rethrow_failure(); });
        }
        progress.advance(w.tokens.size());
        score_window(masked, rep.candidates[k], wi, w);
    }
    mask->clear();
    for (size_t f = 0; f < files.size(); ++f) {
        if (base_file) {
            decode_window(files[f].ctx.get(), w);
            if (files[f].head) {
                draft_window(files[f].head.get(), w);
            }
            progress.advance(w.tokens.size());
        }
        score_window(files[f], rep.candidates[maps.size() + f], wi, w);
    }
    for (size_t r = 0; r < runs.size(); ++r) {
        ClosedLoopRun & run = runs[r];
        if (run.map >= 0) {
            mask->set(maps[size_t(run.map)].second, maps[size_t(run.map)].first.string());
        }
        closed_slot.tap = run.tap.get();
        run.tap->begin_window(uint32_t(wi), w.tokens.size());
        decode_window(closed.ctx.get(), w, [&] { run.tap->rethrow_failure(); }, true);
        run.tap->end_window();
        mask->clear();
        progress.advance(w.tokens.size());
        score_window(closed, rep.candidates[first_closed + r], wi, w);
    }
}

// What the passes leave to finish: the closed loop's figures beside its open-loop replay,
// and the base of --base-out, whole now.
void EvalRun::finish_passes() {
    if (closed_loop) {
        closed_loop_figures(opt, *base_trace, maps, runs, int(facts.moe_layers.size()), threads, rep, first_closed);
        if (trace) {
            trace->close();
            trace_file->commit();
        }
    }
    if (base_writer) {
        base_writer->finish();
        base_out_file->sync();
        base_out->commit();
    }
}

} // namespace moeprune::eval_impl
