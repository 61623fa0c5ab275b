#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"
#include "measure/cgroup.h"
#include "measure/measure.h"
#include "measure/worker.h"

#include <cstdio>
#include <memory>

namespace moeprune::cli {

void add_measure(CLI::App & app, Action & action) {
    auto opt = std::make_shared<MeasureOptions>();
    CLI::App * sub = app.add_subcommand(
        "measure", "llama.cpp's own decode under memory-cgroup limits: tokens/s, major faults and bytes read per token, "
                   "a resident run, a storage probe and the router trace of the timed tokens (docs/measure.md)");
    auto check = std::make_shared<bool>(false);
    sub->add_option("-m,--model", opt->model, "GGUF model (first shard), on the disk to measure");
    sub->add_option("-f,--file", opt->text, "Text the decode is teacher-forced on: plain text, or a JSONL corpus (its documents in order)");
    sub->add_flag("--check", *check,
                  "Only say whether this machine lets moeprune make memory cgroups (exit 0), or what is missing (exit 1)");
    sub->add_option("--ram", opt->ram,
                    "Memory limits of the decoding process: sizes (768M, 2G, as plan reads them) or P% (what stays "
                    "resident plus P% of the routed expert bytes)")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--tokens", opt->tokens, "Timed tokens per run")->capture_default_str();
    sub->add_option("--warmup", opt->warmup, "Untimed tokens decoded first in every run")->capture_default_str();
    sub->add_option("--min-seconds", opt->min_seconds,
                    "A run whose timed tokens take less decodes them again, until this much decode is timed; each "
                    "token's time is its median over the passes")
        ->capture_default_str();
    sub->add_option("--repeats", opt->repeats,
                    "Measure every limit (and the resident decode) this many times, one round of all limits after "
                    "another; each limit's figures are those of its median run")
        ->capture_default_str();
    sub->add_option("-c,--ctx-size", opt->ctx, "Context size (0: warmup + tokens)")->capture_default_str();
    sub->add_option("-t,--threads", opt->threads, "Threads (0: one per core)")->check(thread_count())->capture_default_str();
    sub->add_option("--probe-mib", opt->probe_mib, "Storage probe: MiB of random experts read cold (0: none)")
        ->capture_default_str();
    sub->add_option("--seed", opt->seed, "The probe's order of experts")->capture_default_str();
    sub->add_option("--read-ahead-kb", opt->read_ahead_kb,
                    "Measure every limit at each of these read-aheads of the model's device, in KB (root only); "
                    "the device's own is put back afterwards, and by the next measure after a kill -9")
        ->delimiter(',')
        ->check(CLI::Range(uint64_t(0), uint64_t(1) << 20));
    sub->add_flag("!--no-repack", opt->repack,
                  "As llama.cpp's --no-repack: weights it would repack (q4_0, q4_K, iq4_nl on x86) stay mapped");
    sub->add_option("--llama-bench", opt->llama_bench,
                    "llama.cpp's llama-bench: run its text generation under every limit too, beside measure's figures")
        ->check(CLI::ExistingFile);
    sub->add_option("--llama-bench-timeout", opt->llama_bench_timeout,
                    "Seconds one llama-bench run may take before it and its children are killed (0: from the model's "
                    "size and measure's own runs)")
        ->capture_default_str();
    sub->add_option("--json", opt->json_out, "Write the measurement (moeprune-measure JSON, docs/formats.md)");
    sub->add_option("--trace", opt->trace_out, "Write the router trace of the timed tokens");
    sub->callback([=, &action] {
        action = [=] {
            if (*check) {
                const CgroupSupport s = find_memory_cgroup();
                if (s.version == 0) {
                    std::fprintf(stderr, "moeprune measure: %s\n", s.problem.c_str());
                    return 1;
                }
                std::printf("memory cgroup v%d: measure makes its cgroups under %s\n", s.version, s.parent.c_str());
                return 0;
            }
            if (opt->model.empty() || opt->text.empty()) {
                throw Error("measure needs a model (-m) and a text (-f)");
            }
            const MeasureReport rep = run_measure(*opt);
            std::fputs(to_text(rep).c_str(), stdout);
            return 0;
        };
    });

    // The measured child process measure starts; not for people.
    auto spec = std::make_shared<std::string>();
    auto out = std::make_shared<std::string>();
    CLI::App * worker = app.add_subcommand("measure-worker", "");
    worker->group("");
    worker->add_option("spec", *spec)->required();
    worker->add_option("out", *out)->required();
    worker->callback([=, &action] {
        action = [=] {
            const WorkerSpec s = worker_spec_from_json(parse_json(read_text_file(*spec), *spec), *spec);
            write_file_atomic(*out, run_worker(s).dump());
            return 0;
        };
    });
}

} // namespace moeprune::cli
