#include "cli/commands.h"
#include "core/errors.h"
#include "core/sizes.h"
#include "slice/slice.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_slice(CLI::App & app, Action & action) {
    auto opt = std::make_shared<SliceOptions>();
    auto mtp = std::make_shared<std::string>();
    auto split = std::make_shared<std::string>();
    auto json_out = std::make_shared<bool>(false);
    CLI::App * sub = app.add_subcommand("slice", "Cut routed experts out of a MoE GGUF (and its imatrix) with a keep map");
    sub->add_option("-m,--model", opt->model, "Model .gguf (the first shard of a split model)")->required();
    sub->add_option("--keep", opt->keep, "Keep map JSON (docs/formats.md)")->required();
    sub->add_option("-o,--output", opt->output, "Output .gguf (with --split-max-size: OUT-0000i-of-0000N.gguf)")->required();
    sub->add_option("--imatrix", opt->imatrix, "imatrix GGUF from llama-imatrix to slice with the same keep map");
    sub->add_option("--imatrix-out", opt->imatrix_out, "Where the sliced imatrix goes");
    sub->add_option("--mtp", *mtp, "MTP (nextn) layers: keep (the keep map covers them) or drop")
        ->check(CLI::IsMember({"keep", "drop"}));
    sub->add_option("--split-max-size", *split, "Write shards of at most SIZE (bytes, or N M / N G as in llama-gguf-split)");
    sub->add_flag("--dry-run", opt->dry_run, "Print per-tensor sizes before and after; write nothing");
    sub->add_flag("--json", *json_out, "JSON report on stdout (see docs/formats.md)");
    sub->callback([=, &action] {
        action = [=] {
            SliceOptions o = *opt;
            o.mtp = *mtp == "keep" ? MtpMode::Keep : *mtp == "drop" ? MtpMode::Drop : MtpMode::Unset;
            if (!split->empty()) {
                const double bytes = parse_size(*split, "--split-max-size", SizeUnits::decimal);
                if (bytes < 1) {
                    throw Error("--split-max-size \"" + *split + "\" must be at least one byte");
                }
                o.split_max_bytes = uint64_t(bytes);
            }
            const SliceResult r = slice_model(o);
            if (*json_out) {
                std::printf("%s\n", to_json(r, o.dry_run).dump(1).c_str());
            } else {
                std::printf("%s", to_text(r, o.dry_run).c_str());
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
