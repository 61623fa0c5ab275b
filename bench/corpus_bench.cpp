// Writes a mixed corpus of about MB megabytes for bench/corpus.sh, with planted exact and
// near duplicates and a shared preamble, and its manifest (corpus.toml).
//
//   moeprune_bench_corpus DIR MB CALIB_TOKENS
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::vector<std::string> make_lexicon(std::mt19937_64 & rng) {
    static const char * syll[] = {"ka", "lo", "mi", "ne", "ru", "ta", "vo", "xe", "zi", "pu", "se", "do", "fa", "gi",
                                  "hu", "jo", "the", "and", "ing", "er", "on", "re", "at", "st"};
    std::vector<std::string> lex;
    for (int i = 0; i < 20000; ++i) {
        std::string w;
        for (int k = 0, n = 1 + int(rng() % 3); k < n; ++k) {
            w += syll[rng() % 24];
        }
        lex.push_back(w);
    }
    return lex;
}

struct Text {
    std::mt19937_64 rng{7};
    std::vector<std::string> lex = make_lexicon(rng);
    // Zipf-like word choice: a few words very common, as in real text.
    std::string words(size_t n) {
        std::string s;
        for (size_t i = 0; i < n; ++i) {
            const double u = double(rng() >> 11) * 0x1.0p-53;
            s += lex[size_t(std::pow(double(lex.size()), u)) - 1];
            s += (i % 14 == 13) ? ".\n" : " ";
        }
        return s;
    }
    std::string cjk(size_t n) {
        std::string s;
        for (size_t i = 0; i < n; ++i) {
            const uint32_t cp = 0x4E00 + uint32_t(rng() % 3000);
            s += char(0xE0 | (cp >> 12));
            s += char(0x80 | ((cp >> 6) & 0x3F));
            s += char(0x80 | (cp & 0x3F));
            if (i % 30 == 29) {
                s += "。\n";
            }
        }
        return s;
    }
    std::string code(size_t lines) {
        std::string s;
        for (size_t i = 0; i < lines; ++i) {
            s += "    auto " + lex[rng() % lex.size()] + " = " + lex[rng() % lex.size()] + "(" + lex[rng() % lex.size()] +
                 ", " + std::to_string(rng() % 1000) + ");\n";
        }
        return s;
    }
};

} // namespace

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: moeprune_bench_corpus DIR MB CALIB_TOKENS\n");
        return 2;
    }
    const fs::path dir = argv[1];
    const double mb = std::stod(argv[2]);
    const std::string calib_tokens = argv[3];
    fs::create_directories(dir / "cjk");
    fs::create_directories(dir / "code");
    Text t;
    const auto budget = [&](double share) { return uint64_t(mb * share * 1e6); };

    // Prose, JSONL, 2 kB documents in tasks of four; 10% exact and 5% near duplicates.
    {
        std::ofstream f(dir / "prose.jsonl");
        uint64_t bytes = 0, n = 0;
        std::vector<std::string> recent;
        while (bytes < budget(0.5)) {
            std::string text;
            const uint64_t r = n % 20;
            if ((r == 3 || r == 11) && !recent.empty()) {
                text = recent[t.rng() % recent.size()];
            } else if (r == 7 && !recent.empty()) {
                text = recent[t.rng() % recent.size()] + t.words(20);
            } else {
                text = t.words(330);
                recent.push_back(text);
                if (recent.size() > 64) {
                    recent.erase(recent.begin());
                }
            }
            const std::string line = json({{"text", text}, {"task", "t" + std::to_string(n / 4)}}).dump() + "\n";
            f << line;
            bytes += line.size();
            ++n;
        }
    }
    // Conversations with a shared 3 kB preamble, in sessions of three.
    {
        std::ofstream f(dir / "chat.jsonl");
        const std::string preamble = t.words(500);
        uint64_t bytes = 0, n = 0;
        while (bytes < budget(0.2)) {
            const std::string line =
                json({{"messages", {{{"role", "system"}, {"content", preamble + t.words(10)}},
                                    {{"role", "user"}, {"content", t.words(60)}},
                                    {{"role", "assistant"}, {"content", t.words(150)}}}},
                      {"session", n / 3}})
                    .dump() +
                "\n";
            f << line;
            bytes += line.size();
            ++n;
        }
    }
    // CJK text and code, 20 kB files.
    for (uint64_t bytes = 0, n = 0; bytes < budget(0.15); ++n) {
        const std::string s = t.cjk(6600);
        std::ofstream(dir / "cjk" / ("doc" + std::to_string(n) + ".txt")) << s;
        bytes += s.size();
    }
    for (uint64_t bytes = 0, n = 0; bytes < budget(0.15); ++n) {
        const fs::path repo = dir / "code" / ("repo" + std::to_string(n / 50));
        fs::create_directories(repo);
        const std::string s = t.code(500);
        std::ofstream(repo / ("f" + std::to_string(n) + ".cpp")) << s;
        bytes += s.size();
    }
    std::ofstream(dir / "corpus.toml") << "[corpus]\nseed = 1\ntokens = " << calib_tokens << R"(
doc_tokens = 2048

[[source]]
path = "prose.jsonl"
domain = "prose"
group = "field:task"
weight = 4

[[source]]
path = "chat.jsonl"
domain = "chat"
group = "field:session"
weight = 2

[[source]]
path = "cjk"
domain = "cjk"
weight = 2

[[source]]
path = "code"
domain = "code"
group = "path:-2"
weight = 2
)";
    return 0;
}
