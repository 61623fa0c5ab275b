// Reading: the sources checked, the inputs and outputs named, and every file read into documents.
#include "core/digest.h"
#include "core/errors.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "corpus/phases.h"
#include "model/model_file.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

namespace moeprune::corpus_build {

// The sources with their key roots, and the settings checked before anything is read.
std::vector<SourceSpec> checked_sources(const CorpusSpec & spec, bool has_projector) {
    std::vector<SourceSpec> specs = spec.sources;
    for (SourceSpec & s : specs) {
        s.key_root = source_key_root(s, spec.base_dir);
    }
    if (specs.empty()) {
        throw Error("no sources: give --manifest or --source DOMAIN=PATH");
    }
    std::set<std::string> names;
    for (const SourceSpec & s : specs) {
        if (!names.insert(s.name).second) {
            throw Error(fmt::format("two sources are named \"{}\"", s.name));
        }
    }
    for (const SourceSpec & s : specs) {
        if (s.media != Modality::Text && !has_projector) {
            throw Error(fmt::format("source \"{}\" is {} files: give the model's projector with --mmproj FILE, so "
                                    "their tokens are counted as libmtmd counts them", s.name, modality_name(s.media)));
        }
    }
    if (!(spec.near_dup > 0 && spec.near_dup <= 1) || !(spec.eval_share >= 0 && spec.eval_share < 1)) {
        throw Error("--near-dup must be in (0, 1] and --eval-share in [0, 1)");
    }
    return specs;
}

// Inputs, and the check that no output is one of them.
void prepare_files(CorpusBuild & b) {
    const CorpusOptions & opt = b.opt;
    std::vector<fs::path> inputs{opt.model};
    if (!opt.mmproj.empty()) {
        inputs.push_back(opt.mmproj);
    }
    if (!b.spec.manifest.empty()) {
        inputs.push_back(b.spec.manifest);
    }
    for (size_t s = 0; s < b.specs.size(); ++s) {
        b.paths[s] = expand_source_path(b.specs[s], b.spec.base_dir);
        for (const fs::path & p : b.paths[s]) {
            inputs.push_back(p);
            std::error_code ec;
            b.total_bytes += fs::file_size(p, ec);
        }
    }
    b.calib_path = opt.out_dir / "calib.jsonl";
    b.eval_path = opt.out_dir / "eval.jsonl";
    b.report_path = opt.out_dir / "corpus.json";
    b.tasks_path = opt.out_dir / "tasks.txt";
    b.task_set_path = opt.out_dir / "tasks.json";
    std::vector<fs::path> outputs{b.calib_path, b.eval_path, b.report_path, b.tasks_path, b.task_set_path};
    if (!opt.report.empty()) {
        outputs.push_back(opt.report);
    }
    refuse_output_clashes(outputs, inputs);
    create_output_dir(opt.out_dir);
    // A FIFO or device is refused by name here: llama.cpp would block reading it.
    b.model_identity = model_digest(GgufModel::open(opt.model).shard_paths());
}

namespace {

// The files of a source that were skipped for not being `what`: the first five, then how many more.
void print_skipped(const SourceSpec & src, const std::vector<std::string> & skipped, const std::string & what) {
    if (skipped.empty()) {
        return;
    }
    const size_t shown = std::min<size_t>(skipped.size(), 5);
    std::fprintf(stderr, "moeprune corpus: source \"%s\": skipped %zu file(s) that are not %s: %s%s\n", src.name.c_str(),
                 skipped.size(), what.c_str(), fmt::format("{}", fmt::join(skipped.begin(), skipped.begin() + long(shown), ", ")).c_str(),
                 skipped.size() > shown ? fmt::format(" and {} more (corpus.json lists them)", skipped.size() - shown).c_str() : "");
}

} // namespace

// Read every file, in parallel, keeping the sources' order.
void read_sources(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::pair<uint32_t, fs::path>> & jobs = b.jobs;
    for (size_t s = 0; s < specs.size(); ++s) {
        for (const fs::path & p : b.paths[s]) {
            jobs.emplace_back(uint32_t(s), p);
        }
    }
    std::vector<SourceFiles> read(jobs.size());
    {
        Progress progress("reading", b.total_bytes, "MiB", 1.0 / 1048576);
        std::mutex m;
        run_parallel(jobs.size(), b.opt.threads, [&](size_t i) {
            const SourceSpec & src = specs[jobs[i].first];
            const bool named = fs::path(src.path) == jobs[i].second || b.spec.base_dir / src.path == jobs[i].second;
            read_source_file(src, jobs[i].first, jobs[i].second, !named, read[i]);
            std::lock_guard<std::mutex> lock(m);
            progress.advance(read[i].files[0].bytes);
        });
        progress.finish();
    }
    for (size_t i = 0; i < read.size(); ++i) {
        const uint32_t offset = uint32_t(b.files.size());
        b.files.push_back(read[i].files[0]);
        b.empty_skipped[jobs[i].first] += read[i].empty_skipped;
        for (std::string & skipped : read[i].binary_skipped) {
            b.binary_skipped[jobs[i].first].push_back(std::move(skipped));
        }
        for (std::string & skipped : read[i].not_media_skipped) {
            b.not_media_skipped[jobs[i].first].push_back(std::move(skipped));
        }
        for (SourceDocument & d : read[i].documents) {
            d.file += offset;
            ++b.read_docs[d.source];
            b.docs.push_back({std::move(d), false, 0, kCalib});
        }
        read[i] = {};
    }

    for (size_t s = 0; s < specs.size(); ++s) {
        print_skipped(specs[s], b.binary_skipped[s], "UTF-8 text");
        print_skipped(specs[s], b.not_media_skipped[s], fmt::format("{} files", modality_name(specs[s].media)));
    }
}

} // namespace moeprune::corpus_build
