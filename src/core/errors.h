#pragma once
// Every user-facing failure is a moeprune::Error whose message names the file
// and what is wrong with it; the CLI prints it and exits non-zero.
#include <stdexcept>
#include <string>

namespace moeprune {

class Error : public std::runtime_error {
public:
    explicit Error(const std::string & what) : std::runtime_error(what) {}
};

// "PATH: MESSAGE", the shape of every file-related error.
[[noreturn]] void fail_file(const std::string & path, const std::string & message);

} // namespace moeprune
