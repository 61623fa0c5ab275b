#include "run/shortlist.h"

#include "formats/measure_report.h"

#include <algorithm>

namespace moeprune {

std::vector<size_t> shortlist_of(const PlanFile & plan, int n) {
    std::vector<size_t> order;
    if (plan.recommended) {
        order.push_back(*plan.recommended);
    }
    order.insert(order.end(), plan.pareto_runs_on.begin(), plan.pareto_runs_on.end());
    // Then the rest, fastest first: off the predicted front, an option may be on the measured one.
    std::vector<size_t> rest(plan.options.size());
    for (size_t i = 0; i < rest.size(); ++i) {
        rest[i] = i;
    }
    std::stable_sort(rest.begin(), rest.end(),
                     [&](size_t a, size_t b) { return plan.options[a].speed() > plan.options[b].speed(); });
    order.insert(order.end(), rest.begin(), rest.end());
    std::vector<size_t> out;
    for (const size_t i : order) {
        const PlanOption & o = plan.options[i];
        if (int(out.size()) < n && !o.measured && !o.bound && o.kld_mean && o.runs_on == kRunsOnLlamaCpp &&
            std::find(out.begin(), out.end(), i) == out.end()) {
            out.push_back(i);
        }
    }
    return out;
}

VerifySummary measured_option(const PlanOption & o, const std::string & plan_path, const std::filesystem::path & model,
                              const std::string & ram, const std::filesystem::path & measure_json) {
    const MeasureFile measured = read_measure_report(measure_json);
    const MeasuredRun & run = measured.report.runs.at(0);
    VerifySummary v;
    v.plan = plan_path;
    v.option = to_json(o);
    v.model = model.string();
    v.ram = ram;
    v.predicted_tok_per_s = o.shortlist ? o.shortlist->predicted_tok_per_s : o.tok_per_s;
    v.measured_tok_per_s = run.decode.tokens_per_second;
    if (run.decode.read_bytes_per_token >= 0) {
        v.measured_read_bytes_per_token = run.decode.read_bytes_per_token;
    }
    v.measured_major_faults_per_token = run.decode.major_faults_per_token;
    v.measure = measure_json.string();
    return v;
}

} // namespace moeprune
