#pragma once
// Calibration corpora: one plain-text document, or JSONL with one document per line
// ({"text": ...} or {"messages": [{"role", "content"}, ...]}, optional "domain",
// "session", "turn"). Documents are evaluated from a clean context each, so a corpus
// can be sharded by lines and the shards' statistics merged exactly.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeprune {

struct CorpusMessage {
    std::string role, content;
};

struct CorpusDocument {
    std::string text;                      // plain text, or empty for a conversation
    std::vector<CorpusMessage> messages;   // a conversation, rendered with the model's chat template
    std::string domain;                    // empty: none
    std::optional<int64_t> session, turn;
    uint64_t line = 0;                     // 1-based line of a JSONL corpus; 0 for plain text
};

struct Corpus {
    std::filesystem::path path;
    bool jsonl = false;
    uint64_t bytes = 0;
    std::string digest;                    // xxh64 of the file's bytes, hex
    std::vector<CorpusDocument> documents;
    std::vector<std::string> domains;      // in order of first appearance
};

// A JSONL document's "messages": a non-empty array of {role, content}, roles system, user,
// assistant or tool; anything else is an error naming `where`.
std::vector<CorpusMessage> parse_messages(const nlohmann::json & messages, const std::string & where);

// A file ending in .jsonl (any case) is JSONL, anything else plain text. Every malformed line is
// an error naming the file and line.
Corpus read_corpus(const std::filesystem::path & path);

} // namespace moeprune
