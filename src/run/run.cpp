#include "run/run.h"
#include "collect/collect.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"
#include "corpus/build.h"
#include "corpus/sources.h"
#include "eval/eval.h"
#include "formats/keep_map.h"
#include "formats/stats.h"
#include "gguf/model_file.h"
#include "inspect/inspect.h"
#include "plan/plan.h"
#include "replay/moce.h"
#include "replay/policy.h"
#include "replay/replay.h"
#include "report/report.h"
#include "select/select.h"
#include "slice/slice.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>
#include <xxhash.h>

#include <algorithm>
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

std::string at(const std::string & file, const toml::source_region & r) {
    return fmt::format("{}:{}:{}", file, r.begin.line, r.begin.column);
}

template <class T> std::vector<T> array_of(const toml::node & n, const std::string & where, const std::string & key) {
    std::vector<T> out;
    const auto one = [&](const toml::node & v) {
        if constexpr (std::is_same_v<T, std::string>) {
            if (!v.is_string()) {
                fail_file(where, fmt::format("\"{}\" must hold strings", key));
            }
            out.push_back(v.as_string()->get());
        } else if constexpr (std::is_integral_v<T>) {
            if (!v.is_integer()) {
                fail_file(where, fmt::format("\"{}\" must hold integers", key));
            }
            out.push_back(T(v.as_integer()->get()));
        } else {
            if (!v.is_number()) {
                fail_file(where, fmt::format("\"{}\" must hold numbers", key));
            }
            out.push_back(v.is_integer() ? T(v.as_integer()->get()) : T(v.as_floating_point()->get()));
        }
    };
    if (const toml::array * a = n.as_array()) {
        for (const toml::node & v : *a) {
            one(v);
        }
    } else {
        one(n);
    }
    return out;
}

template <class T> T scalar(const toml::node & n, const std::string & where, const std::string & key) {
    const std::vector<T> v = array_of<T>(n, where, key);
    if (v.size() != 1 || n.is_array()) {
        fail_file(where, fmt::format("\"{}\" must be a single value", key));
    }
    return v[0];
}

std::string toml_string(const std::string & s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
        }
        out += c;
    }
    return out + "\"";
}

template <class T> std::string toml_array(const std::vector<T> & v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) {
        if constexpr (std::is_same_v<T, std::string>) {
            out += (i ? ", " : "") + toml_string(v[i]);
        } else {
            out += (i ? ", " : "") + fmt::format("{}", v[i]);
        }
    }
    return out + "]";
}

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
    static const std::vector<std::string> s = {"corpus", "collect", "heldout", "select", "eval", "replay", "plan", "report", "slice"};
    return s;
}

RunConfig read_run_config(const fs::path & path) {
    const std::string file = path.string();
    toml::table t;
    try {
        t = toml::parse(read_text_file(path), file);
    } catch (const toml::parse_error & e) {
        fail_file(at(file, e.source()), std::string("not valid TOML: ") + std::string(e.description()));
    }
    RunConfig c;
    const fs::path base = path.parent_path();
    const auto rel = [&](const std::string & p) { return fs::path(p).is_absolute() ? fs::path(p) : base / p; };
    for (const auto & [k, n] : t) {
        const std::string key(k.str());
        const std::string where = at(file, k.source());
        if (key == "model") {
            c.model = rel(scalar<std::string>(n, where, key));
        } else if (key == "corpus") {
            c.corpus.clear();
            for (const std::string & s : array_of<std::string>(n, where, key)) {
                c.corpus.push_back(s.find('=') == std::string::npos
                                       ? rel(s).string()
                                       : s.substr(0, s.find('=') + 1) + rel(s.substr(s.find('=') + 1)).string());
            }
        } else if (key == "k") {
            c.ks = array_of<int64_t>(n, where, key);
        } else if (key == "criteria") {
            c.criteria = array_of<std::string>(n, where, key);
        } else if (key == "ram") {
            c.ram = scalar<std::string>(n, where, key);
        } else if (key == "reserve") {
            c.reserve = scalar<std::string>(n, where, key);
        } else if (key == "ssd") {
            c.ssd = scalar<double>(n, where, key);
        } else if (key == "read_latency_us") {
            c.read_latency_us = scalar<double>(n, where, key);
        } else if (key == "queue_depth") {
            c.queue_depth = scalar<int>(n, where, key);
        } else if (key == "compute_ms") {
            c.compute_ms = scalar<double>(n, where, key);
        } else if (key == "sync_us") {
            c.sync_us = scalar<double>(n, where, key);
        } else if (key == "policies") {
            c.policies = array_of<std::string>(n, where, key);
        } else if (key == "cache_shares") {
            c.cache_shares = array_of<double>(n, where, key);
        } else if (key == "lambdas") {
            c.lambdas = array_of<double>(n, where, key);
        } else if (key == "max_kld") {
            c.max_kld = scalar<double>(n, where, key);
        } else if (key == "ctx") {
            c.ctx = scalar<int>(n, where, key);
        } else if (key == "threads") {
            c.threads = scalar<int>(n, where, key);
        } else if (key == "seed") {
            c.seed = scalar<uint64_t>(n, where, key);
        } else if (key == "eval_share") {
            c.eval_share = scalar<double>(n, where, key);
        } else if (key == "tokens") {
            c.tokens = scalar<uint64_t>(n, where, key);
        } else if (key == "doc_tokens") {
            c.doc_tokens = scalar<uint32_t>(n, where, key);
        } else if (key == "trace_top") {
            c.trace_top = scalar<int>(n, where, key);
        } else if (key == "save_every") {
            c.save_every = scalar<int>(n, where, key);
        } else if (key == "slice") {
            c.slice = scalar<std::string>(n, where, key);
        } else {
            fail_file(where, fmt::format("unknown key \"{}\" (docs/run.md lists the keys of run.toml)", key));
        }
    }
    return c;
}

std::string run_config_toml(const RunConfig & c) {
    std::string s = "# moeprune run: every setting of this run (moeprune run --config run.toml repeats it)\n";
    s += "model = " + toml_string(c.model.string()) + "\n";
    s += "corpus = " + toml_array(c.corpus) + "      # a manifest, or DOMAIN=PATH sources\n";
    s += "k = " + toml_array(c.ks) + "\n";
    s += "criteria = " + toml_array(c.criteria) + "\n";
    s += "ram = " + toml_string(c.ram) + "                # empty: no RAM limit\n";
    s += "reserve = " + toml_string(c.reserve) + "        # RAM kept for KV cache and the OS\n";
    s += fmt::format("ssd = {}                  # GB/s\nread_latency_us = {}\nqueue_depth = {}\ncompute_ms = {}\nsync_us = {}\n",
                     c.ssd, c.read_latency_us, c.queue_depth, c.compute_ms, c.sync_us);
    s += "policies = " + toml_array(c.policies) + "\n";
    s += "cache_shares = " + toml_array(c.cache_shares) + "   # per-layer caches as shares of K\n";
    s += "lambdas = " + toml_array(c.lambdas) + "\n";
    if (c.max_kld) {
        s += fmt::format("max_kld = {}\n", *c.max_kld);
    }
    s += fmt::format("ctx = {}\nthreads = {}\n", c.ctx, c.threads);
    s += "# corpus settings given here override the manifest's\n";
    if (c.seed) {
        s += fmt::format("seed = {}\n", *c.seed);
    }
    if (c.eval_share) {
        s += fmt::format("eval_share = {}\n", *c.eval_share);
    }
    if (c.tokens) {
        s += fmt::format("tokens = {}\n", *c.tokens);
    }
    if (c.doc_tokens) {
        s += fmt::format("doc_tokens = {}\n", *c.doc_tokens);
    }
    s += fmt::format("trace_top = {}\nsave_every = {}\n", c.trace_top, c.save_every);
    s += "slice = " + toml_string(c.slice) + "                # \"\", \"best\" or \"all\"\n";
    return s;
}

std::string run_pipeline(const RunOptions & opt) {
    const RunConfig & c = opt.config;
    const fs::path & dir = opt.run_dir;
    if (c.model.empty() || c.corpus.empty() || c.ks.empty()) {
        throw Error("moeprune run needs a model (-m), a corpus (--corpus) and expert counts (-k)");
    }
    if (!opt.from.empty() && std::find(run_stages().begin(), run_stages().end(), opt.from) == run_stages().end()) {
        throw Error(fmt::format("--from {}: the stages are {}", opt.from, fmt::join(run_stages(), ", ")));
    }
    if (c.slice != "" && c.slice != "best" && c.slice != "all") {
        throw Error(fmt::format("--slice is best or all, not \"{}\"", c.slice));
    }
    for (const double s : c.cache_shares) {
        if (!(s > 0 && s <= 1)) {
            throw Error(fmt::format("cache share {} is not in (0, 1]", s));
        }
    }
    const InspectReport model = inspect_model(GgufModel::open(c.model), {});
    if (!model.problems.empty()) {
        fail_file(c.model.string(), "inspect finds problems: " + model.problems.front());
    }
    if (!c.ram.empty()) {
        const double budget = parse_size(c.ram, "--ram") - parse_size(c.reserve, "--reserve");
        if (budget < double(model.other_bytes)) {
            throw Error(fmt::format("--ram {} minus the reserve of {} leaves {:.3f} GB, less than the {:.3f} GB of weights "
                                    "in {} that are not routed experts", c.ram, c.reserve, budget / 1e9,
                                    double(model.other_bytes) / 1e9, c.model.string()));
        }
    }
    create_output_dir(dir);
    refuse_output_clashes({dir / "run.toml"}, {c.model});
    write_file_atomic(dir / "run.toml", run_config_toml(c));

    // The corpus spec, from a manifest or from sources.
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
    std::vector<fs::path> corpus_inputs{c.model};
    if (manifest) {
        corpus_inputs.push_back(c.corpus[0]);
    }
    for (const SourceSpec & s : spec.sources) {
        for (const fs::path & p : expand_source_path(s, spec.base_dir)) {
            corpus_inputs.push_back(p);
        }
    }

    const size_t n_stages = c.slice.empty() ? run_stages().size() - 1 : run_stages().size();
    Runner run(dir, opt.from, n_stages);
    const fs::path calib = dir / "corpus" / "calib.jsonl", eval_text = dir / "corpus" / "eval.jsonl",
                   corpus_report = dir / "corpus" / "corpus.json";
    run.stage("corpus", {{"corpus", c.corpus}, {"seed", spec.seed}, {"eval_share", spec.eval_share},
                         {"tokens", spec.tokens ? json(*spec.tokens) : json(nullptr)}, {"doc_tokens", spec.doc_tokens}},
              corpus_inputs, [&] {
                  CorpusOptions o;
                  o.model = c.model;
                  o.spec = spec;
                  o.out_dir = dir / "corpus";
                  o.threads = c.threads;
                  build_corpus(o);
                  return std::vector<fs::path>{calib, eval_text, corpus_report};
              });

    // Statistics on calib; statistics and the router trace on the held-out side.
    const int trace_top = int(std::min<int64_t>(c.trace_top, model.n_expert));
    const auto collect_stage = [&](const std::string & name, const fs::path & text, const fs::path & out, const fs::path & trace) {
        json settings = {{"ctx", c.ctx}};
        if (!trace.empty()) {
            settings["trace_top"] = trace_top;
        }
        run.stage(name, settings, {c.model, text}, [&] {
            CollectOptions o;
            o.model = c.model;
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
    };
    const fs::path stats = dir / "collect" / "stats.json", heldout = dir / "heldout" / "stats.json",
                   trace = dir / "heldout" / "router.trace";
    collect_stage("collect", calib, stats, {});
    collect_stage("heldout", eval_text, heldout, trace);

    // Keep maps of every criterion and K.
    const fs::path maps_dir = dir / "select" / "maps";
    run.stage("select", {{"k", c.ks}, {"criteria", c.criteria}}, {stats, heldout, trace}, [&] {
        std::error_code ec;
        fs::remove_all(maps_dir, ec);
        SelectOptions o;
        o.stats = stats;
        o.ks = c.ks;
        o.metrics = c.criteria;
        o.out_dir = maps_dir;
        o.heldout = heldout;
        o.trace = trace;
        const SelectReport r = run_select(o, {dir / "select" / "select.json"});
        write_file_atomic(dir / "select" / "select.json", r.json.dump(1) + "\n");
        write_file_atomic(dir / "select" / "select.txt", r.text);
        std::vector<fs::path> outs = r.written;
        outs.push_back(dir / "select" / "select.json");
        return outs;
    });
    const std::vector<fs::path> maps = json_files(maps_dir);

    // Every map and the unpruned model, each with its per-layer cache sizes (shares of K).
    std::vector<fs::path> all_maps{fs::path()};
    all_maps.insert(all_maps.end(), maps.begin(), maps.end());
    const auto map_caches = [&](const fs::path & m) {
        const int64_t k = m.empty() ? model.n_expert : read_keep_map(m).k;
        std::set<int> caches;
        for (const double s : c.cache_shares) {
            caches.insert(int(std::max<int64_t>(model.n_expert_used, std::llround(s * double(k)))));
        }
        return std::vector<int>(caches.begin(), caches.end());
    };

    // Quality of every map, masked in the original model, on the held-out text. Cache-aware
    // routing (λ > 0) changes the output too: its KLD is measured in the closed loop, per
    // map with the caches replay uses, for every online policy.
    std::vector<double> rerouting;
    std::copy_if(c.lambdas.begin(), c.lambdas.end(), std::back_inserter(rerouting), [](double l) { return l > 0; });
    std::vector<std::string> online;
    std::copy_if(c.policies.begin(), c.policies.end(), std::back_inserter(online),
                 [](const std::string & p) { return !policy_reads_future(p); });
    std::vector<fs::path> closed_evals;
    if (!rerouting.empty() && !online.empty()) {
        for (const fs::path & m : all_maps) {
            closed_evals.push_back(dir / "eval" / ("closed-" + (m.empty() ? std::string("none.json") : m.filename().string())));
        }
    }
    const fs::path eval_json = dir / "eval" / "eval.json";
    std::vector<fs::path> eval_inputs{c.model, eval_text};
    eval_inputs.insert(eval_inputs.end(), maps.begin(), maps.end());
    json eval_settings = {{"ctx", c.ctx}};
    if (!closed_evals.empty()) {
        eval_settings["closed_loop"] = {{"policies", online}, {"cache_shares", c.cache_shares}, {"lambdas", rerouting},
                                        {"moce_j", moce_j({}, int(model.n_expert_used))}};
    }
    run.stage("eval", eval_settings, eval_inputs, [&] {
        EvalOptions o;
        o.model = c.model;
        o.corpus = eval_text;
        o.keeps = maps;
        o.ctx = c.ctx;
        o.threads = c.threads;
        o.json_out = eval_json;
        o.progress = opt.progress;
        run_eval(o);
        std::vector<fs::path> written{eval_json};
        for (size_t i = 0; i < closed_evals.size(); ++i) {
            EvalOptions k = o;
            k.keeps = all_maps[i].empty() ? std::vector<fs::path>{} : std::vector<fs::path>{all_maps[i]};
            k.closed_loop_full_model = all_maps[i].empty();
            k.cache_policies = online;
            k.caches = map_caches(all_maps[i]);
            k.lambdas = rerouting;
            k.json_out = closed_evals[i];
            run_eval(k);
            written.push_back(closed_evals[i]);
        }
        return written;
    });

    // Caches for every map (and the unpruned model) on the held-out trace.
    ThroughputParams tp;
    tp.ssd_gbps = c.ssd;
    tp.read_latency_us = c.read_latency_us;
    tp.queue_depth = c.queue_depth;
    tp.compute_ms = c.compute_ms;
    tp.sync_us = c.sync_us;
    const json tp_json = {{"ssd", c.ssd}, {"read_latency_us", c.read_latency_us}, {"queue_depth", c.queue_depth},
                          {"compute_ms", c.compute_ms}, {"sync_us", c.sync_us}};
    std::vector<fs::path> replay_inputs{c.model, trace};
    replay_inputs.insert(replay_inputs.end(), maps.begin(), maps.end());
    const auto replay_out = [&](const fs::path & map) { return dir / "replay" / (map.empty() ? "none.json" : map.filename().string()); };
    std::vector<fs::path> replays{replay_out({})};
    for (const fs::path & m : maps) {
        replays.push_back(replay_out(m));
    }
    // MoCE's J is replay's default; a stage replayed before it was k - 1 for k <= 2 is stale.
    run.stage("replay", {{"policies", c.policies}, {"cache_shares", c.cache_shares}, {"lambdas", c.lambdas},
                         {"moce_j", moce_j({}, int(model.n_expert_used))}, {"throughput", tp_json}},
              replay_inputs, [&] {
                  std::error_code ec;
                  for (const fs::path & old : json_files(dir / "replay")) {
                      fs::remove(old, ec);
                  }
                  std::vector<fs::path> written;
                  for (const fs::path & m : all_maps) {
                      ReplayOptions o;
                      o.trace = trace;
                      o.keep = m;
                      o.policies = c.policies;
                      o.caches = map_caches(m);
                      o.model = c.model;
                      o.lambdas = c.lambdas;
                      o.threads = c.threads;
                      o.throughput = tp;
                      const fs::path out = replay_out(m);
                      const ReplayReport r = run_replay(o, {out});
                      write_file_atomic(out, to_json(r).dump(1) + "\n");
                      written.push_back(out);
                  }
                  return written;
              });

    // The plan.
    const fs::path plan_json = dir / "plan" / "plan.json";
    std::vector<fs::path> plan_inputs{c.model, eval_json};
    plan_inputs.insert(plan_inputs.end(), closed_evals.begin(), closed_evals.end());
    plan_inputs.insert(plan_inputs.end(), replays.begin(), replays.end());
    json recommendation;
    run.stage("plan", {{"k", c.ks}, {"ram", c.ram}, {"reserve", c.reserve}, {"throughput", tp_json},
                       {"max_kld", c.max_kld ? json(*c.max_kld) : json(nullptr)}},
              plan_inputs, [&] {
                  PlanOptions o;
                  o.model = c.model;
                  o.ks = c.ks;
                  o.ram_bytes = c.ram.empty() ? 0 : parse_size(c.ram, "ram");
                  o.reserve_bytes = parse_size(c.reserve, "reserve");
                  o.throughput = tp;
                  o.replays = replays;
                  o.evals = {eval_json};
                  o.evals.insert(o.evals.end(), closed_evals.begin(), closed_evals.end());
                  o.max_kld = c.max_kld;
                  const json plan = make_plan(o);
                  write_file_atomic(plan_json, plan.dump(1) + "\n");
                  write_file_atomic(dir / "plan" / "plan.txt", plan_text(plan));
                  return std::vector<fs::path>{plan_json, dir / "plan" / "plan.txt"};
              });

    // The report.
    ReportInputs ri;
    ri.run_dir = dir;
    ri.config = run_config_toml(c);
    ri.corpus = corpus_report;
    ri.select = dir / "select" / "select.json";
    ri.eval = eval_json;
    ri.replays = replays;
    ri.closed_loop_evals = closed_evals;
    ri.plan = plan_json;
    std::vector<fs::path> report_inputs{corpus_report, ri.select, eval_json, plan_json};
    report_inputs.insert(report_inputs.end(), replays.begin(), replays.end());
    report_inputs.insert(report_inputs.end(), closed_evals.begin(), closed_evals.end());
    run.stage("report", {{"report_version", 2}}, report_inputs, [&] { return write_report(ri); });

    const json plan = parse_json(read_text_file(plan_json), plan_json.string());
    std::string summary = "recommended: " + plan.value("why", std::string("-"));

    if (!c.slice.empty()) {
        std::vector<fs::path> chosen;
        if (c.slice == "all") {
            chosen = maps;
        } else if (!plan["recommended"].is_null()) {
            const json & o = plan["options"][plan["recommended"].get<size_t>()];
            const fs::path m = maps_dir / fmt::format("{}-k{}.json", o["criterion"].get<std::string>(), o["k"].get<int64_t>());
            if (fs::exists(m)) {
                chosen.push_back(m);
            }
        }
        std::vector<fs::path> slice_inputs{c.model, plan_json};
        slice_inputs.insert(slice_inputs.end(), chosen.begin(), chosen.end());
        run.stage("slice", {{"slice", c.slice}}, slice_inputs, [&] {
            std::vector<fs::path> out;
            for (const fs::path & m : chosen) {
                SliceOptions o;
                o.model = c.model;
                o.keep = m;
                o.output = dir / "slice" / (m.stem().string() + ".gguf");
                slice_model(o);
                out.push_back(o.output);
            }
            return out;
        });
        if (chosen.empty()) {
            summary += "\nslice: the recommended option keeps every expert or names no keep map; nothing to slice";
        }
    }
    return summary + "\nreport: " + (dir / "report.html").string();
}

} // namespace moeprune
