// The quality and cache stages: eval of every keep map (and the closed loop where a cache
// reroutes), and replay of the held-out trace through every cache policy.
#include "run/stages.h"

#include "core/atomic_file.h"
#include "eval/eval.h"
#include "formats/corpus_report.h"
#include "formats/keep_map.h"
#include "formats/task_set.h"
#include "replay/replay.h"
#include "sim/moce.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace moeprune::run_impl {

namespace {

// Per-layer cache sizes of a map (the unpruned model for an empty path): shares of K.
std::vector<int> map_caches(const RunConfig & c, const InspectReport & model, const fs::path & m) {
    const int64_t k = m.empty() ? model.n_expert : read_keep_map(m).k;
    std::set<int> caches;
    for (const double s : c.cache_shares) {
        caches.insert(int(std::max<int64_t>(model.n_expert_used, std::llround(s * double(k)))));
    }
    return std::vector<int>(caches.begin(), caches.end());
}

} // namespace

ThroughputParams throughput_of(const RunConfig & c) {
    ThroughputParams tp;
    tp.ssd_gbps = c.ssd;
    tp.read_latency_us = c.read_latency_us;
    tp.queue_depth = c.queue_depth;
    tp.compute_ms = c.compute_ms;
    tp.sync_us = c.sync_us;
    return tp;
}

void eval_stage(Runner & run, const RunOptions & opt, const InspectReport & model, const RunPaths & at,
                const RunMaps & m) {
    const RunConfig & c = opt.config;
    std::vector<fs::path> eval_inputs{c.model, at.eval_text};
    if (!c.mmproj.empty()) {
        eval_inputs.push_back(c.mmproj);
    }
    eval_inputs.insert(eval_inputs.end(), m.maps.begin(), m.maps.end());
    json eval_settings = {{"ctx", c.ctx}};
    for (const auto & [format, file] : {std::pair{"hellaswag", c.hellaswag}, {"winogrande", c.winogrande},
                                        {"multiple_choice", c.multiple_choice}}) {
        if (!file.empty()) {
            eval_inputs.push_back(file);
            eval_settings["tasks"] = {{"format", format}, {"tasks", c.tasks}};
        }
    }
    // Without a task file, the choice tasks corpus made from the held-out text, all of them.
    const bool own_tasks = c.hellaswag.empty() && c.winogrande.empty() && c.multiple_choice.empty() &&
                           read_corpus_report(at.corpus_report).outputs.tasks.tasks > 0;
    if (own_tasks) {
        eval_inputs.push_back(at.tasks);
        eval_inputs.push_back(at.task_set);
        eval_settings["tasks"] = {{"format", "hellaswag"}, {"generated", true}, {"tasks", c.tasks}};
    }
    if (!m.closed_evals.empty()) {
        eval_settings["closed_loop"] = {{"policies", m.online}, {"cache_shares", c.cache_shares}, {"lambdas", m.rerouting},
                                        {"moce_j", moce_j({}, int(model.n_expert_used))}};
    }
    run.stage("eval", eval_settings, eval_inputs, [&] {
        EvalOptions o;
        o.model = c.model;
        o.mmproj = c.mmproj;
        o.corpus = at.eval_text;
        o.keeps = m.maps;
        o.ctx = c.ctx;
        o.threads = c.threads;
        o.json_out = at.eval_json;
        o.progress = opt.progress;
        o.hellaswag = c.hellaswag;
        o.winogrande = c.winogrande;
        o.multiple_choice = c.multiple_choice;
        o.tasks = c.tasks;
        if (own_tasks) {
            o.hellaswag = at.tasks;
            o.task_domains = at.task_set;
            o.tasks = c.tasks > 0 ? c.tasks : int64_t(read_task_set(at.task_set).task_domains.size());
        }
        run_eval(o);
        std::vector<fs::path> written{at.eval_json};
        for (size_t i = 0; i < m.closed_evals.size(); ++i) {
            EvalOptions k = o;
            k.keeps = m.all[i].empty() ? std::vector<fs::path>{} : std::vector<fs::path>{m.all[i]};
            k.closed_loop_full_model = m.all[i].empty();
            k.cache_policies = m.online;
            k.caches = map_caches(c, model, m.all[i]);
            k.lambdas = m.rerouting;
            k.text_only = true;  // the closed loop routes text only; documents with media are scored above
            k.json_out = m.closed_evals[i];
            k.hellaswag.clear();   // the masked maps answered above
            k.task_domains.clear();
            k.winogrande.clear();
            k.multiple_choice.clear();
            run_eval(k);
            written.push_back(m.closed_evals[i]);
        }
        return written;
    });
}

void replay_stage(Runner & run, const RunConfig & c, const InspectReport & model, const RunPaths & at,
                  const RunMaps & m, const ThroughputParams & throughput) {
    std::vector<fs::path> replay_inputs{c.model, at.trace};
    replay_inputs.insert(replay_inputs.end(), m.maps.begin(), m.maps.end());
    // MoCE's J is replay's default; a stage replayed before it was k - 1 for k <= 2 is stale.
    run.stage("replay", {{"policies", c.policies}, {"cache_shares", c.cache_shares}, {"lambdas", c.lambdas},
                         {"moce_j", moce_j({}, int(model.n_expert_used))}, {"throughput", to_json(throughput)}},
              replay_inputs, [&] {
                  std::error_code ec;
                  for (const fs::path & old : json_files(at.dir / "replay")) {
                      fs::remove(old, ec);
                  }
                  std::vector<fs::path> written;
                  for (const fs::path & map : m.all) {
                      ReplayOptions o;
                      o.trace = at.trace;
                      o.keep = map;
                      o.policies = c.policies;
                      o.caches = map_caches(c, model, map);
                      o.model = c.model;
                      o.lambdas = c.lambdas;
                      o.threads = c.threads;
                      o.throughput = throughput;
                      const fs::path out = at.replay_of(map);
                      const ReplayReport r = run_replay(o, {out});
                      write_file_atomic(out, to_json(r).dump(1) + "\n");
                      written.push_back(out);
                  }
                  return written;
              });
}

} // namespace moeprune::run_impl
