#include "plan/geometry.h"

#include "core/digest.h"
#include "core/errors.h"
#include "model/inspect.h"
#include "model/model_file.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

namespace moeprune {

namespace {

// ggml_repack_get_optimal_repack_type at the pin: q4_0, q4_K, iq4_nl and mxfp4 with AVX2,
// q2_K with AVX-512, and q5_K, q6_K, q8_0 on ARM with dot products.
std::vector<std::string> repacked_expert_types(const GgufModel & model) {
    static const std::set<ggml_type> repacked{GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_IQ4_NL, GGML_TYPE_MXFP4,
                                              GGML_TYPE_Q2_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0};
    std::set<std::string> found;
    for (const TensorEntry & t : model.tensors()) {
        if (t.cls.role == TensorRole::Expert && repacked.count(t.type)) {
            found.insert(ggml_type_name(t.type));
        }
    }
    return {found.begin(), found.end()};
}

} // namespace

Geometry geometry(const PlanOptions & opt) {
    Geometry g;
    const bool by_hand = opt.expert_mb > 0 || opt.layers > 0 || opt.experts > 0;
    if (!opt.model.empty() && by_hand) {
        throw Error("give --model or --expert-mb/--layers/--experts, not both");
    }
    if (!opt.model.empty()) {
        const GgufModel model = GgufModel::open(opt.model);
        g.digest = model_digest(model.shard_paths());
        const InspectReport r = inspect_model(model, {});
        if (!r.problems.empty()) {
            fail_file(opt.model.string(), "inspect finds problems: " + r.problems.front());
        }
        g.bytes = r.routed_layer_expert_bytes();
        for (const LayerInfo & l : r.layers) {
            if (l.nextn) {
                g.mtp_bytes.push_back(double(l.expert_bytes));
            }
        }
        if (g.bytes.empty()) {
            fail_file(opt.model.string(), "has no routed experts to plan for");
        }
        g.repacked_expert_types = repacked_expert_types(model);
        g.n_expert = r.n_expert;
        g.used = r.n_expert_used;
        g.other = double(r.other_bytes);
        g.other_known = true;
        g.source = opt.model.string();
        if (opt.other_gb) {
            throw Error("--other-gb is read from the model when --model is given");
        }
        return g;
    }
    if (!(opt.expert_mb > 0) || !std::isfinite(opt.expert_mb) || opt.layers < 1 || opt.experts < 1 || opt.used < 1 ||
        opt.used > opt.experts) {
        throw Error("without --model, give --expert-mb (> 0), --layers, --experts and --used (1..experts)");
    }
    // As many as a router trace can hold: a geometry past them is a typing error, and
    // would be allocated per layer.
    if (opt.layers > 100000 || opt.experts > 65536 || opt.expert_mb > 1e9) {
        throw Error(fmt::format("--layers {} --experts {} --expert-mb {}: at most 100000 layers of 65536 experts of 10^9 MB",
                                opt.layers, opt.experts, opt.expert_mb));
    }
    g.bytes.assign(size_t(opt.layers), opt.expert_mb * 1e6);
    g.n_expert = opt.experts;
    g.used = opt.used;
    g.other_known = opt.other_gb.has_value();
    g.other = opt.other_gb.value_or(0) * 1e9;
    g.source = fmt::format("--expert-mb {} --layers {} --experts {} --used {}", opt.expert_mb, opt.layers, opt.experts, opt.used);
    return g;
}

void check_plan_options(const PlanOptions & opt) {
    if (!std::isfinite(opt.ram_bytes) || opt.ram_bytes < 0 || opt.ram_bytes >= 0x1p64) {
        throw Error(fmt::format("--ram {} bytes is not a RAM size (0 < size < 2^64 bytes)", opt.ram_bytes));
    }
    if (!std::isfinite(opt.reserve_bytes) || opt.reserve_bytes < 0 || opt.reserve_bytes >= 0x1p64) {
        throw Error(fmt::format("--reserve {} bytes is not a size (0 <= size < 2^64 bytes)", opt.reserve_bytes));
    }
    if (!(opt.speed_share > 0 && opt.speed_share <= 1)) {
        throw Error(fmt::format("--speed-share {} must be a share in (0, 1]", opt.speed_share));
    }
    if (opt.mtp_acceptance && !(*opt.mtp_acceptance >= 0 && *opt.mtp_acceptance <= 1)) {
        throw Error(fmt::format("--mtp-acceptance {} must be a share of drafts in [0, 1]", *opt.mtp_acceptance));
    }
    if (opt.min_accuracy && !(*opt.min_accuracy >= 0 && *opt.min_accuracy <= 1)) {
        throw Error(fmt::format("--min-accuracy {} must be a share of the base's accuracy in [0, 1]", *opt.min_accuracy));
    }
    if (opt.max_kld && !(std::isfinite(*opt.max_kld) && *opt.max_kld >= 0)) {
        throw Error(fmt::format("--max-kld {} must be a finite KLD >= 0", *opt.max_kld));
    }
    for (const double m : opt.misses_per_token) {
        if (!(std::isfinite(m) && m >= 0)) {
            throw Error(fmt::format("--misses-per-token {} must be a finite count >= 0", m));
        }
    }
    const ThroughputParams & t = opt.throughput;
    if (!(std::isfinite(t.ssd_gbps) && t.ssd_gbps > 0) || !(std::isfinite(t.read_latency_us) && t.read_latency_us >= 0) ||
        !(std::isfinite(t.compute_ms) && t.compute_ms >= 0) || !(std::isfinite(t.sync_us) && t.sync_us >= 0) ||
        t.queue_depth < 1) {
        throw Error("--ssd must be > 0, --read-latency-us, --compute-ms and --sync-us finite and >= 0, --queue-depth >= 1");
    }
}

} // namespace moeprune
