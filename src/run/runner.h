#pragma once
// The stages of `moeprune run` and how each is skipped: a stage folder's stage.json holds
// the digests of its inputs and outputs and its settings (run/run.h).
#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moeprune::run_impl {

namespace fs = std::filesystem;
using nlohmann::json;

class Runner {
public:
    Runner(fs::path dir, std::string from, size_t n_stages) : dir_(std::move(dir)), from_(std::move(from)), n_(n_stages) {}

    // Runs `work` unless the stage's manifest shows the same inputs and settings; `work`
    // returns the files it wrote.
    void stage(const std::string & name, const json & settings, const std::vector<fs::path> & inputs,
               const std::function<std::vector<fs::path>()> & work);

private:
    // A file's identity digest, computed once per run and again after a stage rewrites it.
    std::string digest(const fs::path & p);

    fs::path dir_;
    std::string from_;
    size_t n_, index_ = 0;
    bool forcing_ = false;
    std::map<std::string, std::string> digests_;
};

// The JSON files of a folder, by name.
std::vector<fs::path> json_files(const fs::path & dir);

} // namespace moeprune::run_impl
