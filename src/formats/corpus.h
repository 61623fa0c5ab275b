#pragma once
// Calibration corpora: one plain-text document, or JSONL with one document per line
// ({"text": ...} or {"messages": [{"role", "content"}, ...]}, optional "domain",
// "session", "turn"; a message's content may hold images and audio, docs/formats.md). Documents are evaluated from a clean context each, so a corpus
// can be sharded by lines and the shards' statistics merged exactly.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeprune {

// llama.cpp's libmtmd default media marker: a message's content holds one where each of
// its media parts goes.
inline constexpr const char * kMediaMarker = "<__media__>";

enum class Modality : uint8_t { Text = 0, Image = 1, Audio = 2 };
const char * modality_name(Modality m);  // "text", "image", "audio"

struct CorpusMedia {
    Modality modality = Modality::Image;
    std::filesystem::path path;            // resolved against the JSONL file's folder
};

struct CorpusMessage {
    std::string role, content;
    std::vector<CorpusMedia> media;        // in the order of kMediaMarker in content
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
    std::string digest;                    // xxh64 of the file's bytes (then each media file's), hex
    std::vector<CorpusDocument> documents;
    std::vector<std::string> domains;      // in order of first appearance
    // Modalities other than text that some document holds, in order: "image", "audio"
    std::vector<Modality> media_modalities;
};

// A JSONL document's "messages": a non-empty array of {role, content}, roles system, user,
// assistant or tool; anything else is an error naming `where`. A content is a string, or an
// array of parts {"type": "text", "text"}, {"type": "image" | "audio", "path"}; media paths
// are relative to `media_base`, and without one (or for a file that is not there or not a
// regular file) a media part is an error naming it.
std::vector<CorpusMessage> parse_messages(const nlohmann::json & messages, const std::string & where,
                                          const std::filesystem::path * media_base = nullptr);

// Every media part of the messages, in order.
std::vector<CorpusMedia> media_of(const std::vector<CorpusMessage> & messages);

// Media rows are counted under their modality's domain ("image", "audio"), after the
// corpus' own domains; a corpus domain of either name is refused.
void add_modality_domains(Corpus & corpus);

// Leaves out the documents with media (a stage that decodes text only, inside a run whose
// corpus has images); returns how many.
size_t drop_media_documents(Corpus & corpus);

// Every media file the corpus names: inputs, which no output may overwrite.
std::vector<std::filesystem::path> media_paths(const Corpus & corpus);

// For a reader that takes text only: the first document with media is an error naming
// its line and saying `why`, so its markers are never read as text.
void refuse_media(const Corpus & corpus, const std::string & why);

// A file ending in .jsonl (any case) is JSONL, anything else plain text. Every malformed line is
// an error naming the file and line.
Corpus read_corpus(const std::filesystem::path & path);

} // namespace moeprune
