#pragma once
// A document as the phases of build_corpus see it, its two sides, and the text of it that
// deduplication and the leak check compare.
#include "corpus/sources.h"

#include <string>
#include <vector>

namespace moeprune::corpus_build {

constexpr int kCalib = 0, kEval = 1;
constexpr const char * kSideName[2] = {"calib", "eval"};

struct Doc {
    SourceDocument d;
    bool dropped = false;
    size_t boiler_skip = 0;  // bytes of the body that are reported boilerplate
    int side = kCalib;
};

// The part of a document boilerplate lives in: a text, or a conversation's first message.
std::string & body(SourceDocument & d);

// What deduplication and the leak check compare. A document with media is its media
// files' digests and the answers: the user's words beside a file are mostly a prompt
// every document of a media source shares.
std::string content_text(const SourceDocument & d);

// Where a document came from: its file, and its line in a JSONL file.
std::string label(const std::vector<SourceFile> & files, const SourceDocument & d);

} // namespace moeprune::corpus_build
