#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "select/select.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_select(CLI::App & app, Action & action) {
    auto opt = std::make_shared<SelectOptions>();
    auto weights = std::make_shared<std::vector<std::string>>();
    auto json_out = std::make_shared<std::string>();
    CLI::App * sub = app.add_subcommand("select", "Keep maps from saliency statistics, every criterion, with screens");
    sub->add_option("--stats", opt->stats, "Statistics from moeprune collect (or merge)")->required();
    sub->add_option("-k", opt->ks, "Experts to keep per layer, e.g. 224,256,320")->delimiter(',')->required();
    sub->add_option("--metric", opt->metrics, fmt::format("Criteria: {}", fmt::join(select_metrics(), ", ")))
        ->delimiter(',')
        ->required();
    sub->add_option("-o,--output", opt->out_dir, "Directory for the keep maps (METRIC-kK.json)");
    sub->add_option("--heldout", opt->heldout, "Held-out statistics: retention out of sample");
    sub->add_option("--trace", opt->trace, "Router trace: substitution screen of every keep map");
    sub->add_option("--domain-weights", *weights, "domain-mix weights NAME=W,...")->delimiter(',');
    sub->add_option("--hybrid-of", opt->hybrid_of, "Criteria the hybrid averages rank percentiles of")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--domain-metric", opt->domain_metric, "Criterion ranked within each domain")->capture_default_str();
    sub->add_option("--lcb-z", opt->lcb_z,
                    "reap-lcb: confidence of the lower bound as a normal quantile (1.96: 97.5% one-sided); Student's t "
                    "at that level is used with each expert's hits")
        ->capture_default_str();
    sub->add_option("--lcb-prior", opt->lcb_prior,
                    "reap-lcb: weight, in observations, of the layer's pooled variance in each expert's variance")
        ->capture_default_str();
    sub->add_option("--rare-hits", opt->rare_hits, "Flag kept experts with fewer hits than this in the report")
        ->capture_default_str();
    sub->add_option("--seed", opt->seed, "random: seed of the experts' order")->capture_default_str();
    sub->add_flag("--protect-super", opt->protect_super, "Always keep REAP's super experts");
    sub->add_option("--json", *json_out, "Write the report as JSON");
    sub->callback([=, &action] {
        action = [=] {
            for (const std::string & w : *weights) {
                const auto eq = w.find('=');
                if (eq == std::string::npos || eq == 0) {
                    throw Error(fmt::format("--domain-weights takes NAME=WEIGHT, got \"{}\"", w));
                }
                double v = 0;
                try {
                    v = std::stod(w.substr(eq + 1));
                } catch (const std::exception &) {
                    throw Error(fmt::format("--domain-weights: \"{}\" is not a number", w.substr(eq + 1)));
                }
                if (!(v >= 0)) {
                    throw Error(fmt::format("--domain-weights: weight of {} must be >= 0", w.substr(0, eq)));
                }
                opt->domain_weights[w.substr(0, eq)] = v;
            }
            const SelectReport r = run_select(*opt, {*json_out});
            std::printf("%s", r.text.c_str());
            for (const std::string & w : r.warnings) {
                std::fprintf(stderr, "moeprune select: %s\n", w.c_str());
            }
            if (!json_out->empty()) {
                write_file_atomic(*json_out, r.json.dump(1) + "\n");
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
