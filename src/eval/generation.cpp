// Eval's behaviour checks: chat prompts read, greedy continuations by the base and every
// candidate (with their MTP drafts), and each candidate's compared with the base's.
#include "eval/eval_run.h"
#include "core/errors.h"
#include "eval/behaviour.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace moeprune::eval_impl {

std::string piece(const llama_vocab * v, llama_token t) {
    char buf[256];
    const int n = llama_token_to_piece(v, t, buf, sizeof(buf), 0, true);
    return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

namespace {

// The head's drafts over a continuation the trunk generated: the trunk decodes the prompt
// and the continuation once more (for its hidden states of every position), the head runs
// over the same tokens, and its draft after generated token j is checked against token j + 1.
std::vector<int8_t> continuation_drafts(const Decoder & d, const Prompt & p, const Continuation & c, int n_vocab) {
    std::vector<int8_t> accept;
    if (!d.head || c.tokens.size() < 2) {
        return accept;
    }
    std::vector<llama_token> seq = p.tokens;
    seq.insert(seq.end(), c.tokens.begin(), c.tokens.end() - 1);
    const int n = int(seq.size()), first = int(p.tokens.size());
    llama_memory_clear(llama_get_memory(d.ctx), true);
    if (d.before) {
        d.before(n);
    }
    decode_tokens(d.ctx, seq.data(), n, 0, n - 1, n - 1, d.after);
    d.head->reset();
    try {
        d.head->decode(seq, 0);
    } catch (const Error &) {
        if (d.after) {
            d.after();
        }
        throw;
    }
    for (int j = 0; j + 1 < int(c.tokens.size()); ++j) {
        accept.push_back(int8_t(top1(d.head->logits(first + j), n_vocab) == c.tokens[size_t(j) + 1]));
    }
    return accept;
}

// The greedy continuation of `p`, at most `limit` tokens, ending at an end-of-generation token.
Continuation generate(const Decoder & d, const Prompt & p, int limit, const llama_vocab * vocab, int n_vocab) {
    llama_memory_clear(llama_get_memory(d.ctx), true);
    const int n = int(p.tokens.size());
    if (d.before) {
        d.before(n);
    }
    decode_tokens(d.ctx, p.tokens.data(), n, 0, d.all_outputs ? 0 : n - 1, n - 1, d.after);
    Continuation c;
    for (int g = 0; g < limit; ++g) {
        const float * l = llama_get_logits_ith(d.ctx, -1);
        const llama_token t = llama_token(std::max_element(l, l + n_vocab) - l);
        c.tokens.push_back(t);
        if (llama_vocab_is_eog(vocab, t)) {
            c.terminated = true;
            break;
        }
        c.text += piece(vocab, t);
        if (g + 1 == limit) {
            break;
        }
        if (d.before) {
            d.before(1);
        }
        decode_tokens(d.ctx, &t, 1, n + g, 0, 0, d.after);
    }
    return c;
}

// A candidate's continuations against the base's, prompt by prompt: behaviour whole and
// per domain, and its earliest departures from the base.
void compare_behaviour(EvalCandidate & c, const std::vector<Prompt> & prompts,
                       const std::vector<Continuation> & base_gen, const std::vector<Continuation> & gen) {
    std::vector<BehaviourSample> all;
    std::map<std::string, std::vector<BehaviourSample>> by_domain;
    for (size_t i = 0; i < prompts.size(); ++i) {
        const BehaviourSample x{&base_gen[i], &gen[i], prompts[i].opens_think};
        all.push_back(x);
        if (!prompts[i].domain.empty()) {
            by_domain[prompts[i].domain].push_back(x);
        }
    }
    c.behaviour = behaviour_stats(all);
    for (const auto & [name, xs] : by_domain) {
        c.behaviour_domains.emplace_back(name, behaviour_stats(xs));
    }
    // The earliest departures from the base, side by side.
    std::vector<size_t> order(prompts.size());
    for (size_t i = 0; i < order.size(); ++i) {
        order[i] = i;
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return divergence(base_gen[a], gen[a]) < divergence(base_gen[b], gen[b]);
    });
    for (size_t i = 0; i < std::min<size_t>(3, order.size()); ++i) {
        const size_t at = order[i];
        if (base_gen[at].tokens == gen[at].tokens) {
            break;
        }
        const std::string & pt = prompts[at].text;
        c.behaviour_worst.push_back({{"prompt", prompts[at].where},
                                     {"prompt_end", pt.substr(pt.size() - std::min<size_t>(pt.size(), 160))},
                                     {"divergence", divergence(base_gen[at], gen[at])},
                                     {"base", base_gen[at].text},
                                     {"candidate", gen[at].text},
                                     {"domain", prompts[at].domain}});
    }
}

} // namespace

// Chat prompts for the behaviour checks, refused before anything runs.
void EvalRun::read_prompts() {
    if (opt.generate > 0) {
        const fs::path & from = opt.prompts.empty() ? opt.corpus : opt.prompts;
        const Corpus pc = opt.prompts.empty() ? corpus : read_corpus(opt.prompts);
        refuse_media(pc, "the behaviour checks (--generate) take text prompts");
        for (const CorpusDocument & doc : pc.documents) {
            if (doc.messages.empty()) {
                continue;
            }
            const std::string where = fmt::format("{}:{}", from.string(), doc.line);
            Prompt p;
            p.text = document_text(base.model.get(), doc, true, where);
            p.tokens = tokenize(vocab, p.text, opt.parse_special, where);
            p.domain = doc.domain;
            p.where = where;
            const size_t open = p.text.rfind("<think>"), close = p.text.rfind("</think>");
            p.opens_think = open != std::string::npos && (close == std::string::npos || open > close);
            if (int(p.tokens.size()) + opt.generate > opt.ctx) {
                fail_file(where, fmt::format("is a prompt of {} tokens: with --generate {} it exceeds -c {}", p.tokens.size(),
                                             opt.generate, opt.ctx));
            }
            prompts.push_back(std::move(p));
        }
        if (prompts.empty()) {
            fail_file(from.string(), "has no chat documents (JSONL lines with \"messages\") to generate from (--generate)");
        }
    }
}

// The base's continuations, then every candidate's against them. A closed loop keeps
// its caches from the scored windows and routes on, uncounted.
void EvalRun::check_behaviour() {
    if (prompts.empty()) {
        return;
    }
    if (!base.ctx) {
        base.ctx = make_context(base.model.get(), opt, threads, nullptr, nullptr);
    }
    observer_slot.tap = nullptr;
    Progress gen_progress("generate", prompts.size() * (1 + rep.candidates.size()), "prompts");
    const auto continuations = [&](const Decoder & d) {
        std::vector<Continuation> out;
        for (const Prompt & p : prompts) {
            out.push_back(generate(d, p, opt.generate, vocab, n_vocab));
            out.back().mtp_accept = continuation_drafts(d, p, out.back(), n_vocab);
            gen_progress.advance(1);
        }
        return out;
    };
    const std::vector<Continuation> base_gen = continuations({base.ctx.get(), {}, {}, false, base.head.get()});
    const auto judge = [&](EvalCandidate & c, const Decoder & d) {
        compare_behaviour(c, prompts, base_gen, continuations(d));
    };
    for (size_t k = 0; k < maps.size(); ++k) {
        mask->set(maps[k].second, maps[k].first.string());
        judge(rep.candidates[k], {masked.ctx.get(), {}, [&] { mask->rethrow_failure(); }, false, masked.head.get()});
    }
    mask->clear();
    for (size_t f = 0; f < files.size(); ++f) {
        judge(rep.candidates[maps.size() + f], {files[f].ctx.get(), {}, {}, false, files[f].head.get()});
    }
    for (size_t r = 0; r < runs.size(); ++r) {
        RouterTap & tap = *runs[r].tap;
        if (runs[r].map >= 0) {
            mask->set(maps[size_t(runs[r].map)].second, maps[size_t(runs[r].map)].first.string());
        }
        closed_slot.tap = &tap;
        tap.set_counting(false);
        judge(rep.candidates[first_closed + r],
              {closed.ctx.get(), [&](int n) { tap.begin_window(0, size_t(n)); },
               [&] {
                   tap.rethrow_failure();
                   tap.end_window();
               },
               true});
        tap.set_counting(true);
        mask->clear();
    }
    gen_progress.finish();
    uint64_t terminated = 0;
    double repeat = 0;
    DraftWalk drafts;
    for (const Continuation & c : base_gen) {
        terminated += c.terminated;
        repeat += repeated_4gram_share(c.tokens);
        const DraftWalk w = draft_walk(c.mtp_accept);
        drafts.steps += w.steps;
        drafts.tokens += w.tokens;
    }
    rep.generation = {{"prompts", prompts.size()},
                      {"file", (opt.prompts.empty() ? opt.corpus : opt.prompts).string()},
                      {"max_tokens", opt.generate},
                      {"base_terminated", double(terminated) / double(prompts.size())},
                      {"base_repeat_4gram", repeat / double(prompts.size())}};
    if (drafts.steps > 0) {
        const double per_step = double(drafts.tokens) / double(drafts.steps);
        rep.generation["base_mtp_tokens_per_step"] = per_step;
        base_tokens_per_step = per_step;
    }
}

} // namespace moeprune::eval_impl
