#pragma once
// `moeprune corpus`: sources -> deduplicated documents -> calib/eval split by group ->
// token budgets measured with the model's tokenizer -> interleaved calib.jsonl and
// eval.jsonl, with corpus.json reporting what was done and a leak check of eval
// against calib. docs/corpus.md is the user's description.
#include "corpus/manifest.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct CorpusOptions {
    std::filesystem::path model;
    std::filesystem::path mmproj;   // the projector that counts media tokens; needed for media sources
    CorpusSpec spec;
    std::filesystem::path out_dir;
    std::filesystem::path report;   // a copy of corpus.json elsewhere; empty: none
    bool allow_shortfall = false;   // a budget a source cannot meet is reported, not an error
    int threads = 0;                // 0: one per core
};

// Builds the corpus and returns the report (also written to out_dir/corpus.json).
nlohmann::json build_corpus(const CorpusOptions & opt);

// One document of a side, as the leak check sees it.
struct LeakDocument {
    std::string text;        // the text (a conversation's contents joined by newlines)
    std::string group;
    std::string label;       // where it came from, for examples
    size_t skip = 0;         // leading bytes that are reported boilerplate, not compared
};

// Eval against calib: exact duplicates (normalized), near duplicates (Jaccard >= near_dup),
// documents sharing a long n-gram, and groups on both sides; counts with examples.
nlohmann::json leak_check(const std::vector<LeakDocument> & calib, const std::vector<LeakDocument> & eval,
                          double near_dup, int threads);

} // namespace moeprune
