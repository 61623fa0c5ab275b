#include "run/shortlist.h"

#include "core/atomic_file.h"
#include "core/sizes.h"
#include "formats/keep_map.h"
#include "formats/measure_report.h"
#include "formats/sliced_trace.h"
#include "measure/predict.h"
#include "model/inspect.h"
#include "model/model_file.h"
#include "slice/slice.h"

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
    const auto resident_speed = [](const MeasureReport & r) {
        return r.resident.decode.tokens_per_second > 0 ? std::optional(r.resident.decode.tokens_per_second) : std::nullopt;
    };
    v.resident_tok_per_s = resident_speed(measured.report);
    if (o.shortlist) {
        // Only a decode of the same model (by content) tells the machine's drift apart.
        const MeasureFile earlier = read_measure_report(o.shortlist->measure);
        if (earlier.model.digest && earlier.model.digest == measured.model.digest) {
            v.shortlist_resident_tok_per_s = resident_speed(earlier.report);
        }
    }
    return v;
}

std::vector<StreamedSlice> price_streamed_slices(const std::filesystem::path & model,
                                                 const std::vector<std::filesystem::path> & maps,
                                                 const std::filesystem::path & trace,
                                                 const std::filesystem::path & measure_json, const std::string & ram,
                                                 const std::filesystem::path & scratch) {
    const MeasureFile measured = read_measure_report(measure_json);
    const MeasureReport & r = measured.report;
    std::vector<const StreamCalibration *> calibrations;   // one per read-ahead measured
    for (const StreamCalibration & c : r.calibrations) {
        if (r.probed && c.read_gbps > 0) {
            calibrations.push_back(&c);
        }
    }
    if (calibrations.empty()) {
        return {};
    }
    const GgufModel original = GgufModel::open(model);
    const InspectReport info = inspect_model(original, {});
    double expert_sum = 0;
    for (const double b : info.routed_layer_expert_bytes()) {
        expert_sum += b;
    }
    const double limit = parse_size(ram, "ram");
    const TraceReader heldout = TraceReader::open(trace);
    constexpr uint64_t kWarmup = 32;   // measure's: the first tokens decode uncounted
    std::vector<StreamedSlice> out;
    for (const std::filesystem::path & map : maps) {
        const KeepMap keep = read_keep_map(map);
        const double need = double(r.process_bytes) + double(info.other_bytes) + double(keep.k) * expert_sum;
        if (need <= limit || heldout.n_tokens() <= kWarmup) {
            continue;   // every kept expert fits: the resident option is that model
        }
        create_output_dir(scratch);
        SliceOptions s;
        s.model = model;
        s.keep = map;
        s.output = scratch / (map.stem().string() + ".gguf");
        slice_model(s);
        {
            const GgufModel sliced = GgufModel::open(s.output);
            const SlicedTrace routed(heldout, keep, uint32_t(info.n_expert_used), map.string());
            for (const StreamCalibration * c : calibrations) {
                // Only a setting to change is named: the device's own needs no root to measure or run.
                const std::optional<uint64_t> read_ahead =
                    c->read_ahead_kb != r.read_ahead_kb ? c->read_ahead_kb : std::nullopt;
                StreamedSlice priced{keep.metric.empty() ? map.stem().string() : keep.metric, keep.k, map.string(), ram,
                                     limit, read_ahead, {}};
                priced.prediction = predict_stream(sliced, routed, kWarmup, uint64_t(limit), *c);
                out.push_back(std::move(priced));
            }
        }
        std::filesystem::remove(s.output);   // a model's worth of disk per K
    }
    std::error_code ec;
    std::filesystem::remove(scratch, ec);   // only when empty: nothing of this pass is left
    return out;
}

} // namespace moeprune
