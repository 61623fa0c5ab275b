#include "formats/measure_report.h"

#include "core/digest.h"
#include "core/errors.h"
#include "core/atomic_file.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numeric>

namespace moeprune {

using json = nlohmann::json;

namespace {

json or_null(double v) { return v < 0 ? json() : json(v); }

json to_json(const DecodeFigures & f) {
    return {{"tokens", f.tokens},
            {"tokens_per_second", f.tokens_per_second},
            {"ms_per_token", {{"mean", f.ms_mean}, {"median", f.ms_median}, {"p90", f.ms_p90}}},
            {"major_faults_per_token", f.major_faults_per_token},
            {"read_bytes_per_token", or_null(f.read_bytes_per_token)}};
}

json to_json(const StreamPrediction & p) {
    return {{"page_cache_bytes", p.page_cache_bytes},
            {"outside_model", p.outside_model.empty() ? json(nullptr) : json(p.outside_model)},
            {"tokens_per_second", p.tokens_per_second},
            {"ms_per_token", p.ms_per_token},
            {"read_bytes_per_token", p.read_bytes_per_token},
            {"expert_read_bytes_per_token", p.expert_read_bytes_per_token},
            {"other_read_bytes_per_token", p.other_read_bytes_per_token},
            {"faults_per_token", p.faults_per_token},
            {"expert_faults_per_token", p.expert_faults_per_token}};
}

json to_json(const MeasuredRun & r) {
    return {{"ram", r.ram},
            {"limit_bytes", r.limit_bytes},
            {"cache_bytes", r.cache_bytes},
            {"peak_bytes", r.peak_bytes},
            {"read_ahead_kb", r.read_ahead_kb ? json(*r.read_ahead_kb) : json(nullptr)},
            {"decode", to_json(r.decode)},
            {"predicted", r.predicted ? to_json(r.prediction) : json()},
            {"error", r.predicted ? json(r.error) : json()},
            {"residency", r.residency},
            {"llama_bench", r.llama_bench},
            {"repeats_tokens_per_second", r.repeats_tokens_per_second},
            {"detail", r.detail ? to_json(*r.detail) : json(nullptr)}};
}

json to_json(const ProbeFigures & p) {
    return {{"read_ahead_kb", p.read_ahead_kb ? json(*p.read_ahead_kb) : json(nullptr)},
            {"limit_bytes", p.limit_bytes},
            {"experts", p.experts},
            {"bytes_needed", p.bytes_needed},
            {"bytes_read", p.bytes_read < 0 ? json() : json(p.bytes_read)},
            {"major_faults", p.major_faults},
            {"threads", p.threads},
            {"seconds", p.seconds},
            {"effective_gbps", p.effective_gbps},
            {"read_gbps", or_null(p.read_gbps)},
            {"readahead_amplification", or_null(p.readahead_amplification)},
            {"fault_latency_us", p.fault_latency_us},
            {"sequential_gbps", or_null(p.sequential_gbps)},
            {"simulated_faults", p.simulated_faults},
            {"fault_ms", or_null(p.fault_ms)},
            {"expert_ms", {{"median", p.expert_ms_median}, {"p90", p.expert_ms_p90}}}};
}

json to_json(const StreamCalibration & c) {
    return {{"read_ahead_kb", c.read_ahead_kb ? json(*c.read_ahead_kb) : json(nullptr)},
            {"compute_ms", c.compute_ms},
            {"read_gbps", c.read_gbps},
            {"fault_ms", c.fault_ms},
            {"stream_ms", c.stream_ms},
            {"sequential_gbps", c.sequential_gbps},
            {"process_bytes", c.process_bytes},
            {"page_bytes", c.page_bytes},
            {"readaround_bytes", c.readaround_bytes},
            {"fitted_on", c.fitted_on},
            {"compute_ms_repeats", c.compute_ms_repeats}};
}

// Physical bounds, far outside any machine: a token in at most 1000 s, at most 10^6
// tokens/s, 2^50 bytes of memory, storage between 1 kB/s and 10 TB/s.
constexpr double kMostBytes = 0x1p50, kMostTokPerS = 1e6;

std::optional<uint64_t> optional_read_ahead(const JsonFields & f) {
    return f.has("read_ahead_kb") ? std::optional(uint64_t(f.integer("read_ahead_kb", 0, int64_t(1) << 40)))
                                  : std::nullopt;
}

double optional_number(const JsonFields & f, const char * key, double lo, double hi, double absent) {
    return f.has(key) ? f.number(key, lo, hi) : absent;
}

uint64_t optional_bytes(const JsonFields & f, const char * key) {
    return uint64_t(optional_number(f, key, 0, kMostBytes, 0));
}

// A speed must be what its own times make, so that a report edited by hand (or forged)
// with figures each in range but impossible together is refused by name instead of priced.
void check_speed(const JsonFields & run, const DecodeFigures & d, const std::optional<DecodeDetail> & detail) {
    const JsonFields decode = run.object("decode");
    if (std::abs(d.tokens_per_second * d.ms_mean / 1000 - 1) > 1e-3) {
        decode.fail("tokens_per_second", fmt::format("is {}, but the mean of {} ms per token makes {:.6g}: the report "
                                                     "was edited", d.tokens_per_second, d.ms_mean, 1000 / d.ms_mean));
    }
    if (!detail || detail->wall_us.empty()) {
        return;
    }
    const double total = std::accumulate(detail->wall_us.begin(), detail->wall_us.end(), 0.0);
    const double from_wall = double(detail->wall_us.size()) * 1e6 / total;
    if (!(total > 0) || std::abs(d.tokens_per_second / from_wall - 1) > 1e-3) {
        decode.fail("tokens_per_second", fmt::format("is {}, but its {} tokens took {} us in all ({:.6g} tokens/s): the "
                                                     "report was edited",
                                                     d.tokens_per_second, detail->wall_us.size(), total, from_wall));
    }
}

} // namespace

uint64_t DecodeDetail::process_value(const std::string & key) const {
    for (const auto & [k, v] : process) {
        if (k == key) {
            return v;
        }
    }
    return 0;
}

json to_json(const DecodeDetail & d) {
    json out = {{"load_seconds", d.load_seconds},
                {"load_read_bytes", d.load_read_bytes ? json(*d.load_read_bytes) : json(nullptr)},
                {"load_major_faults", d.load_major_faults},
                {"passes", d.passes},
                {"timed_seconds", d.timed_seconds},
                {"per_token",
                 {{"wall_us", d.wall_us},
                  {"read_bytes", d.read_bytes},
                  {"major_faults", d.major_faults},
                  {"minor_faults", d.minor_faults}}},
                {"read_bytes_counted", d.read_bytes_counted}};
    if (d.residency) {
        json samples = json::array();
        for (const ResidencySample & r : *d.residency) {
            samples.push_back({{"token", r.token}, {"resident", r.resident}});
        }
        out["residency"] = std::move(samples);
    }
    json process = json::object();
    for (const auto & [k, v] : d.process) {
        process[k] = v;
    }
    out["process"] = std::move(process);
    return out;
}

DecodeDetail read_decode_detail(const JsonFields & f) {
    DecodeDetail d;
    d.load_seconds = optional_number(f, "load_seconds", 0, 1e9, 0);
    if (f.has("load_read_bytes") && !f.any("load_read_bytes").is_null()) {
        d.load_read_bytes = f.integer("load_read_bytes", 0, int64_t(kMostBytes));
    }
    d.load_major_faults = int64_t(optional_number(f, "load_major_faults", 0, 1e15, 0));
    d.passes = int64_t(optional_number(f, "passes", 1, 1e6, 1));
    d.timed_seconds = optional_number(f, "timed_seconds", 0, 1e9, 0);
    const JsonFields per_token = f.object("per_token");
    d.wall_us = per_token.numbers("wall_us", 0, 1e12);
    const auto series = [&](const char * key, int64_t lo, std::vector<int64_t> & out) {
        if (per_token.has(key)) {
            out = per_token.integers(key, lo, int64_t(kMostBytes));
            if (out.size() != d.wall_us.size()) {
                per_token.fail(key, fmt::format("has {} tokens, wall_us {}", out.size(), d.wall_us.size()));
            }
        }
    };
    series("read_bytes", -1, d.read_bytes);
    series("major_faults", 0, d.major_faults);
    series("minor_faults", 0, d.minor_faults);
    d.read_bytes_counted = f.has("read_bytes_counted") && f.boolean("read_bytes_counted");
    if (f.has("residency")) {
        d.residency.emplace();
        for (const JsonFields & r : f.objects("residency")) {
            ResidencySample sample;
            sample.token = uint64_t(r.integer("token", 0, int64_t(d.wall_us.size())));
            for (const int64_t e : r.integers("resident", 0, int64_t(UINT32_MAX))) {
                sample.resident.push_back(uint32_t(e));
            }
            d.residency->push_back(std::move(sample));
        }
    }
    if (f.has("process")) {
        const JsonFields process = f.object("process");
        for (const char * key : {"RssAnon", "RssFile", "VmHWM", "VmPTE"}) {
            if (process.has(key)) {
                d.process.emplace_back(key, uint64_t(process.integer(key, 0, int64_t(kMostBytes))));
            }
        }
    }
    return d;
}

namespace {

DecodeFigures read_decode(const JsonFields & run, double least_tok_per_s) {
    const JsonFields decode = run.object("decode");
    DecodeFigures d;
    d.tokens = uint64_t(optional_number(decode, "tokens", 0, 1e12, 0));
    d.tokens_per_second = decode.number("tokens_per_second", least_tok_per_s, kMostTokPerS);
    const JsonFields ms = decode.object("ms_per_token");
    d.ms_mean = ms.number("mean", 1e-6, 1e6);
    d.ms_median = optional_number(ms, "median", 0, 1e6, 0);
    d.ms_p90 = optional_number(ms, "p90", 0, 1e6, 0);
    d.major_faults_per_token = optional_number(decode, "major_faults_per_token", 0, 1e12, 0);
    d.read_bytes_per_token = optional_number(decode, "read_bytes_per_token", 0, kMostBytes, -1);
    return d;
}

json optional_json(const JsonFields & f, const char * key) { return f.has(key) ? f.any(key) : json(); }

MeasuredRun read_run(const JsonFields & run, bool limited) {
    MeasuredRun r;
    r.ram = limited ? run.string("ram") : (run.has("ram") ? run.string("ram") : "resident");
    // Printed by plan and report: a limit as measure reads one, never terminal codes.
    if (limited && (r.ram.empty() || r.ram.find_first_not_of("0123456789.%KMGTkmgtiBb") != std::string::npos)) {
        run.fail("ram", "is not a limit as measure --ram reads one (2G, 768M, 50%)");
    }
    r.limit_bytes = limited ? uint64_t(run.number("limit_bytes", 1, kMostBytes)) : optional_bytes(run, "limit_bytes");
    r.cache_bytes = optional_bytes(run, "cache_bytes");
    r.peak_bytes = optional_bytes(run, "peak_bytes");
    r.decode = read_decode(run, 1e-3);
    if (run.has("detail") && !run.any("detail").is_null()) {
        r.detail = read_decode_detail(run.object("detail"));
    }
    check_speed(run, r.decode, r.detail);
    r.llama_bench = optional_json(run, "llama_bench");
    r.read_ahead_kb = optional_read_ahead(run);
    r.residency = optional_json(run, "residency");
    if (run.has("repeats_tokens_per_second")) {
        r.repeats_tokens_per_second = run.numbers("repeats_tokens_per_second", 0, kMostTokPerS);
    }
    if (run.has("predicted")) {
        const JsonFields p = run.object("predicted");
        StreamPrediction & s = r.prediction;
        r.predicted = true;
        s.tokens_per_second = p.number("tokens_per_second", 0, kMostTokPerS);
        s.page_cache_bytes = optional_bytes(p, "page_cache_bytes");
        s.ms_per_token = optional_number(p, "ms_per_token", 0, 1e12, 0);
        s.read_bytes_per_token = optional_number(p, "read_bytes_per_token", 0, kMostBytes, 0);
        s.expert_read_bytes_per_token = optional_number(p, "expert_read_bytes_per_token", 0, kMostBytes, 0);
        s.other_read_bytes_per_token = optional_number(p, "other_read_bytes_per_token", 0, kMostBytes, 0);
        s.faults_per_token = optional_number(p, "faults_per_token", 0, 1e12, 0);
        s.expert_faults_per_token = optional_number(p, "expert_faults_per_token", 0, 1e12, 0);
        s.outside_model = p.has("outside_model") ? p.string("outside_model") : "";
        r.error = run.number("error", 0, 1e12);
    }
    return r;
}

StreamCalibration read_calibration(const JsonFields & c) {
    StreamCalibration k;
    k.read_ahead_kb = optional_read_ahead(c);
    k.compute_ms = c.number("compute_ms", 0, 1e6);
    k.read_gbps = c.number("read_gbps", 0, 1e4);
    k.fault_ms = optional_number(c, "fault_ms", 0, 1e6, 0);
    k.stream_ms = optional_number(c, "stream_ms", 0, 1e6, 0);
    k.sequential_gbps = optional_number(c, "sequential_gbps", 0, 1e4, 0);
    k.process_bytes = uint64_t(c.number("process_bytes", 0, kMostBytes));
    k.page_bytes = uint64_t(c.number("page_bytes", 1, 1 << 30));
    k.readaround_bytes = uint64_t(c.number("readaround_bytes", 0, kMostBytes));
    if (c.has("fitted_on")) {
        k.fitted_on = c.strings("fitted_on");
    }
    if (c.has("compute_ms_repeats")) {
        k.compute_ms_repeats = c.numbers("compute_ms_repeats", 0, 1e6);
    }
    return k;
}

ProbeFigures read_probe(const JsonFields & probe) {
    ProbeFigures p;
    p.effective_gbps = probe.number("effective_gbps", 0, 1e4);
    p.limit_bytes = optional_bytes(probe, "limit_bytes");
    p.experts = uint64_t(optional_number(probe, "experts", 0, 1e12, 0));
    p.bytes_read = int64_t(optional_number(probe, "bytes_read", 0, kMostBytes, -1));
    p.major_faults = uint64_t(optional_number(probe, "major_faults", 0, 1e15, 0));
    p.threads = int(optional_number(probe, "threads", 0, 1e6, 0));
    if (probe.has("seconds") && probe.has("bytes_needed")) {
        p.seconds = probe.number("seconds", 0, 1e9);
        p.bytes_needed = uint64_t(probe.number("bytes_needed", 0, kMostBytes));
        const double gbps = double(p.bytes_needed) / p.seconds / 1e9;
        if (!(p.seconds > 0) || std::abs(gbps / p.effective_gbps - 1) > 1e-3) {
            probe.fail("effective_gbps", fmt::format("is {}, but {} bytes in {} s make {:.6g} GB/s: the report was edited",
                                                     p.effective_gbps, p.bytes_needed, p.seconds, gbps));
        }
    }
    if (probe.has("read_gbps")) {
        p.read_gbps = probe.number("read_gbps", 0, 1e4);
        p.readahead_amplification = probe.number("readahead_amplification", 0, 1e6);
    }
    p.fault_latency_us = probe.number("fault_latency_us", 0, 1e9);
    p.sequential_gbps = optional_number(probe, "sequential_gbps", 0, 1e4, -1);
    p.fault_ms = optional_number(probe, "fault_ms", 0, 1e6, -1);
    p.simulated_faults = uint64_t(optional_number(probe, "simulated_faults", 0, 1e15, 0));
    p.read_ahead_kb = optional_read_ahead(probe);
    if (probe.has("expert_ms")) {
        const JsonFields ms = probe.object("expert_ms");
        p.expert_ms_median = ms.number("median", 0, 1e9);
        p.expert_ms_p90 = ms.number("p90", 0, 1e9);
    }
    return p;
}

MeasureReport read_report(const json & doc, const std::string & file) {
    const JsonFields r(doc, file);
    if (!doc.is_object() || doc.value("format", json()) != "moeprune-measure") {
        fail_file(file, "is not a moeprune-measure report (\"format\")");
    }
    if (r.integer("version", 0, std::numeric_limits<int64_t>::max()) != 1) {
        r.fail("version", "is not 1, the version of moeprune-measure this moeprune reads");
    }
    MeasureReport m;
    m.model = optional_json(r, "model");
    m.text = optional_json(r, "text");
    m.settings = optional_json(r, "settings");
    m.system = optional_json(r, "system");
    if (r.has("system") && r.object("system").has("storage")) {
        const JsonFields storage = r.object("system").object("storage");
        m.storage_device = storage.has("device") ? storage.string("device") : "";
        if (storage.has("read_ahead_kb")) {
            m.read_ahead_kb = uint64_t(storage.integer("read_ahead_kb", 0, int64_t(1) << 40));
        }
    }
    if (r.has("settings") && r.object("settings").has("threads")) {
        m.threads = int(r.object("settings").integer("threads", 1, 4096));
    }
    m.busy = r.has("busy") ? r.string("busy") : "";
    m.trace = r.has("trace") ? r.string("trace") : "";
    m.resident = read_run(r.object("resident"), false);
    m.routed_expert_bytes = optional_bytes(r, "routed_expert_bytes");
    m.process_bytes = uint64_t(r.number("process_bytes", 0, kMostBytes));
    m.resident_weight_bytes = uint64_t(r.number("resident_weight_bytes", 0, kMostBytes));
    m.resident_need_bytes = uint64_t(r.number("resident_need_bytes", 0, kMostBytes));
    if (m.resident_need_bytes != m.resident_weight_bytes + m.process_bytes) {
        r.fail("resident_need_bytes", fmt::format("is {}, not resident_weight_bytes {} + process_bytes {}: the report "
                                                  "was edited", m.resident_need_bytes, m.resident_weight_bytes,
                                                  m.process_bytes));
    }
    m.probed = r.has("probe");
    if (m.probed) {
        m.probe = read_probe(r.object("probe"));
        m.probes = {m.probe};
    }
    if (r.has("probes")) {
        m.probes.clear();
        for (const JsonFields & p : r.objects("probes")) {
            m.probes.push_back(read_probe(p));
        }
    }
    for (const JsonFields & run : r.objects("runs")) {
        MeasuredRun x = read_run(run, true);
        if (x.limit_bytes < m.resident_need_bytes) {
            run.fail("limit_bytes", fmt::format("is {}, below the {} bytes the report says must stay resident: no run "
                                                "could have decoded under it", x.limit_bytes, m.resident_need_bytes));
        }
        m.runs.push_back(std::move(x));
    }
    if (r.has("median_error")) {
        m.median_error = r.number("median_error", 0, 1e12);
        m.max_error = r.number("max_error", 0, 1e12);
    }
    if (r.has("calibration")) {
        m.calibration = read_calibration(r.object("calibration"));
        m.calibrations = {m.calibration};
    }
    if (r.has("calibrations")) {
        m.calibrations.clear();
        for (const JsonFields & c : r.objects("calibrations")) {
            m.calibrations.push_back(read_calibration(c));
        }
    }
    return m;
}

} // namespace

std::vector<const MeasuredRun *> all_runs(const MeasureReport & r) {
    std::vector<const MeasuredRun *> out{&r.resident};
    for (const MeasuredRun & m : r.runs) {
        out.push_back(&m);
    }
    return out;
}

template <class T> json list_json(const std::vector<T> & items) {
    json out = json::array();
    for (const T & item : items) {
        out.push_back(to_json(item));
    }
    return out;
}

json to_json(const MeasureReport & r) {
    json runs = json::array();
    for (const MeasuredRun & run : r.runs) {
        runs.push_back(to_json(run));
    }
    json most_apart;
    for (const MeasuredRun * m : all_runs(r)) {
        if (!m->llama_bench.is_null() && (most_apart.is_null() || m->llama_bench.at("difference") > most_apart)) {
            most_apart = m->llama_bench.at("difference");
        }
    }
    return {{"format", "moeprune-measure"},
            {"version", 1},
            {"model", r.model},
            {"text", r.text},
            {"settings", r.settings},
            {"system", r.system},
            {"routed_expert_bytes", r.routed_expert_bytes},
            {"resident_weight_bytes", r.resident_weight_bytes},
            {"process_bytes", r.process_bytes},
            {"resident_need_bytes", r.resident_need_bytes},
            {"resident", to_json(r.resident)},
            {"probe", r.probed ? to_json(r.probe) : json()},
            {"probes", r.probed ? json(list_json(r.probes)) : json()},
            {"runs", runs},
            {"calibration", r.median_error < 0 ? json() : to_json(r.calibration)},
            {"calibrations", r.median_error < 0 ? json() : json(list_json(r.calibrations))},
            {"median_error", or_null(r.median_error)},
            {"llama_bench_max_difference", most_apart},
            {"max_error", or_null(r.max_error)},
            {"busy", r.busy.empty() ? json() : json(r.busy)},
            {"trace", r.trace.empty() ? json() : json(r.trace)}};
}

MeasureFile read_measure_report(const std::filesystem::path & path) {
    MeasureFile f;
    f.path = path.string();
    const std::string bytes = read_text_file(path);
    f.digest = content_digest(bytes);
    f.report = with_json_errors(f.path, [&] { return read_report(parse_json(bytes, f.path), f.path); });
    f.model = read_model_identity(JsonFields(f.report.model, f.path, "model"));
    return f;
}

} // namespace moeprune
