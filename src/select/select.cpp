#include "select/select.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "formats/trace.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <boost/math/distributions/normal.hpp>
#include <boost/math/distributions/students_t.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <set>

namespace moeprune {

using nlohmann::json;

const std::vector<std::string> & select_metrics() {
    static const std::vector<std::string> names = {"freq", "soft-freq", "reap",   "reap-sum",   "ean",
                                                   "ean-sum", "reap-lcb", "hybrid", "domain-max", "domain-mix"};
    return names;
}

namespace {

// Rank percentile of every expert in [0, 1], tied experts sharing their mean rank, so
// one outlier moves no other expert's value.
std::vector<double> rank_percentiles(const std::vector<double> & v) {
    const size_t n = v.size();
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
    std::vector<double> pct(n, 0.0);
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j + 1 < n && v[order[j + 1]] == v[order[i]]) {
            ++j;
        }
        const double mean_rank = 0.5 * double(i + j);
        for (size_t t = i; t <= j; ++t) {
            pct[order[t]] = n > 1 ? mean_rank / double(n - 1) : 1.0;
        }
        i = j + 1;
    }
    return pct;
}

// Averages of rank percentiles are ratios of small integers; rounding them to 1e-12
// makes equal averages ties however the sum was rounded, so the tie-break decides.
LcbParams lcb_of(const SelectOptions & o) { return {o.lcb_z, o.lcb_prior}; }

std::vector<double> on_grid(std::vector<double> v) {
    for (double & x : v) {
        x = std::round(x * 1e12) / 1e12;
    }
    return v;
}

// The layer's pooled squared coefficient of variation of g·‖f‖ within an expert (over
// experts with two hits or more): REAP values scale with the expert, so the spread a
// rare expert is assumed to have is this share of its own mean. Without any such
// expert, 1 (a spread as large as the mean).
double pooled_cv2(const LayerStats & L) {
    double ss = 0, df = 0;
    for (size_t e = 0; e < L.n_expert(); ++e) {
        const double c = double(L.count[e]);
        const double m = c > 0 ? L.reap_sum[e] / c : 0.0;
        if (c >= 2 && m > 0) {
            ss += std::max(0.0, L.reap_sq_sum[e] - c * m * m) / (m * m);
            df += c - 1;
        }
    }
    return df > 0 ? ss / df : 1.0;
}

std::vector<double> base_scores(const LayerStats & L, const std::string & metric, const LcbParams & lcb) {
    const size_t n = L.n_expert();
    std::vector<double> s(n, 0.0);
    const double cv2 = metric == "reap-lcb" ? pooled_cv2(L) : 0.0;
    // --lcb-z names a confidence level through the normal quantile (1.96: 97.5% one-sided).
    const double confidence = boost::math::cdf(boost::math::normal(), lcb.z);
    for (size_t e = 0; e < n; ++e) {
        const double c = double(L.count[e]);
        if (metric == "freq") {
            s[e] = c;
        } else if (metric == "soft-freq") {
            s[e] = L.prob_sum[e];
        } else if (metric == "reap") {
            s[e] = c > 0 ? L.reap_sum[e] / c : 0.0;
        } else if (metric == "reap-sum") {
            s[e] = L.reap_sum[e];
        } else if (metric == "ean") {
            s[e] = c > 0 ? L.ean_sum[e] / c : 0.0;
        } else if (metric == "ean-sum") {
            s[e] = L.ean_sum[e];
        } else if (metric == "reap-lcb") {
            if (c == 0) {
                continue;
            }
            const double mean = L.reap_sum[e] / c;
            const double sample_var = c >= 2 ? std::max(0.0, (L.reap_sq_sum[e] - c * mean * mean) / (c - 1)) : 0.0;
            // A few agreeing values say little about the spread: the variance is shrunk
            // toward the layer's (relative) pooled one with `prior` pseudo-observations.
            const double var = ((c - 1) * sample_var + lcb.prior * cv2 * mean * mean) / (c - 1 + lcb.prior);
            const double t = lcb.z > 0 ? boost::math::quantile(boost::math::students_t(std::max(1.0, c - 1)), confidence)
                                       : 0.0;
            s[e] = std::max(0.0, mean - t * std::sqrt(var / c));
        } else {
            throw Error(fmt::format("\"{}\" is not a per-expert criterion (known: freq, soft-freq, reap, reap-sum, ean, "
                                    "ean-sum, reap-lcb)",
                                    metric));
        }
    }
    return s;
}

std::string gating_of(const SaliencyStats & s) { return s.settings.value("gating", std::string("softmax")); }

double sum(const std::vector<double> & v) { return std::accumulate(v.begin(), v.end(), 0.0); }

// Model layer index of stats layer l.
int model_layer(const SaliencyStats & s, size_t l) {
    if (s.model.contains("moe_layers") && s.model["moe_layers"].is_array() && s.model["moe_layers"].size() > l) {
        return s.model["moe_layers"][l].get<int>();
    }
    return int(l);
}

struct Retention {
    double count_share = 0, reap_share = 0, prob_share = 0;
    uint64_t min_kept_count = 0, kept_under_100 = 0, kept_rare = 0;
    json rare = json::array();  // kept experts with fewer than --rare-hits hits: [layer, expert, hits]
};

Retention retention(const LayerStats & L, const std::vector<int32_t> & kept, int layer, uint64_t rare_hits) {
    Retention r;
    double c = 0, rs = 0, p = 0;
    r.min_kept_count = UINT64_MAX;
    for (int32_t e : kept) {
        c += double(L.count[size_t(e)]);
        rs += L.reap_sum[size_t(e)];
        p += L.prob_sum[size_t(e)];
        r.min_kept_count = std::min(r.min_kept_count, L.count[size_t(e)]);
        r.kept_under_100 += L.count[size_t(e)] < 100;
        if (L.count[size_t(e)] < rare_hits) {
            ++r.kept_rare;
            r.rare.push_back({layer, e, L.count[size_t(e)]});
        }
    }
    const double ct = double(std::accumulate(L.count.begin(), L.count.end(), uint64_t(0)));
    r.count_share = ct > 0 ? c / ct : 0;
    r.reap_share = sum(L.reap_sum) > 0 ? rs / sum(L.reap_sum) : 0;
    r.prob_share = sum(L.prob_sum) > 0 ? p / sum(L.prob_sum) : 0;
    return r;
}

json retention_json(const Retention & r) {
    return {{"count_share", r.count_share},
            {"reap_share", r.reap_share},
            {"prob_share", r.prob_share},
            {"min_kept_count", r.min_kept_count},
            {"kept_under_100", r.kept_under_100},
            {"kept_rare", r.kept_rare},
            {"rare", r.rare}};
}

// Mean over layers of the per-layer shares; min and sums over layers.
Retention whole_model(const std::vector<Retention> & per_layer) {
    Retention w;
    w.min_kept_count = UINT64_MAX;
    for (const Retention & r : per_layer) {
        w.count_share += r.count_share / double(per_layer.size());
        w.reap_share += r.reap_share / double(per_layer.size());
        w.prob_share += r.prob_share / double(per_layer.size());
        w.min_kept_count = std::min(w.min_kept_count, r.min_kept_count);
        w.kept_under_100 += r.kept_under_100;
        w.kept_rare += r.kept_rare;
        w.rare.insert(w.rare.end(), r.rare.begin(), r.rare.end());
    }
    return w;
}

// REAP's super experts: largest activation above both the layer's 99.5th percentile
// and a tenth of the largest activation anywhere.
std::vector<std::vector<int32_t>> super_experts(const SaliencyStats & s) {
    double global = 0;
    for (const LayerStats & L : s.layers) {
        for (double m : L.max_act) {
            global = std::max(global, m);
        }
    }
    std::vector<std::vector<int32_t>> out(s.layers.size());
    for (size_t l = 0; l < s.layers.size(); ++l) {
        std::vector<double> v = s.layers[l].max_act;
        std::sort(v.begin(), v.end());
        const double pos = 0.995 * double(v.size() - 1);
        const size_t lo = size_t(std::floor(pos));
        const double p995 = v[lo] + (pos - double(lo)) * (v[std::min(lo + 1, v.size() - 1)] - v[lo]);
        const double threshold = std::max(p995, global / 10.0);
        for (size_t e = 0; e < s.layers[l].n_expert(); ++e) {
            if (s.layers[l].max_act[e] > threshold) {
                out[l].push_back(int32_t(e));
            }
        }
    }
    return out;
}

} // namespace

std::vector<double> criterion_scores(const SaliencyStats & s, size_t layer, const std::string & metric,
                                     const SelectOptions & opt) {
    const LayerStats & L = s.layers[layer];
    if (metric == "hybrid") {
        std::vector<double> h(L.n_expert(), 0.0);
        for (const std::string & m : opt.hybrid_of) {
            const std::vector<double> pct = rank_percentiles(base_scores(L, m, lcb_of(opt)));
            for (size_t e = 0; e < h.size(); ++e) {
                h[e] += pct[e] / double(opt.hybrid_of.size());
            }
        }
        return on_grid(h);
    }
    if (metric == "domain-max" || metric == "domain-mix") {
        if (s.domains.empty()) {
            throw Error(fmt::format("{} needs per-domain statistics: collect a corpus whose documents carry \"domain\"",
                                    metric));
        }
        std::vector<double> out(L.n_expert(), 0.0);
        if (metric == "domain-mix") {
            if (opt.domain_weights.empty()) {
                throw Error("domain-mix needs --domain-weights NAME=W,...");
            }
            for (const auto & [name, w] : opt.domain_weights) {
                if (!s.domains.count(name)) {
                    throw Error(fmt::format("--domain-weights names domain \"{}\", which the statistics do not have", name));
                }
            }
        }
        for (const auto & [name, d] : s.domains) {
            if (d.n_tokens == 0) {
                continue;
            }
            const std::vector<double> pct = rank_percentiles(base_scores(d.layers[layer], opt.domain_metric, lcb_of(opt)));
            const auto w = opt.domain_weights.find(name);
            for (size_t e = 0; e < out.size(); ++e) {
                if (metric == "domain-max") {
                    out[e] = std::max(out[e], pct[e]);
                } else if (w != opt.domain_weights.end()) {
                    out[e] += w->second * pct[e];
                }
            }
        }
        return on_grid(out);
    }
    return base_scores(L, metric, lcb_of(opt));
}

void validate_stats_for_selection(const SaliencyStats & s, const std::string & origin, const std::vector<int64_t> & ks) {
    const auto refuse = [&](const std::string & check, const std::string & detail) {
        fail_file(origin, fmt::format("fails the {} check: {}", check, detail));
    };
    if (is_checkpoint(s)) {
        refuse("complete", "it is a checkpoint of an unfinished collect (resume it with --resume)");
    }
    if (s.settings.contains("invariants") && !s.settings["invariants"].value("ok", true)) {
        refuse("invariants", "collect recorded broken invariants: " + s.settings["invariants"].dump());
    }
    if (s.n_tokens == 0) {
        refuse("tokens", "it covers no tokens");
    }
    if (int64_t(s.layers.size()) != s.n_layer || s.n_layer == 0) {
        refuse("layers", fmt::format("{} layers present, n_layer says {}", s.layers.size(), s.n_layer));
    }
    const std::string gating = gating_of(s);
    for (size_t l = 0; l < s.layers.size(); ++l) {
        const LayerStats & L = s.layers[l];
        const uint64_t picks = std::accumulate(L.count.begin(), L.count.end(), uint64_t(0));
        if (picks != s.n_tokens * uint64_t(s.n_expert_used)) {
            refuse("count sum", fmt::format("layer {}: counts sum to {}, expected n_tokens {} x n_expert_used {} = {}",
                                            model_layer(s, l), picks, s.n_tokens, s.n_expert_used,
                                            s.n_tokens * uint64_t(s.n_expert_used)));
        }
        if (gating == "softmax" || gating == "softmax-over-selected") {
            const double p = sum(L.prob_sum);
            const double expect = double(s.n_tokens);
            if (std::fabs(p - expect) > 1e-3 * expect) {
                refuse("probability sum", fmt::format("layer {}: router probabilities sum to {}, expected about {} ({} gating)",
                                                      model_layer(s, l), p, expect, gating));
            }
        }
        for (size_t e = 0; e < L.n_expert(); ++e) {
            if (L.reap_sum[e] < 0 || L.prob_sum[e] < 0 || L.ean_sum[e] < 0 || L.reap_sq_sum[e] < 0) {
                refuse("sign", fmt::format("layer {} expert {}: a sum is negative", model_layer(s, l), e));
            }
            if (L.count[e] == 0 && (L.reap_sum[e] != 0 || L.ean_sum[e] != 0)) {
                refuse("consistency", fmt::format("layer {} expert {}: no hits but REAP/EAN mass", model_layer(s, l), e));
            }
        }
    }
    const int64_t groups = s.model.value("expert_group_count", int64_t(1));
    for (int64_t k : ks) {
        if (k < s.n_expert_used || k > s.n_expert) {
            refuse("K", fmt::format("K = {} must be between n_expert_used {} and n_expert {}", k, s.n_expert_used, s.n_expert));
        }
        if (groups > 1 && k % groups != 0) {
            refuse("expert groups", fmt::format("K = {} does not split evenly over {} expert groups", k, groups));
        }
    }
}

std::vector<int32_t> select_layer(const LayerStats & L, const std::vector<double> & score, int64_t k,
                                  const std::vector<int32_t> & forced, int64_t n_groups) {
    const int64_t n = int64_t(L.n_expert());
    const int64_t groups = std::max<int64_t>(1, n_groups);
    const int64_t per_group = n / groups, keep_per_group = k / groups;
    std::vector<char> is_forced(static_cast<size_t>(n), 0);
    for (int32_t e : forced) {
        is_forced[size_t(e)] = 1;
    }
    const auto before = [&](int32_t a, int32_t b) {
        if (is_forced[size_t(a)] != is_forced[size_t(b)]) {
            return is_forced[size_t(a)] > is_forced[size_t(b)];
        }
        const bool ha = L.count[size_t(a)] > 0, hb = L.count[size_t(b)] > 0;
        if (ha != hb) {
            return ha;  // an expert never routed to is dropped while K allows it, whatever the criterion says
        }
        if (score[size_t(a)] != score[size_t(b)]) {
            return score[size_t(a)] > score[size_t(b)];
        }
        if (L.prob_sum[size_t(a)] != L.prob_sum[size_t(b)]) {
            return L.prob_sum[size_t(a)] > L.prob_sum[size_t(b)];
        }
        if (L.count[size_t(a)] != L.count[size_t(b)]) {
            return L.count[size_t(a)] > L.count[size_t(b)];
        }
        return a < b;
    };
    std::vector<int32_t> kept;
    for (int64_t g = 0; g < groups; ++g) {
        std::vector<int32_t> ids(static_cast<size_t>(per_group));
        std::iota(ids.begin(), ids.end(), int32_t(g * per_group));
        std::sort(ids.begin(), ids.end(), before);
        const int64_t forced_here = std::count_if(ids.begin(), ids.end(), [&](int32_t e) { return is_forced[size_t(e)]; });
        if (forced_here > keep_per_group) {
            throw Error(fmt::format("{} protected super experts in group {} do not fit in its {} slots", forced_here, g,
                                    keep_per_group));
        }
        kept.insert(kept.end(), ids.begin(), ids.begin() + keep_per_group);
    }
    std::sort(kept.begin(), kept.end());
    return kept;
}

SubstitutionScreen substitution_screen(const std::filesystem::path & trace_path, const KeepMap & km, int k,
                                       int max_examples) {
    const TraceReader reader = TraceReader::open(trace_path);
    const TraceHeader & h = reader.header();
    if (h.n_layer != km.layers.size()) {
        fail_file(trace_path.string(), fmt::format("has {} MoE layers, the keep map {}", h.n_layer, km.layers.size()));
    }
    if (uint32_t(k) > h.top_m) {
        fail_file(trace_path.string(), fmt::format("holds the top {} candidates, fewer than k = {}", h.top_m, k));
    }
    SubstitutionScreen sc;
    uint32_t l = 0;
    for (const auto & entry : km.layers) {
        const int layer = entry.first;  // a plain variable: lambdas below capture it
        const std::vector<int32_t> & ids = entry.second;
        std::vector<char> kept(h.n_expert, 0);
        for (int32_t e : ids) {
            if (uint32_t(e) >= h.n_expert) {
                fail_file(trace_path.string(), fmt::format("has {} experts; the keep map names expert {}", h.n_expert, e));
            }
            kept[size_t(e)] = 1;
        }
        const uint64_t slots_before = sc.slots, replaced_before = sc.replaced, token_layers_before = sc.token_layers;
        const double moved_before = sc.moved_mass;
        reader.for_each_layer_chunk(l, [&](uint64_t first, uint32_t n, const uint16_t * cand, const float * z) {
            for (uint32_t t = 0; t < n; ++t) {
                const uint16_t * c = cand + size_t(t) * h.top_m;
                const float * zt = z + size_t(t) * h.top_m;
                double all = 0, moved = 0;
                int lost = 0;
                for (int j = 0; j < k; ++j) {
                    const double w = std::exp(double(zt[j]) - double(zt[0]));
                    all += w;
                    if (!kept[c[j]]) {
                        moved += w;
                        ++lost;
                    }
                }
                int survivors_in_top_k = k - lost, filled = survivors_in_top_k;
                for (uint32_t m = uint32_t(k); m < h.top_m && filled < k; ++m) {
                    if (kept[c[m]]) {
                        ++filled;
                        ++sc.substitutes;
                        sc.substitute_rank += double(m);
                    }
                }
                ++sc.token_layers;
                sc.slots += uint64_t(k);
                sc.replaced += uint64_t(lost);
                sc.moved_mass += moved / all;
                if (filled < k) {
                    ++sc.ran_out;
                    if (int(sc.ran_out_examples.size()) < max_examples) {
                        sc.ran_out_examples.push_back({{"token", first + t}, {"layer", layer}, {"survivors", filled}});
                    }
                }
            }
        });
        const uint64_t slots = sc.slots - slots_before, token_layers = sc.token_layers - token_layers_before;
        sc.layers.push_back({{"layer", layer},
                             {"replaced_share", slots ? double(sc.replaced - replaced_before) / double(slots) : 0.0},
                             {"moved_mass", token_layers ? (sc.moved_mass - moved_before) / double(token_layers) : 0.0}});
        ++l;
    }
    return sc;
}

SelectReport run_select(const SelectOptions & opt, const std::vector<std::filesystem::path> & outputs) {
    if (opt.ks.empty() || opt.metrics.empty()) {
        throw Error("give -k and --metric");
    }
    if (!std::isfinite(opt.lcb_z) || opt.lcb_z < 0 || opt.lcb_z > 10) {
        throw Error(fmt::format("--lcb-z must be a number from 0 to 10, got {}", opt.lcb_z));
    }
    if (!std::isfinite(opt.lcb_prior) || opt.lcb_prior < 0) {
        throw Error(fmt::format("--lcb-prior must be a finite number >= 0, got {}", opt.lcb_prior));
    }
    if (opt.rare_hits < 1) {
        throw Error(fmt::format("--rare-hits must be at least 1, got {}", opt.rare_hits));
    }
    std::vector<std::filesystem::path> all_outputs = outputs;
    if (!opt.out_dir.empty()) {
        for (const std::string & metric : opt.metrics) {
            for (int64_t k : opt.ks) {
                all_outputs.push_back(opt.out_dir / fmt::format("{}-k{}.json", metric, k));
            }
        }
    }
    refuse_output_clashes(all_outputs, {opt.stats, opt.heldout, opt.trace});
    for (const std::string & m : opt.metrics) {
        if (std::find(select_metrics().begin(), select_metrics().end(), m) == select_metrics().end()) {
            throw Error(fmt::format("unknown metric \"{}\" (known: {})", m, fmt::join(select_metrics(), ", ")));
        }
    }
    for (const std::string & m : opt.hybrid_of) {
        base_scores(LayerStats(1), m, lcb_of(opt));  // rejects criteria hybrid cannot combine
    }
    base_scores(LayerStats(1), opt.domain_metric, lcb_of(opt));
    const SaliencyStats s = read_stats(opt.stats);
    validate_stats_for_selection(s, opt.stats.string(), opt.ks);
    std::optional<SaliencyStats> held;
    if (!opt.heldout.empty()) {
        held = read_stats(opt.heldout);
        validate_stats_for_selection(*held, opt.heldout.string(), opt.ks);
        if (held->n_layer != s.n_layer || held->n_expert != s.n_expert || held->model != s.model) {
            fail_file(opt.heldout.string(), "describes another model than " + opt.stats.string());
        }
    }
    if (!opt.trace.empty()) {
        // Checked before any keep map is written: a trace of another model or of nothing
        // would make every map's screen read as perfect or index out of range.
        const TraceReader trace = TraceReader::open(opt.trace);
        const TraceHeader & h = trace.header();
        if (int64_t(h.n_expert) != s.n_expert || int64_t(h.n_layer) != s.n_layer) {
            fail_file(opt.trace.string(), fmt::format("records {} layers x {} experts, but {} describes {} x {}: another "
                                                      "model", h.n_layer, h.n_expert, opt.stats.string(), s.n_layer,
                                                      s.n_expert));
        }
        if (trace.n_tokens() == 0) {
            fail_file(opt.trace.string(), "holds no tokens: there is nothing to screen the keep maps with");
        }
    }
    const int64_t groups = s.model.value("expert_group_count", int64_t(1));
    const std::vector<std::vector<int32_t>> supers =
        opt.protect_super ? super_experts(s) : std::vector<std::vector<int32_t>>(s.layers.size());

    SelectReport rep;
    json results = json::array();
    std::map<std::pair<std::string, int64_t>, KeepMap> maps;
    std::vector<int64_t> ks = opt.ks;
    std::sort(ks.begin(), ks.end());
    ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
    rep.text = fmt::format("{} layers x {} experts (top-{}), {} tokens{}\n", s.n_layer, s.n_expert, s.n_expert_used,
                           s.n_tokens, held ? fmt::format("; held out: {} tokens", held->n_tokens) : "");
    rep.text += fmt::format("{:<11} {:>5} {:>8} {:>8} {:>8} {:>9} {:>6} {:>6}{}{}\n", "metric", "K", "count%", "reap%", "prob%",
                            "min hits", "<100", fmt::format("<{}", opt.rare_hits), held ? fmt::format(" {:>9} {:>9}", "ho reap%", "ho prob%") : "",
                            opt.trace.empty() ? "" : fmt::format(" {:>9} {:>7} {:>8} {:>8}", "replaced%", "moved", "sub rank", "ran out"));
    if (!opt.out_dir.empty()) {
        create_output_dir(opt.out_dir);
    }
    std::string rare_notes;
    for (const std::string & metric : opt.metrics) {
        std::vector<std::vector<double>> scores;
        for (size_t l = 0; l < s.layers.size(); ++l) {
            scores.push_back(criterion_scores(s, l, metric, opt));
        }
        for (int64_t k : ks) {
            KeepMap km;
            km.n_expert = s.n_expert;
            km.k = k;
            km.metric = metric;
            km.source = {{"stats", opt.stats.string()},
                         {"n_tokens", s.n_tokens},
                         {"model", s.model},
                         {"protect_super", opt.protect_super}};
            if (metric == "hybrid") {
                km.source["hybrid_of"] = opt.hybrid_of;
            } else if (metric.rfind("domain-", 0) == 0) {
                km.source["domain_metric"] = opt.domain_metric;
                km.source["domain_weights"] = opt.domain_weights;
            } else if (metric == "reap-lcb") {
                km.source["z"] = opt.lcb_z;
                km.source["prior"] = opt.lcb_prior;
            }
            std::vector<Retention> per_layer, held_layers;
            json layers = json::array();
            for (size_t l = 0; l < s.layers.size(); ++l) {
                const std::vector<int32_t> kept = select_layer(s.layers[l], scores[l], k, supers[l], groups);
                km.layers[model_layer(s, l)] = kept;
                per_layer.push_back(retention(s.layers[l], kept, model_layer(s, l), uint64_t(opt.rare_hits)));
                json jl = retention_json(per_layer.back());
                jl["layer"] = model_layer(s, l);
                if (held) {
                    held_layers.push_back(retention(held->layers[l], kept, model_layer(s, l), uint64_t(opt.rare_hits)));
                    jl["heldout"] = retention_json(held_layers.back());
                }
                layers.push_back(jl);
            }
            const Retention w = whole_model(per_layer);
            json r = {{"metric", metric}, {"k", k}, {"whole", retention_json(w)}, {"layers", layers}};
            std::string row = fmt::format("{:<11} {:>5} {:>8.2f} {:>8.2f} {:>8.2f} {:>9} {:>6} {:>6}", metric, k,
                                          100 * w.count_share, 100 * w.reap_share, 100 * w.prob_share, w.min_kept_count,
                                          w.kept_under_100, w.kept_rare);
            if (held) {
                const Retention hw = whole_model(held_layers);
                r["whole"]["heldout"] = retention_json(hw);
                row += fmt::format(" {:>9.2f} {:>9.2f}", 100 * hw.reap_share, 100 * hw.prob_share);
            }
            if (!opt.trace.empty()) {
                const SubstitutionScreen sc = substitution_screen(opt.trace, km, int(s.n_expert_used), opt.trace_examples);
                const double replaced = sc.slots ? double(sc.replaced) / double(sc.slots) : 0;
                const double moved = sc.token_layers ? sc.moved_mass / double(sc.token_layers) : 0;
                const double rank = sc.substitutes ? sc.substitute_rank / double(sc.substitutes) : 0;
                r["screen"] = {{"token_layers", sc.token_layers},
                               {"replaced_share", replaced},
                               {"moved_mass", moved},
                               {"substitute_rank", rank},
                               {"ran_out", sc.ran_out},
                               {"ran_out_examples", sc.ran_out_examples},
                               {"layers", sc.layers}};
                row += fmt::format(" {:>9.2f} {:>7.4f} {:>8.2f} {:>8}", 100 * replaced, moved, rank, sc.ran_out);
            }
            rep.text += row + "\n";
            if (w.kept_rare > 0) {
                std::string which;
                for (size_t i = 0; i < std::min<size_t>(w.rare.size(), 6); ++i) {
                    which += fmt::format("{}blk.{} e{} ({} hits)", i ? ", " : "", w.rare[i][0].get<int>(),
                                         w.rare[i][1].get<int>(), w.rare[i][2].get<uint64_t>());
                }
                rare_notes += fmt::format("  {} K={}: {} kept experts with fewer than {} hits: {}{}{}\n", metric, k,
                                          w.kept_rare, opt.rare_hits, which, w.rare.size() > 6 ? ", ..." : "",
                                          metric == "reap" ? " (reap, the published mean, trusts rare experts by design)"
                                          : metric == "hybrid" ? " (hybrid inherits part of it from reap)" : "");
            }
            if (!opt.out_dir.empty()) {
                const std::filesystem::path file = opt.out_dir / fmt::format("{}-k{}.json", metric, k);
                write_keep_map(file, km);
                rep.written.push_back(file);
                r["file"] = file.string();
            }
            results.push_back(r);
            maps[{metric, k}] = std::move(km);
        }
    }
    if (!rare_notes.empty()) {
        rep.text += "\nkept on little evidence:\n" + rare_notes;
    }
    // Whether a criterion's maps nest (K1 ⊂ K2 ⊂ ...), and how much criteria agree.
    json nesting = json::object();
    for (const std::string & metric : opt.metrics) {
        bool nested = true;
        for (size_t i = 1; i < ks.size(); ++i) {
            for (const auto & [layer, small] : maps[{metric, ks[i - 1]}].layers) {
                const auto & big = maps[{metric, ks[i]}].layers.at(layer);
                nested = nested && std::includes(big.begin(), big.end(), small.begin(), small.end());
            }
        }
        nesting[metric] = nested;
    }
    json overlap = json::array();
    for (int64_t k : ks) {
        for (size_t a = 0; a < opt.metrics.size(); ++a) {
            for (size_t b = a + 1; b < opt.metrics.size(); ++b) {
                double share = 0;
                const KeepMap & ma = maps[{opt.metrics[a], k}];
                const KeepMap & mb = maps[{opt.metrics[b], k}];
                for (const auto & [layer, ids] : ma.layers) {
                    std::vector<int32_t> both;
                    const auto & other = mb.layers.at(layer);
                    std::set_intersection(ids.begin(), ids.end(), other.begin(), other.end(), std::back_inserter(both));
                    share += double(both.size()) / double(k) / double(ma.layers.size());
                }
                overlap.push_back({{"k", k}, {"a", opt.metrics[a]}, {"b", opt.metrics[b]}, {"shared", share}});
            }
        }
    }
    json super = json::object();
    size_t n_super = 0;
    for (size_t l = 0; l < supers.size(); ++l) {
        if (!supers[l].empty()) {
            super[std::to_string(model_layer(s, l))] = supers[l];
            n_super += supers[l].size();
        }
    }
    rep.text += "nested: ";
    for (const auto & [metric, nested] : nesting.items()) {
        rep.text += fmt::format("{}={} ", metric, nested.get<bool>() ? "yes" : "no");
    }
    rep.text += "\n";
    if (opt.protect_super) {
        rep.text += fmt::format("super experts kept in every map: {} ({})\n", n_super, super.dump());
    }
    rep.json = {{"format", "moeprune-select"},
                {"version", 1},
                {"inputs",
                 {{"stats", opt.stats.string()},
                  {"stats_tokens", s.n_tokens},
                  {"model", s.model},
                  {"heldout", opt.heldout.empty() ? json() : json(opt.heldout.string())},
                  {"trace", opt.trace.empty() ? json() : json(opt.trace.string())},
                  {"ks", ks},
                  {"metrics", opt.metrics},
                  {"hybrid_of", opt.hybrid_of},
                  {"domain_metric", opt.domain_metric},
                  {"domain_weights", opt.domain_weights},
                  {"lcb_z", opt.lcb_z},
                  {"lcb_prior", opt.lcb_prior},
                  {"rare_hits", opt.rare_hits},
                  {"protect_super", opt.protect_super}}},
                {"super_experts", super},
                {"results", results},
                {"nested", nesting},
                {"overlap", overlap}};
    return rep;
}

} // namespace moeprune
