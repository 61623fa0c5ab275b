#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "corpus/sources.h"

#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    // llama.cpp's multi-letter short flags, which CLI11 cannot name, mean their long forms.
    std::vector<std::string> args(argv, argv + argc);
    for (std::string & a : args) {
        a = a == "-ub" ? "--ubatch-size" : a == "-ngl" ? "--gpu-layers" : a == "-nr" ? "--no-repack" : a;
    }
    // CLI11 reads a list of only commas as no value and takes the next argument instead,
    // an option included: `--ram , -t 4` would measure under "-t".
    for (size_t i = 1; i < args.size(); ++i) {
        if (!args[i].empty() && args[i].find_first_not_of(',') == std::string::npos) {
            std::fprintf(stderr, "moeprune: error: %s %s: an empty list; give its values separated by commas\n",
                         args[i - 1].c_str(), args[i].c_str());
            return 1;
        }
    }
    // Paths and names end up in JSON, which holds UTF-8 alone: refused here, naming the
    // argument, before anything is made (a command after `--` gets its bytes as they are).
    for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
        if (moeprune::invalid_utf8_at(args[i]) != std::string::npos) {
            std::string shown;
            for (const unsigned char c : args[i]) {
                shown += c < 0x20 || c >= 0x80 ? fmt::format("\\x{:02x}", c) : std::string(1, char(c));
            }
            std::fprintf(stderr, "moeprune: error: %s%s: is not UTF-8: moeprune records the paths and names it is "
                                 "given in JSON, which holds UTF-8 alone; rename it\n",
                         i > 1 && args[i - 1].rfind("-", 0) == 0 ? (args[i - 1] + " ").c_str() : "", shown.c_str());
            return 1;
        }
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
    moeprune::cli::add_limit(app, action);
    moeprune::cli::add_plan(app, action);
    moeprune::cli::add_run(app, action);
    CLI11_PARSE(app, argc, argv);
    moeprune::install_cleanup_on_signals();
    try {
        return action();
    } catch (const moeprune::Interrupted & e) {
        // What the interrupted work made is removed by now; end as the signal would have.
        std::fprintf(stderr, "moeprune: %s: stopped, and removed what it had made\n", e.what());
        std::signal(e.signal(), SIG_DFL);
        std::raise(e.signal());
        return 128 + e.signal();
    } catch (const std::exception & e) {
        std::fprintf(stderr, "moeprune: error: %s\n", e.what());
        return 1;
    }
}
