// Criteria that blend per-expert criteria by rank: hybrid over criteria, the domain
// criteria over the statistics' domains.
#include "select/criteria/criteria.h"
#include "core/errors.h"
#include "select/select.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moeprune::criteria_impl {

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

std::vector<double> percentiles_by(const std::string & name, const std::string & use, const CriterionInput & in,
                                   const LayerStats & L) {
    return rank_percentiles(per_expert_criterion(name, use).scores({in.stats, in.layer, L, in.opt}));
}

// Averages of rank percentiles are ratios of small integers; rounding them to 1e-12
// makes equal averages ties however the sum was rounded, so the tie-break decides.
std::vector<double> on_grid(std::vector<double> v) {
    for (double & x : v) {
        x = std::round(x * 1e12) / 1e12;
    }
    return v;
}

void require_domains(const CriterionInput & in, const char * criterion) {
    if (in.stats.domains.empty()) {
        throw Error(fmt::format("{} needs per-domain statistics: collect a corpus whose documents carry \"domain\"",
                                criterion));
    }
}

} // namespace

std::vector<double> hybrid_scores(const CriterionInput & in) {
    std::vector<double> h(in.layer_stats.n_expert(), 0.0);
    for (const std::string & m : in.opt.hybrid_of) {
        const std::vector<double> pct = percentiles_by(m, "--hybrid-of", in, in.layer_stats);
        for (size_t e = 0; e < h.size(); ++e) {
            h[e] += pct[e] / double(in.opt.hybrid_of.size());
        }
    }
    return on_grid(h);
}

nlohmann::json hybrid_settings(const SelectOptions & opt) { return {{"hybrid_of", opt.hybrid_of}}; }

std::vector<double> domain_max_scores(const CriterionInput & in) {
    require_domains(in, "domain-max");
    std::vector<double> out(in.layer_stats.n_expert(), 0.0);
    for (const auto & [name, d] : in.stats.domains) {
        if (d.n_tokens > 0) {
            const std::vector<double> pct = percentiles_by(in.opt.domain_metric, "--domain-metric", in, d.layers[in.layer]);
            for (size_t e = 0; e < out.size(); ++e) {
                out[e] = std::max(out[e], pct[e]);
            }
        }
    }
    return on_grid(out);
}

std::vector<double> domain_mix_scores(const CriterionInput & in) {
    require_domains(in, "domain-mix");
    if (in.opt.domain_weights.empty()) {
        throw Error("domain-mix needs --domain-weights NAME=W,...");
    }
    for (const auto & [name, w] : in.opt.domain_weights) {
        if (!in.stats.domains.count(name)) {
            throw Error(fmt::format("--domain-weights names domain \"{}\", which the statistics do not have", name));
        }
    }
    std::vector<double> out(in.layer_stats.n_expert(), 0.0);
    for (const auto & [name, d] : in.stats.domains) {
        const auto w = in.opt.domain_weights.find(name);
        if (d.n_tokens > 0 && w != in.opt.domain_weights.end()) {
            const std::vector<double> pct = percentiles_by(in.opt.domain_metric, "--domain-metric", in, d.layers[in.layer]);
            for (size_t e = 0; e < out.size(); ++e) {
                out[e] += w->second * pct[e];
            }
        }
    }
    return on_grid(out);
}

nlohmann::json domain_settings(const SelectOptions & opt) {
    return {{"domain_metric", opt.domain_metric}, {"domain_weights", opt.domain_weights}};
}

} // namespace moeprune::criteria_impl
