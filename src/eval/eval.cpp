#include "eval/eval.h"
#include "formats/corpus.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "eval/behaviour.h"
#include "eval/masking.h"
#include "formats/base_logits.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "engine/media.h"
#include "engine/mtp.h"
#include "engine/session.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A stretch of one document decoded from a clean context; positions [first, last]
// predict the token after them.
// A document with media is one window: its prompt up to the text after its last media
// span is decoded first without outputs (`media`), and `tokens` are that text, from
// position `pos0`.
struct Window {
    size_t doc = 0;
    int domain = -1;
    std::vector<llama_token> tokens;
    int first = 0, last = -1;
    uint64_t first_record = 0;  // index of its first scored token over the whole run
    int n_scored() const { return last - first + 1; }
    std::shared_ptr<const MediaPrompt> media;
    const MediaEncoder * encoder = nullptr;
    size_t prefix_rows = 0;
    int32_t pos0 = 0;
};

// The reference distribution of one scored position, from the live base context.
struct BaseRow {
    const float * logits = nullptr;
    float max = 0;
    double lse = 0;  // ln Σ exp(l - max)
    int argmax = 0;
};

// `exps`, when given, receives exp(l - max) of every entry (reused by compact_record).
BaseRow base_row(const float * l, int n_vocab, std::vector<float> * exps = nullptr) {
    BaseRow b;
    b.logits = l;
    b.argmax = int(std::max_element(l, l + n_vocab) - l);
    b.max = l[b.argmax];
    if (exps) {
        exps->resize(size_t(n_vocab));
    }
    // Summed exactly as score_exact sums a candidate's, so identical logits score KLD 0.
    double s = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const double e = std::exp(double(l[i] - b.max));
        s += e;
        if (exps) {
            (*exps)[size_t(i)] = float(e);
        }
    }
    b.lse = std::log(s);
    return b;
}

// Exact KL(base || candidate) over the whole vocabulary, plus the target's log-likelihoods.
TokenScore score_exact(const BaseRow & b, const float * c, int n_vocab, int32_t target) {
    const float cmax = *std::max_element(c, c + n_vocab);
    double cs = 0;
    for (int i = 0; i < n_vocab; ++i) {
        cs += std::exp(double(c[i] - cmax));
    }
    const double clse = std::log(cs);
    const double shift = (double(b.max) + b.lse) - (double(cmax) + clse);  // ln p - ln q = (lb - lc) - shift
    double kl = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const double lp = double(b.logits[i]) - b.max - b.lse;
        kl += std::exp(lp) * (double(b.logits[i]) - double(c[i]) - shift);
    }
    TokenScore s;
    s.target = target;
    s.kld = std::max(0.0, kl);
    s.nll = double(cmax) + clse - double(c[target]);
    s.nll_base = double(b.max) + b.lse - double(b.logits[target]);
    s.same_top1 = int(std::max_element(c, c + n_vocab) - c) == b.argmax;
    return s;
}

// KL from a compact base record: the top-T terms plus the tail taken as one outcome
// (a lower bound of the exact KL; docs/eval.md).
TokenScore score_compact(const BaseRecord & r, const float * c, int n_vocab, std::vector<uint8_t> & in_top) {
    const float cmax = *std::max_element(c, c + n_vocab);
    for (int32_t id : r.ids) {
        in_top[size_t(id)] = 1;
    }
    double all = 0, tail = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const double e = std::exp(double(c[i] - cmax));
        all += e;
        tail += in_top[size_t(i)] ? 0.0 : e;
    }
    for (int32_t id : r.ids) {
        in_top[size_t(id)] = 0;
    }
    const double clse = double(cmax) + std::log(all);
    double kl = 0;
    for (size_t i = 0; i < r.ids.size(); ++i) {
        const double lq = double(c[r.ids[i]]) - clse;
        kl += std::exp(double(r.lp[i])) * (double(r.lp[i]) - lq);
    }
    if (std::isfinite(r.ln_tail) && tail > 0) {
        const double ln_q_tail = double(cmax) + std::log(tail) - clse;
        kl += std::exp(double(r.ln_tail)) * (double(r.ln_tail) - ln_q_tail);
    }
    TokenScore s;
    s.target = r.target;
    s.kld = std::max(0.0, kl);
    s.nll = clse - double(c[r.target]);
    s.nll_base = -double(r.lp_target);
    s.same_top1 = int(std::max_element(c, c + n_vocab) - c) == r.ids[0];
    return s;
}

// The top-T entries, found with a min-heap of T (most entries fail one comparison with
// its root), and the tail summed directly from `exps` (1 - Σ top would cancel when the
// tail is small).
BaseRecord compact_record(const BaseRow & b, const std::vector<float> & exps, uint32_t top, int32_t target) {
    const float * l = b.logits;
    const int n_vocab = int(exps.size());
    // Heap order: the root is the lowest logit kept (ties: the higher id goes first).
    const auto lower = [l](int32_t x, int32_t y) { return l[x] > l[y] || (l[x] == l[y] && x < y); };
    std::vector<int32_t> heap;
    heap.reserve(top);
    for (int32_t i = 0; i < n_vocab; ++i) {
        if (heap.size() < top) {
            heap.push_back(i);
            std::push_heap(heap.begin(), heap.end(), lower);
        } else if (lower(i, heap.front())) {
            std::pop_heap(heap.begin(), heap.end(), lower);
            heap.back() = i;
            std::push_heap(heap.begin(), heap.end(), lower);
        }
    }
    std::sort(heap.begin(), heap.end(), lower);
    BaseRecord r;
    r.target = target;
    r.lp_target = float(double(l[target]) - b.max - b.lse);
    r.ids = heap;
    for (int32_t id : r.ids) {
        r.lp.push_back(float(double(l[id]) - b.max - b.lse));
    }
    std::sort(heap.begin(), heap.end());  // ascending ids: one merge pass skips them in the tail
    double tail = 0;
    for (int32_t i = 0, j = 0; i < n_vocab; ++i) {
        if (j < int32_t(heap.size()) && heap[size_t(j)] == i) {
            ++j;
        } else {
            tail += double(exps[size_t(i)]);
        }
    }
    r.ln_tail = tail > 0 ? float(std::log(tail) - b.lse) : -std::numeric_limits<float>::infinity();
    return r;
}

std::string piece(const llama_vocab * v, llama_token t) {
    char buf[256];
    const int n = llama_token_to_piece(v, t, buf, sizeof(buf), 0, true);
    return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

double percentile(const std::vector<double> & sorted, double f) {
    if (sorted.empty()) {
        return 0;
    }
    const double p = f * double(sorted.size() - 1);
    const size_t lo = size_t(p);
    const size_t hi = std::min(lo + 1, sorted.size() - 1);
    return sorted[lo] + (p - double(lo)) * (sorted[hi] - sorted[lo]);
}

// Candidate names come from file names; a repeated one gets its position appended.
std::string unique_name(const std::string & stem, const std::vector<EvalCandidate> & taken) {
    std::string name = stem;
    for (int i = 2; std::any_of(taken.begin(), taken.end(), [&](const EvalCandidate & c) { return c.name == name; }); ++i) {
        name = fmt::format("{}#{}", stem, i);
    }
    return name;
}

ContextPtr make_context(llama_model * model, const EvalOptions & opt, int threads, ggml_backend_sched_eval_callback cb,
                        void * cb_data) {
    // A window is one llama_decode, so its logits stay readable while the candidates run.
    return new_context(model, {opt.ctx, std::max(opt.batch, opt.ctx), std::min(opt.ubatch, opt.ctx), threads, cb, cb_data});
}

// `rethrow` reports what a callback of the pass caught. A pass that watches routing makes
// every token an output: llama.cpp's last layer computes only output rows.
// Decodes tokens [0, n) at positions pos0.. of sequence 0; outputs are [first, last].
void decode_tokens(llama_context * ctx, const llama_token * tokens, int n, int pos0, int first, int last,
                   const std::function<void()> & rethrow) {
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = pos0 + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i >= first && i <= last;
    }
    batch.n_tokens = n;
    const int rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rethrow) {
        rethrow();
    }
    if (rc != 0) {
        throw Error(fmt::format("llama_decode failed ({}) on {} tokens at position {}", rc, n, pos0));
    }
}

// The text and media before a media window's scored text, without outputs.
void decode_media_prefix(llama_context * ctx, const Window & w, int batch, const std::function<void()> & rethrow) {
    const MediaPrompt & p = *w.media;
    walk_rows(
        p.media, w.prefix_rows, size_t(batch),
        [&](size_t first, size_t n, int32_t pos0) { decode_tokens(ctx, p.tokens.data() + first, int(n), pos0, 0, -1, rethrow); },
        [&](const MediaSpan & span, int32_t pos0) {
            try {
                return w.encoder->decode(ctx, p, span, pos0, batch, {}, rethrow);
            } catch (const Error &) {
                if (rethrow) {
                    rethrow();
                }
                throw;
            }
        });
}

void decode_window(llama_context * ctx, const Window & w, const std::function<void()> & rethrow = {},
                   bool all_outputs = false) {
    llama_memory_clear(llama_get_memory(ctx), true);
    if (w.media) {
        decode_media_prefix(ctx, w, int(llama_n_batch(ctx)), rethrow);
    }
    const int n = int(w.tokens.size());
    decode_tokens(ctx, w.tokens.data(), n, w.pos0, all_outputs ? 0 : w.first, all_outputs ? n - 1 : w.last, rethrow);
}

// KL(P || Q) of two rows of logits, in nats.
double kld_of_logits(const float * p, const float * q, int n_vocab) {
    const float mp = *std::max_element(p, p + n_vocab), mq = *std::max_element(q, q + n_vocab);
    double zp = 0, zq = 0;
    for (int i = 0; i < n_vocab; ++i) {
        zp += std::exp(double(p[i]) - mp);
        zq += std::exp(double(q[i]) - mq);
    }
    const double lzp = std::log(zp) + mp, lzq = std::log(zq) + mq;
    double kld = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const double lp = double(p[i]) - lzp;
        kld += std::exp(lp) * (lp - (double(q[i]) - lzq));
    }
    return std::max(0.0, kld);
}

int top1(const float * l, int n_vocab) { return int(std::max_element(l, l + n_vocab) - l); }

// The MTP head's drafts over the window its trunk just decoded.
void draft_window(MtpHead * head, const Window & w, const std::function<void()> & rethrow = {}) {
    head->reset();
    try {
        head->decode(w.tokens, 0);
    } catch (const Error &) {
        if (rethrow) {
            rethrow();
        }
        throw;
    }
    if (rethrow) {
        rethrow();
    }
}

// A chat prompt for the behaviour checks.
struct Prompt {
    std::vector<llama_token> tokens;
    std::string text, domain, where;
    bool opens_think = false;
};

// How one candidate's context is set up for a decode and checked after it.
struct Decoder {
    llama_context * ctx = nullptr;
    std::function<void(int)> before;     // per call, with its token count: a closed loop starts a "window"
    std::function<void()> after;         // per call: rethrows what the callbacks caught
    bool all_outputs = false;            // a routing tap needs every token in every layer
    MtpHead * head = nullptr;            // drafts over the continuation, when the candidate has one
};

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

// One context runs every closed-loop configuration in turn: its callback goes to the tap
// of the configuration being decoded.
struct TapSlot {
    RouterTap * tap = nullptr;
    static bool callback(ggml_tensor * t, bool ask, void * ud) {
        RouterTap * tap = static_cast<TapSlot *>(ud)->tap;
        return tap ? RouterTap::callback(t, ask, tap) : !ask;
    }
};

// A closed-loop candidate: its configuration, the keep map it runs on (or none) and its tap.
struct ClosedLoopRun {
    ClosedLoopConfig config;
    int map = -1;  // index into the keep maps, -1: the full model
    std::unique_ptr<RouterTap> tap;
};

// A loaded model, the context its windows decode in, and its MTP head's when it drafts.
struct Model {
    ModelPtr model{nullptr, llama_model_free};
    ContextPtr ctx{nullptr, llama_free};
    std::unique_ptr<MtpHead> head;
};

// What a base file compares: the model's content, never its file name.
json model_identity(const InspectReport & info, const GgufModel & gguf, const std::string & vocab) {
    return {{"digest", model_digest(gguf.shard_paths())}, {"file_bytes", info.file_bytes}, {"arch", info.arch},
            {"name", info.name},                          {"n_expert", info.n_expert},     {"vocab", vocab}};
}

// The closed-loop candidates' cache figures, beside the open-loop replay of the base
// pass's trace under the same configurations (on the full model or the same keep map).
void closed_loop_figures(const EvalOptions & opt, const TraceInMemory & base_trace,
                         const std::vector<std::pair<fs::path, KeepMap>> & maps, std::vector<ClosedLoopRun> & runs,
                         int n_layer, int threads, EvalReport & rep, size_t first_closed) {
    std::map<int, ReplayReport> open_loop;
    for (const ClosedLoopRun & run : runs) {
        if (open_loop.count(run.map)) {
            continue;
        }
        ReplayOptions ro;
        ro.trace_source = &base_trace;
        // The map as eval read and checked it once: no second read of the file.
        if (run.map >= 0) {
            ro.keep = maps[size_t(run.map)].first;
            ro.keep_map = maps[size_t(run.map)].second;
        }
        ro.policies = opt.cache_policies;
        ro.caches = opt.caches;
        ro.lambdas = opt.lambdas;
        ro.j = opt.j;
        ro.moce = opt.moce;
        ro.model = opt.model;
        ro.threads = threads;
        ro.params = opt.policy_params;
        ro.throughput = opt.throughput;
        open_loop.emplace(run.map, run_replay(ro));
    }
    for (size_t r = 0; r < runs.size(); ++r) {
        ClosedLoopRun & run = runs[r];
        EvalCandidate & c = rep.candidates[first_closed + r];
        const PhaseCounts & k = run.tap->counts();
        ClosedLoopStats st;
        const double tokens = double(std::max<uint64_t>(1, k.tokens));
        st.misses_per_token = double(k.misses) / tokens;
        st.hit_rate = k.picks ? 1.0 - double(k.misses) / double(k.picks) : 0.0;
        st.swap_rate = k.picks ? double(k.swaps) / double(k.picks) : 0.0;
        st.moved_gate_mass = k.moved_mass / (tokens * n_layer);
        st.tok_per_s = tokens_per_second(k, n_layer, opt.throughput);
        const ReplayReport & ol = open_loop.at(run.map);
        const auto rec = std::find_if(ol.records.begin(), ol.records.end(), [&](const ReplayRecord & x) {
            return x.policy == run.config.policy && x.cache == run.config.cache && x.lambda == run.config.lambda;
        });
        if (rec == ol.records.end()) {
            throw Error(fmt::format("the open-loop replay has no record for {} (an internal error)", c.name));
        }
        const PhaseCounts o = rec->total();
        st.open_loop_misses_per_token = o.tokens ? double(o.misses + o.forced_misses) / double(o.tokens) : 0.0;
        st.open_loop_tok_per_s = tokens_per_second(o, ol.n_layer, opt.throughput);
        c.closed = st;
        c.routing = std::move(run.tap->log);
    }
}

} // namespace

EvalStats eval_stats(const std::vector<const TokenScore *> & toks) {
    EvalStats s;
    const size_t n = toks.size();
    s.tokens = n;
    if (n == 0) {
        return s;
    }
    std::vector<double> kld;
    double k1 = 0, k2 = 0, same = 0, dp2 = 0, d1 = 0, d2 = 0, nll = 0, nll_base = 0;
    for (const TokenScore * t : toks) {
        kld.push_back(t->kld);
        k1 += t->kld;
        k2 += t->kld * t->kld;
        same += t->same_top1;
        const double dp = std::exp(-t->nll) - std::exp(-t->nll_base);
        dp2 += dp * dp;
        const double d = t->nll - t->nll_base;
        d1 += d;
        d2 += d * d;
        nll += t->nll;
        nll_base += t->nll_base;
    }
    const double dn = double(n);
    // Standard error of a mean as llama-perplexity computes it: sqrt((E[x²] - E[x]²) / (n - 1)).
    const auto stderr_of = [&](double s1, double s2) {
        const double m = s1 / dn, v = s2 / dn - m * m;
        return n > 1 && v > 0 ? std::sqrt(v / (dn - 1)) : 0.0;
    };
    std::sort(kld.begin(), kld.end());
    s.kld_mean = k1 / dn;
    s.kld_stderr = stderr_of(k1, k2);
    s.kld_median = percentile(kld, 0.5);
    s.kld_p90 = percentile(kld, 0.9);
    s.kld_p99 = percentile(kld, 0.99);
    s.kld_p999 = percentile(kld, 0.999);
    s.kld_max = kld.back();
    s.same_top1 = same / dn;
    s.same_top1_stderr = n > 1 ? std::sqrt(s.same_top1 * (1 - s.same_top1) / (dn - 1)) : 0.0;
    s.dp_rms = std::sqrt(dp2 / dn);
    s.ln_ppl_ratio = d1 / dn;
    s.ln_ppl_ratio_stderr = stderr_of(d1, d2);
    s.ppl = std::exp(nll / dn);
    s.ppl_base = std::exp(nll_base / dn);
    double accepted = 0, mtp_kld = 0;
    for (const TokenScore * t : toks) {
        if (t->mtp_accept >= 0) {
            ++s.mtp_tokens;
            accepted += t->mtp_accept;
        }
        if (t->mtp_kld >= 0) {
            ++s.mtp_kld_tokens;
            mtp_kld += t->mtp_kld;
        }
    }
    if (s.mtp_tokens > 0) {
        const double m = double(s.mtp_tokens);
        s.mtp_acceptance = accepted / m;
        s.mtp_acceptance_stderr = m > 1 ? std::sqrt(s.mtp_acceptance * (1 - s.mtp_acceptance) / (m - 1)) : 0.0;
    }
    if (s.mtp_kld_tokens > 0) {
        s.mtp_kld_mean = mtp_kld / double(s.mtp_kld_tokens);
    }
    return s;
}

namespace {

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

// One eval run, phase by phase (run_eval calls them in order). Contexts' callbacks point
// at the mask and the tap slots, the slots at the taps, and taps at the mask, the keep maps
// and their configurations: a run stays where it is made, and its members are declared in
// the order they come to life (and go in reverse).
class EvalRun {
public:
    explicit EvalRun(const EvalOptions & given) : given(given), opt(given), closed_loop(!opt.cache_policies.empty()) {}
    EvalRun(const EvalRun &) = delete;
    EvalRun & operator=(const EvalRun &) = delete;

    void check_options();
    void read_model();
    void read_keep_maps();
    void load_base();
    void make_windows();
    void refuse_unsupported_media();
    void read_prompts();
    void check_base_file();
    void open_candidates();
    void choose_reference();
    void plan_closed_loop();
    void open_base_context();
    void name_candidates();
    void open_outputs();
    void score_windows();
    void check_behaviour();
    void finish_passes();
    void score_statistics();
    void describe_run();
    void write_outputs();
    EvalReport take_report() { return std::move(rep); }

private:
    void observe_base(size_t wi, const Window & w);
    void reference_pass(size_t wi, const Window & w, Progress & progress);
    void candidate_passes(size_t wi, const Window & w, Progress & progress);
    void score_window(const Model & m, EvalCandidate & cand, size_t wi, const Window & w);
    std::unique_ptr<MtpHead> head_for(llama_model * model, llama_context * ctx, ggml_backend_sched_eval_callback cb,
                                      void * cb_data) const;
    const Model * reference_model() const;

    const EvalOptions & given;
    EvalOptions opt;  // with J resolved once the model's k is known
    std::vector<fs::path> keeps;
    const bool closed_loop;
    GgufModel gguf;
    InspectReport info;
    MaskFacts facts;
    bool run_mtp = false;   // the model has an MTP head and --mtp drop was not given
    std::optional<double> base_tokens_per_step;  // of the base's greedy continuations, with its head
    MaskFacts mask_layers;  // what keep maps cover and the mask plans: facts' layers, and the MTP head's
    std::vector<std::pair<fs::path, KeepMap>> maps;
    std::optional<BaseLogitsReader> base_file;
    Corpus corpus;
    int threads = 0;
    Model base;
    const llama_vocab * vocab = nullptr;
    int n_vocab = 0;
    std::string base_vocab;
    std::unique_ptr<MediaEncoder> media;  // --mmproj: encodes the corpus' media for every model's passes
    size_t media_documents_left_out = 0;  // text_only
    json mmproj_identity;                 // the projector's file and digest when the corpus has media; null otherwise
    std::vector<Window> windows;
    uint64_t n_scored = 0;
    std::vector<Prompt> prompts;
    json settings, base_identity;
    uint32_t top = 0;
    std::optional<RouterMask> mask;  // made from the model's facts, before the contexts that call it
    Model masked;
    std::vector<Model> files;
    int against = -1;
    int trace_top = 0;
    std::vector<double> expert_bytes;
    std::optional<RouterTap> observer;
    TapSlot observer_slot, closed_slot;
    std::vector<ClosedLoopRun> runs;
    Model closed;
    bool base_live = false;
    EvalReport rep;
    size_t first_closed = 0;
    std::optional<TraceInMemory> base_trace;   // the base pass's routing, replayed open-loop from memory
    std::optional<AtomicOutput> trace_file;    // --trace-out
    std::optional<TraceWriter> trace;
    std::optional<AtomicOutput> base_out;
    std::optional<File> base_out_file;
    std::optional<BaseLogitsWriter> base_writer;
    std::vector<BaseRow> rows;
    std::vector<BaseRecord> records;
    // Per scored token: the base's own draft accepted there (-1: none), and its domain.
    std::vector<int8_t> base_accept;
    std::vector<int> base_accept_domain;
    double base_tail_mass = 0;  // summed over the records of --base: how tight their lower bound is
};

// Every option checked, and the keep maps of --keep-dir listed, before any file is read.
void EvalRun::check_options() {
    if (opt.score != "all" && opt.score != "second-half") {
        throw Error(fmt::format("--score must be all or second-half, got \"{}\"", opt.score));
    }
    if (opt.ctx < 8 || opt.batch < 1 || opt.ubatch < 1 || opt.threads < 0 || opt.gpu_layers < 0 || opt.chunks == 0 ||
        opt.chunks < -1) {
        throw Error("-c must be at least 8, -b and -ub at least 1, -t and -ngl >= 0, --chunks >= 1 (or -1 for all)");
    }
    if (opt.top_tokens < 0) {
        throw Error(fmt::format("--worst {}: the number of worst tokens to list must be >= 0", opt.top_tokens));
    }
    if (!opt.base_out.empty() + !opt.base_in.empty() + !opt.against.empty() > 1) {
        throw Error("--base-out records the base, --base reads a recorded one, --against compares with a candidate "
                    "instead: give one of them");
    }
    keeps = opt.keeps;
    if (!opt.keep_dir.empty()) {
        std::error_code ec;
        std::vector<fs::path> found;
        for (const auto & e : fs::directory_iterator(opt.keep_dir, ec)) {
            if (e.path().extension() == ".json") {
                found.push_back(e.path());
            }
        }
        if (ec) {
            fail_file(opt.keep_dir.string(), "cannot list keep maps: " + ec.message());
        }
        if (found.empty()) {
            fail_file(opt.keep_dir.string(), "holds no keep maps (*.json)");
        }
        std::sort(found.begin(), found.end());
        keeps.insert(keeps.end(), found.begin(), found.end());
    }
    if (closed_loop) {
        if (opt.caches.empty()) {
            throw Error("--cache-policy needs --cache: the slots per layer of each simulated expert cache");
        }
        if (opt.lambdas.empty()) {
            throw Error("--lambda needs at least one value");
        }
        for (double l : opt.lambdas) {
            if (!(l >= 0.0) || !std::isfinite(l)) {
                throw Error(fmt::format("--lambda must be finite and >= 0, got {}", l));
            }
        }
        if (opt.moce != "prior" && opt.moce != "topk-gap") {
            throw Error(fmt::format("--moce must be prior or topk-gap, got \"{}\"", opt.moce));
        }
        if (opt.j && *opt.j < 0) {
            throw Error(fmt::format("--j must be >= 0, got {}", *opt.j));
        }
        for (const std::string & p : opt.cache_policies) {
            if (std::find(policy_names().begin(), policy_names().end(), p) == policy_names().end()) {
                throw Error(fmt::format("unknown --cache-policy {} (known: {})", p, fmt::join(policy_names(), ", ")));
            }
        }
    } else if (!opt.caches.empty() || !opt.trace_out.empty()) {
        throw Error("--cache and --trace-out belong to the closed loop: give --cache-policy too");
    }
    if (opt.generate < 0 || (opt.generate == 0 && !opt.prompts.empty())) {
        throw Error("--generate takes the number of tokens to generate per prompt (--prompts needs it)");
    }
    if (keeps.empty() && opt.candidates.empty() && opt.base_out.empty() && !closed_loop) {
        throw Error("nothing to evaluate: give --keep, --keep-dir, --candidate or --cache-policy (or --base-out to record "
                    "the base alone)");
    }
}

// Outputs checked against every input, then the model's facts (MoCE's J among them).
void EvalRun::read_model() {
    gguf = GgufModel::open(opt.model);
    std::vector<fs::path> inputs = gguf.shard_paths();
    inputs.push_back(opt.corpus);
    inputs.push_back(opt.base_in);
    inputs.push_back(opt.prompts);
    inputs.push_back(opt.mmproj);
    inputs.insert(inputs.end(), keeps.begin(), keeps.end());
    for (const fs::path & c : opt.candidates) {
        const GgufModel cm = GgufModel::open(c);
        inputs.insert(inputs.end(), cm.shard_paths().begin(), cm.shard_paths().end());
    }
    refuse_output_clashes({opt.base_out, opt.json_out, opt.per_token_out, opt.trace_out}, inputs);

    info = inspect_model(gguf, {});
    if (!info.problems.empty()) {
        fail_file(opt.model.string(), "is inconsistent (see moeprune inspect): " + fmt::format("{}", fmt::join(info.problems, "; ")));
    }
    facts = mask_facts(info);
    run_mtp = opt.mtp && !info.mtp_layers().empty();
    mask_layers = facts;
    if (run_mtp) {
        const std::vector<int> mtp = info.mtp_layers();
        mask_layers.moe_layers.insert(mask_layers.moe_layers.end(), mtp.begin(), mtp.end());
    }
    opt.j = moce_j(given.j, int(info.n_expert_used));
    if (closed_loop) {
        refuse_inert_moce(*opt.j, int(info.n_expert_used), opt.lambdas);
    }
}

// Keep maps are read and checked against the model before anything runs.
void EvalRun::read_keep_maps() {
    for (const fs::path & k : keeps) {
        KeepMap km = read_keep_map(k);
        if (run_mtp) {
            std::vector<int> missing;
            for (int l : info.mtp_layers()) {
                if (!km.layers.count(l)) {
                    missing.push_back(l);
                }
            }
            if (!missing.empty()) {
                fail_file(k.string(), fmt::format("leaves out the MTP (nextn) layer(s) {} of {}, whose head eval runs and "
                                                  "masks too: use a keep map from moeprune select on this model's "
                                                  "statistics (it covers them), or evaluate the trunk only with --mtp drop",
                                                  fmt::join(missing, ", "), opt.model.string()));
            }
        } else {
            for (auto it = km.layers.begin(); it != km.layers.end();) {
                // Without the head, a map may still cover the nextn layers for slice.
                it = info.is_nextn(it->first) ? km.layers.erase(it) : std::next(it);
            }
        }
        validate_keep_map_for_model(km, k.string(), info.n_expert, mask_layers.moe_layers);
        require_top_k_room(km, k.string(), info.n_expert_used);
        maps.emplace_back(k, std::move(km));
    }
}

// The recorded base (--base), the text and the base model with its vocabulary.
void EvalRun::load_base() {
    if (!opt.base_in.empty()) {
        base_file = BaseLogitsReader::open(opt.base_in);
    }

    corpus = read_corpus(opt.corpus);
    refuse_output_clashes({opt.base_out, opt.json_out, opt.per_token_out, opt.trace_out}, media_paths(corpus));
    if (opt.text_only) {
        media_documents_left_out = drop_media_documents(corpus);
    }
    add_modality_domains(corpus);
    refuse_unsupported_media();
    init_llama(opt.rpc);
    threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));

    base.model = load_model(opt.model, opt.gpu_layers, run_mtp);
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, base.model.get(), threads, opt.gpu_layers > 0);
    }
    vocab = llama_model_get_vocab(base.model.get());
    n_vocab = llama_vocab_n_tokens(vocab);
    base_vocab = vocab_digest(vocab);
}

// Windows and the positions they score.
// A document with media: the text after its last media span is scored, under that
// span's modality's domain, after the rest is decoded.
Window media_window(const EvalOptions & opt, const MediaEncoder & encoder, const Corpus & corpus, const llama_model * model,
                    size_t d, const std::string & where) {
    const CorpusDocument & doc = corpus.documents[d];
    auto prompt = std::make_shared<MediaPrompt>(
        encoder.tokenize(document_text(model, doc, false, where), media_of(doc.messages), opt.parse_special, where));
    if (prompt->tokens.size() > size_t(opt.ctx)) {
        fail_file(where, fmt::format("takes {} rows with its media, more than -c {}; a document with media is not split",
                                     prompt->tokens.size(), opt.ctx));
    }
    const MediaSpan & last = prompt->media.back();
    Window w;
    w.doc = d;
    const std::string domain = modality_name(last.modality);
    w.domain = int(std::find(corpus.domains.begin(), corpus.domains.end(), domain) - corpus.domains.begin());
    w.prefix_rows = last.offset + last.n_tokens;
    w.tokens.assign(prompt->tokens.begin() + long(w.prefix_rows), prompt->tokens.end());
    // A media span takes n_pos positions for its n_tokens rows (fewer for an M-RoPE image).
    w.pos0 = int32_t(w.prefix_rows);
    for (const MediaSpan & s : prompt->media) {
        w.pos0 -= int32_t(s.n_tokens) - s.n_pos;
    }
    w.last = int(w.tokens.size()) - 2;
    w.media = std::move(prompt);
    w.encoder = &encoder;
    return w;
}

void EvalRun::make_windows() {
    const bool second_half = opt.score == "second-half";
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    for (size_t d = 0; d < corpus.documents.size(); ++d) {
        const CorpusDocument & doc = corpus.documents[d];
        const std::string where = doc.line ? fmt::format("{}:{}", opt.corpus.string(), doc.line) : opt.corpus.string();
        if (!media_of(doc.messages).empty()) {
            Window w = media_window(opt, *media, corpus, base.model.get(), d, where);
            if (w.n_scored() > 0) {
                w.first_record = n_scored;
                n_scored += uint64_t(w.n_scored());
                windows.push_back(std::move(w));
            }
            continue;
        }
        const std::vector<llama_token> toks =
            tokenize(vocab, document_text(base.model.get(), doc, false, where), opt.parse_special, where);
        const auto dit = std::find(corpus.domains.begin(), corpus.domains.end(), doc.domain);
        const int domain = doc.domain.empty() ? -1 : int(dit - corpus.domains.begin());
        for (size_t i = 0; i < toks.size(); i += size_t(opt.ctx)) {
            Window w;
            w.doc = d;
            w.domain = domain;
            w.tokens.assign(toks.begin() + long(i), toks.begin() + long(std::min(toks.size(), i + size_t(opt.ctx))));
            if (second_half) {
                // llama-perplexity's convention: whole windows only, each starting with BOS,
                // the first half context, the second half scored.
                if (int(w.tokens.size()) < opt.ctx) {
                    continue;
                }
                if (add_bos) {
                    w.tokens[0] = llama_vocab_bos(vocab);
                }
                w.first = opt.ctx / 2;
            }
            w.last = int(w.tokens.size()) - 2;
            if (w.n_scored() <= 0) {
                continue;
            }
            w.first_record = n_scored;
            n_scored += uint64_t(w.n_scored());
            windows.push_back(std::move(w));
        }
    }
    if (opt.chunks > 0 && size_t(opt.chunks) < windows.size()) {
        windows.resize(size_t(opt.chunks));
        n_scored = windows.empty() ? 0 : windows.back().first_record + uint64_t(windows.back().n_scored());
    }
    if (n_scored == 0) {
        fail_file(opt.corpus.string(), second_half ? fmt::format("has no document of at least -c {} tokens, so "
                                                                 "--score second-half scores nothing", opt.ctx)
                                                   : "scores no tokens (every document is a single token)");
    }
}

// What does not take media yet, refused before a model loads: media without a
// projector, the passes that need every row's routing or token (the closed loop, MTP
// drafts), llama-perplexity's second-half scoring and the behaviour checks' prompts.
void EvalRun::refuse_unsupported_media() {
    if (corpus.media_modalities.empty()) {
        return;
    }
    const auto refuse = [&](const std::string & why) { refuse_media(corpus, why); };
    if (opt.mmproj.empty()) {
        refuse("no projector was given to encode it (--mmproj FILE)");
    }
    if (closed_loop) {
        refuse("the closed loop (--cache-policy) routes text only; evaluate media without it");
    }
    if (run_mtp) {
        refuse("the model's MTP head drafts from token ids, which media positions have none: give --mtp drop");
    }
    if (opt.score == "second-half") {
        refuse("--score second-half splits windows, and a document with media is one window: use --score all");
    }
    if (opt.generate > 0 && opt.prompts.empty()) {
        refuse("the behaviour checks (--generate) take text prompts: give them with --prompts FILE");
    }
}

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

// What a base file records: the settings, the model and T. A base given with --base must
// match them, and T is then its own.
void EvalRun::check_base_file() {
    settings = {{"ctx", opt.ctx}, {"score", opt.score}, {"parse_special", opt.parse_special}, {"chunks", opt.chunks}};
    base_identity = model_identity(info, gguf, base_vocab);
    // The compact base: T such that a record is at most 0.99% of llama-perplexity's 2 bytes per
    // vocabulary entry; the rest of 1% is the file's header, not negligible below ~100k tokens.
    const uint32_t top_max = uint32_t(std::max<int64_t>(1, (int64_t(n_vocab) * 2 * 99 / 10000 - 12) / 8));
    top = opt.top > 0 ? opt.top : std::min<uint32_t>(256, top_max);
    // Media rows come from the projector: a base recorded through another one scored other inputs.
    if (!corpus.media_modalities.empty()) {
        mmproj_identity = {{"file", opt.mmproj.string()}, {"digest", model_digest({opt.mmproj})}};
    }
    if (base_file) {
        const json & h = base_file->header();
        const std::string origin = opt.base_in.string();
        const json recorded_mmproj = h.contains("mmproj") && h["mmproj"].is_object() ? h["mmproj"] : json();
        const auto digest_of = [](const json & id) { return id.is_object() ? id.value("digest", json()) : json(); };
        if (digest_of(recorded_mmproj) != digest_of(mmproj_identity)) {
            fail_file(origin, fmt::format("was recorded through another projector ({}), not {}",
                                          recorded_mmproj.is_null() ? "none" : recorded_mmproj.value("file", json()).dump(),
                                          mmproj_identity.is_null() ? "none" : opt.mmproj.string()));
        }
        if (h.value("model", json()) != base_identity) {
            fail_file(origin, "was recorded on another model: " + h.value("model", json()).dump() + ", not " +
                                  base_identity.dump());
        }
        if (h.value("corpus", json()).value("digest", "") != corpus.digest) {
            fail_file(origin, "was recorded on other text (its corpus digest differs from " + opt.corpus.string() + ")");
        }
        if (h.value("settings", json()) != settings) {
            fail_file(origin, "was recorded with other settings: " + h.value("settings", json()).dump() + ", not " +
                                  settings.dump());
        }
        if (base_file->n_vocab() != n_vocab) {
            fail_file(origin, fmt::format("was recorded on a vocabulary of {} tokens, the model has {}", base_file->n_vocab(),
                                          n_vocab));
        }
        if (base_file->n_scored() != n_scored) {
            fail_file(origin, fmt::format("holds {} scored tokens, this text and settings score {}", base_file->n_scored(),
                                          n_scored));
        }
        top = base_file->top();
    }
    if (top > uint32_t(n_vocab)) {
        throw Error(fmt::format("--top {} exceeds the vocabulary of {} tokens", top, n_vocab));
    }
}

// The candidates: keep maps masked in the base model, other files loaded beside it.
void EvalRun::open_candidates() {
    mask.emplace(mask_layers);
    if (!maps.empty()) {
        masked.ctx = make_context(base.model.get(), opt, threads, &RouterMask::callback, &*mask);
        masked.head = head_for(base.model.get(), masked.ctx.get(), &RouterMask::callback, &*mask);
        // A one-token pass shows how llama.cpp builds this model's router (and its MTP head's).
        Window probe;
        probe.tokens = {windows.front().tokens.front()};
        mask->start_probe();
        decode_window(masked.ctx.get(), probe, [&] { mask->rethrow_failure(); });
        if (masked.head) {
            draft_window(masked.head.get(), probe, [&] { mask->rethrow_failure(); });
        }
        mask->stop_probe();
        for (const auto & [path, km] : maps) {
            mask->set(km, path.string());  // refuses, by name, a map masking cannot reproduce
        }
        mask->clear();
    }
    for (const fs::path & c : opt.candidates) {
        Model m;
        m.model = load_model(c, opt.gpu_layers, run_mtp);
        const llama_vocab * cv = llama_model_get_vocab(m.model.get());
        if (llama_vocab_n_tokens(cv) != n_vocab || vocab_digest(cv) != base_vocab) {
            fail_file(c.string(), fmt::format("has another vocabulary than {} ({} tokens vs {}): KL needs the same tokens",
                                              opt.model.string(), llama_vocab_n_tokens(cv), n_vocab));
        }
        m.ctx = make_context(m.model.get(), opt, threads, nullptr, nullptr);
        m.head = head_for(m.model.get(), m.ctx.get(), nullptr, nullptr);
        files.push_back(std::move(m));
    }
}

// The reference every candidate is compared with: the base model, or one candidate file.
void EvalRun::choose_reference() {
    if (!opt.against.empty()) {
        const auto it = std::find(opt.candidates.begin(), opt.candidates.end(), opt.against);
        if (it == opt.candidates.end()) {
            throw Error(fmt::format("--against {} must be one of the --candidate files", opt.against.string()));
        }
        against = int(it - opt.candidates.begin());
    }
}

// Closed loop: an observer records the base pass's routing as a trace (for the open-loop
// replay of the same tokens), and every configuration routes one pass of its own.
void EvalRun::plan_closed_loop() {
    trace_top = std::min(opt.trace_top, int(info.n_expert));
    expert_bytes = info.routed_layer_expert_bytes();
    if (closed_loop) {
        observer.emplace(facts, trace_top, nullptr, nullptr, nullptr, expert_bytes);
        observer_slot.tap = &*observer;
        for (int m = opt.closed_loop_full_model || maps.empty() ? -1 : 0; m < int(maps.size()); ++m) {
            for (const std::string & policy : opt.cache_policies) {
                for (int cache : opt.caches) {
                    for (double lambda : opt.lambdas) {
                        ClosedLoopRun run;
                        run.config = {policy, cache, lambda, *opt.j, opt.moce == "prior", opt.policy_params,
                                      opt.throughput.queue_depth};
                        run.map = m;
                        runs.push_back(std::move(run));
                    }
                }
            }
        }
        for (ClosedLoopRun & run : runs) {
            const KeepMap * km = run.map >= 0 ? &maps[size_t(run.map)].second : nullptr;
            run.tap = std::make_unique<RouterTap>(facts, trace_top, &run.config, km, km ? &*mask : nullptr,
                                                  expert_bytes);
            run.tap->record = opt.record_routing;
        }
        closed.ctx = make_context(base.model.get(), opt, threads, &TapSlot::callback, &closed_slot);
    }
}

// The base decodes live unless --base or --against stands in for it; the closed loop
// observes its routing even then.
void EvalRun::open_base_context() {
    base_live = !base_file && against < 0;
    if (base_live || closed_loop) {
        base.ctx = make_context(base.model.get(), opt, threads, observer ? &TapSlot::callback : nullptr,
                                observer ? &observer_slot : nullptr);
        if (base_live) {
            base.head = head_for(base.model.get(), base.ctx.get(), nullptr, nullptr);
        }
    }
}

// A head for a model that has MTP layers, drafting from `m`'s context, when eval runs them.
std::unique_ptr<MtpHead> EvalRun::head_for(llama_model * model, llama_context * ctx, ggml_backend_sched_eval_callback cb,
                                           void * cb_data) const {
    if (!run_mtp || llama_model_n_layer_nextn(model) < 1) {
        return nullptr;
    }
    return std::make_unique<MtpHead>(model, ctx,
                                     ContextSettings{opt.ctx, std::max(opt.batch, opt.ctx), std::min(opt.ubatch, opt.ctx),
                                                     threads, cb, cb_data});
}

// The live reference whose drafts the candidates' are compared with, if any.
const Model * EvalRun::reference_model() const {
    if (base_file) {
        return nullptr;
    }
    return against >= 0 ? &files[size_t(against)] : &base;
}

// The report's candidates in the order of their passes (keep maps, files, closed-loop
// configurations), each with room for every scored token.
void EvalRun::name_candidates() {
    rep.domains = corpus.domains;
    for (const auto & [path, km] : maps) {
        EvalCandidate c;
        c.name = unique_name(path.stem().string(), rep.candidates);
        c.kind = "keep";
        c.source = path.string();
        rep.candidates.push_back(std::move(c));
    }
    for (const fs::path & path : opt.candidates) {
        EvalCandidate c;
        c.name = unique_name(path.stem().string(), rep.candidates);
        c.kind = "file";
        c.source = path.string();
        rep.candidates.push_back(std::move(c));
    }
    for (const ClosedLoopRun & run : runs) {
        EvalCandidate c;
        const ClosedLoopConfig & k = run.config;
        const std::string stem = fmt::format("{}{}-c{}-l{}", run.map >= 0 ? maps[size_t(run.map)].first.stem().string() + "+" : "",
                                             k.policy, k.cache, k.lambda);
        c.name = unique_name(stem, rep.candidates);
        c.kind = "closed-loop";
        c.source = run.map >= 0 ? maps[size_t(run.map)].first.string() : opt.model.string();
        c.config = {{"policy", k.policy},
                    {"cache", k.cache},
                    {"lambda", k.lambda},
                    {"j", k.j},
                    {"moce", opt.moce},
                    {"keep", run.map >= 0 ? json(maps[size_t(run.map)].first.string()) : json()}};
        rep.candidates.push_back(std::move(c));
    }
    for (EvalCandidate & c : rep.candidates) {
        c.tokens.resize(n_scored);
    }
    first_closed = maps.size() + opt.candidates.size();
}

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

} // namespace

EvalReport run_eval(const EvalOptions & given) {
    EvalRun run(given);
    run.check_options();
    run.read_model();
    run.read_keep_maps();
    run.load_base();
    run.make_windows();
    run.read_prompts();
    run.check_base_file();
    run.open_candidates();
    run.choose_reference();
    run.plan_closed_loop();
    run.open_base_context();
    run.name_candidates();
    run.open_outputs();
    run.score_windows();
    run.check_behaviour();
    run.finish_passes();
    run.score_statistics();
    run.describe_run();
    run.write_outputs();
    return run.take_report();
}

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
        cand["worst_tokens"] = c.worst;
        cands.push_back(cand);
    }
    json out = {{"format", "moeprune-eval"}, {"version", 1}, {"base", r.base}, {"inputs", r.inputs}, {"candidates", cands}};
    if (!r.generation.is_null()) {
        out["generation"] = r.generation;
    }
    return out;
}

std::string to_text(const EvalReport & r) {
    std::ostringstream o;
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
    if (r.base.contains("mtp") || std::any_of(r.candidates.begin(), r.candidates.end(),
                                              [](const EvalCandidate & c) { return c.all.mtp_tokens > 0; })) {
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
    if (std::any_of(r.candidates.begin(), r.candidates.end(), [](const EvalCandidate & c) { return c.closed.has_value(); })) {
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
    if (!r.generation.is_null()) {
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
    return o.str();
}

} // namespace moeprune
