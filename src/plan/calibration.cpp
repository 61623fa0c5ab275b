#include "plan/calibration.h"

#include "core/json.h"
#include "plan/geometry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moeprune {

Measured read_measured(const std::filesystem::path & path) {
    Measured m{read_measure_report(path), {}};
    const MeasureReport & r = m.report();
    const JsonPlace top = m.file.place();
    if (!r.busy.empty()) {
        top.fail("busy", "says the machine was busy while it measured (" + r.busy +
                             "): nothing can be calibrated on it; measure again on a quiet machine");
    }
    if (!r.probed) {
        top.fail("probe", "is null: the storage was not probed (measure --probe-mib 0), so nothing calibrates the reads; "
                          "measure again with a probe");
    }
    if (!(r.probe.effective_gbps >= 1e-6)) {
        m.file.place("probe").fail("effective_gbps", fmt::format("is {}: the probe read nothing, or under 1 kB/s",
                                                                 r.probe.effective_gbps));
    }
    return m;
}

// The guesses the measurement replaces, unless given by hand. The probe's bandwidth is of
// bytes needed, read as a decode reads them (page faults at its thread count, readahead
// and fault latency included), so no latency per round is added on top of it.
void calibrate(PlanOptions & opt, Measured & m) {
    const auto by_hand = [&](const char * flag) {
        return std::find(opt.by_hand.begin(), opt.by_hand.end(), flag) != opt.by_hand.end();
    };
    if (!by_hand("--compute-ms")) {
        // The calibration's is the median of the resident decodes at the device's read-ahead
        // (measure --repeats), where the resident run's is one of them.
        const StreamCalibration & c = m.report().calibration;
        opt.throughput.compute_ms = c.compute_ms > 0 ? c.compute_ms : m.report().resident.decode.ms_mean;
        m.taken.push_back("compute_ms");
    }
    if (!by_hand("--ssd")) {
        opt.throughput.ssd_gbps = m.report().probe.effective_gbps;
        m.taken.push_back("ssd_gbps");
    }
    if (!by_hand("--read-latency-us")) {
        opt.throughput.read_latency_us = 0;
        m.taken.push_back("read_latency_us");
    }
    if (!by_hand("--reserve")) {
        opt.reserve_bytes = double(m.report().process_bytes);
        m.taken.push_back("reserve_bytes");
    }
}

// Where the time per token came from, for `why`.
std::string timing_source(const PlanOptions & opt, const std::optional<Measured> & m) {
    const ThroughputParams & t = opt.throughput;
    if (!m) {
        return fmt::format("tokens/s rest on guesses, as nothing was measured: --ssd {} GB/s, --compute-ms {}, "
                           "--read-latency-us {} (moeprune measure, then plan --measured, replaces them)",
                           t.ssd_gbps, t.compute_ms, t.read_latency_us);
    }
    std::vector<std::string> from;
    const auto taken = [&](const char * p) { return std::find(m->taken.begin(), m->taken.end(), p) != m->taken.end(); };
    if (taken("compute_ms")) {
        const size_t decodes = m->report().calibration.compute_ms_repeats.size();
        from.push_back(decodes > 1 ? fmt::format("compute {:.3g} ms per token (the median of {} resident decodes)",
                                                 t.compute_ms, decodes)
                                   : fmt::format("compute {:.3g} ms per token (resident run)", t.compute_ms));
    }
    if (taken("ssd_gbps")) {
        std::string s = fmt::format("storage {:.3g} GB/s of experts through page faults", t.ssd_gbps);
        const ProbeFigures & probe = m->report().probe;
        if (probe.readahead_amplification >= 0) {
            s += fmt::format(" (device {:.3g} GB/s, readahead x{:.2f}, {:.0f} us per fault)", probe.read_gbps,
                             probe.readahead_amplification, probe.fault_latency_us);
        }
        from.push_back(s + " (probe)");
    }
    if (taken("reserve_bytes")) {
        from.push_back(fmt::format("reserve {:.3f} GB of process memory (resident run)", gb(opt.reserve_bytes)));
    }
    const std::string & file = m->file.path;
    std::string out = from.empty() ? "every timing parameter was given by hand, though " + file + " was measured"
                                   : "measured by " + file + ": " + fmt::format("{}", fmt::join(from, ", "));
    if (m->report().median_error >= 0) {
        out += fmt::format("; that calibration predicted the measured limits with median error {:.0f}% (max {:.0f}%)",
                           100 * m->report().median_error, 100 * m->report().max_error);
    }
    std::vector<std::string> outside;
    for (const MeasuredRun & r : m->report().runs) {
        if (r.predicted && !r.prediction.outside_model.empty()) {
            outside.push_back(r.ram);
        }
    }
    if (!outside.empty()) {
        out += fmt::format("; at {} the predictor is outside what it models (a read-around window over half the page "
                           "cache): there, only measured speeds are answers",
                           fmt::join(outside, ", "));
    }
    std::vector<std::string> hand;
    for (const auto & [flag, p] : {std::pair{"--compute-ms", "compute_ms"}, {"--ssd", "ssd_gbps"},
                                   {"--read-latency-us", "read_latency_us"}, {"--reserve", "reserve_bytes"}}) {
        if (!taken(p)) {
            hand.push_back(flag);
        }
    }
    if (!hand.empty()) {
        out += fmt::format("; given by hand: {}", fmt::join(hand, ", "));
    }
    return out;
}

ThroughputParams measured_throughput(const std::filesystem::path & measure_json, const ThroughputParams & guesses,
                                     const std::vector<std::string> & by_hand) {
    PlanOptions opt;
    opt.throughput = guesses;
    opt.by_hand = by_hand;
    Measured m = read_measured(measure_json);
    calibrate(opt, m);
    return opt.throughput;
}

} // namespace moeprune
