// The options' ranges checked, and the configurations a replay runs: every policy at every
// cache size and lambda, with the combinations that cannot run listed as skipped.
#include "replay/internal.h"
#include "core/errors.h"
#include "sim/moce.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moeprune::replay_impl {

using nlohmann::json;

void check_replay_options(const ReplayOptions & opt, const Setup & s, const TraceSource & reader) {
    const TraceHeader & h = reader.header();
    refuse_inert_moce(s.j, s.k, opt.lambdas);
    if (opt.warmup >= reader.n_tokens()) {
        fail_file(s.origin, fmt::format("has {} tokens, not more than the warm-up of {}: nothing would be counted",
                                        reader.n_tokens(), opt.warmup));
    }
    if (opt.moce != "prior" && opt.moce != "topk-gap") {
        throw Error(fmt::format("--moce must be prior or topk-gap, got \"{}\"", opt.moce));
    }
    if (opt.prefill_union < 0) {
        throw Error(fmt::format("--prefill-union must be >= 0, got {}", opt.prefill_union));
    }
    if (opt.throughput.queue_depth < 1 || !(opt.throughput.ssd_gbps > 0) || !std::isfinite(opt.throughput.ssd_gbps)) {
        throw Error("--queue-depth must be >= 1 and the SSD bandwidth positive and finite");
    }
    for (const auto & [flag, v] : {std::pair{"--read-latency-us", opt.throughput.read_latency_us},
                                   std::pair{"--compute-ms", opt.throughput.compute_ms},
                                   std::pair{"--sync-us", opt.throughput.sync_us}}) {
        if (!(v >= 0) || !std::isfinite(v)) {
            throw Error(fmt::format("{} must be a finite number >= 0, got {}", flag, v));
        }
    }
    // Below a kilobyte an "expert" is a typo, and budgets would hold more slots than an int.
    if (opt.expert_mb != 0 && (!(opt.expert_mb >= 1e-3) || !std::isfinite(opt.expert_mb))) {
        throw Error(fmt::format("--expert-mb must be a finite size of at least 0.001 (1 kB), got {}", opt.expert_mb));
    }
    if (opt.threads < 0 || opt.prefetch_n < 0) {
        throw Error("-t and --prefetch-n must be >= 0");
    }
    // Next-layer prefetch counts every pair of experts of adjacent layers in each worker.
    if (opt.prefetch && h.n_expert > kMaxPrefetchExperts) {
        fail_file(s.origin, fmt::format("has {} experts per layer; --prefetch counts expert pairs and supports up to {}",
                                        h.n_expert, kMaxPrefetchExperts));
    }
}

// The warm-up must leave tokens to count, caches must hold a token's k experts, and
// counts must not exceed what there is to cache.
std::vector<Config> make_configs(const ReplayOptions & opt, const Setup & s, json & skipped, bool & mixed_sizes,
                                 double & min_bytes, double & max_bytes) {
    std::vector<Config> out;
    const uint32_t L = s.n_layer;
    mixed_sizes = false;
    min_bytes = max_bytes = 0;
    if (!s.expert_bytes.empty()) {
        min_bytes = *std::min_element(s.expert_bytes.begin(), s.expert_bytes.end());
        max_bytes = *std::max_element(s.expert_bytes.begin(), s.expert_bytes.end());
        mixed_sizes = min_bytes != max_bytes;
    }
    const int max_slots = opt.global ? s.n_expert * int(L) : s.n_expert;
    std::vector<Config> sizes;
    for (int c : opt.caches) {
        if (c < s.k) {
            throw Error(fmt::format("cache of {} experts is smaller than k = {}: every token needs k resident at once",
                                    c, s.k));
        }
        if (c > max_slots) {
            throw Error(fmt::format("cache of {} experts is larger than the {} experts {}", c, max_slots,
                                    opt.global ? "of all layers together" : "per layer"));
        }
        sizes.push_back({"", c, std::nullopt, std::vector<int>(opt.global ? 1 : L, c), 0});
    }
    for (double mib : opt.cache_mib) {
        if (s.expert_bytes.empty()) {
            throw Error("--cache-mib needs the bytes of an expert: give --model or --expert-mb");
        }
        if (!(mib > 0) || !std::isfinite(mib)) {
            throw Error(fmt::format("--cache-mib must be positive and finite, got {}", mib));
        }
        const double budget = mib * 1048576.0;
        Config c{"", std::nullopt, mib, {}, 0};
        if (opt.global) {
            const double mean = std::accumulate(s.expert_bytes.begin(), s.expert_bytes.end(), 0.0) / double(L);
            c.slots = {int(std::min(double(max_slots), std::floor(budget / mean)))};
        } else {
            for (uint32_t l = 0; l < L; ++l) {
                c.slots.push_back(int(std::min(double(max_slots), std::floor(budget / s.expert_bytes[l]))));
            }
        }
        for (size_t l = 0; l < c.slots.size(); ++l) {
            if (c.slots[l] < s.k) {
                throw Error(fmt::format("a budget of {} MiB holds {} experts{}, fewer than k = {}", mib, c.slots[l],
                                        opt.global ? "" : fmt::format(" of layer {}", l), s.k));
            }
        }
        sizes.push_back(c);
    }
    for (const std::string & policy : opt.policies) {
        for (double lambda : opt.lambdas) {
            if (!(lambda >= 0.0) || !std::isfinite(lambda)) {
                throw Error(fmt::format("--lambda must be finite and >= 0, got {}", lambda));
            }
            if (lambda > 0 && policy_reads_future(policy)) {
                skipped.push_back({{"policy", policy}, {"lambda", lambda},
                                   {"why", "offline optimum needs routing that does not depend on the cache"}});
                continue;
            }
            for (Config c : sizes) {
                c.policy = policy;
                c.lambda = lambda;
                out.push_back(c);
            }
        }
    }
    return out;
}

} // namespace moeprune::replay_impl
