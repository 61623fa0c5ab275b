#include "cli/commands.h"
#include "core/errors.h"
#include "engine/session.h"
#include "run/run.h"

#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <type_traits>
#include <variant>

namespace moeprune::cli {

namespace {

// A setting's check as its flag's, on each value given (one of a list).
CLI::Validator setting_check(const RunSetting & s) {
    return CLI::Validator(
        [&s](std::string & text) {
            try {
                check_setting_text(s, text);
            } catch (const std::exception & e) {
                return std::string(e.what());
            }
            return std::string();
        },
        "", s.key);
}

// The flag of setting `s`, bound to its member of `flags`.
CLI::Option * add_setting_flag(CLI::App * sub, const RunSetting & s, RunConfig & flags) {
    return std::visit(
        [&](auto m) -> CLI::Option * {
            using T = std::remove_cvref_t<decltype(flags.*m)>;
            if constexpr (std::is_same_v<T, bool>) {
                return sub->add_flag(s.flag, flags.*m, s.help);
            } else {
                CLI::Option * o = sub->add_option(s.flag, flags.*m, s.help);
                if constexpr (std::is_same_v<T, RunsOn>) {
                    o->transform(runs_on_names())->type_name("TEXT");
                } else if constexpr (requires { typename T::value_type; } && !std::is_same_v<T, std::string> &&
                                     !std::is_same_v<T, std::filesystem::path>) {
                    // A list takes commas, but for corpus entries: a path may hold one.
                    if constexpr (requires { (flags.*m).push_back(typename T::value_type{}); }) {
                        if (s.paths != SettingPaths::CorpusEntries) {
                            o->delimiter(',');
                        }
                    }
                }
                if (s.range || !s.one_of.empty() || s.check_integer) {
                    o->check(setting_check(s));
                }
                return o;
            }
        },
        s.member);
}

} // namespace

void add_run(CLI::App & app, Action & action) {
    auto opt = std::make_shared<RunOptions>();
    auto config = std::make_shared<std::filesystem::path>();
    auto flags = std::make_shared<RunConfig>();  // what the command line gave
    CLI::App * sub = app.add_subcommand(
        "run", "From a model and a corpus to an answer: corpus, collect, select, eval, replay, plan and an HTML report "
               "in one resumable run (docs/run.md)");
    sub->add_option("--config", *config, "Settings of every stage (run.toml; flags override it)");
    sub->add_option("-o,--out", opt->run_dir, "Run directory")->required();
    auto given = std::make_shared<std::map<const RunSetting *, CLI::Option *>>();
    for (const RunSetting & s : run_settings()) {
        if (*s.flag) {
            (*given)[&s] = add_setting_flag(sub, s, *flags);
        }
    }
    sub->add_option("--from", opt->from, "Re-run this stage and every later one");
    sub->callback([=, &action] {
        action = [=] {
            RunConfig merged = config->empty() ? RunConfig{} : read_run_config(*config);
            // Paths from the command line are the working directory's; run.toml is read from its own folder.
            merge_flags(merged, *flags, [&](const RunSetting & s) { return given->at(&s)->count() > 0; },
                        std::filesystem::current_path());
            if (sub->count("--measure-shortlist") && merged.measure_shortlist > 0 &&
                (merged.measure.empty() || merged.ram.empty())) {
                throw Error(fmt::format("--measure-shortlist {}: the shortlist is measured under --ram after the measure "
                                        "stage: give --measure and --ram as well",
                                        merged.measure_shortlist));
            }
            opt->config = merged;
            opt->moeprune_bin = this_program();
            init_llama({});
            std::printf("%s\n", run_pipeline(*opt).c_str());
            return 0;
        };
    });
}

} // namespace moeprune::cli
