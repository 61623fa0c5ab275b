#pragma once
// The phases of build_corpus, in the order it runs them, and CorpusBuild, what they share.
#include "core/atomic_file.h"
#include "corpus/build.h"
#include "corpus/similarity.h"
#include "corpus/documents.h"
#include "corpus/units.h"
#include "formats/corpus_report.h"
#include "formats/task_set.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moeprune::corpus_build {

using nlohmann::json;
namespace fs = std::filesystem;

// The budget of a source that takes everything it has.
constexpr uint64_t kAll = std::numeric_limits<uint64_t>::max();

constexpr size_t kExamples = 5;   // example pairs reported of each kind

// What the phases of build_corpus share; each group of members is filled by the phases its comment names.
struct CorpusBuild {
    CorpusBuild(const CorpusOptions & options, std::vector<SourceSpec> sources)
        : opt(options), spec(options.spec), specs(std::move(sources)), paths(specs.size()),
          empty_skipped(specs.size(), 0), read_docs(specs.size(), 0), binary_skipped(specs.size()),
          not_media_skipped(specs.size()),
          exact_dropped(specs.size(), 0), near_dropped(specs.size(), 0), boiler_only(specs.size(), 0),
          order(specs.size()), groups(specs.size()), budget(specs.size(), {0, 0}), taken(specs.size()),
          next_doc(specs.size(), {0, 0}), taken_tokens(specs.size(), {0, 0}), spare(specs.size()) {}

    const CorpusOptions & opt;
    const CorpusSpec & spec;
    const std::vector<SourceSpec> specs;

    // prepare_files
    std::vector<std::vector<fs::path>> paths;
    uint64_t total_bytes = 0;
    fs::path calib_path, eval_path, report_path, tasks_path, task_set_path;
    std::string model_identity;

    // read_sources
    std::vector<std::pair<uint32_t, fs::path>> jobs;
    std::vector<SourceFile> files;  // in the order of the reading jobs
    std::vector<Doc> docs;
    std::vector<uint64_t> empty_skipped, read_docs;
    std::vector<std::vector<std::string>> binary_skipped;
    std::vector<std::vector<std::string>> not_media_skipped;

    // drop_exact_duplicates, mark_boilerplate, drop_near_duplicates
    std::vector<uint64_t> exact_dropped, near_dropped, boiler_only;

    // split_sides
    std::vector<std::array<std::vector<size_t>, 2>> order;
    std::vector<std::array<std::set<std::string>, 2>> groups;

    // plan_budgets, take_budgets, check_shortfalls
    std::vector<std::array<uint64_t, 2>> budget;
    std::vector<std::array<std::vector<Unit>, 2>> taken;
    std::vector<std::array<size_t, 2>> next_doc;
    std::vector<std::array<uint64_t, 2>> taken_tokens;
    std::vector<std::array<std::vector<Unit>, 2>> spare;  // pieces past the budget

    // interleave
    std::array<std::vector<const Unit *>, 2> sequence;
    std::array<uint64_t, 2> side_tokens{0, 0};

    // make_tasks: tasks.txt's text and tasks.json's record
    std::string tasks_text;
    TaskSet tasks;

    // stage_jsonl, commit_outputs
    std::vector<std::unique_ptr<AtomicOutput>> staged;

    // corpus.json, filled in by every phase from the deduplication on: dedupe.examples and
    // boilerplate, tokenized_bytes and shortfalls by the budgets, domains and prefix shares,
    // leak_check, outputs, seconds, and the rest by finish_report
    CorpusReport report;
};

// read.cpp
std::vector<SourceSpec> checked_sources(const CorpusSpec & spec, bool has_projector);
void prepare_files(CorpusBuild & b);
void read_sources(CorpusBuild & b);

// deduplicate.cpp
void drop_exact_duplicates(CorpusBuild & b);
void mark_boilerplate(CorpusBuild & b);
void drop_near_duplicates(CorpusBuild & b, LshIndex & lsh);

// split.cpp
void split_sides(CorpusBuild & b);

// budgets.cpp
void plan_budgets(CorpusBuild & b);
void take_budgets(CorpusBuild & b, const Tokenizer & tokenizer);
void check_shortfalls(CorpusBuild & b);
void refuse_empty_sides(const CorpusBuild & b);

// writer.cpp
void interleave(CorpusBuild & b);
void stage_jsonl(CorpusBuild & b);
void commit_outputs(CorpusBuild & b);

// tasks.cpp
void make_tasks(CorpusBuild & b, const llama_model * model);

// leak_check.cpp
CorpusLeakCheck check_leaks(const CorpusBuild & b);

// build_report.cpp
void report_domains(CorpusBuild & b);
void finish_report(CorpusBuild & b, const llama_model * model, const LshIndex & lsh);

} // namespace moeprune::corpus_build
