#include "run/run.h"
#include "collect/collect.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/sizes.h"
#include "core/threads.h"
#include "corpus/build.h"
#include "corpus/sources.h"
#include "eval/eval.h"
#include "formats/corpus_report.h"
#include "formats/keep_map.h"
#include "formats/stage_reports.h"
#include "formats/stats.h"
#include "formats/task_set.h"
#include "formats/verify_summary.h"
#include "measure/measure.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "plan/plan.h"
#include "sim/moce.h"
#include "sim/policy.h"
#include "replay/replay.h"
#include "report/report.h"
#include "run/shortlist.h"
#include "select/select.h"
#include "slice/slice.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <set>

#include <sys/stat.h>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

class Runner {
public:
    Runner(fs::path dir, std::string from, size_t n_stages) : dir_(std::move(dir)), from_(std::move(from)), n_(n_stages) {}

    // Runs `work` unless the stage's manifest shows the same inputs and settings; `work`
    // returns the files it wrote.
    void stage(const std::string & name, const json & settings, const std::vector<fs::path> & inputs,
               const std::function<std::vector<fs::path>()> & work) {
        ++index_;
        forcing_ = forcing_ || from_ == name;
        const fs::path sdir = dir_ / name, manifest = sdir / "stage.json";
        json in = json::object();
        for (const fs::path & p : inputs) {
            in[fs::absolute(p).lexically_normal().string()] = digest(p);
        }
        std::error_code ec;
        if (!forcing_ && fs::exists(manifest, ec)) {
            const json m = parse_json(read_text_file(manifest), manifest.string());
            if (m.value("settings", json()) == settings && m.value("inputs", json()) == in) {
                const JsonFields manifest_fields(m, manifest.string());
                const JsonFields outputs = manifest_fields.object("outputs");
                for (const auto & [rel, d] : m.at("outputs").items()) {
                    const fs::path p = dir_ / rel;
                    if (!fs::exists(p, ec)) {
                        fail_file(p.string(), fmt::format("is gone, but stage {} wrote it: run again with --from {} to redo it",
                                                          name, name));
                    }
                    if (digest(p) != outputs.string(rel)) {
                        fail_file(p.string(), fmt::format("changed since stage {} wrote it (edited by hand?): run again with "
                                                          "--from {} to redo it, or restore it", name, name));
                    }
                }
                std::printf("[%zu/%zu] %-8s unchanged, skipped\n", index_, n_, name.c_str());
                std::fflush(stdout);
                return;
            }
        }
        // What the stage wrote before goes first: a run killed in it must leave no earlier
        // output under its final name for a later command to take as this run's.
        if (fs::exists(manifest, ec)) {
            try {
                const json old = parse_json(read_text_file(manifest), manifest.string());
                if (old.contains("outputs") && old.at("outputs").is_object()) {
                    for (const auto & [rel, digest] : old.at("outputs").items()) {
                        const fs::path p = fs::path(rel).lexically_normal();
                        if (!p.is_absolute() && !p.empty() && *p.begin() != "..") {  // a hand-edited manifest stays in the run
                            fs::remove(dir_ / p, ec);
                        }
                    }
                }
            } catch (const std::exception &) {
                // A damaged manifest is replaced below; the stage rewrites its outputs.
            }
        }
        fs::remove(manifest, ec);
        create_output_dir(sdir);
        std::printf("[%zu/%zu] %-8s running\n", index_, n_, name.c_str());
        std::fflush(stdout);
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<fs::path> outputs = work();
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        json out = json::object();
        for (const fs::path & p : outputs) {
            digests_.erase(fs::absolute(p).lexically_normal().string());
            out[fs::relative(p, dir_).string()] = digest(p);
        }
        write_file_atomic(manifest, json({{"stage", name}, {"settings", settings}, {"inputs", in}, {"outputs", out},
                                          {"seconds", seconds}})
                                        .dump(1) +
                                        "\n");
        std::printf("[%zu/%zu] %-8s done in %.1f s\n", index_, n_, name.c_str(), seconds);
        std::fflush(stdout);
    }

private:
    std::string digest(const fs::path & p) {
        const std::string key = fs::absolute(p).lexically_normal().string();
        if (auto it = digests_.find(key); it != digests_.end()) {
            return it->second;
        }
        return digests_[key] = identity_digest(p);
    }

    fs::path dir_;
    std::string from_;
    size_t n_, index_ = 0;
    bool forcing_ = false;
    std::map<std::string, std::string> digests_;
};

std::vector<fs::path> json_files(const fs::path & dir) {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto & e : fs::directory_iterator(dir, ec)) {
        if (e.path().extension() == ".json") {
            out.push_back(e.path());
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

} // namespace

const std::vector<std::string> & run_stages() {
    static const std::vector<std::string> s = {"corpus", "collect", "heldout", "measure", "select", "eval",
                                               "replay", "plan", "report", "slice", "verify"};
    return s;
}

namespace {

std::string reserve_of(const RunConfig & c) { return c.reserve.empty() ? "2G" : c.reserve; }

// The corpus spec, from a manifest or from sources, with run.toml's overrides; and every
// file it reads.
CorpusSpec corpus_spec(const RunConfig & c, std::vector<fs::path> & inputs) {
    CorpusSpec spec;
    const bool manifest = c.corpus.size() == 1 && c.corpus[0].find('=') == std::string::npos;
    if (manifest) {
        spec = read_manifest(c.corpus[0]);
    } else {
        for (const std::string & s : c.corpus) {
            spec.sources.push_back(source_from_flag(s));
        }
    }
    spec.seed = c.seed.value_or(spec.seed);
    spec.eval_share = c.eval_share.value_or(spec.eval_share);
    spec.tokens = c.tokens ? c.tokens : spec.tokens;
    spec.doc_tokens = c.doc_tokens.value_or(spec.doc_tokens);
    if (!(spec.eval_share > 0 && spec.eval_share < 1)) {
        throw Error("eval_share must be in (0, 1): the held-out side feeds eval and replay");
    }
    inputs = {c.model};
    if (!c.mmproj.empty()) {
        inputs.push_back(c.mmproj);
    }
    if (manifest) {
        inputs.push_back(c.corpus[0]);
    }
    for (const SourceSpec & s : spec.sources) {
        for (const fs::path & p : expand_source_path(s, spec.base_dir)) {
            inputs.push_back(p);
        }
    }
    return spec;
}

// The settings checked before anything is written; returns the model's geometry.
InspectReport check_run_options(const RunOptions & opt) {
    const RunConfig & c = opt.config;
    if (c.model.empty() || c.corpus.empty() || c.ks.empty()) {
        throw Error("moeprune run needs a model (-m), a corpus (--corpus) and expert counts (-k)");
    }
    if (!opt.from.empty() && std::find(run_stages().begin(), run_stages().end(), opt.from) == run_stages().end()) {
        throw Error(fmt::format("--from {}: the stages are {}", opt.from, fmt::join(run_stages(), ", ")));
    }
    if (c.runs_on != "llama.cpp" && c.runs_on != "any") {
        throw Error(fmt::format("runs_on is \"llama.cpp\" or \"any\", not \"{}\"", c.runs_on));
    }
    if (c.slice != "" && c.slice != "best" && c.slice != "all") {
        throw Error(fmt::format("--slice is best or all, not \"{}\"", c.slice));
    }
    for (const double s : c.cache_shares) {
        if (!(s > 0 && s <= 1)) {
            throw Error(fmt::format("cache share {} is not in (0, 1]", s));
        }
    }
    InspectReport model = inspect_model(GgufModel::open(c.model), {});
    if (!model.problems.empty()) {
        fail_file(c.model.string(), "inspect finds problems: " + model.problems.front());
    }
    for (const int64_t k : c.ks) {
        if (k < model.n_expert_used || k > model.n_expert) {
            throw Error(fmt::format("-k {}: the experts kept per layer are between the {} each token uses and the {} of {}",
                                    k, model.n_expert_used, model.n_expert, c.model.string()));
        }
    }
    for (const std::string & p : c.policies) {
        if (std::find(policy_names().begin(), policy_names().end(), p) == policy_names().end()) {
            throw Error(fmt::format("--policies {}: not a cache policy ({})", p, fmt::join(policy_names(), ", ")));
        }
    }
    check_threads(c.threads, "threads");
    for (const std::string & ram : c.measure) {
        parse_ram_limit(ram, "--measure");
    }
    if (!c.ram.empty()) {
        parse_size(c.ram, "--ram");
    }
    parse_size(reserve_of(c), "--reserve");
    // The corpus' manifest and sources are read now, so that a bad one is refused before
    // run.toml records the run.
    std::vector<fs::path> corpus_inputs;
    corpus_spec(c, corpus_inputs);
    if (c.verify && c.ram.empty()) {
        throw Error("--verify measures the recommendation at --ram: give --ram");
    }
    if (!c.read_ahead_kb.empty() && (c.measure.empty() || ::geteuid() != 0)) {
        throw Error("read_ahead_kb: the measure stage measures at each read-ahead of the model's device, which needs "
                    "--measure and root");
    }
    if (c.measure_shortlist < 0 || c.measure_shortlist > 64) {
        throw Error(fmt::format("measure_shortlist is {}: 0 (none) to 64 options", c.measure_shortlist));
    }
    if (!c.hellaswag.empty() + !c.winogrande.empty() + !c.multiple_choice.empty() > 1) {
        throw Error("hellaswag, winogrande, multiple_choice: give one task file per run");
    }
    if (c.tasks < 0) {
        throw Error(fmt::format("tasks is {}: at least 1 (0: llama-perplexity's default)", c.tasks));
    }
    if (c.measure_tokens < 1) {
        throw Error(fmt::format("measure_tokens {} must be at least 1", c.measure_tokens));
    }
    // Without a reserve given, a measured run learns it; the plan checks the budget then.
    if (!c.ram.empty() && (!c.reserve.empty() || c.measure.empty())) {
        const double budget = parse_size(c.ram, "--ram") - parse_size(reserve_of(c), "--reserve");
        if (budget < double(model.other_bytes)) {
            throw Error(fmt::format("--ram {} minus the reserve of {} leaves {:.3f} GB, less than the {:.3f} GB of weights "
                                    "in {} that are not routed experts", c.ram, reserve_of(c), budget / 1e9,
                                    double(model.other_bytes) / 1e9, c.model.string()));
        }
    }
    return model;
}

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

// Per-layer cache sizes of a map (the unpruned model for an empty path): shares of K.
std::vector<int> map_caches(const RunConfig & c, const InspectReport & model, const fs::path & m) {
    const int64_t k = m.empty() ? model.n_expert : read_keep_map(m).k;
    std::set<int> caches;
    for (const double s : c.cache_shares) {
        caches.insert(int(std::max<int64_t>(model.n_expert_used, std::llround(s * double(k)))));
    }
    return std::vector<int>(caches.begin(), caches.end());
}

ThroughputParams throughput_of(const RunConfig & c) {
    ThroughputParams tp;
    tp.ssd_gbps = c.ssd;
    tp.read_latency_us = c.read_latency_us;
    tp.queue_depth = c.queue_depth;
    tp.compute_ms = c.compute_ms;
    tp.sync_us = c.sync_us;
    return tp;
}

void corpus_stage(Runner & run, const RunConfig & c, const RunPaths & at) {
    std::vector<fs::path> corpus_inputs;
    const CorpusSpec spec = corpus_spec(c, corpus_inputs);
    const fs::path & dir = at.dir;
    run.stage("corpus", {{"corpus", c.corpus}, {"seed", spec.seed}, {"eval_share", spec.eval_share},
                         {"tokens", spec.tokens ? json(*spec.tokens) : json(nullptr)}, {"doc_tokens", spec.doc_tokens}},
              corpus_inputs, [&] {
                  CorpusOptions o;
                  o.model = c.model;
                  o.mmproj = c.mmproj;
                  o.spec = spec;
                  o.out_dir = dir / "corpus";
                  o.threads = c.threads;
                  build_corpus(o);
                  return std::vector<fs::path>{at.calib, at.eval_text, at.corpus_report, at.tasks, at.task_set};
              });

}

// Statistics on calib; statistics and the router trace on the held-out side.
void collect_stage(Runner & run, const RunOptions & opt, const InspectReport & model, const std::string & name,
                   const fs::path & text, const fs::path & out, const fs::path & trace) {
    const RunConfig & c = opt.config;
    const int trace_top = int(std::min<int64_t>(c.trace_top, model.n_expert));
    json settings = {{"ctx", c.ctx}};
    if (!trace.empty()) {
        settings["trace_top"] = trace_top;
    }
    std::vector<fs::path> inputs{c.model, text};
    if (!c.mmproj.empty()) {
        inputs.push_back(c.mmproj);
    }
    run.stage(name, settings, inputs, [&] {
        CollectOptions o;
        o.model = c.model;
        o.mmproj = c.mmproj;
        o.corpus = text;
        o.output = out;
        o.trace = trace;
        o.trace_top = trace_top;
        o.ctx = c.ctx;
        o.threads = c.threads;
        o.save_every = c.save_every;
        o.progress = opt.progress;
        // A checkpoint left by a killed run continues (collect refuses one of other
        // inputs or settings by name); anything else starts over.
        std::error_code ec;
        o.resume = o.save_every > 0 && fs::exists(collect_checkpoint_path(out), ec);
        if (!o.resume) {
            fs::remove(collect_checkpoint_path(out), ec);
            fs::remove(out, ec);
            if (!trace.empty()) {
                fs::remove(trace, ec);
            }
        }
        collect(o);
        std::vector<fs::path> outs{out};
        if (!trace.empty()) {
            outs.push_back(trace);
        }
        return outs;
    });
}

// Keep maps of every criterion and K.
void select_stage(Runner & run, const RunConfig & c, const RunPaths & at) {
    run.stage("select", {{"k", c.ks}, {"criteria", c.criteria}}, {at.stats, at.heldout, at.trace}, [&] {
        std::error_code ec;
        fs::remove_all(at.maps_dir, ec);
        SelectOptions o;
        o.stats = at.stats;
        o.ks = c.ks;
        o.metrics = c.criteria;
        o.out_dir = at.maps_dir;
        o.heldout = at.heldout;
        o.trace = at.trace;
        const SelectReport r = run_select(o, {at.select_json});
        for (const std::string & w : r.warnings) {
            std::fprintf(stderr, "moeprune run: %s\n", w.c_str());
        }
        write_file_atomic(at.select_json, r.json.dump(1) + "\n");
        write_file_atomic(at.dir / "select" / "select.txt", r.text);
        std::vector<fs::path> outs = r.written;
        outs.push_back(at.select_json);
        return outs;
    });
}

RunMaps run_maps(const RunConfig & c, const RunPaths & at) {
    RunMaps m;
    m.maps = json_files(at.maps_dir);
    m.all = {fs::path()};
    m.all.insert(m.all.end(), m.maps.begin(), m.maps.end());
    std::copy_if(c.lambdas.begin(), c.lambdas.end(), std::back_inserter(m.rerouting), [](double l) { return l > 0; });
    std::copy_if(c.policies.begin(), c.policies.end(), std::back_inserter(m.online),
                 [](const std::string & p) { return !policy_reads_future(p); });
    if (!m.rerouting.empty() && !m.online.empty()) {
        for (const fs::path & map : m.all) {
            m.closed_evals.push_back(at.closed_eval_of(map));
        }
    }
    for (const fs::path & map : m.all) {
        m.replays.push_back(at.replay_of(map));
    }
    return m;
}

// Quality of every map, masked in the original model, on the held-out text. Cache-aware
// routing (λ > 0) changes the output too: its KLD is measured in the closed loop, per
// map with the caches replay uses, for every online policy.
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

// Caches for every map (and the unpruned model) on the held-out trace.
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

// A moeprune-measure run of `model` on the held-out text: JSON and text in `json_out`'s folder.
std::vector<fs::path> measure_to(const RunOptions & opt, const fs::path & model, const fs::path & text,
                                 const std::vector<std::string> & ram, const fs::path & json_out,
                                 const std::vector<uint64_t> & read_ahead_kb = {}) {
    MeasureOptions o;
    o.read_ahead_kb = read_ahead_kb;
    o.text_only = true;  // llama.cpp's decode of the held-out text; images are encoded, not streamed
    o.model = model;
    o.text = text;
    o.ram = ram;
    o.tokens = opt.config.measure_tokens;
    o.threads = opt.config.threads;
    o.json_out = json_out;
    const MeasureReport r = run_measure(o);
    const fs::path text_out = fs::path(json_out).replace_extension(".txt");
    write_file_atomic(text_out, to_text(r));
    return {json_out, text_out};
}

// llama.cpp's own decode under every --measure limit: what the plan's timing comes from.
void measure_stage(Runner & run, const RunOptions & opt, const RunPaths & at) {
    const RunConfig & c = opt.config;
    run.stage("measure",
              {{"ram", c.measure}, {"tokens", c.measure_tokens}, {"threads", c.threads}, {"read_ahead_kb", c.read_ahead_kb}},
              {c.model, at.eval_text},
              [&] { return measure_to(opt, c.model, at.eval_text, c.measure, at.measure_json, c.read_ahead_kb); });
}

// Whether the plan stage measures its shortlist: llama.cpp is measured (--measure), under a
// budget to measure it in (--ram).
bool shortlisting(const RunConfig & c) { return !c.measure.empty() && !c.ram.empty() && c.measure_shortlist > 0; }

// The shortlist of the plan made from predictions, each option's model (sliced where it
// keeps fewer experts, then deleted) measured under --ram; returns their summaries, which
// `out` gets with the measure reports and the predicted plan.
std::vector<fs::path> measure_shortlist(const RunOptions & opt, const RunPaths & at, const json & predicted,
                                        std::vector<fs::path> & out) {
    const RunConfig & c = opt.config;
    const fs::path dir = at.dir / "plan" / "shortlist";
    create_output_dir(dir);
    const fs::path predicted_json = at.dir / "plan" / "predicted.json";
    write_file_atomic(predicted_json, predicted.dump(1) + "\n");
    out.push_back(predicted_json);
    const PlanFile plan = read_plan_document(predicted, predicted_json.string());
    std::vector<fs::path> summaries;
    for (const size_t i : shortlist_of(plan, c.measure_shortlist)) {
        const PlanOption & o = plan.options[i];
        const std::string label = keep_map_label(o.criterion, o.k) + (o.policy == "resident" ? "" : "-" + o.policy);
        fs::path model = c.model;
        if (o.k < plan.n_expert) {
            SliceOptions s;
            s.model = c.model;
            s.keep = o.keep_map ? fs::path(*o.keep_map) : at.maps_dir / keep_map_file_name(o.criterion, o.k);
            s.output = model = dir / (label + ".gguf");
            slice_model(s);
        }
        const fs::path measure_json = dir / (label + ".measure.json");
        const std::vector<fs::path> measured = measure_to(opt, model, at.eval_text, {c.ram}, measure_json);
        if (model != c.model) {
            fs::remove(model);   // a model's worth of disk per option; the measure report says what it was
        }
        const fs::path summary = dir / (label + ".json");
        write_file_atomic(summary, to_json(measured_option(o, predicted_json.string(), model, c.ram, measure_json)).dump(1) + "\n");
        out.insert(out.end(), measured.begin(), measured.end());
        out.push_back(summary);
        summaries.push_back(summary);
    }
    return summaries;
}

void plan_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const RunMaps & m) {
    const RunConfig & c = opt.config;
    std::vector<fs::path> plan_inputs{c.model, at.eval_json};
    if (!c.measure.empty()) {
        plan_inputs.insert(plan_inputs.end(), {at.measure_json, at.trace});
    }
    plan_inputs.insert(plan_inputs.end(), m.closed_evals.begin(), m.closed_evals.end());
    plan_inputs.insert(plan_inputs.end(), m.replays.begin(), m.replays.end());
    run.stage("plan", {{"k", c.ks}, {"ram", c.ram}, {"reserve", c.reserve}, {"throughput", to_json(throughput_of(c))},
                       {"max_kld", c.max_kld ? json(*c.max_kld) : json(nullptr)},
                       {"min_accuracy", c.min_accuracy ? json(*c.min_accuracy) : json(nullptr)}, {"runs_on", c.runs_on},
                       {"llama_bin", c.llama_bin}, {"threads", c.threads}, {"ctx", c.ctx},
                       {"measure_shortlist", shortlisting(c) ? c.measure_shortlist : 0}, {"measure_tokens", c.measure_tokens}},
              plan_inputs, [&] {
                  PlanOptions o;
                  o.model = c.model;
                  o.ks = c.ks;
                  o.ram_bytes = c.ram.empty() ? 0 : parse_size(c.ram, "ram");
                  o.reserve_bytes = parse_size(reserve_of(c), "reserve");
                  if (!c.measure.empty()) {
                      o.measured = at.measure_json;
                      if (!c.reserve.empty()) {
                          o.by_hand = {"--reserve"};
                      }
                  }
                  o.throughput = throughput_of(c);
                  o.replays = m.replays;
                  o.evals = {at.eval_json};
                  o.evals.insert(o.evals.end(), m.closed_evals.begin(), m.closed_evals.end());
                  o.max_kld = c.max_kld;
                  o.min_accuracy = c.min_accuracy;
                  o.runs_on = c.runs_on;
                  o.sliced_dir = at.dir / "slice";
                  o.threads = c.threads;
                  o.ctx = c.ctx;
                  o.llama_bin = c.llama_bin;
                  o.moeprune_bin = opt.moeprune_bin;
                  std::vector<fs::path> out;
                  if (!c.measure.empty() && !c.ram.empty()) {
                      o.streamed = price_streamed_slices(c.model, m.maps, at.trace, at.measure_json, c.ram,
                                                         at.dir / "plan" / "streamed");
                  }
                  json plan = make_plan(o);
                  if (shortlisting(c)) {
                      o.shortlist = measure_shortlist(opt, at, plan, out);
                      plan = make_plan(o);
                  }
                  write_file_atomic(at.plan_json, plan.dump(1) + "\n");
                  write_file_atomic(at.dir / "plan" / "plan.txt", plan_text(read_plan_document(plan, at.plan_json.string())));
                  out.insert(out.end(), {at.plan_json, at.dir / "plan" / "plan.txt"});
                  return out;
              });
}

void report_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m) {
    ReportInputs ri;
    ri.run_dir = at.dir;
    ri.config = run_config_toml(c);
    ri.corpus = at.corpus_report;
    ri.select = at.select_json;
    ri.eval = at.eval_json;
    ri.replays = m.replays;
    ri.closed_loop_evals = m.closed_evals;
    ri.plan = at.plan_json;
    std::vector<fs::path> report_inputs{at.corpus_report, ri.select, at.eval_json, at.plan_json};
    if (!c.measure.empty()) {
        ri.measure = at.measure_json;
        report_inputs.push_back(at.measure_json);
    }
    report_inputs.insert(report_inputs.end(), m.replays.begin(), m.replays.end());
    report_inputs.insert(report_inputs.end(), m.closed_evals.begin(), m.closed_evals.end());
    run.stage("report", {{"report_version", 3}}, report_inputs, [&] { return write_report(ri); });
}

// The maps to slice: every one, or the recommended option's; returns what the summary
// adds.
std::string slice_stage(Runner & run, const RunConfig & c, const RunPaths & at, const RunMaps & m, const PlanFile & plan) {
    std::vector<fs::path> chosen;
    if (c.slice == "all") {
        chosen = m.maps;
    } else if (const PlanOption * o = plan.recommendation()) {
        const fs::path map = at.maps_dir / keep_map_file_name(o->criterion, o->k);
        if (fs::exists(map)) {
            chosen.push_back(map);
        }
    }
    std::vector<fs::path> slice_inputs{c.model, at.plan_json};
    slice_inputs.insert(slice_inputs.end(), chosen.begin(), chosen.end());
    run.stage("slice", {{"slice", c.slice}}, slice_inputs, [&] {
        std::vector<fs::path> out;
        for (const fs::path & map : chosen) {
            SliceOptions o;
            o.model = c.model;
            o.keep = map;
            o.output = at.dir / "slice" / (map.stem().string() + ".gguf");
            slice_model(o);
            out.push_back(o.output);
        }
        return out;
    });
    return chosen.empty() ? "\nslice: the recommended option keeps every expert or names no keep map; nothing to slice" : "";
}

// The recommendation as llama.cpp runs it: its sliced model (the model itself when it keeps
// every expert) measured at --ram, next to the tokens/s the plan predicted for it.
std::string verify_stage(Runner & run, const RunOptions & opt, const RunPaths & at, const PlanFile & plan) {
    const RunConfig & c = opt.config;
    const PlanOption * o = plan.recommendation();
    if (!o) {
        return "\nverify: the plan recommends nothing to verify";
    }
    fs::path model = c.model;
    if (o->k < plan.n_expert) {
        model = at.dir / "slice" / (fs::path(keep_map_file_name(o->criterion, o->k)).stem().string() + ".gguf");
        if (!fs::exists(model)) {
            fail_file(model.string(), "is missing: verify measures the recommended option's sliced model");
        }
    }
    run.stage("verify", {{"ram", c.ram}, {"tokens", c.measure_tokens}, {"threads", c.threads}},
              {model, at.eval_text, at.plan_json}, [&] {
                  std::vector<fs::path> out = measure_to(opt, model, at.eval_text, {c.ram}, at.verify_json);
                  const VerifySummary v = measured_option(*o, at.plan_json.string(), model, c.ram, at.verify_json);
                  const fs::path summary = at.dir / "verify" / "summary.json";
                  write_file_atomic(summary, to_json(v).dump(1) + "\n");
                  out.push_back(summary);
                  return out;
              });
    const VerifySummary v = read_verify_summary(at.dir / "verify" / "summary.json");
    return fmt::format("\nverify: {} at --ram {}: predicted {}, measured {:.2f} tokens/s{}", v.model, c.ram,
                       v.predicted_tok_per_s ? fmt::format("{:.2f}", *v.predicted_tok_per_s) : "unbounded tokens/s",
                       v.measured_tok_per_s, v.error() ? fmt::format(" (error {:.0f}%)", 100 * *v.error()) : "");
}

} // namespace

std::string run_pipeline(const RunOptions & opt) {
    const RunConfig & c = opt.config;
    const fs::path & dir = opt.run_dir;
    const InspectReport model = check_run_options(opt);
    create_output_dir(dir);
    refuse_output_clashes({dir / "run.toml"}, {c.model});
    write_file_atomic(dir / "run.toml", run_config_toml(c));

    const RunPaths at(dir);
    const std::string slice = c.verify && c.slice.empty() ? "best" : c.slice;
    const size_t n_stages = 8 + (c.measure.empty() ? 0 : 1) + (slice.empty() ? 0 : 1) + (c.verify ? 1 : 0);
    Runner run(dir, opt.from, n_stages);
    corpus_stage(run, c, at);
    collect_stage(run, opt, model, "collect", at.calib, at.stats, {});
    collect_stage(run, opt, model, "heldout", at.eval_text, at.heldout, at.trace);
    // Measured, tokens/s are priced from the measurement from the replay on, as in the plan.
    ThroughputParams throughput = throughput_of(c);
    if (!c.measure.empty()) {
        measure_stage(run, opt, at);
        throughput = measured_throughput(at.measure_json, throughput, {});
    }
    select_stage(run, c, at);
    const RunMaps maps = run_maps(c, at);
    eval_stage(run, opt, model, at, maps);
    replay_stage(run, c, model, at, maps, throughput);
    plan_stage(run, opt, at, maps);
    report_stage(run, c, at, maps);

    const PlanFile plan = read_plan_report(at.plan_json);
    std::string summary = "recommended: " + plan.why;
    if (plan.commands) {
        summary += "\nto run it:";
        for (const std::string & line : plan.commands->lines) {
            summary += "\n  " + line;
        }
    }
    if (!slice.empty()) {
        RunConfig sliced = c;
        sliced.slice = slice;
        summary += with_json_errors(at.plan_json.string(), [&] { return slice_stage(run, sliced, at, maps, plan); });
    }
    if (c.verify) {
        summary += with_json_errors(at.plan_json.string(), [&] { return verify_stage(run, opt, at, plan); });
    }
    return summary + "\nreport: " + (dir / "report.html").string();
}

} // namespace moeprune
