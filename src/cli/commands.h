#pragma once
// Each subcommand registers its flags on the app and returns the action to run.
#include <CLI/CLI.hpp>

#include <functional>

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

} // namespace moeprune::cli
