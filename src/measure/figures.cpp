// The figures of a measure report, from what its child processes recorded.
#include "measure/figures.h"
#include "measure/measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <numeric>

using json = nlohmann::json;

namespace moeprune {

double quantile(std::vector<double> v, double q) {
    if (v.empty()) {
        return 0;
    }
    // Linear between the order statistics: the median of an even count is the mean of the middle two.
    std::sort(v.begin(), v.end());
    const double at = q * double(v.size() - 1);
    const size_t lo = size_t(at);
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (at - double(lo)) * (v[hi] - v[lo]);
}

DecodeFigures decode_figures(const DecodeDetail & detail) {
    const std::vector<double> & wall = detail.wall_us;
    const std::vector<int64_t> & faults = detail.major_faults, & reads = detail.read_bytes;
    DecodeFigures f;
    f.tokens = wall.size();
    const double total_us = std::accumulate(wall.begin(), wall.end(), 0.0);
    const double n = double(std::max<size_t>(1, wall.size()));
    f.tokens_per_second = total_us > 0 ? double(wall.size()) * 1e6 / total_us : 0;
    f.ms_mean = total_us / n / 1e3;
    f.ms_median = quantile(wall, 0.5) / 1e3;
    f.ms_p90 = quantile(wall, 0.9) / 1e3;
    f.major_faults_per_token = std::accumulate(faults.begin(), faults.end(), 0.0) / n;
    if (detail.read_bytes_counted) {
        f.read_bytes_per_token = std::accumulate(reads.begin(), reads.end(), 0.0) / n;
    }
    return f;
}

ProbeFigures probe_figures(const ProbeResult & r, uint64_t limit) {
    ProbeFigures p;
    p.limit_bytes = limit;
    p.experts = r.experts;
    p.bytes_needed = r.bytes_needed;
    p.bytes_read = r.bytes_read.value_or(-1);
    p.major_faults = r.major_faults;
    p.threads = r.threads;
    p.seconds = r.seconds;
    const std::vector<double> & expert_ms = r.expert_ms;
    p.effective_gbps = p.seconds > 0 ? double(p.bytes_needed) / p.seconds / 1e9 : 0;
    if (p.bytes_read >= 0) {
        p.read_gbps = p.seconds > 0 ? double(p.bytes_read) / p.seconds / 1e9 : 0;
        p.readahead_amplification = p.bytes_needed ? double(p.bytes_read) / double(p.bytes_needed) : 0;
    }
    const double reader_ms = std::accumulate(expert_ms.begin(), expert_ms.end(), 0.0);
    p.fault_latency_us = p.major_faults ? reader_ms * 1e3 / double(p.major_faults) : 0;
    if (r.sequential && r.sequential->seconds > 0) {
        p.sequential_gbps = double(r.sequential->bytes) / r.sequential->seconds / 1e9;
        p.simulated_faults = r.simulated_faults;
        if (p.bytes_read >= 0 && p.simulated_faults > 0) {
            const double transfer_s = double(p.bytes_read) / (p.sequential_gbps * 1e9);
            p.fault_ms = std::max(0.0, p.seconds - transfer_s) * 1e3 / double(p.simulated_faults);
        }
    }
    p.expert_ms_median = quantile(expert_ms, 0.5);
    p.expert_ms_p90 = quantile(expert_ms, 0.9);
    return p;
}

// How far the simulated page cache holds the experts the kernel held, sample by sample
// (mincore() in the run, the simulation after the same tokens): the share of experts on
// which both agree, and the Jaccard index of the two resident sets (1 when both are empty).
json residency_agreement(const std::vector<ResidencySample> & measured, const std::vector<std::vector<uint32_t>> & predicted,
                         size_t n_experts) {
    if (measured.empty() || measured.size() != predicted.size() || n_experts == 0) {
        return nullptr;
    }
    double agree = 0, jaccard = 0, measured_mean = 0, predicted_mean = 0;
    for (size_t i = 0; i < predicted.size(); ++i) {
        std::vector<uint32_t> m = measured[i].resident;
        const std::vector<uint32_t> & p = predicted[i];
        std::sort(m.begin(), m.end());
        std::vector<uint32_t> both;
        std::set_intersection(m.begin(), m.end(), p.begin(), p.end(), std::back_inserter(both));
        const double either = double(m.size() + p.size() - both.size());
        agree += 1.0 - (either - double(both.size())) / double(n_experts);
        jaccard += either > 0 ? double(both.size()) / either : 1.0;
        measured_mean += double(m.size());
        predicted_mean += double(p.size());
    }
    const double n = double(predicted.size());
    return {{"samples", predicted.size()},
            {"experts", n_experts},
            {"agreement", agree / n},
            {"jaccard", jaccard / n},
            {"measured_resident_mean", measured_mean / n},
            {"predicted_resident_mean", predicted_mean / n}};
}

std::string machine_was_busy(const MeasureReport & r) {
    // A limited run reads from storage what the resident one holds in memory: its median
    // token cannot be much faster. Medians, so that a few preempted tokens are not a busy
    // machine, and a factor of 5, so that tests sharing two cores are not either.
    const double resident_ms = r.resident.decode.ms_median;
    for (const MeasuredRun & m : r.runs) {
        if (resident_ms > 5 * m.decode.ms_median) {
            return fmt::format("the resident run took {:.2f} ms per token (median), more than 5 times the {:.2f} ms of "
                               "the run under --ram {}, which reads what it holds from storage; another job was using "
                               "the CPUs", resident_ms, m.decode.ms_median, m.ram);
        }
    }
    if (!r.resident.llama_bench.is_null()) {
        const double peer = r.resident.llama_bench.value("tokens_per_second", 0.0);
        const double own = r.resident.decode.tokens_per_second;
        if (peer > 0 && own > 0 && std::max(peer, own) > 5 * std::min(peer, own)) {
            return fmt::format("the resident run's {:.2f} tokens/s are more than 5 times away from llama-bench's {:.2f} "
                               "under the same conditions", own, peer);
        }
    }
    return "";
}

} // namespace moeprune
