// The plan as moeprune-plan JSON (docs/plan.md): its inputs, options, fronts,
// recommendation and commands.
#include "plan/planner.h"

#include "plan/commands.h"

namespace moeprune::plan_impl {

json Planner::to_plan_json(const std::vector<size_t> & pareto, const std::vector<size_t> & pareto_eligible,
                  const std::optional<size_t> & recommended, const std::string & why) const {
    json options_json = json::array();
    for (const PlanOption & o : options) {
        options_json.push_back(to_json(o));
    }
    json layer_bytes = json::array();
    for (const double b : g.bytes) {
        layer_bytes.push_back(b);
    }
    json throughput_inputs = to_json(tp);
    throughput_inputs["model"] =
        "t = compute + layers * sync + read_bytes / ssd + rounds * latency; tokens/s = 1 / t";
    if (!g.mtp_bytes.empty()) {
        throughput_inputs["mtp_draft_model"] =
            "one draft token per step: the step's t has compute * (1 + mtp_layers / layers), (layers + mtp_layers) * "
            "sync, the trunk's reads of 2 positions and the head's of 1 + a; tokens/s = (1 + a) / t";
    }
    return {{"format", "moeprune-plan"},
            {"version", 1},
            {"inputs",
             {{"geometry",
               {{"source", g.source},
                {"model_digest", g.digest.empty() ? json(nullptr) : json(g.digest)},
                {"moe_layers", L},
                {"experts", g.n_expert},
                {"used", g.used},
                {"expert_bytes", layer_bytes},
                {"routed_bytes_all", g.sum() * double(g.n_expert)},
                {"other_bytes", g.other_known ? json(g.other) : json(nullptr)},
                {"mtp_layers", g.mtp_bytes.size()},
                {"mtp_expert_bytes", g.mtp_bytes}}},
              {"mtp_acceptance", opt.mtp_acceptance ? json(*opt.mtp_acceptance) : json(nullptr)},
              {"ram_bytes", opt.ram_bytes > 0 ? json(opt.ram_bytes) : json(nullptr)},
              {"reserve_bytes", opt.reserve_bytes},
              {"budget_bytes", budget > 0 ? json(budget) : json(nullptr)},
              {"throughput", throughput_inputs},
              {"measured", measured ? measured_inputs() : json(nullptr)},
              {"replays", replay_inputs},
              {"evals", eval_inputs},
              {"misses_per_token", opt.misses_per_token},
              {"cache_experts", opt.cache_experts},
              {"max_kld", opt.max_kld ? json(*opt.max_kld) : json(nullptr)},
              {"min_accuracy", opt.min_accuracy ? json(*opt.min_accuracy) : json(nullptr)},
              {"speed_share", opt.speed_share},
              {"runs_on", runs_on_name(opt.runs_on)},
              {"shortlist", shortlist_inputs}}},
            {"options", options_json},
            {"infeasible", infeasible},
            {"pareto", pareto},
            {"pareto_runs_on", pareto_eligible},
            {"recommended", recommended ? json(*recommended) : json(nullptr)},
            // llama.cpp's commands run only what llama.cpp runs: a recommended expert cache has none.
            {"commands", recommended && options[*recommended].runs_on == kRunsOnLlamaCpp
                             ? to_json(commands_of(options[*recommended], opt, g, measured))
                             : json(nullptr)},
            {"why", why}};
}

json Planner::measured_inputs() const {
    const Measured & m = *measured;
    const MeasureReport & r = m.report();
    const auto or_null = [](double v) { return v < 0 ? json(nullptr) : json(v); };
    return {{"file", m.file.path},
            {"digest", m.file.digest},
            {"compute_ms", r.resident.decode.ms_mean},
            {"effective_gbps", r.probe.effective_gbps},
            {"read_gbps", or_null(r.probe.read_gbps)},
            {"readahead_amplification", or_null(r.probe.readahead_amplification)},
            {"fault_latency_us", r.probe.fault_latency_us},
            {"process_bytes", double(r.process_bytes)},
            {"median_error", or_null(r.median_error)},
            {"max_error", or_null(r.max_error)},
            {"from_measurement", m.taken}};
}

} // namespace moeprune::plan_impl
