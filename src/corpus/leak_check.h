#pragma once
// The leak check of a corpus: eval's documents against calib's.
#include "formats/corpus_report.h"

#include <cstddef>
#include <string>
#include <vector>

namespace moeprune {

// One document of a side, as the leak check sees it.
struct LeakDocument {
    std::string text;        // the text (a conversation's contents joined by newlines)
    std::string group;
    std::string label;       // where it came from, for examples
    size_t skip = 0;         // leading bytes that are reported boilerplate, not compared
};

// Eval against calib: exact duplicates (normalized), near duplicates (Jaccard >= near_dup),
// documents sharing a long n-gram, and groups on both sides; counts with examples.
CorpusLeakCheck leak_check(const std::vector<LeakDocument> & calib, const std::vector<LeakDocument> & eval,
                           double near_dup, int threads);

} // namespace moeprune
