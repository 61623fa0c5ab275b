// What the user acts on: the report, the sliced models, and the recommendation measured
// as llama.cpp runs it.
#include "run/stages.h"

#include "core/atomic_file.h"
#include "formats/keep_map.h"
#include "formats/verify_summary.h"
#include "report/report.h"
#include "run/shortlist.h"
#include "slice/slice.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace moeprune::run_impl {

void report_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m) {
    ReportInputs ri;
    ri.run_dir = at.dir;
    ri.config = run_config_toml(c);
    ri.corpus = at.corpus_report;
    ri.select = at.select_json;
    ri.eval = at.eval_json;
    ri.replays = m.replays;
    ri.closed_loop_evals = m.closed_evals;
    ri.plan = at.plan_json;
    std::vector<fs::path> report_inputs{at.corpus_report, ri.select, at.eval_json, at.plan_json};
    if (!c.measure.empty()) {
        ri.measure = at.measure_json;
        report_inputs.push_back(at.measure_json);
    }
    report_inputs.insert(report_inputs.end(), m.replays.begin(), m.replays.end());
    report_inputs.insert(report_inputs.end(), m.closed_evals.begin(), m.closed_evals.end());
    run.stage("report", {{"report_version", 3}}, report_inputs, [&] { return write_report(ri); });
}

std::string slice_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m, const PlanFile & plan) {
    std::vector<fs::path> chosen;
    if (c.slice == "all") {
        chosen = m.maps;
    } else if (const PlanOption * o = plan.recommendation()) {
        const fs::path map = at.maps_dir / keep_map_file_name(o->criterion, o->k);
        if (fs::exists(map)) {
            chosen.push_back(map);
        }
    }
    std::vector<fs::path> slice_inputs{c.model, at.plan_json};
    slice_inputs.insert(slice_inputs.end(), chosen.begin(), chosen.end());
    run.stage("slice", {{"slice", c.slice}}, slice_inputs, [&] {
        std::vector<fs::path> out;
        for (const fs::path & map : chosen) {
            SliceOptions o;
            o.model = c.model;
            o.keep = map;
            o.output = at.dir / "slice" / (map.stem().string() + ".gguf");
            slice_model(o);
            out.push_back(o.output);
        }
        return out;
    });
    return chosen.empty() ? "\nslice: the recommended option keeps every expert or names no keep map; nothing to slice" : "";
}

std::string verify_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const PlanFile & plan) {
    const RunConfig & c = opt.config;
    const PlanOption * o = plan.recommendation();
    if (!o) {
        return "\nverify: the plan recommends nothing to verify";
    }
    fs::path model = c.model;
    if (o->k < plan.n_expert) {
        model = at.dir / "slice" / (fs::path(keep_map_file_name(o->criterion, o->k)).stem().string() + ".gguf");
        if (!fs::exists(model)) {
            fail_file(model.string(), "is missing: verify measures the recommended option's sliced model");
        }
    }
    // Under the limit the option was measured under, which its commands use too: at --ram
    // the error would mostly be the difference between the two limits.
    const std::string ram = o->measured ? std::to_string(uint64_t(o->measured->limit_bytes)) : c.ram;
    run.stage("verify", {{"ram", ram}, {"tokens", c.measure_tokens}, {"repeats", c.measure_repeats}, {"threads", c.threads},
                         {"read_ahead_kb", o->read_ahead_kb ? json(*o->read_ahead_kb) : json(nullptr)}},
              {model, at.eval_text, at.plan_json}, [&] {
                  std::vector<fs::path> out =
                      measure_to(opt, model, at.eval_text, {ram}, at.verify_json, read_ahead_of(*o));
                  const VerifySummary v = measured_option(*o, at.plan_json.string(), model, ram, at.verify_json);
                  const fs::path summary = at.dir / "verify" / "summary.json";
                  write_file_atomic(summary, to_json(v).dump(1) + "\n");
                  out.push_back(summary);
                  return out;
              });
    const VerifySummary v = read_verify_summary(at.dir / "verify" / "summary.json");
    // A figure a shortlist measured minutes before can be off by the machine's drift alone:
    // the same model's resident decode, then and now, tells that from the predictor's error.
    const std::string drift =
        v.drift() ? fmt::format("; resident, the same model decoded at {:.2f} tokens/s here and {:.2f} when the "
                                "shortlist measured it: the machine ran {:.0f}% {}",
                                *v.resident_tok_per_s, *v.shortlist_resident_tok_per_s, 100 * std::abs(*v.drift()),
                                *v.drift() < 0 ? "slower" : "faster")
                  : "";
    const std::string limit = o->measured ? fmt::format("{} bytes, the limit it was measured under", ram) : "--ram " + ram;
    return fmt::format("\nverify: {} at {}: predicted {}, measured {:.2f} tokens/s{}{}", v.model, limit,
                       v.predicted_tok_per_s ? fmt::format("{:.2f}", *v.predicted_tok_per_s) : "unbounded tokens/s",
                       v.measured_tok_per_s, v.error() ? fmt::format(" (error {:.0f}%)", 100 * *v.error()) : "", drift);
}

} // namespace moeprune::run_impl
