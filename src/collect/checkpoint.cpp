// Collect's checkpoints: where --save-every keeps them, the settings a resumed run must
// share, and reading one back for --resume after checking it is this run's.
#include "collect/collect_run.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune {

std::filesystem::path collect_checkpoint_path(const std::filesystem::path & output) {
    std::filesystem::path p = output;
    p += ".checkpoint";
    return p;
}

namespace collect_impl {

json result_settings(const CollectOptions & o) {
    return {{"ctx", o.ctx},           {"parse_special", o.parse_special}, {"generate", o.generate},
            {"seed", o.seed},         {"trace", !o.trace.empty()},         {"trace_top", o.trace_top},
            {"trace_tokens", o.trace_tokens}, {"chunks", o.chunks},        {"coact", o.coact},
            {"mtp", o.mtp},           {"mmproj", o.mmproj.empty() ? json() : json(o.mmproj.string())}};
}

ResumePoint resume_from_checkpoint(const CollectOptions & opt, const Corpus & corpus, const json & settings,
                                   const fs::path & trace_partial, SaliencyStats & stats, CollectResult & res) {
    ResumePoint at;
    const fs::path checkpoint_path = collect_checkpoint_path(opt.output);
    std::error_code ec;
    if (!fs::exists(checkpoint_path, ec)) {
        if (fs::exists(opt.output, ec)) {
            fail_file(opt.output.string(),
                      "is a finished run: nothing to resume (no checkpoint " + checkpoint_path.string() + ")");
        }
        fail_file(checkpoint_path.string(), "no such checkpoint to resume from (written by --save-every)");
    }
    const SaliencyStats saved = read_stats(checkpoint_path);
    const json & prog = saved.settings.value("progress", json());
    const std::string origin = checkpoint_path.string();
    if (!prog.is_object() || prog.value("complete", true)) {
        fail_file(origin, "is not a collect checkpoint (settings.progress with \"complete\": false)");
    }
    if (saved.model != stats.model) {
        // The same model, with or without its MTP head's layers.
        const auto trunk_of = [](json m) {
            const json mtp = m.value("mtp_layers", json::array());
            if (m.contains("moe_layers") && m["moe_layers"].is_array()) {
                json trunk = json::array();
                for (const json & l : m["moe_layers"]) {
                    if (std::find(mtp.begin(), mtp.end(), l) == mtp.end()) {
                        trunk.push_back(l);
                    }
                }
                m["moe_layers"] = trunk;
            }
            m.erase("mtp_layers");
            return m;
        };
        if (trunk_of(saved.model) == trunk_of(stats.model)) {
            const bool had_mtp = saved.model.contains("mtp_layers");
            fail_file(origin, fmt::format("was collected {} the MTP head's layers: resume {} --no-mtp, as it was started",
                                          had_mtp ? "with" : "without", had_mtp ? "without" : "with"));
        }
        fail_file(origin, "was collected on another model: " + saved.model.dump());
    }
    if (saved.settings.value("corpus_digest", "") != corpus.digest) {
        fail_file(origin, "was collected on another corpus (its digest differs from " + opt.corpus.string() + ")");
    }
    if (saved.settings.value("result_settings", json()) != settings) {
        fail_file(origin, "was collected with other settings: " +
                              saved.settings.value("result_settings", json()).dump() + " vs " + settings.dump());
    }
    stats.layers = saved.layers;
    stats.domains = saved.domains;
    stats.n_tokens = saved.n_tokens;
    stats.nonfinite_drops = saved.nonfinite_drops;
    at.first_window = prog.at("windows").get<size_t>();
    res.traced_tokens = prog.value("traced_tokens", uint64_t(0));
    at.prob_drops = prog.at("prob_drops").get<std::vector<uint64_t>>();
    if (!opt.trace.empty()) {
        // Killed between naming the trace and writing the final statistics.
        std::error_code ec;
        if (!fs::exists(trace_partial) && fs::exists(opt.trace)) {
            fs::rename(opt.trace, trace_partial, ec);
            if (ec) {
                fail_file(opt.trace.string(), "cannot take it back to resume: " + ec.message());
            }
        }
        at.trace_from = TraceResumePoint{prog.at("trace_bytes").get<uint64_t>(), res.traced_tokens};
        at.trace_count = prog.at("trace_count").get<std::vector<std::vector<uint64_t>>>();
    }
    return at;
}

} // namespace collect_impl

} // namespace moeprune
