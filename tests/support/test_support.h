#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <gtest/gtest.h>

#include "core/errors.h"

#include "synth/synth.h"

namespace moeprune::test {

// Tests synthesize with the Qwen2 tokenizer cut to its first 4,096 ordinary tokens, one token
// per character and the special tokens (synth --vocab-first, about 23,000 tokens): with all
// 151,936 the output layer and the full-vocabulary KL were most of the suite's time (issue 46).
inline constexpr int kTestVocabFirst = 4096;
// SynthOptions with the test vocabulary.
SynthOptions synth_options();
// The id `model`'s vocabulary gives a special token's text, such as "<|im_start|>".
int special_token_id(const std::filesystem::path & model, const std::string & text);

// A fresh directory per test, removed afterwards.
class TempDir {
public:
    TempDir();
    ~TempDir();
    const std::filesystem::path & path() const { return path_; }
    std::filesystem::path operator/(const std::string & name) const { return path_ / name; }

private:
    std::filesystem::path path_;
};

struct CommandResult {
    int exit_code;
    std::string output;  // stdout and stderr together
};
CommandResult run_command(const std::string & command);

std::filesystem::path bin(const std::string & name);  // build/bin/NAME

// The command line that runs build/bin/moeprune with `args`; a synth without --vocab-first
// gets the test vocabulary.
std::string moeprune_cmd(const std::string & args);

// `moeprune synth ARGS -o OUT`; a failure fails the calling test (check HasFatalFailure).
void synth(const std::string & args, const std::filesystem::path & out);

nlohmann::json read_json(const std::filesystem::path & path);

// `read(path)` refuses the file: it throws an Error that names the file and holds `needle`.
template <class Read> void expect_read_refused(Read read, const std::filesystem::path & path, const std::string & needle) {
    try {
        read(path);
        ADD_FAILURE() << "accepted " << path;
    } catch (const Error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
}

// eval's --per-token JSONL grouped by candidate name, rows in file order.
std::map<std::string, std::vector<nlohmann::json>> per_token_rows(const std::filesystem::path & path);

// About 700 tokens of mixed English, source code and CJK text: enough for
// llama-perplexity at -c 128 and for every planted text kind to appear.
std::string mixed_text();

void write_text(const std::filesystem::path & path, const std::string & text);

// llama-perplexity's final estimate for `model` on `text` (extra arguments appended), or
// nullopt when it fails; `log` receives its last output. llama.cpp's logger writes from a
// thread that can lose the last lines at exit (about 1 run in 15 here, exit status 0), so
// a run whose output lacks the estimate is repeated, up to three times: the computation is
// deterministic, only its printing is lost.
std::optional<double> llama_perplexity(const std::filesystem::path & model, const std::filesystem::path & text,
                                       const std::string & args, std::string * log = nullptr);
std::string read_bytes(const std::filesystem::path & path);

// Writes a trace in the seed pipeline's Q4RT v1 layout, independently of the library's
// reader. record(t, ids, logits) fills token t's [n_layer][top_m] candidates; logits
// must be exact in f16. header_count is what the header claims (the seed wrote 0 when
// killed); extra_tail_bytes appends a torn record.
using TokenRecordFn = std::function<void(uint64_t, std::vector<uint16_t> &, std::vector<float> &)>;
void write_q4rt(const std::filesystem::path & path, uint32_t n_layer, uint32_t n_expert, uint32_t top_m,
                uint64_t n_tokens, uint32_t header_count, const TokenRecordFn & record, size_t extra_tail_bytes = 0);

} // namespace moeprune::test
