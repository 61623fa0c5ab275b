// corpus.json's record (formats/corpus_report): written and read back equal, and impossible files refused by field.
#include "core/atomic_file.h"
#include "core/errors.h"
#include "formats/corpus_report.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

using namespace moeprune;
using nlohmann::json;

namespace {

CorpusReport sample_report() {
    CorpusReport r;
    r.inputs = {{"m.gguf", 123456, "xxh3:1234", "xxh64:abcd"}, "corpus.toml", std::nullopt, 4096};
    r.settings = {uint64_t(1) << 63 | 5, 0.5, 0.1, 2000, 4096, false, true, "llama.cpp tokenizer", {5, 128, 3, 42}};
    CorpusSourceRow prose{.name = "prose", .path = "docs/*.md", .domain = "en", .group = "path:-2", .split = "both", .media = "text"};
    prose.files = {{"docs/a.md", 100, "00ff00ff00ff00ff"}, {"docs/b.md", 200, "ff00ff00ff00ff00"}};
    prose.documents_read = 40;
    prose.binary_skipped = {"docs/logo.png"};
    prose.exact_duplicates = 3;
    prose.near_duplicates = 2;
    prose.weight = 2.0;
    prose.calib = {std::nullopt, 1500, 0, 30, 31, 2, 1, 32, 8};
    prose.eval = {200, 150, 50, 3, 3, 0, 0, 3, 1};
    CorpusSourceRow chat{.name = "chat", .path = "chat.jsonl", .domain = "chat", .group = "field:session", .split = "calib", .media = "text"};
    chat.tokens = 500;
    chat.calib = {500, 512, 0, 10, 10, 0, 0, 12, 12};
    r.sources = {prose, chat};
    r.domains = {{"en", {1500, 0.75, 0.7455}, {150, 1.0, 1.0}}, {"chat", {512, 0.25, 0.2545}, {0, 0.0, 0.0}}};
    r.dedupe = {3, 2, json::array({{{"kind", "exact"}, {"kept", {{"source", "prose"}, {"at", "docs/a.md"}}}}})};
    r.boilerplate = {{"chat", 300, 7, 0.3125, "You are a helpful", false}};
    r.leak_check = {0, 1, 0, 0, 0, 25, 8, false, json::array({{{"kind", "near"}, {"jaccard", 0.6}}})};
    r.calib_prefix_shares = {{0.1, 201, {{"chat", 0.25}, {"en", 0.75}}, 0.01}, {1.0, 2012, {{"chat", 0.2545}, {"en", 0.7455}}, 0.0045}};
    r.eval_prefix_shares = {{0.1, 15, {{"en", 1.0}}, 0.0}};
    r.shortfalls = {"source \"prose\" has 150 eval tokens, short of its budget of 200"};
    r.tokenized_bytes = 9000;
    r.seconds = {0.5, 0.25, 1.5, 0.125, 0.0625};
    r.outputs = {{"out/calib.jsonl", 40, 2012, 8000, "0123456789abcdef"}, {"out/eval.jsonl", 3, 150, 600, "fedcba9876543210"}};
    return r;
}

std::filesystem::path write(const test::TempDir & dir, const std::string & name, const json & doc) {
    const std::filesystem::path p = dir / name;
    write_file_atomic(p, doc.dump(2) + "\n");
    return p;
}


} // namespace

TEST(CorpusReport, WrittenAndReadBackIsTheSameRecord) {
    test::TempDir dir;
    const CorpusReport r = sample_report();
    const json doc = to_json(r);
    EXPECT_EQ(json(r), doc);
    EXPECT_EQ(doc["format"], "moeprune-corpus");
    EXPECT_TRUE(doc["inputs"]["mmproj"].is_null());
    EXPECT_TRUE(doc["sources"][0]["calib"]["budget"].is_null());
    EXPECT_FALSE(doc["sources"][0].contains("tokens"));
    EXPECT_FALSE(doc["sources"][1].contains("weight"));
    const CorpusReport back = read_corpus_report(write(dir, "corpus.json", doc));
    EXPECT_EQ(back, r);
    EXPECT_EQ(to_json(back).dump(2), doc.dump(2));
}

TEST(CorpusReport, ImpossibleValuesAreRefusedByFileAndField) {
    test::TempDir dir;
    const json good = to_json(sample_report());
    const auto forged = [&](const std::string & name, const auto & forge) {
        json doc = good;
        forge(doc);
        return write(dir, name, doc);
    };
    test::expect_read_refused(read_corpus_report, forged("a.json", [](json & d) { d["format"] = "moeprune-eval"; }), "is not a moeprune corpus report");
    test::expect_read_refused(read_corpus_report, forged("b.json", [](json & d) { d["version"] = 2; }), "version: is 2");
    test::expect_read_refused(read_corpus_report, forged("c.json", [](json & d) { d["domains"][1]["calib"]["share"] = 2; }), "domains[1].calib.share: is 2");
    test::expect_read_refused(read_corpus_report, forged("d.json", [](json & d) { d["sources"][0]["eval"]["shortfall"] = 0; }),
                   "sources[0].eval.shortfall: is 0, but the side took 150 tokens of a budget of 200");
    test::expect_read_refused(read_corpus_report, forged("e.json", [](json & d) { d["leak_check"]["clean"] = true; }), "leak_check.clean: is true beside");
    test::expect_read_refused(read_corpus_report, forged("f.json", [](json & d) { d["outputs"]["eval"]["tokens"] = -1; }), "outputs.eval.tokens: is -1");
    test::expect_read_refused(read_corpus_report, forged("g.json", [](json & d) { d["settings"]["seed"] = -1; }), "settings.seed");
    test::expect_read_refused(read_corpus_report, forged("h.json", [](json & d) { d["prefix_shares"]["calib"][0]["shares"]["en"] = "most"; }),
                   "prefix_shares.calib[0].shares.en");
    test::expect_read_refused(read_corpus_report, forged("i.json", [](json & d) { d["sources"][1].erase("tokens"); }), "sources[1].weight: is missing");
    test::expect_read_refused(read_corpus_report, forged("j.json", [](json & d) { d["boilerplate"][0].erase("begins"); }), "boilerplate[0].begins: is missing");
}
