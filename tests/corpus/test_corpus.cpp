// moeprune corpus: planted duplicates, near duplicates, boilerplate and groups are found
// and kept apart; budgets and prefix shares are met in the model's tokens; the output
// is what collect reads; bad input is refused by name with nothing written.
#include "corpus/build.h"
#include "corpus/similarity.h"
#include "corpus/sources.h"
#include "core/digest.h"
#include "formats/task_set.h"
#include "engine/session.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <map>
#include <random>
#include <set>
#include <sstream>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

std::vector<json> read_jsonl(const fs::path & p) {
    std::vector<json> out;
    std::istringstream in(test::read_bytes(p));
    for (std::string line; std::getline(in, line);) {
        out.push_back(json::parse(line));
    }
    return out;
}

// Words that are not in any dictionary, so texts share shingles only where planted.
std::string word(std::mt19937_64 & rng) {
    static const char * syll[] = {"ka", "lo", "mi", "ne", "ru", "ta", "vo", "xe", "zi", "pu", "se", "do", "fa", "gi", "hu", "jo"};
    std::string w;
    const int n = 2 + int(rng() % 3);
    for (int i = 0; i < n; ++i) {
        w += syll[rng() % 16];
    }
    return w;
}

std::vector<std::string> words(std::mt19937_64 & rng, size_t n) {
    std::vector<std::string> out;
    for (size_t i = 0; i < n; ++i) {
        out.push_back(word(rng));
    }
    return out;
}

std::string join(const std::vector<std::string> & w) {
    std::string s;
    for (const std::string & x : w) {
        s += (s.empty() ? "" : " ") + x;
    }
    return s;
}

std::string cjk(std::mt19937_64 & rng, size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) {
        const uint32_t cp = 0x4E00 + uint32_t(rng() % 2000);
        s += char(0xE0 | (cp >> 12));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
        if (i % 20 == 19) {
            s += "。";
        }
    }
    return s;
}

std::string code(std::mt19937_64 & rng, size_t lines) {
    std::string s;
    for (size_t i = 0; i < lines; ++i) {
        s += fmt::format("    int {} = {}({}, {});\n", word(rng), word(rng), word(rng), rng() % 1000);
    }
    return s;
}

class CorpusTest : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        init_llama({});
        dir_ = new test::TempDir();
        // The whole vocabulary: the planted domains must differ in bytes per token as much as
        // a real tokenizer makes them, and corpus only tokenizes.
        const auto r = test::run_command(
            moeprune_cmd(fmt::format("synth --arch qwen3moe --layers 2 --experts 8 --used 2 --vocab-first 0 -o {}", model().string())));
        ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    static void TearDownTestSuite() { delete dir_; }
    static fs::path model() { return dir_->path() / "m.gguf"; }

    static test::TempDir * dir_;
    test::TempDir tmp_;
};
test::TempDir * CorpusTest::dir_ = nullptr;

// The planted corpus: three domains of different characters per token; exact duplicates
// (changed only in case and spacing), near duplicates above the threshold and distant
// relatives below it, multi-document groups, a shared preamble.
struct Planted {
    std::vector<std::pair<std::string, std::string>> exact;  // kept text, duplicate
    std::vector<double> near_j, far_j;                      // planted Jaccard of each pair
    size_t preamble_docs = 0;
};

Planted write_planted(const fs::path & dir) {
    std::mt19937_64 rng(42);
    Planted p;
    std::string en, chat, cjk_lines;
    // English-like: 300 tasks of 3 documents each.
    std::vector<std::string> originals;
    for (int t = 0; t < 300; ++t) {
        for (int k = 0; k < 3; ++k) {
            const std::string text = join(words(rng, 25));
            originals.push_back(text);
            en += json({{"text", text}, {"task", fmt::format("task-{}", t)}}).dump() + "\n";
        }
    }
    for (int i = 0; i < 20; ++i) {
        const std::string & o = originals[size_t(i * 7)];
        std::string dup = "  " + o + "\n";
        std::transform(dup.begin(), dup.begin() + 8, dup.begin(), [](unsigned char c) { return char(std::toupper(c)); });
        p.exact.emplace_back(o, dup);
        en += json({{"text", dup}, {"task", fmt::format("dup-{}", i)}}).dump() + "\n";
    }
    // Near duplicates: a longer original, and a copy with one word in ten changed (J ~ 0.6-0.7),
    // and a distant relative with one in three changed (J ~ 0.1-0.2).
    for (int i = 0; i < 20; ++i) {
        const std::vector<std::string> base = words(rng, 60);
        std::vector<std::string> near = base, far = base;
        for (size_t k = 5; k < near.size(); k += 30) {
            near[k] = word(rng);
        }
        for (size_t k = 0; k < far.size(); k += 3) {
            far[k] = word(rng);
        }
        p.near_j.push_back(jaccard(shingle_set(join(base)), shingle_set(join(near))));
        p.far_j.push_back(jaccard(shingle_set(join(base)), shingle_set(join(far))));
        en += json({{"text", join(base)}, {"task", fmt::format("near-{}", i)}}).dump() + "\n";
        en += json({{"text", join(near)}, {"task", fmt::format("near-copy-{}", i)}}).dump() + "\n";
        en += json({{"text", join(far)}, {"task", fmt::format("far-{}", i)}}).dump() + "\n";
    }
    test::write_text(dir / "en.jsonl", en);
    // Conversations sharing a long system preamble, in sessions of two.
    std::string preamble;
    for (int l = 0; l < 4; ++l) {
        preamble += "You are a careful assistant. " + join(words(rng, 6)) + ".\n";
    }
    for (int i = 0; i < 200; ++i) {
        chat += json({{"messages",
                       {{{"role", "system"}, {"content", preamble + join(words(rng, 6))}},
                        {{"role", "user"}, {"content", join(words(rng, 10))}},
                        {{"role", "assistant"}, {"content", join(words(rng, 12))}}}},
                      {"session", i / 2}})
                    .dump() +
                "\n";
    }
    p.preamble_docs = 200;
    test::write_text(dir / "chat.jsonl", chat);
    // CJK files (one group each) and code files.
    fs::create_directories(dir / "cjk");
    fs::create_directories(dir / "code" / "repo-a");
    fs::create_directories(dir / "code" / "repo-b");
    for (int i = 0; i < 400; ++i) {
        test::write_text(dir / "cjk" / fmt::format("{:03}.txt", i), cjk(rng, 40));
    }
    for (int i = 0; i < 400; ++i) {
        test::write_text(dir / "code" / (i % 2 ? "repo-a" : "repo-b") / fmt::format("f{:03}.c", i), code(rng, 3));
    }
    return p;
}

const char * kManifest = R"(
[corpus]
seed = 11
eval_share = 0.2
doc_tokens = 256

[[source]]
path = "en.jsonl"
domain = "en"
group = "field:task"
tokens = 24000

[[source]]
path = "chat.jsonl"
domain = "chat"
group = "field:session"
tokens = 18000

[[source]]
path = "cjk"
domain = "cjk"
tokens = 12000

[[source]]
name = "code"
path = "code/*"
domain = "code"
group = "path:-2"
tokens = 6000
eval_tokens = 0
)";

CorpusOptions planted_options(const fs::path & dir, const fs::path & model, const fs::path & out) {
    test::write_text(dir / "corpus.toml", kManifest);
    CorpusOptions o;
    o.model = model;
    o.spec = read_manifest(dir / "corpus.toml");
    o.out_dir = out;
    return o;
}

} // namespace

TEST(CorpusText, UnitsCoverWordsAndEveryCjkCharacter) {
    EXPECT_EQ(text_units("Hello, world_1 -- 42!").size(), 3u);
    EXPECT_EQ(text_units("日本語のテキスト").size(), 8u);
    EXPECT_EQ(text_units("Hello").front().hash, text_units("hELLO").front().hash);
    EXPECT_NE(text_units("Hello").front().hash, text_units("Hallo").front().hash);
}

TEST(CorpusText, InvalidUtf8IsFoundWhereItIs) {
    EXPECT_EQ(invalid_utf8_at("plain ascii and 日本語 and é"), std::string_view::npos);
    EXPECT_EQ(invalid_utf8_at(std::string("abc\xC0\x80", 5)), 3u);         // overlong
    EXPECT_EQ(invalid_utf8_at(std::string("ab\xED\xA0\x80", 5)), 2u);       // surrogate
    EXPECT_EQ(invalid_utf8_at(std::string("a\xF5\x80\x80\x80", 5)), 1u);    // past U+10FFFF
    EXPECT_EQ(invalid_utf8_at(std::string("abcdefghij\xE6\x97", 12)), 10u); // cut short
    EXPECT_EQ(invalid_utf8_at(std::string("abcdefgh\x80", 9)), 8u);         // stray continuation
}

TEST(CorpusText, NormalizedDigestIgnoresOnlyCaseOfAsciiAndSpacing) {
    EXPECT_EQ(normalized_digest("Hello  World\n"), normalized_digest(" hello world"));
    EXPECT_NE(normalized_digest("Hello World"), normalized_digest("Hello Word"));
    EXPECT_NE(normalized_digest("ab"), normalized_digest("a b"));
}

TEST(CorpusText, LshProposesEveryPairAboveTheThreshold) {
    std::mt19937_64 rng(5);
    LshIndex lsh(0.5);
    std::vector<std::vector<uint64_t>> bases;
    for (uint32_t i = 0; i < 300; ++i) {
        bases.push_back(shingle_set(join(words(rng, 80))));
        lsh.add(i, minhash(bases.back()));
    }
    int proposed = 0, above = 0, unrelated = 0;
    for (uint32_t i = 0; i < 300; ++i) {
        // Shingle sets at Jaccard about 0.55-0.65 with base i.
        std::vector<uint64_t> mod = bases[i];
        for (size_t k = 0; k < mod.size(); k += 4) {
            mod[k] = rng();
        }
        std::sort(mod.begin(), mod.end());
        if (jaccard(mod, bases[i]) < 0.5) {
            continue;
        }
        ++above;
        const auto c = lsh.candidates(minhash(mod));
        proposed += std::find(c.begin(), c.end(), i) != c.end();
        unrelated += int(c.size()) - (std::find(c.begin(), c.end(), i) != c.end());
    }
    ASSERT_GT(above, 250);
    EXPECT_GE(proposed, above - 2) << "recall at J >= 0.5 must be about 0.99";
    EXPECT_LT(unrelated, 30) << "unrelated texts should rarely share a band";
}

TEST(CorpusText, BoilerplateIsALongPrefixOfWholeLinesSharedByEnoughDocuments) {
    const std::string pre = std::string(300, 'p') + "\n" + "second line of the preamble\n";
    std::vector<std::string> texts = {pre + "one", pre + "two", pre + "three", "other text", std::string(400, 'q') + "\nx",
                                      std::string(400, 'q') + "\ny"};
    std::vector<std::string_view> views(texts.begin(), texts.end());
    const auto found = find_boilerplate(views);
    ASSERT_EQ(found.size(), 1u) << "two documents sharing a prefix are not boilerplate";
    EXPECT_EQ(found[0].prefix, pre);
    EXPECT_EQ(found[0].members, (std::vector<size_t>{0, 1, 2}));
}

TEST_F(CorpusTest, PlantedTruthIsFoundAndKeptApart) {
    const Planted p = write_planted(tmp_.path());
    CorpusOptions o = planted_options(tmp_.path(), model(), tmp_ / "out");
    const json r = build_corpus(o);

    // Every duplicate found, no merge below the threshold.
    EXPECT_EQ(r["sources"][0]["exact_duplicates"].get<int>(), 20);
    for (size_t i = 0; i < p.near_j.size(); ++i) {
        ASSERT_GE(p.near_j[i], 0.55) << "planted near duplicate " << i;
        ASSERT_LT(p.far_j[i], 0.4) << "planted distant relative " << i;
    }
    EXPECT_EQ(r["sources"][0]["near_duplicates"].get<int>(), 20);
    EXPECT_EQ(r["dedupe"]["near"].get<int>(), 20);
    for (const json & e : r["dedupe"]["examples"]) {
        if (e["kind"] == "near") {
            EXPECT_GE(e["jaccard"].get<double>(), 0.5);
        }
    }
    const auto calib = read_jsonl(tmp_ / "out" / "calib.jsonl"), eval = read_jsonl(tmp_ / "out" / "eval.jsonl");
    std::multiset<std::string> texts;
    for (const auto * side : {&calib, &eval}) {
        for (const json & d : *side) {
            if (d.contains("text")) {
                texts.insert(d["text"].get<std::string>());
            }
        }
    }
    for (const auto & [kept, dup] : p.exact) {
        EXPECT_EQ(texts.count(dup), 0u) << "an exact duplicate was written: " << dup.substr(0, 40);
    }

    // The preamble is reported, and it does not make unrelated conversations near duplicates.
    ASSERT_EQ(r["boilerplate"].size(), 1u) << r["boilerplate"].dump();
    EXPECT_EQ(r["boilerplate"][0]["source"], "chat.jsonl");
    EXPECT_EQ(r["boilerplate"][0]["documents"].get<size_t>(), p.preamble_docs);
    EXPECT_EQ(r["sources"][1]["near_duplicates"].get<int>(), 0);

    // No group on both sides, and groups of several documents whole on one side.
    std::map<std::string, std::set<std::string>> sides_of_group;
    for (const json & d : calib) {
        sides_of_group[d["group"].get<std::string>()].insert("calib");
    }
    for (const json & d : eval) {
        sides_of_group[d["group"].get<std::string>()].insert("eval");
    }
    for (const auto & [g, sides] : sides_of_group) {
        EXPECT_EQ(sides.size(), 1u) << "group " << g << " is on both sides";
    }
    EXPECT_TRUE(sides_of_group.count("path:repo-a") + sides_of_group.count("path:repo-b") >= 1);
    EXPECT_GT(r["sources"][0]["eval"]["groups_available"].get<int>(), 20);

    // The leak check of the output is clean.
    EXPECT_TRUE(r["leak_check"]["clean"].get<bool>()) << r["leak_check"].dump();

    // Budgets met in the model's tokens (overshoot below one document), shares at every prefix.
    const std::map<std::string, double> target = {{"en", 0.4}, {"chat", 0.3}, {"cjk", 0.2}, {"code", 0.1}};
    for (const json & s : r["sources"]) {
        const uint64_t budget = s["calib"]["budget"].get<uint64_t>(), got = s["calib"]["tokens"].get<uint64_t>();
        EXPECT_GE(got, budget) << s["name"];
        EXPECT_LT(got, budget + 256) << s["name"];
    }
    for (const json & row : r["prefix_shares"]["calib"]) {
        for (const auto & [domain, share] : row["shares"].items()) {
            EXPECT_NEAR(share.get<double>(), target.at(domain), 0.02) << "prefix " << row["prefix"] << " domain " << domain;
        }
    }
    // Shares are of tokens, not characters: in bytes the same output is far from the targets.
    std::map<std::string, double> bytes;
    double all_bytes = 0;
    for (const json & d : calib) {
        const double n = double(d.contains("text") ? d["text"].get<std::string>().size() : d["messages"].dump().size());
        bytes[d["domain"].get<std::string>()] += n;
        all_bytes += n;
    }
    double worst = 0;
    for (const auto & [domain, share] : target) {
        worst = std::max(worst, std::abs(bytes[domain] / all_bytes - share));
    }
    EXPECT_GT(worst, 0.05) << "the planted domains should differ in bytes per token";
    EXPECT_EQ(r["outputs"]["eval"]["documents"].get<size_t>(), eval.size());
    for (const json & d : eval) {
        EXPECT_NE(d["domain"], "code") << "eval_tokens = 0 keeps a source out of eval";
    }
}

TEST_F(CorpusTest, StrippedBoilerplateStaysInOneDocument) {
    const Planted p = write_planted(tmp_.path());
    CorpusOptions o = planted_options(tmp_.path(), model(), tmp_ / "out");
    o.spec.strip_boilerplate = true;
    o.allow_shortfall = true;  // the stripped conversations are shorter than the budget was set for
    const json r = build_corpus(o);
    ASSERT_EQ(r["boilerplate"].size(), 1u);
    EXPECT_TRUE(r["boilerplate"][0]["stripped"].get<bool>());
    const std::string preamble_start = r["boilerplate"][0]["begins"].get<std::string>();
    int with_preamble = 0, conversations = 0;
    for (const char * side : {"calib.jsonl", "eval.jsonl"}) {
        for (const json & d : read_jsonl(tmp_ / "out" / side)) {
            if (d.contains("messages")) {
                ++conversations;
                with_preamble += d["messages"][0]["content"].get<std::string>().rfind(preamble_start, 0) == 0;
            }
        }
    }
    EXPECT_GT(conversations, 10);
    EXPECT_LE(with_preamble, 1) << "the preamble is kept in the first document only";
    (void)p;
}

TEST_F(CorpusTest, SameSeedSameBytesOtherSeedOtherSplit) {
    write_planted(tmp_.path());
    CorpusOptions o = planted_options(tmp_.path(), model(), tmp_ / "a");
    build_corpus(o);
    o.out_dir = tmp_ / "b";
    o.threads = 1;
    build_corpus(o);
    o.out_dir = tmp_ / "c";
    o.spec.seed = 12;
    build_corpus(o);
    for (const char * f : {"calib.jsonl", "eval.jsonl"}) {
        EXPECT_EQ(test::read_bytes(tmp_ / "a" / f), test::read_bytes(tmp_ / "b" / f)) << f;
        EXPECT_NE(test::read_bytes(tmp_ / "a" / f), test::read_bytes(tmp_ / "c" / f)) << f;
    }
}

TEST(CorpusLeakCheck, CountsEveryKindOfLeak) {
    std::mt19937_64 rng(9);
    std::vector<LeakDocument> calib, eval;
    for (int i = 0; i < 40; ++i) {
        calib.push_back({join(words(rng, 60)), fmt::format("g{}", i), fmt::format("calib:{}", i), 0});
    }
    for (int i = 0; i < 40; ++i) {
        eval.push_back({join(words(rng, 60)), fmt::format("h{}", i), fmt::format("eval:{}", i), 0});
    }
    const json clean = leak_check(calib, eval, 0.5, 2);
    EXPECT_TRUE(clean["clean"].get<bool>()) << clean.dump();

    eval[0].text = calib[3].text + "  ";                                             // exact
    std::vector<std::string> w;
    std::istringstream in(calib[5].text);
    for (std::string x; in >> x;) {
        w.push_back(x);
    }
    w[30] = "changed";
    eval[1].text = join(w);                                                          // near
    eval[2].text = join(words(rng, 10)) + " " + calib[7].text.substr(0, 300) + " " + join(words(rng, 50));  // shared span
    eval[3].group = "g9";                                                            // shared group
    const json leaky = leak_check(calib, eval, 0.5, 2);
    EXPECT_FALSE(leaky["clean"].get<bool>());
    EXPECT_EQ(leaky["exact"].get<int>(), 1);
    EXPECT_EQ(leaky["near"].get<int>(), 1);
    EXPECT_GE(leaky["shared_ngrams"].get<int>(), 2) << "the near copy and the shared span";
    EXPECT_EQ(leaky["shared_groups"].get<int>(), 1);
    EXPECT_FALSE(leaky["examples"].empty());
}

TEST_F(CorpusTest, LongDocumentsBecomePiecesOrKeepTheirEnd) {
    std::mt19937_64 rng(3);
    std::string text;
    for (int l = 0; l < 60; ++l) {
        text += join(words(rng, 9)) + "\n";
    }
    std::string chat;
    json msgs = json::array();
    for (int m = 0; m < 12; ++m) {
        msgs.push_back({{"role", m % 2 ? "assistant" : "user"}, {"content", join(words(rng, 20))}});
    }
    msgs.push_back({{"role", "user"}, {"content", "the last question"}});
    test::write_text(tmp_ / "long.txt", text);
    test::write_text(tmp_ / "chat.jsonl", json({{"messages", msgs}}).dump() + "\n");
    CorpusOptions o;
    o.model = model();
    o.spec.sources = {source_from_flag("prose=" + (tmp_ / "long.txt").string()),
                      source_from_flag("chat=" + (tmp_ / "chat.jsonl").string())};
    o.spec.doc_tokens = 64;
    o.spec.eval_share = 0;
    for (SourceSpec & s : o.spec.sources) {
        s.tokens = 1000000;  // all there is: the shortfall is expected
    }
    o.allow_shortfall = true;
    o.out_dir = tmp_ / "out";
    const json r = build_corpus(o);
    const auto calib = read_jsonl(tmp_ / "out" / "calib.jsonl");
    std::string rebuilt;
    const llama_vocab * vocab = nullptr;
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    ModelPtr m(llama_model_load_from_file(model().c_str(), mp), llama_model_free);
    vocab = llama_model_get_vocab(m.get());
    int pieces = 0, conversations = 0;
    for (const json & d : calib) {
        if (d.contains("text")) {
            ++pieces;
            rebuilt += d["text"].get<std::string>();
            EXPECT_LE(tokenize(vocab, d["text"].get<std::string>(), true, "piece").size(), 64u);
        } else {
            ++conversations;
            EXPECT_EQ(d["messages"].back()["content"], "the last question") << "a conversation keeps its end";
            EXPECT_LT(d["messages"].size(), msgs.size());
            CorpusDocument c;
            for (const json & mm : d["messages"]) {
                c.messages.push_back({mm["role"].get<std::string>(), mm["content"].get<std::string>()});
            }
            EXPECT_LE(tokenize(vocab, render_chat(m.get(), c, false, "chat"), true, "chat").size(), 64u);
        }
    }
    EXPECT_GT(pieces, 4);
    EXPECT_EQ(conversations, 1);
    // Pieces are whole consecutive parts: in order they give back the text (their order
    // in calib.jsonl is shuffled, so compare as multisets of lines).
    std::multiset<std::string> a, b;
    std::istringstream ia(text), ib(rebuilt);
    for (std::string l; std::getline(ia, l);) {
        a.insert(l);
    }
    for (std::string l; std::getline(ib, l);) {
        b.insert(l);
    }
    EXPECT_EQ(a, b);
    EXPECT_EQ(r["sources"][1]["calib"]["truncated"].get<int>(), 1);
}

TEST_F(CorpusTest, CollectSeesTheTokensCorpusCounted) {
    // Conversations rendered with the template, prompts already templated used as they
    // are: collect's token counts per domain equal the corpus's, which they would not if
    // special tokens were read as text or a template were applied twice.
    std::mt19937_64 rng(8);
    std::string chat, prompts;
    for (int i = 0; i < 30; ++i) {
        chat += json({{"messages", {{{"role", "user"}, {"content", join(words(rng, 8))}},
                                    {{"role", "assistant"}, {"content", join(words(rng, 8))}}}}}).dump() + "\n";
        prompts += json({{"prompt", "<|im_start|>user\n" + join(words(rng, 6)) + "<|im_end|>\n<|im_start|>assistant\n"},
                         {"response", join(words(rng, 6)) + "<|im_end|>"}}).dump() + "\n";
    }
    test::write_text(tmp_ / "chat.jsonl", chat);
    test::write_text(tmp_ / "prompts.jsonl", prompts);
    CorpusOptions o;
    o.model = model();
    o.spec.sources = {source_from_flag("chat=" + (tmp_ / "chat.jsonl").string()),
                      source_from_flag("prompts=" + (tmp_ / "prompts.jsonl").string())};
    o.spec.eval_share = 0;
    o.out_dir = tmp_ / "out";
    const json r = build_corpus(o);
    for (const json & d : read_jsonl(tmp_ / "out" / "calib.jsonl")) {
        if (d["domain"] == "prompts") {
            ASSERT_TRUE(d.contains("text")) << "an already templated prompt stays text";
            const std::string t = d["text"].get<std::string>();
            EXPECT_EQ(t.find("<|im_start|>user"), t.rfind("<|im_start|>user")) << "wrapped twice: " << t;
        } else {
            EXPECT_TRUE(d.contains("messages"));
        }
    }
    const auto c = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -c 512", model().string(),
                                                              (tmp_ / "out" / "calib.jsonl").string(),
                                                              (tmp_ / "stats.json").string())));
    ASSERT_EQ(c.exit_code, 0) << c.output;
    const json stats = json::parse(test::read_bytes(tmp_ / "stats.json"));
    EXPECT_EQ(stats["n_tokens"].get<uint64_t>(), r["outputs"]["calib"]["tokens"].get<uint64_t>());
    for (const json & d : r["domains"]) {
        EXPECT_EQ(stats["domains"][d["domain"].get<std::string>()]["n_tokens"].get<uint64_t>(),
                  d["calib"]["tokens"].get<uint64_t>())
            << d["domain"];
    }
    // A control token is one id: the rendered conversation holds <|im_start|> as a single token.
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    ModelPtr m(llama_model_load_from_file(model().c_str(), mp), llama_model_free);
    const auto ids = tokenize(llama_model_get_vocab(m.get()), "<|im_start|>user", true, "t");
    EXPECT_LE(ids.size(), 3u);
}

TEST_F(CorpusTest, BadInputIsRefusedByNameWithNothingWritten) {
    const fs::path out = tmp_ / "out";
    const auto run = [&](const std::string & args) {
        return test::run_command(moeprune_cmd(fmt::format("corpus -m {} -o {} {}", model().string(), out.string(), args)));
    };
    test::write_text(tmp_ / "ok.txt", "some text to read\n");
    test::write_text(tmp_ / "bad.txt", std::string("fine line\nbroken \xC3\x28 byte\n"));
    test::write_text(tmp_ / "shape.jsonl", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n");
    test::write_text(tmp_ / "unknown.toml", "[[source]]\npath = \"ok.txt\"\ndomain = \"d\"\nwieght = 2\n");
    test::write_text(tmp_ / "budget.toml", "[corpus]\neval_share = 0\n[[source]]\npath = \"ok.txt\"\ndomain = \"d\"\ntokens = 1000000\n");
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"--source d=" + (tmp_ / "missing-*.txt").string(), "matches no file"},
        {"--source d=" + (tmp_ / "bad.txt").string(), "bad.txt:2: is not UTF-8"},
        {"--source d=" + (tmp_ / "shape.jsonl").string(), "shape.jsonl:2: a document needs exactly one of"},
        {"--manifest " + (tmp_ / "unknown.toml").string(), "unknown.toml:4:1: unknown key \"wieght\""},
        {"--manifest " + (tmp_ / "budget.toml").string(), "source \"ok.txt\""},
        {"--source d=" + (tmp_ / "ok.txt").string() + " --json " + (tmp_ / "ok.txt").string(), "ok.txt"},
    };
    for (const auto & [args, message] : cases) {
        const auto r = run(args);
        EXPECT_NE(r.exit_code, 0) << args;
        EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
        EXPECT_FALSE(fs::exists(out / "calib.jsonl")) << args;
        EXPECT_FALSE(fs::exists(out / "corpus.json")) << args;
    }
    EXPECT_EQ(test::read_bytes(tmp_ / "ok.txt"), "some text to read\n") << "an input is never overwritten";
    const auto shortfall = run("--manifest " + (tmp_ / "budget.toml").string() + " --allow-shortfall");
    ASSERT_EQ(shortfall.exit_code, 0) << shortfall.output;
    EXPECT_NE(shortfall.output.find("shortfall"), std::string::npos);
    const json r = json::parse(test::read_bytes(out / "corpus.json"));
    EXPECT_GT(r["sources"][0]["calib"]["shortfall"].get<uint64_t>(), 0u);
}

namespace {

// A line of tasks.txt is its text with every whitespace run one space.
std::string flat(const std::string & s) {
    std::string out;
    for (const char c : s) {
        if (std::isspace(static_cast<unsigned char>(c))) {
            if (!out.empty() && out.back() != ' ') {
                out += ' ';
            }
        } else {
            out += c;
        }
    }
    while (!out.empty() && out.back() == ' ') {
        out.pop_back();
    }
    return out;
}

// Held-out prose of six documents, each of its own words in sentences over lines; a
// conversation domain; a domain of one document; and calib prose that must never show.
void write_task_sources(const fs::path & dir) {
    std::mt19937_64 rng(5);
    std::string prose, chat, solo, calib, line;
    for (int d = 0; d < 6; ++d) {
        std::string text;
        for (int s = 0; s < 24; ++s) {
            text += join(words(rng, 6 + rng() % 6)) + (s % 5 == 4 ? ".\n" : ". ");
        }
        prose += json({{"text", text}}).dump() + "\n";
    }
    for (int i = 0; i < 30; ++i) {
        chat += json({{"messages",
                       {{{"role", "user"}, {"content", "What is " + join(words(rng, 3)) + "?"}},
                        {{"role", "assistant"}, {"content", join(words(rng, 8)) + "."}}}}})
                    .dump() +
                "\n";
    }
    std::string only;
    for (int s = 0; s < 30; ++s) {
        only += join(words(rng, 8)) + ". ";
    }
    solo = json({{"text", only}}).dump() + "\n";
    for (int d = 0; d < 4; ++d) {
        line += json({{"text", join(words(rng, 80))}}).dump() + "\n";   // no sentence, no line break
    }
    for (int d = 0; d < 20; ++d) {
        calib += json({{"text", "calibonly " + join(words(rng, 40)) + ". calibonly again."}}).dump() + "\n";
    }
    test::write_text(dir / "prose.jsonl", prose);
    test::write_text(dir / "chat.jsonl", chat);
    test::write_text(dir / "solo.jsonl", solo);
    test::write_text(dir / "calib.jsonl", calib);
    test::write_text(dir / "line.jsonl", line);
    test::write_text(dir / "corpus.toml", R"(
[corpus]
seed = 3
task_context = 24
task_ending = 10
tasks_per_domain = 20

[[source]]
path = "prose.jsonl"
domain = "prose"
group = "file"
split = "eval"

[[source]]
path = "chat.jsonl"
domain = "chat"
split = "eval"
group = "file"

[[source]]
path = "solo.jsonl"
domain = "solo"
split = "eval"

[[source]]
path = "line.jsonl"
domain = "line"
split = "eval"

[[source]]
path = "calib.jsonl"
domain = "prose"
split = "calib"
)");
}

struct ReadTask {
    std::string context;
    int gold = -1;
    std::vector<std::string> endings;
};

std::vector<ReadTask> read_tasks_txt(const fs::path & p) {
    std::vector<std::string> lines;
    std::istringstream in(test::read_bytes(p));
    for (std::string line; std::getline(in, line);) {
        lines.push_back(line);
    }
    EXPECT_EQ(lines.size() % 6, 0u);
    std::vector<ReadTask> out;
    for (size_t i = 0; i + 6 <= lines.size(); i += 6) {
        out.push_back({lines[i], std::stoi(lines[i + 1]), {lines.begin() + long(i) + 2, lines.begin() + long(i) + 6}});
    }
    return out;
}

} // namespace

// corpus' choice tasks: each context followed by its true ending is a held-out document's
// text, and each wrong ending starts a sentence of another held-out document of the same
// domain; a conversation's ending is its answer; a domain of one document has none, and
// says why; calib text never shows; the same seed gives the same bytes.
TEST_F(CorpusTest, ChoiceTasksComeFromHeldOutDocumentsOfTheirDomain) {
    write_task_sources(tmp_.path());
    CorpusOptions o;
    o.model = model();
    o.spec = read_manifest(tmp_ / "corpus.toml");
    o.out_dir = tmp_ / "out";
    const CorpusReport r = build_corpus(o);
    const TaskSet set = read_task_set(tmp_ / "out" / "tasks.json");
    const std::vector<ReadTask> tasks = read_tasks_txt(tmp_ / "out" / "tasks.txt");
    ASSERT_EQ(tasks.size(), set.task_domains.size());
    EXPECT_EQ(r.outputs.tasks.tasks, tasks.size());
    EXPECT_EQ(set.file_digest, xxh64_hex(test::read_bytes(tmp_ / "out" / "tasks.txt")));
    EXPECT_EQ(set.context_tokens, 24);
    EXPECT_EQ(set.ending_tokens, 10);

    std::map<std::string, TaskSetDomain> domains;
    for (const TaskSetDomain & d : set.domains) {
        domains[d.domain] = d;
    }
    ASSERT_EQ(domains.size(), 4u);
    EXPECT_GT(domains["line"].tasks, 0u) << "text without sentences is cut at word starts";
    EXPECT_EQ(domains["prose"].tasks, 20u);
    EXPECT_EQ(domains["prose"].documents, 6u);
    EXPECT_EQ(domains["chat"].tasks, 20u);
    EXPECT_EQ(domains["solo"].tasks, 0u);
    EXPECT_NE(domains["solo"].skipped.find("one document"), std::string::npos) << domains["solo"].skipped;

    // The held-out documents as one line each, and each conversation's question and answer.
    std::vector<std::string> prose_docs;
    std::map<std::string, std::string> answer_of;
    std::set<std::string> answers;
    for (const json & line : read_jsonl(tmp_ / "out" / "eval.jsonl")) {
        if (line["domain"] == "prose") {
            prose_docs.push_back(flat(line["text"].get<std::string>()));
        } else if (line["domain"] == "chat") {
            const std::string q = flat(line["messages"][0]["content"].get<std::string>());
            answer_of[q] = flat(line["messages"][1]["content"].get<std::string>());
            answers.insert(answer_of[q]);
        }
    }
    ASSERT_EQ(prose_docs.size(), 6u);
    std::array<int, 4> golds{};
    for (size_t t = 0; t < tasks.size(); ++t) {
        const ReadTask & task = tasks[t];
        ASSERT_GE(task.gold, 0);
        ASSERT_LT(task.gold, 4);
        ++golds[size_t(task.gold)];
        const std::string & truth = task.endings[size_t(task.gold)];
        EXPECT_EQ(std::set<std::string>(task.endings.begin(), task.endings.end()).size(), 4u) << "task " << t;
        for (const std::string & e : task.endings) {
            EXPECT_EQ(e.find("calibonly"), std::string::npos);
            EXPECT_FALSE(e.empty());
        }
        EXPECT_EQ(task.context.find("calibonly"), std::string::npos);
        if (set.task_domains[t] == "chat") {
            ASSERT_TRUE(answer_of.contains(task.context)) << task.context;
            EXPECT_TRUE(answer_of[task.context].starts_with(truth)) << truth;
            for (size_t e = 0; e < 4; ++e) {
                if (int(e) != task.gold) {
                    EXPECT_TRUE(std::any_of(answers.begin(), answers.end(), [&](const std::string & a) {
                        return a.starts_with(task.endings[e]) && a != answer_of[task.context];
                    })) << task.endings[e];
                }
            }
            continue;
        }
        if (set.task_domains[t] == "line") {
            continue;
        }
        ASSERT_EQ(set.task_domains[t], "prose");
        // The context ends a sentence and the true ending follows it in one document.
        EXPECT_TRUE(task.context.ends_with(".")) << task.context;
        size_t home = prose_docs.size();
        for (size_t d = 0; d < prose_docs.size(); ++d) {
            if (prose_docs[d].find(task.context + " " + truth) != std::string::npos) {
                home = d;
            }
        }
        ASSERT_LT(home, prose_docs.size()) << "task " << t << ": " << task.context << " | " << truth;
        for (size_t e = 0; e < 4; ++e) {
            if (int(e) == task.gold) {
                continue;
            }
            bool found = false;
            for (size_t d = 0; d < prose_docs.size(); ++d) {
                const size_t at = prose_docs[d].find(task.endings[e]);
                found = found || (d != home && at != std::string::npos && (at == 0 || prose_docs[d].substr(at - 2, 2) == ". "));
            }
            EXPECT_TRUE(found) << "task " << t << " ending " << e << ": " << task.endings[e];
        }
    }
    EXPECT_GT(*std::min_element(golds.begin(), golds.end()), 0) << "the right ending's place is drawn";

    // Same seed, same bytes; another seed, other tasks; none asked for, none made.
    o.out_dir = tmp_ / "again";
    build_corpus(o);
    EXPECT_EQ(test::read_bytes(tmp_ / "again" / "tasks.txt"), test::read_bytes(tmp_ / "out" / "tasks.txt"));
    o.spec.seed = 4;
    o.out_dir = tmp_ / "other";
    build_corpus(o);
    EXPECT_NE(test::read_bytes(tmp_ / "other" / "tasks.txt"), test::read_bytes(tmp_ / "out" / "tasks.txt"));
    o.spec.tasks_per_domain = 0;
    o.out_dir = tmp_ / "none";
    EXPECT_EQ(build_corpus(o).outputs.tasks.tasks, 0u);
    EXPECT_EQ(test::read_bytes(tmp_ / "none" / "tasks.txt"), "");
}
