#pragma once
// What each fuzz target feeds: one parser moeprune owns or feeds, read the way a command
// reads it and then used as far as a command would use it, so a malformed field is met
// where it matters. A rejection is a moeprune::Error; anything else (another exception,
// a crash, a sanitizer report, a leak, a hang) is a finding. docs/reliability.md.
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune::fuzz {

struct Reader {
    std::string name;        // the target: fuzz_NAME, seeds in fuzz/corpus/NAME
    std::string extension;   // the file name's ending the reader dispatches on
    void (*read)(const std::filesystem::path & path);
};

const std::vector<Reader> & readers();
const Reader & reader(const std::string & name);

} // namespace moeprune::fuzz
