#pragma once
// `moeprune corpus`: sources -> deduplicated documents -> calib/eval split by group ->
// token budgets measured with the model's tokenizer -> interleaved calib.jsonl and
// eval.jsonl, with corpus.json reporting what was done and a leak check of eval
// against calib. docs/corpus.md is the user's description.
#include "corpus/leak_check.h"
#include "corpus/manifest.h"
#include "formats/corpus_report.h"

#include <filesystem>

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
CorpusReport build_corpus(const CorpusOptions & opt);

} // namespace moeprune
