#include "support/test_support.h"

#include <fmt/format.h>
#include "llama.h"
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <sys/wait.h>
#include <unistd.h>

namespace moeprune::test {

namespace fs = std::filesystem;

TempDir::TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() / ("moeprune-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    fs::create_directories(path_);
}

TempDir::~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
}

CommandResult run_command(const std::string & command) {
    const std::string full = command + " 2>&1";
    FILE * p = ::popen(full.c_str(), "r");
    if (!p) {
        return {-1, "popen failed"};
    }
    std::string out;
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) {
        out.append(buf.data(), n);
    }
    const int status = ::pclose(p);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

fs::path bin(const std::string & name) { return fs::path(MOEPRUNE_BIN_DIR) / name; }

std::string moeprune_cmd(const std::string & args) {
    const bool synth = args.starts_with("synth ") && args.find("--vocab-first") == std::string::npos;
    return bin("moeprune").string() + " " + args + (synth ? fmt::format(" --vocab-first {}", kTestVocabFirst) : "");
}

SynthOptions synth_options() {
    SynthOptions o;
    o.vocab_first = kTestVocabFirst;
    return o;
}

int special_token_id(const fs::path & model, const std::string & text) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    std::unique_ptr<llama_model, decltype(&llama_model_free)> m(llama_model_load_from_file(model.c_str(), mp), llama_model_free);
    if (!m) {
        throw std::runtime_error("llama.cpp cannot load " + model.string());
    }
    llama_token id[2];
    if (llama_tokenize(llama_model_get_vocab(m.get()), text.data(), int32_t(text.size()), id, 2, false, true) != 1) {
        throw std::runtime_error(text + " is not one token of " + model.string());
    }
    return id[0];
}

void synth(const std::string & args, const fs::path & out) {
    const auto r = run_command(moeprune_cmd("synth " + args + " -o " + out.string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
}

nlohmann::json read_json(const fs::path & path) { return nlohmann::json::parse(read_bytes(path)); }


std::map<std::string, std::vector<nlohmann::json>> per_token_rows(const fs::path & path) {
    std::map<std::string, std::vector<nlohmann::json>> out;
    std::istringstream in(read_bytes(path));
    for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        out[j["candidate"].get<std::string>()].push_back(j);
    }
    return out;
}

std::optional<double> llama_perplexity(const fs::path & model, const fs::path & text, const std::string & args,
                                       std::string * log) {
    static const std::regex estimate(R"(Final estimate: PPL = ([0-9.]+|nan|inf))");
    for (int attempt = 0; attempt < 3; ++attempt) {
        const auto r = run_command(bin("llama-perplexity").string() + " -m " + model.string() + " -f " + text.string() + " " + args);
        if (log) *log = r.output;
        if (r.exit_code != 0) return std::nullopt;
        std::smatch m;
        if (std::regex_search(r.output, m, estimate)) return std::stod(m[1]);
    }
    return std::nullopt;
}

std::string mixed_text() {
    std::ostringstream o;
    for (int i = 0; i < 6; ++i) {
        o << "The expert cache keeps the most useful experts resident while the rest stream from disk. "
          << "Calibration text decides which experts matter for a given workload, round " << i << ".\n";
        o << "def route(tokens, k=" << i + 2 << "):\n    return sorted(range(len(tokens)), key=lambda j: -tokens[j])[:k]\n";
        o << "int main() { std::vector<int> v{" << i << ", 2, 3}; return v.size() == 3 ? 0 : 1; }\n";
        o << "専門家の混合モデルは、入力ごとに一部の専門家だけを使います。東京の天気は晴れです。\n";
        o << "我们在笔记本电脑上运行大型语言模型，需要减少内存使用。\n";
    }
    return o.str();
}

void write_text(const fs::path & path, const std::string & text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
}

std::string read_bytes(const fs::path & path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

static uint16_t half_bits(float f) {
    if (f == 0.0f) {
        return 0;
    }
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const int32_t exp = int32_t((x >> 23) & 0xFF) - 127 + 15;
    const uint32_t mant = (x >> 13) & 0x3FF;
    return uint16_t(sign | (uint32_t(exp) << 10) | mant);
}

void write_q4rt(const fs::path & path, uint32_t n_layer, uint32_t n_expert, uint32_t top_m, uint64_t n_tokens,
                uint32_t header_count, const TokenRecordFn & record, size_t extra_tail_bytes) {
    std::ofstream out(path, std::ios::binary);
    const auto u16 = [&](uint16_t v) { out.write(reinterpret_cast<const char *>(&v), 2); };
    const auto u32 = [&](uint32_t v) { out.write(reinterpret_cast<const char *>(&v), 4); };
    out.write("Q4RT", 4);
    u16(1);
    u16(uint16_t(n_layer));
    u16(uint16_t(n_expert));
    u16(uint16_t(top_m));
    u32(header_count);
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    for (uint64_t t = 0; t < n_tokens; ++t) {
        record(t, ids, logits);
        for (uint32_t l = 0; l < n_layer; ++l) {
            for (uint32_t i = 0; i < top_m; ++i) {
                u16(ids[l * top_m + i]);
            }
            for (uint32_t i = 0; i < top_m; ++i) {
                u16(half_bits(logits[l * top_m + i]));
            }
        }
    }
    out << std::string(extra_tail_bytes, '\x7f');
}

} // namespace moeprune::test
