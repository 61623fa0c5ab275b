#pragma once
// Reading a source's files into documents: plain text and Markdown (one document per
// file), JSONL (one per line: "text", chat "messages", or "prompt" + "response").
#include "formats/corpus.h"
#include "corpus/manifest.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct SourceDocument {
    uint32_t source = 0;
    uint32_t file = 0;                     // index into SourceFiles::files
    uint64_t line = 0;                     // 1-based JSONL line; 0 for a whole file
    std::string text;                      // plain text (empty for a conversation)
    std::vector<CorpusMessage> messages;   // a conversation
    bool prompt_response = false;          // messages came from "prompt" + "response"
    std::string group;                     // the group key, qualified by the rule's kind
    // "media:<xxh64>" of each media file, in order: what deduplication and the leak check
    // compare a document with media by, with its answers (never the shared prompt).
    std::string media_key;
};

struct SourceFile {
    std::filesystem::path path;
    uint64_t bytes = 0;
    std::string digest;                    // xxh64 of the bytes
};

struct SourceFiles {
    std::vector<SourceFile> files;
    std::vector<SourceDocument> documents;
    uint64_t empty_skipped = 0;            // empty files and whitespace-only texts
    std::vector<std::string> binary_skipped;  // files of a directory or glob that are not text
    std::vector<std::string> not_media_skipped;  // files of a media source of another type (captions aside)
};

// File name endings libmtmd reads as each modality (stb_image's and miniaudio's formats).
bool is_media_file(Modality m, const std::filesystem::path & path);

// Files of a source's path (a file, a directory searched recursively, or a glob), sorted,
// relative paths starting at `base_dir`. No match is an error naming the source.
std::vector<std::filesystem::path> expand_source_path(const SourceSpec & s, const std::filesystem::path & base_dir);

// The folder a source's group keys are relative to: `base_dir` (the manifest's folder)
// for a relative source path, so keys are the paths as written; for an absolute one the
// folder before its first glob character (the directory itself, or a file's folder).
std::filesystem::path source_key_root(const SourceSpec & s, const std::filesystem::path & base_dir);

// Reads one file of source `index`. Every malformed document (invalid UTF-8, a JSONL
// line of the wrong shape, a group key that cannot be found) is an error naming the
// file and line. With `skip_binary` (files found in a directory or by a glob), a file
// whose first 8 KiB hold a NUL byte or break UTF-8 (an image, an archive) is skipped
// and listed instead.
void read_source_file(const SourceSpec & s, uint32_t index, const std::filesystem::path & path, bool skip_binary,
                      SourceFiles & out);

// Offset of the first byte that breaks UTF-8 (overlong forms, surrogates and code points
// past U+10FFFF included), or npos.
size_t invalid_utf8_at(std::string_view text);

} // namespace moeprune
