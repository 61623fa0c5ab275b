// The stages that make the data: the corpus, collect on calib and on the held-out side
// (with its router trace), and select's keep maps.
#include "run/stages.h"

#include "collect/collect.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "corpus/build.h"
#include "corpus/sources.h"
#include "select/select.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace moeprune::run_impl {

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
    spec.tasks_per_domain = c.tasks_per_domain.value_or(spec.tasks_per_domain);
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

void corpus_stage(Runner & run, const RunConfig & c, const RunPaths & at) {
    std::vector<fs::path> corpus_inputs;
    const CorpusSpec spec = corpus_spec(c, corpus_inputs);
    const fs::path & dir = at.dir;
    run.stage("corpus", {{"corpus", c.corpus}, {"seed", spec.seed}, {"eval_share", spec.eval_share},
                         {"tokens", spec.tokens ? json(*spec.tokens) : json(nullptr)}, {"doc_tokens", spec.doc_tokens},
                         {"tasks_per_domain", spec.tasks_per_domain}},
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

} // namespace moeprune::run_impl
