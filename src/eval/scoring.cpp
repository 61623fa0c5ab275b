// Eval's scores: KL divergence of one position, exact or from a compact base record, the
// compact record itself, and the statistics of a set of scored tokens.
#include "eval/scoring.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moeprune {

namespace eval_impl {

// `exps`, when given, receives exp(l - max) of every entry (reused by compact_record).
BaseRow base_row(const float * l, int n_vocab, std::vector<float> * exps) {
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

} // namespace eval_impl

namespace {

double percentile(const std::vector<double> & sorted, double f) {
    if (sorted.empty()) {
        return 0;
    }
    const double p = f * double(sorted.size() - 1);
    const size_t lo = size_t(p);
    const size_t hi = std::min(lo + 1, sorted.size() - 1);
    return sorted[lo] + (p - double(lo)) * (sorted[hi] - sorted[lo]);
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

} // namespace moeprune
