// The timing and the plan: llama.cpp measured under the --measure limits, the plan priced
// from it, and its shortlist measured under --ram.
#include "run/stages.h"

#include "core/atomic_file.h"
#include "core/sizes.h"
#include "formats/keep_map.h"
#include "measure/measure.h"
#include "plan/plan.h"
#include "run/shortlist.h"
#include "slice/slice.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace moeprune::run_impl {

std::vector<fs::path> measure_to(const RunOptions & opt, const fs::path & model, const fs::path & text,
                                 const std::vector<std::string> & ram, const fs::path & json_out,
                                 const std::vector<uint64_t> & read_ahead_kb) {
    MeasureOptions o;
    o.read_ahead_kb = read_ahead_kb;
    o.text_only = true;  // llama.cpp's decode of the held-out text; images are encoded, not streamed
    o.model = model;
    o.text = text;
    o.ram = ram;
    o.tokens = opt.config.measure_tokens;
    o.repeats = opt.config.measure_repeats;
    o.threads = opt.config.threads;
    o.json_out = json_out;
    const MeasureReport r = run_measure(o);
    const fs::path text_out = fs::path(json_out).replace_extension(".txt");
    write_file_atomic(text_out, to_text(r));
    return {json_out, text_out};
}

std::vector<uint64_t> read_ahead_of(const PlanOption & o) {
    return o.read_ahead_kb ? std::vector<uint64_t>{*o.read_ahead_kb} : std::vector<uint64_t>{};
}

void measure_stage(Runner & run, const RunOptions & opt, const RunPaths & at) {
    const RunConfig & c = opt.config;
    run.stage("measure",
              {{"ram", c.measure}, {"tokens", c.measure_tokens}, {"repeats", c.measure_repeats}, {"threads", c.threads},
               {"read_ahead_kb", c.read_ahead_kb}},
              {c.model, at.eval_text},
              [&] { return measure_to(opt, c.model, at.eval_text, c.measure, at.measure_json, c.read_ahead_kb); });
}

namespace {

// Whether the plan stage measures its shortlist: llama.cpp is measured (--measure), under a
// budget to measure it in (--ram).
bool shortlisting(const RunConfig & c) { return !c.measure.empty() && !c.ram.empty() && c.measure_shortlist > 0; }

// The shortlist of the plan made from predictions, each option's model (sliced where it
// keeps fewer experts, then deleted) measured under --ram; returns their summaries, which
// `out` gets with the measure reports and the predicted plan.
std::vector<fs::path> measure_shortlist(const RunOptions & opt, const RunPaths & at, const json & predicted,
                                        std::vector<fs::path> & out) {
    const RunConfig & c = opt.config;
    const fs::path dir = at.dir / "plan" / "shortlist";
    create_output_dir(dir);
    const fs::path predicted_json = at.dir / "plan" / "predicted.json";
    write_file_atomic(predicted_json, predicted.dump(1) + "\n");
    out.push_back(predicted_json);
    const PlanFile plan = read_plan_document(predicted, predicted_json.string());
    std::vector<fs::path> summaries;
    for (const size_t i : shortlist_of(plan, c.measure_shortlist)) {
        const PlanOption & o = plan.options[i];
        const std::string label = keep_map_label(o.criterion, o.k) + (o.policy == kPolicyResident ? "" : "-" + o.policy) +
                                  (o.read_ahead_kb ? fmt::format("-ra{}", *o.read_ahead_kb) : "");
        fs::path model = c.model;
        if (o.k < plan.n_expert) {
            SliceOptions s;
            s.model = c.model;
            s.keep = o.keep_map ? fs::path(*o.keep_map) : at.maps_dir / keep_map_file_name(o.criterion, o.k);
            s.output = model = dir / (label + ".gguf");
            slice_model(s);
        }
        const fs::path measure_json = dir / (label + ".measure.json");
        const std::vector<fs::path> measured =
            measure_to(opt, model, at.eval_text, {c.ram}, measure_json, read_ahead_of(o));
        if (model != c.model) {
            fs::remove(model);   // a model's worth of disk per option; the measure report says what it was
        }
        const fs::path summary = dir / (label + ".json");
        write_file_atomic(summary, to_json(measured_option(o, predicted_json.string(), model, c.ram, measure_json)).dump(1) + "\n");
        out.insert(out.end(), measured.begin(), measured.end());
        out.push_back(summary);
        summaries.push_back(summary);
    }
    return summaries;
}

} // namespace

void plan_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const RunMaps & m) {
    const RunConfig & c = opt.config;
    std::vector<fs::path> plan_inputs{c.model, at.eval_json};
    if (!c.measure.empty()) {
        plan_inputs.insert(plan_inputs.end(), {at.measure_json, at.trace});
    }
    plan_inputs.insert(plan_inputs.end(), m.closed_evals.begin(), m.closed_evals.end());
    plan_inputs.insert(plan_inputs.end(), m.replays.begin(), m.replays.end());
    run.stage("plan", {{"k", c.ks}, {"ram", c.ram}, {"reserve", c.reserve}, {"throughput", to_json(throughput_of(c))},
                       {"max_kld", c.max_kld ? json(*c.max_kld) : json(nullptr)},
                       {"min_accuracy", c.min_accuracy ? json(*c.min_accuracy) : json(nullptr)}, {"runs_on", runs_on_name(c.runs_on)},
                       {"llama_bin", c.llama_bin}, {"threads", c.threads}, {"ctx", c.ctx},
                       {"measure_shortlist", shortlisting(c) ? c.measure_shortlist : 0}, {"measure_tokens", c.measure_tokens},
                       {"measure_repeats", c.measure_repeats}},
              plan_inputs, [&] {
                  PlanOptions o;
                  o.model = c.model;
                  o.ks = c.ks;
                  o.ram_bytes = c.ram.empty() ? 0 : parse_size(c.ram, "ram");
                  o.reserve_bytes = parse_size(reserve_of(c), "reserve");
                  if (!c.measure.empty()) {
                      o.measured = at.measure_json;
                      if (!c.reserve.empty()) {
                          o.by_hand = {"--reserve"};
                      }
                  }
                  o.throughput = throughput_of(c);
                  o.replays = m.replays;
                  o.evals = {at.eval_json};
                  o.evals.insert(o.evals.end(), m.closed_evals.begin(), m.closed_evals.end());
                  o.max_kld = c.max_kld;
                  o.min_accuracy = c.min_accuracy;
                  o.runs_on = c.runs_on;
                  o.sliced_dir = at.dir / "slice";
                  o.threads = c.threads;
                  o.ctx = c.ctx;
                  o.llama_bin = c.llama_bin;
                  o.moeprune_bin = opt.moeprune_bin;
                  std::vector<fs::path> out;
                  if (!c.measure.empty() && !c.ram.empty()) {
                      o.streamed = price_streamed_slices(c.model, m.maps, at.trace, at.measure_json, c.ram,
                                                         at.dir / "plan" / "streamed");
                  }
                  json plan = make_plan(o);
                  if (shortlisting(c)) {
                      o.shortlist = measure_shortlist(opt, at, plan, out);
                      plan = make_plan(o);
                  }
                  write_file_atomic(at.plan_json, plan.dump(1) + "\n");
                  write_file_atomic(at.dir / "plan" / "plan.txt", plan_text(read_plan_document(plan, at.plan_json.string())));
                  out.insert(out.end(), {at.plan_json, at.dir / "plan" / "plan.txt"});
                  return out;
              });
}

} // namespace moeprune::run_impl
