#include "cli/commands.h"
#include "core/atomic_file.h"
#include "replay/replay.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_replay(CLI::App & app, Action & action) {
    auto opt = std::make_shared<ReplayOptions>();
    auto json_out = std::make_shared<std::string>();
    CLI::App * sub = app.add_subcommand("replay", "Replay a router trace through per-layer expert caches");
    sub->add_option("--trace", opt->trace, "Router trace (moeprune trace or Q4RT v1)")->required();
    sub->add_option("--keep", opt->keep, "Keep map: re-choose the top-k among its survivors");
    sub->add_option("--policy", opt->policies, "Policies: lru, lfu, ema, belady, sieve")->delimiter(',')->required();
    sub->add_option("--cache", opt->caches, "Cache sizes, experts per layer")->delimiter(',')->required();
    sub->add_option("--k", opt->k, "Experts per token (default: the trace's meta.n_expert_used)");
    sub->add_option("--warmup", opt->warmup, "Tokens replayed before counting starts")->capture_default_str();
    sub->add_option("--ema-decay", opt->params.ema_decay, "ema: per-token decay of every expert's score")
        ->capture_default_str();
    sub->add_option("-t,--threads", opt->threads, "Worker threads over layers (0: one per core)")->capture_default_str();
    sub->add_flag("--reset-on-session", opt->reset_on_session, "Empty the caches where the sequence id changes");
    sub->add_option("--json", *json_out, "Write one record per configuration as JSON (docs/formats.md)");
    sub->callback([=, &action] {
        action = [=] {
            const ReplayReport r = run_replay(*opt);
            std::printf("%s", to_text(r).c_str());
            if (!json_out->empty()) {
                write_file_atomic(*json_out, to_json(r).dump(1) + "\n");
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
