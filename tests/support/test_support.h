#pragma once
#include <filesystem>
#include <string>

namespace moeprune::test {

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

// About 700 tokens of mixed English, source code and CJK text: enough for
// llama-perplexity at -c 128 and for every planted text kind to appear.
std::string mixed_text();

void write_text(const std::filesystem::path & path, const std::string & text);
std::string read_bytes(const std::filesystem::path & path);

} // namespace moeprune::test
