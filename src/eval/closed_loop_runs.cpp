// An eval run's closed-loop candidates: one pass per configuration (and keep map), and
// their cache figures beside the open-loop replay of the base pass's trace.
#include "eval/eval_run.h"
#include "core/errors.h"
#include "replay/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace moeprune::eval_impl {

// Closed loop: an observer records the base pass's routing as a trace (for the open-loop
// replay of the same tokens), and every configuration routes one pass of its own.
void EvalRun::plan_closed_loop() {
    trace_top = std::min(opt.trace_top, int(info.n_expert));
    expert_bytes = info.routed_layer_expert_bytes();
    if (closed_loop) {
        observer.emplace(facts, trace_top, nullptr, nullptr, nullptr, expert_bytes);
        observer_slot.tap = &*observer;
        for (int m = opt.closed_loop_full_model || maps.empty() ? -1 : 0; m < int(maps.size()); ++m) {
            for (const std::string & policy : opt.cache_policies) {
                for (int cache : opt.caches) {
                    for (double lambda : opt.lambdas) {
                        ClosedLoopRun run;
                        run.config = {policy, cache, lambda, *opt.j, opt.moce == "prior", opt.policy_params,
                                      opt.throughput.queue_depth};
                        run.map = m;
                        runs.push_back(std::move(run));
                    }
                }
            }
        }
        for (ClosedLoopRun & run : runs) {
            const KeepMap * km = run.map >= 0 ? &maps[size_t(run.map)].second : nullptr;
            run.tap = std::make_unique<RouterTap>(facts, trace_top, &run.config, km, km ? &*mask : nullptr,
                                                  expert_bytes);
            run.tap->record = opt.record_routing;
        }
        closed.ctx = make_context(base.model.get(), opt, threads, &TapSlot::callback, &closed_slot);
    }
}

// The closed-loop candidates' cache figures, beside the open-loop replay of the base
// pass's trace under the same configurations (on the full model or the same keep map).
void closed_loop_figures(const EvalOptions & opt, const TraceInMemory & base_trace,
                         const std::vector<std::pair<fs::path, KeepMap>> & maps, std::vector<ClosedLoopRun> & runs,
                         int n_layer, int threads, EvalReport & rep, size_t first_closed) {
    std::map<int, ReplayReport> open_loop;
    for (const ClosedLoopRun & run : runs) {
        if (open_loop.count(run.map)) {
            continue;
        }
        ReplayOptions ro;
        ro.trace_source = &base_trace;
        // The map as eval read and checked it once: no second read of the file.
        if (run.map >= 0) {
            ro.keep = maps[size_t(run.map)].first;
            ro.keep_map = maps[size_t(run.map)].second;
        }
        ro.policies = opt.cache_policies;
        ro.caches = opt.caches;
        ro.lambdas = opt.lambdas;
        ro.j = opt.j;
        ro.moce = opt.moce;
        ro.model = opt.model;
        ro.threads = threads;
        ro.params = opt.policy_params;
        ro.throughput = opt.throughput;
        open_loop.emplace(run.map, run_replay(ro));
    }
    for (size_t r = 0; r < runs.size(); ++r) {
        ClosedLoopRun & run = runs[r];
        EvalCandidate & c = rep.candidates[first_closed + r];
        const PhaseCounts & k = run.tap->counts();
        ClosedLoopStats st;
        const double tokens = double(std::max<uint64_t>(1, k.tokens));
        st.misses_per_token = double(k.misses) / tokens;
        st.hit_rate = k.picks ? 1.0 - double(k.misses) / double(k.picks) : 0.0;
        st.swap_rate = k.picks ? double(k.swaps) / double(k.picks) : 0.0;
        st.moved_gate_mass = k.moved_mass / (tokens * n_layer);
        st.tok_per_s = tokens_per_second(k, n_layer, opt.throughput);
        const ReplayReport & ol = open_loop.at(run.map);
        const auto rec = std::find_if(ol.records.begin(), ol.records.end(), [&](const ReplayRecord & x) {
            return x.policy == run.config.policy && x.cache == run.config.cache && x.lambda == run.config.lambda;
        });
        if (rec == ol.records.end()) {
            throw Error(fmt::format("the open-loop replay has no record for {} (an internal error)", c.name));
        }
        const PhaseCounts o = rec->total();
        st.open_loop_misses_per_token = o.tokens ? double(o.misses + o.forced_misses) / double(o.tokens) : 0.0;
        st.open_loop_tok_per_s = tokens_per_second(o, ol.n_layer, opt.throughput);
        c.closed = st;
        c.routing = std::move(run.tap->log);
    }
}

} // namespace moeprune::eval_impl
