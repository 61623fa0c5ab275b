#pragma once
// Each subcommand registers its flags on the app and returns the action to run.
#include "sim/policy.h"
#include "replay/replay.h"
#include "core/threads.h"
#include "formats/plan_option.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <functional>
#include <string>

namespace moeprune::cli {

using Action = std::function<int()>;

void add_synth(CLI::App & app, Action & action);
void add_inspect(CLI::App & app, Action & action);
void add_trace(CLI::App & app, Action & action);
void add_merge(CLI::App & app, Action & action);
void add_keep(CLI::App & app, Action & action);
void add_slice(CLI::App & app, Action & action);
void add_replay(CLI::App & app, Action & action);
void add_collect(CLI::App & app, Action & action);
void add_select(CLI::App & app, Action & action);
void add_eval(CLI::App & app, Action & action);
void add_corpus(CLI::App & app, Action & action);
void add_plan(CLI::App & app, Action & action);
void add_run(CLI::App & app, Action & action);
void add_measure(CLI::App & app, Action & action);
void add_limit(CLI::App & app, Action & action);

// --runs-on's two spellings, as plan and run take them.
inline CLI::Validator runs_on_names() {
    return CLI::Validator(
        [](std::string & text) {
            const std::optional<RunsOn> r = parse_runs_on(text);
            if (!r) {
                return "is llama.cpp or any, not \"" + text + "\"";
            }
            text = std::to_string(int(*r));   // CLI11 converts an enum from its number
            return std::string();
        },
        "{llama.cpp,any}");
}

// The flags of the cache policies and the throughput model, shared by replay and eval's closed loop.
// -t as every command takes it: refused far above this machine's CPUs (check_threads).
inline CLI::Validator thread_count() {
    return CLI::Validator(
        [](std::string & text) {
            int64_t n = 0;
            if (!CLI::detail::lexical_cast(text, n)) {
                return std::string();  // not a number: the option's own conversion says so
            }
            try {
                check_threads(n, "");  // CLI11 names the flag
            } catch (const std::exception & e) {
                return std::string(e.what());
            }
            return std::string();
        },
        "THREADS");
}

void add_cache_model_flags(CLI::App & sub, PolicyParams & params, ThroughputParams & throughput, std::string & ssd);
void apply_ssd_preset(const std::string & ssd, ThroughputParams & throughput);

// This program's path, for the commands a plan prints; "moeprune" where /proc cannot say.
inline std::filesystem::path this_program() {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    return ec ? std::filesystem::path("moeprune") : self;
}

} // namespace moeprune::cli
