#include "cli/commands.h"
#include "core/errors.h"
#include "model/inspect.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_inspect(CLI::App & app, Action & action) {
    auto model = std::make_shared<std::string>();
    auto at_k = std::make_shared<std::vector<int64_t>>();
    auto json_out = std::make_shared<bool>(false);
    CLI::App * sub = app.add_subcommand("inspect", "Report a MoE GGUF's expert geometry and sizes from metadata alone");
    sub->add_option("model", *model, "Model .gguf (the first shard of a split model)")->required();
    sub->add_option("--at-k", *at_k, "Also report the model size when keeping K experts per layer")->delimiter(',');
    sub->add_flag("--json", *json_out, "JSON output (see docs/formats.md)");
    sub->callback([=, &action] {
        action = [=] {
            const GgufModel m = GgufModel::open(*model);
            for (int64_t k : *at_k) {
                if (k <= 0) {
                    throw Error("--at-k values must be positive");
                }
            }
            const InspectReport r = inspect_model(m, *at_k);
            if (*json_out) {
                std::printf("%s\n", to_json(r).dump(1).c_str());
            } else {
                std::printf("%s", to_text(r).c_str());
            }
            // A model with inconsistencies is reported in full, then flagged by the exit status.
            return r.problems.empty() ? 0 : 2;
        };
    });
}

} // namespace moeprune::cli
