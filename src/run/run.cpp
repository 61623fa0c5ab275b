#include "run/run.h"

#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/sizes.h"
#include "core/threads.h"
#include "formats/stage_reports.h"
#include "formats/verify_summary.h"
#include "measure/measure.h"
#include "measure/read_ahead.h"
#include "model/inspect.h"
#include "model/model_file.h"
#include "plan/plan.h"
#include "run/stages.h"
#include "sim/policy.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

using namespace run_impl;

namespace {

// The slice stage's setting: with --verify and no --slice, the recommendation is sliced.
std::string slice_of(const RunConfig & c) { return c.verify && c.slice.empty() ? "best" : c.slice; }

// Every stage of a run, in order, and whether a run of `c` has it.
struct RunStage {
    const char * name;
    bool (*runs)(const RunConfig & c);
};

bool always(const RunConfig &) { return true; }

const std::vector<RunStage> & stage_table() {
    static const std::vector<RunStage> t = {
        {"corpus", always},
        {"collect", always},
        {"heldout", always},
        {"measure", [](const RunConfig & c) { return !c.measure.empty(); }},
        {"select", always},
        {"eval", always},
        {"replay", always},
        {"plan", always},
        {"report", always},
        {"slice", [](const RunConfig & c) { return !slice_of(c).empty(); }},
        {"verify", [](const RunConfig & c) { return c.verify; }},
    };
    return t;
}

bool stage_runs(const char * name, const RunConfig & c) {
    for (const RunStage & s : stage_table()) {
        if (std::string_view(s.name) == name) {
            return s.runs(c);
        }
    }
    throw Error(fmt::format("internal: no run stage {}", name));
}

} // namespace

const std::vector<std::string> & run_stages() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> out;
        for (const RunStage & s : stage_table()) {
            out.push_back(s.name);
        }
        return out;
    }();
    return names;
}

namespace {

// The settings checked before anything is written; returns the model's geometry.
InspectReport check_run_options(const RunOptions & opt) {
    const RunConfig & c = opt.config;
    for (const RunSetting & s : run_settings()) {
        check_setting(s, c);
    }
    if (c.model.empty() || c.corpus.empty() || c.ks.empty()) {
        throw Error("moeprune run needs a model (-m), a corpus (--corpus) and expert counts (-k)");
    }
    if (!opt.from.empty() && std::find(run_stages().begin(), run_stages().end(), opt.from) == run_stages().end()) {
        throw Error(fmt::format("--from {}: the stages are {}", opt.from, fmt::join(run_stages(), ", ")));
    }
    InspectReport model = inspect_model(GgufModel::open(c.model), {});
    if (!model.problems.empty()) {
        fail_file(c.model.string(), "inspect finds problems: " + model.problems.front());
    }
    for (const int64_t k : c.ks) {
        if (k < model.n_expert_used || k > model.n_expert) {
            throw Error(fmt::format("-k {}: the experts kept per layer are between the {} each token uses and the {} of {}",
                                    k, model.n_expert_used, model.n_expert, c.model.string()));
        }
    }
    for (const std::string & p : c.policies) {
        if (std::find(policy_names().begin(), policy_names().end(), p) == policy_names().end()) {
            throw Error(fmt::format("--policies {}: not a cache policy ({})", p, fmt::join(policy_names(), ", ")));
        }
    }
    for (const std::string & ram : c.measure) {
        parse_ram_limit(ram, "--measure");
    }
    if (!c.ram.empty()) {
        parse_size(c.ram, "--ram");
    }
    parse_size(reserve_of(c), "--reserve");
    // The corpus' manifest and sources are read now, so that a bad one is refused before
    // run.toml records the run.
    std::vector<fs::path> corpus_inputs;
    corpus_spec(c, corpus_inputs);
    if (c.verify && c.ram.empty()) {
        throw Error("--verify measures the recommendation at --ram: give --ram");
    }
    if (!c.read_ahead_kb.empty() && (c.measure.empty() || ::geteuid() != 0)) {
        throw Error("read_ahead_kb: the measure stage measures at each read-ahead of the model's device, which needs "
                    "--measure and root");
    }

    if (!c.hellaswag.empty() + !c.winogrande.empty() + !c.multiple_choice.empty() > 1) {
        throw Error("hellaswag, winogrande, multiple_choice: give one task file per run");
    }
    // Without a reserve given, a measured run learns it, and the plan checks the budget then;
    // a --ram under the weights that are not experts is refused whatever that reserve.
    if (!c.ram.empty()) {
        const bool reserve_known = !c.reserve.empty() || c.measure.empty();
        const double budget = parse_size(c.ram, "--ram") - (reserve_known ? parse_size(reserve_of(c), "--reserve") : 0);
        if (budget < double(model.other_bytes)) {
            throw Error(fmt::format("--ram {}{} leaves {:.3f} GB, less than the {:.3f} GB of weights in {} that are not "
                                    "routed experts",
                                    c.ram, reserve_known ? " minus the reserve of " + reserve_of(c) : std::string(),
                                    budget / 1e9, double(model.other_bytes) / 1e9, c.model.string()));
        }
    }
    return model;
}

} // namespace

std::string run_pipeline(const RunOptions & opt) {
    const RunConfig & c = opt.config;
    const fs::path & dir = opt.run_dir;
    const InspectReport model = check_run_options(opt);
    // What the run measures and what its commands serve at is the device's own read-ahead.
    print_left_read_ahead();
    create_output_dir(dir);
    refuse_output_clashes({dir / "run.toml"}, {c.model});
    write_file_atomic(dir / "run.toml", run_config_toml(c));

    const RunPaths at(dir);
    const size_t n_stages = size_t(std::count_if(stage_table().begin(), stage_table().end(),
                                                 [&](const RunStage & s) { return s.runs(c); }));
    Runner run(dir, opt.from, n_stages);
    corpus_stage(run, c, at);
    collect_stage(run, opt, model, "collect", at.calib, at.stats, {});
    collect_stage(run, opt, model, "heldout", at.eval_text, at.heldout, at.trace);
    // Measured, tokens/s are priced from the measurement from the replay on, as in the plan.
    ThroughputParams throughput = throughput_of(c);
    if (stage_runs("measure", c)) {
        measure_stage(run, opt, at);
        throughput = measured_throughput(at.measure_json, throughput, {});
    }
    select_stage(run, c, at);
    const RunMaps maps = run_maps(c, at);
    eval_stage(run, opt, model, at, maps);
    replay_stage(run, c, model, at, maps, throughput);
    plan_stage(run, opt, at, maps);
    report_stage(run, c, at, maps);

    const PlanFile plan = read_plan_report(at.plan_json);
    std::string summary = "recommended: " + plan.why;
    if (plan.commands) {
        summary += "\nto run it:";
        for (const std::string & line : plan.commands->lines) {
            summary += "\n  " + line;
        }
    }
    if (stage_runs("slice", c)) {
        RunConfig sliced = c;
        sliced.slice = slice_of(c);
        summary += with_json_errors(at.plan_json.string(), [&] { return slice_stage(run, sliced, at, maps, plan); });
    }
    if (stage_runs("verify", c)) {
        summary += with_json_errors(at.plan_json.string(), [&] { return verify_stage(run, opt, at, plan); });
    }
    return summary + "\nreport: " + (dir / "report.html").string();
}

} // namespace moeprune
