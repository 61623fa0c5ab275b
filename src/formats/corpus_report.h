#pragma once
// corpus.json, the report `moeprune corpus` writes (docs/corpus.md): one record that corpus
// fills and writes, and that the cli and report read back typed and checked.
#include "core/json.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct CorpusModelInput {
    std::string path;
    uint64_t bytes = 0;
    std::string digest;   // of the model's files (core/digest)
    std::string vocab;    // of its tokenizer, as eval records it
    bool operator==(const CorpusModelInput &) const = default;
};

struct CorpusInputs {
    CorpusModelInput model;
    std::optional<std::string> manifest, mmproj;
    uint64_t bytes = 0;   // of every source file
    bool operator==(const CorpusInputs &) const = default;
};

struct CorpusMinhash {
    int64_t shingle_units = 0, signature = 0, lsh_rows = 0, lsh_bands = 0;
    bool operator==(const CorpusMinhash &) const = default;
};

struct CorpusSettings {
    uint64_t seed = 0;
    double near_dup = 0, eval_share = 0;
    std::optional<uint64_t> tokens;   // the calib budget the weighted sources share; none: all they have
    int64_t doc_tokens = 0;
    bool strip_boilerplate = false, allow_shortfall = false;
    std::string tokens_counted_as;
    CorpusMinhash minhash;
    int64_t task_context = 64, task_ending = 48, tasks_per_domain = 100;   // the choice tasks' (tasks.json)
    bool operator==(const CorpusSettings &) const = default;
};

struct CorpusSourceFile {
    std::string path;
    uint64_t bytes = 0;
    std::string digest;
    bool operator==(const CorpusSourceFile &) const = default;
};

// What one source took on one side.
struct CorpusSourceSide {
    std::optional<uint64_t> budget;   // none: all the source has
    uint64_t tokens = 0, shortfall = 0;
    uint64_t documents = 0, units = 0, pieces = 0, truncated = 0;
    uint64_t documents_available = 0, groups_available = 0;
    bool operator==(const CorpusSourceSide &) const = default;
};

struct CorpusSourceRow {
    std::string name, path, domain, group, split, media;
    std::vector<CorpusSourceFile> files;
    uint64_t documents_read = 0, empty_skipped = 0;
    std::vector<std::string> binary_skipped, not_media_skipped;
    uint64_t exact_duplicates = 0, near_duplicates = 0, boilerplate_only = 0;
    std::optional<uint64_t> tokens;   // a fixed budget (of eval for a split = "eval" source); without one
    std::optional<double> weight;     // the source's weight in the corpus budget
    CorpusSourceSide calib, eval;
    bool operator==(const CorpusSourceRow &) const = default;
};

struct CorpusDomainSide {
    uint64_t tokens = 0;
    double target_share = 0, share = 0;
    bool operator==(const CorpusDomainSide &) const = default;
};

struct CorpusDomainRow {
    std::string domain;
    CorpusDomainSide calib, eval;
    bool operator==(const CorpusDomainRow &) const = default;
};

struct CorpusDedupe {
    uint64_t exact = 0, near = 0;
    nlohmann::json examples = nlohmann::json::array();   // kept and dropped pairs, as shown to a reader
    bool operator==(const CorpusDedupe &) const = default;
};

struct CorpusBoilerplate {
    std::string source;
    uint64_t chars = 0, documents = 0;
    double share_of_their_bytes = 0;
    std::string begins;
    bool stripped = false;
    bool operator==(const CorpusBoilerplate &) const = default;
};

struct CorpusLeakCheck {
    uint64_t exact = 0, near = 0;
    uint64_t shared_ngrams = 0;        // eval documents sharing an n-gram with calib
    uint64_t shared_ngram_hashes = 0;
    uint64_t shared_groups = 0;
    int64_t ngram_units = 0, ngram_sample = 0;
    bool clean = true;                 // no hit of any kind
    nlohmann::json examples = nlohmann::json::array();
    bool operator==(const CorpusLeakCheck &) const = default;
};

// The domains' shares over the first `prefix` of a side's tokens.
struct CorpusPrefixShares {
    double prefix = 0;
    uint64_t tokens = 0;
    std::map<std::string, double> shares;   // by domain
    double max_abs_error_vs_target = 0;
    bool operator==(const CorpusPrefixShares &) const = default;
};

struct CorpusSeconds {
    double read = 0, dedupe = 0, tokenize = 0, leak_check = 0, write = 0;
    bool operator==(const CorpusSeconds &) const = default;
};

// calib.jsonl or eval.jsonl as written.
struct CorpusOutput {
    std::string path;
    uint64_t documents = 0, tokens = 0, bytes = 0;
    std::string digest;
    bool operator==(const CorpusOutput &) const = default;
};

// tasks.txt, the choice tasks in llama.cpp's HellaSwag format, and tasks.json beside it.
struct CorpusTasksOutput {
    std::string path;
    uint64_t tasks = 0;
    std::string digest;
    std::string domains;   // tasks.json's path
    bool operator==(const CorpusTasksOutput &) const = default;
};

struct CorpusOutputs {
    CorpusOutput calib, eval;
    CorpusTasksOutput tasks;
    bool operator==(const CorpusOutputs &) const = default;
};

struct CorpusReport {
    CorpusInputs inputs;
    CorpusSettings settings;
    std::vector<CorpusSourceRow> sources;
    std::vector<CorpusDomainRow> domains;
    CorpusDedupe dedupe;
    std::vector<CorpusBoilerplate> boilerplate;
    CorpusLeakCheck leak_check;
    std::vector<CorpusPrefixShares> calib_prefix_shares, eval_prefix_shares;   // "prefix_shares": by side
    std::vector<std::string> shortfalls;
    uint64_t tokenized_bytes = 0;
    CorpusSeconds seconds;
    CorpusOutputs outputs;
    bool operator==(const CorpusReport &) const = default;
};

// corpus.json's text: the record with the file's keys.
nlohmann::json to_json(const CorpusReport & r);

// The same for a record and each part that report.json repeats, in the form by which
// nlohmann::json converts a record where JSON is expected (`nlohmann::json j = record;`).
void to_json(nlohmann::json & j, const CorpusReport & r);
void to_json(nlohmann::json & j, const CorpusDomainRow & d);
void to_json(nlohmann::json & j, const CorpusDedupe & d);
void to_json(nlohmann::json & j, const CorpusBoilerplate & b);
void to_json(nlohmann::json & j, const CorpusLeakCheck & l);
void to_json(nlohmann::json & j, const CorpusOutputs & o);

// A moeprune-corpus report; refuses another format and impossible values by field.
CorpusReport read_corpus_report(const std::filesystem::path & path);

} // namespace moeprune
