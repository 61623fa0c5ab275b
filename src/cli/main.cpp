#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    // llama.cpp's multi-letter short flags, which CLI11 cannot name, mean their long forms.
    std::vector<std::string> args(argv, argv + argc);
    for (std::string & a : args) {
        a = a == "-ub" ? "--ubatch-size" : a == "-ngl" ? "--gpu-layers" : a == "-nr" ? "--no-repack" : a;
    }
    std::vector<char *> argv2;
    for (std::string & a : args) {
        argv2.push_back(a.data());
    }
    argv = argv2.data();
    CLI::App app{"moeprune: measure, select, slice and stream the experts of MoE GGUF models"};
    app.set_version_flag("--version", MOEPRUNE_VERSION);
    app.require_subcommand(1);
    moeprune::cli::Action action;
    moeprune::cli::add_synth(app, action);
    moeprune::cli::add_inspect(app, action);
    moeprune::cli::add_trace(app, action);
    moeprune::cli::add_merge(app, action);
    moeprune::cli::add_keep(app, action);
    moeprune::cli::add_slice(app, action);
    moeprune::cli::add_corpus(app, action);
    moeprune::cli::add_collect(app, action);
    moeprune::cli::add_select(app, action);
    moeprune::cli::add_replay(app, action);
    moeprune::cli::add_eval(app, action);
    moeprune::cli::add_measure(app, action);
    moeprune::cli::add_plan(app, action);
    moeprune::cli::add_run(app, action);
    CLI11_PARSE(app, argc, argv);
    moeprune::install_cleanup_on_signals();
    try {
        return action();
    } catch (const std::exception & e) {
        std::fprintf(stderr, "moeprune: error: %s\n", e.what());
        return 1;
    }
}
