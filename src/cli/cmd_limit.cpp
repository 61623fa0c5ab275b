#include "cli/commands.h"
#include "core/sizes.h"
#include "measure/limit.h"

#include <cmath>
#include <memory>

namespace moeprune::cli {

void add_limit(CLI::App & app, Action & action) {
    auto ram = std::make_shared<std::string>();
    auto command = std::make_shared<std::vector<std::string>>();
    CLI::App * sub = app.add_subcommand(
        "limit", "Run a command in a memory cgroup of its own, its page cache included, as measure runs llama.cpp: "
                 "the commands plan prints run their answer under the limit it was measured under (docs/measure.md)");
    sub->add_option("--ram", *ram, "The limit: a size as plan reads it (32MB = 32*10^6 bytes, 2G = 2 GiB)")->required();
    sub->add_option("command", *command, "The command and its arguments, after --")->required();
    sub->callback([=, &action] {
        action = [=] { return run_limited(*command, uint64_t(std::llround(parse_size(*ram, "--ram")))); };
    });
}

} // namespace moeprune::cli
