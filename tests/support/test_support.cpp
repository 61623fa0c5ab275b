#include "support/test_support.h"

#include <array>
#include <cstdio>
#include <fstream>
#include <random>
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

} // namespace moeprune::test
