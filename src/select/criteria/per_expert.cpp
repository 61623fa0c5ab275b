// Criteria that score each expert from its own counters in one layer's statistics.
#include "select/criteria/criteria.h"
#include "select/select.h"

#include <boost/math/distributions/normal.hpp>
#include <boost/math/distributions/students_t.hpp>

#include <algorithm>
#include <cmath>

namespace moeprune::criteria_impl {

namespace {

// Each expert's value, or 0 for an expert without hits where the value is a mean.
template <class F> std::vector<double> per_expert(const LayerStats & L, F value) {
    std::vector<double> s(L.n_expert(), 0.0);
    for (size_t e = 0; e < s.size(); ++e) {
        s[e] = value(e, double(L.count[e]));
    }
    return s;
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

} // namespace

std::vector<double> freq_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [](size_t, double c) { return c; });
}

std::vector<double> soft_freq_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [&](size_t e, double) { return in.layer_stats.prob_sum[e]; });
}

std::vector<double> reap_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [&](size_t e, double c) { return c > 0 ? in.layer_stats.reap_sum[e] / c : 0.0; });
}

std::vector<double> reap_sum_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [&](size_t e, double) { return in.layer_stats.reap_sum[e]; });
}

std::vector<double> ean_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [&](size_t e, double c) { return c > 0 ? in.layer_stats.ean_sum[e] / c : 0.0; });
}

std::vector<double> ean_sum_scores(const CriterionInput & in) {
    return per_expert(in.layer_stats, [&](size_t e, double) { return in.layer_stats.ean_sum[e]; });
}

std::vector<double> reap_lcb_scores(const CriterionInput & in) {
    const LayerStats & L = in.layer_stats;
    const double z = in.opt.lcb_z, prior = in.opt.lcb_prior, cv2 = pooled_cv2(L);
    // --lcb-z names a confidence level through the normal quantile (1.96: 97.5% one-sided).
    const double confidence = boost::math::cdf(boost::math::normal(), z);
    return per_expert(L, [&](size_t e, double c) {
        if (c == 0) {
            return 0.0;
        }
        const double mean = L.reap_sum[e] / c;
        const double sample_var = c >= 2 ? std::max(0.0, (L.reap_sq_sum[e] - c * mean * mean) / (c - 1)) : 0.0;
        // A few agreeing values say little about the spread: the variance is shrunk
        // toward the layer's (relative) pooled one with `prior` pseudo-observations.
        const double var = ((c - 1) * sample_var + prior * cv2 * mean * mean) / (c - 1 + prior);
        const double t = z > 0 ? boost::math::quantile(boost::math::students_t(std::max(1.0, c - 1)), confidence) : 0.0;
        return std::max(0.0, mean - t * std::sqrt(var / c));
    });
}

nlohmann::json reap_lcb_settings(const SelectOptions & opt) { return {{"z", opt.lcb_z}, {"prior", opt.lcb_prior}}; }

} // namespace moeprune::criteria_impl
