#pragma once
// The stages of `moeprune run` in the order run_pipeline runs them, and what they share:
// where each writes (RunPaths) and the keep maps every later stage derives from
// (RunMaps). Each stage skips itself through the Runner when nothing it reads changed.
#include "core/defaults.h"
#include "corpus/manifest.h"
#include "model/inspect.h"
#include "plan/plan.h"
#include "run/run.h"
#include "run/runner.h"
#include "sim/throughput.h"

#include <filesystem>
#include <string>
#include <vector>

namespace moeprune::run_impl {

// Where every stage writes, so later stages name their inputs before earlier ones run.
struct RunPaths {
    explicit RunPaths(const fs::path & dir) : dir(dir) {}
    fs::path dir;
    fs::path calib = dir / "corpus" / "calib.jsonl", eval_text = dir / "corpus" / "eval.jsonl",
             corpus_report = dir / "corpus" / "corpus.json";
    fs::path tasks = dir / "corpus" / "tasks.txt", task_set = dir / "corpus" / "tasks.json";
    fs::path stats = dir / "collect" / "stats.json", heldout = dir / "heldout" / "stats.json",
             trace = dir / "heldout" / "router.trace";
    fs::path maps_dir = dir / "select" / "maps", select_json = dir / "select" / "select.json";
    fs::path eval_json = dir / "eval" / "eval.json";
    fs::path plan_json = dir / "plan" / "plan.json";
    fs::path measure_json = dir / "measure" / "measure.json", verify_json = dir / "verify" / "verify.json";
    fs::path replay_of(const fs::path & map) const {
        return dir / "replay" / (map.empty() ? "none.json" : map.filename().string());
    }
    fs::path closed_eval_of(const fs::path & map) const {
        return dir / "eval" / ("closed-" + (map.empty() ? std::string("none.json") : map.filename().string()));
    }
};

// The keep maps of the run and what every later stage derives from them.
struct RunMaps {
    std::vector<fs::path> maps;       // select's, by name
    std::vector<fs::path> all;        // the unpruned model (empty path) first, then maps
    std::vector<fs::path> closed_evals;
    std::vector<fs::path> replays;
    std::vector<double> rerouting;    // lambdas > 0
    std::vector<std::string> online;  // policies a runtime can follow
};

// --reserve as given, or its default.
inline std::string reserve_of(const RunConfig & c) { return c.reserve.empty() ? kDefaultReserve : c.reserve; }

// data_stages.cpp: the corpus, the statistics on both sides, the keep maps.
// The corpus spec, from a manifest or from sources, with run.toml's overrides; and every
// file it reads.
CorpusSpec corpus_spec(const RunConfig & c, std::vector<fs::path> & inputs);

void corpus_stage(Runner & run, const RunConfig & c, const RunPaths & at);

// Statistics on calib; statistics and the router trace on the held-out side.
void collect_stage(Runner & run, const RunOptions & opt, const InspectReport & model, const std::string & name,
                   const fs::path & text, const fs::path & out, const fs::path & trace);

// Keep maps of every criterion and K.
void select_stage(Runner & run, const RunConfig & c, const RunPaths & at);

RunMaps run_maps(const RunConfig & c, const RunPaths & at);

// quality_stages.cpp: what each map costs in quality, and its caches on the held-out trace.
ThroughputParams throughput_of(const RunConfig & c);

// Quality of every map, masked in the original model, on the held-out text. Cache-aware
// routing (λ > 0) changes the output too: its KLD is measured in the closed loop, per
// map with the caches replay uses, for every online policy.
void eval_stage(Runner & run, const RunOptions & opt, const InspectReport & model, const RunPaths & at,
                const RunMaps & m);

// Caches for every map (and the unpruned model) on the held-out trace.
void replay_stage(Runner & run, const RunConfig & c, const InspectReport & model, const RunPaths & at,
                  const RunMaps & m, const ThroughputParams & throughput);

// plan_stages.cpp: llama.cpp measured, and the plan with its shortlist.
// A moeprune-measure run of `model` on the held-out text: JSON and text in `json_out`'s folder.
std::vector<fs::path> measure_to(const RunOptions & opt, const fs::path & model, const fs::path & text,
                                 const std::vector<std::string> & ram, const fs::path & json_out,
                                 const std::vector<uint64_t> & read_ahead_kb = {});

// The read-ahead to measure option `o` at: the one it was priced at, where that is not the
// device's own (measure then sets it, and puts the device's back); empty otherwise.
std::vector<uint64_t> read_ahead_of(const PlanOption & o);

// llama.cpp's own decode under every --measure limit: what the plan's timing comes from.
void measure_stage(Runner & run, const RunOptions & opt, const RunPaths & at);

void plan_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const RunMaps & m);

// answer_stages.cpp: the report, the sliced models and the recommendation measured.
void report_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m);

// The maps to slice: every one, or the recommended option's; returns what the summary
// adds.
std::string slice_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m, const PlanFile & plan);

// The recommendation as llama.cpp runs it: its sliced model (the model itself when it keeps
// every expert) measured at --ram, next to the tokens/s the plan predicted for it.
std::string verify_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const PlanFile & plan);

} // namespace moeprune::run_impl
