#pragma once
// What a corpus is made of: the sources of a TOML manifest (or of --source flags) and the
// corpus-wide settings. docs/corpus.md documents every key.
#include "formats/corpus.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// What must never be split across calib and eval.
struct GroupRule {
    enum class Kind { File, Document, Field, PathComponent, Regex } kind = Kind::File;
    std::string field;          // Field; Regex over a field when not empty
    int component = 0;          // PathComponent: 0-based, negative counts from the end
    std::string pattern;        // Regex: the first capture group (or the whole match) is the key
    std::string written;        // as the manifest spells it, for reports
};

enum class SourceFormat { Auto, Text, Markdown, Jsonl };
enum class SplitSide { Both, Calib, Eval };
// Over-long documents: conversations keep their end, other text is cut into pieces,
// unless a source says otherwise.
enum class Truncate { Auto, Left, Pieces };

struct SourceSpec {
    std::string name;           // unique; defaults to the path
    std::string path;           // file, directory (recursive) or glob, relative to the manifest
    std::string domain;
    GroupRule group;
    std::optional<uint64_t> tokens;       // this source's calib budget (eval budget for split = "eval")
    std::optional<uint64_t> eval_tokens;  // eval budget; default tokens * eval_share / (1 - eval_share)
    std::optional<double> weight;         // share of the corpus budget when no tokens are given
    SourceFormat format = SourceFormat::Auto;
    SplitSide split = SplitSide::Both;
    Truncate truncate = Truncate::Auto;
    // A media source: every image (or audio) file of `path` is one conversation, the user
    // giving `prompt` and the file, the assistant answering with the caption in the file's
    // NAME.txt beside it when there is one. Text (the default) reads documents.
    Modality media = Modality::Text;
    std::string prompt;         // the user's words beside each file; empty: a default per modality
    // Where group keys of files (`file`, `path:N`, a regex over the path) are taken
    // relative to, so a corpus moved elsewhere splits the same; set by source_key_root.
    std::filesystem::path key_root;
};

// The longest context or ending of a choice task, in tokens (--task-context, task_context).
inline constexpr uint64_t kMostTaskTokens = uint64_t(1) << 16;

struct CorpusSpec {
    std::filesystem::path manifest;       // empty for --source flags
    std::filesystem::path base_dir;       // relative source paths start here
    std::vector<SourceSpec> sources;
    uint64_t seed = 0;
    double near_dup = 0.5;                // Jaccard over shingles at or above which documents are one
    double eval_share = 0.1;              // share of groups that go to eval
    std::optional<uint64_t> tokens;       // calib budget shared by weighted sources; none: all they have
    uint32_t doc_tokens = 4096;           // longer documents are truncated or cut into pieces
    bool strip_boilerplate = false;
    // Choice tasks from the held-out side (corpus/choice_tasks.cpp): up to tasks_per_domain per
    // domain (0: none), each a context of about task_context tokens and four endings of
    // about task_ending.
    int64_t task_context = 64, task_ending = 48, tasks_per_domain = 100;
};

CorpusSpec read_manifest(const std::filesystem::path & path);

// "DOMAIN=PATH_OR_GLOB": one group per file, weight 1, both sides.
SourceSpec source_from_flag(const std::string & flag);

// Parses a group rule ("file", "field:NAME", "path:N", "regex:PATTERN"); `origin` names
// where it was written.
GroupRule parse_group_rule(const std::string & text, const std::string & group_on, const std::string & origin);

const char * to_string(SplitSide s);

} // namespace moeprune
