#pragma once
// Every setting of a `moeprune run`, declared once in one table (run_settings()): its
// run.toml key, its flag and help line, its check, how its paths are read; its default is
// RunConfig's initializer. run.toml's reader and writer, the command's flags and their
// merge over run.toml are made from the table (docs/run.md lists the keys; a test checks
// that it lists every one).
#include "core/defaults.h"
#include "formats/plan_option.h"
#include "sim/throughput.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace moeprune {

struct RunConfig {
    std::filesystem::path model;
    std::vector<std::string> corpus;       // one manifest (.toml), or DOMAIN=PATH sources
    std::filesystem::path mmproj;          // the model's projector: media sources flow through corpus, collect and eval
    std::vector<int64_t> ks;
    std::vector<std::string> criteria{"reap", "reap-lcb", "freq"};
    std::string ram;                       // e.g. "24G"; empty: no limit
    std::string reserve;                   // empty: the process memory measure found, else 2G
    // The throughput model's inputs, with its defaults.
    double ssd = ThroughputParams{}.ssd_gbps;   // GB/s
    double read_latency_us = ThroughputParams{}.read_latency_us;
    int queue_depth = ThroughputParams{}.queue_depth;
    double compute_ms = ThroughputParams{}.compute_ms;
    double sync_us = ThroughputParams{}.sync_us;
    std::vector<std::string> policies{"lru", "lfu", "sieve", "s3fifo", "belady"};
    std::vector<double> cache_shares{0.125, 0.25, 0.5};  // per-layer cache sizes as shares of K
    std::vector<double> lambdas{0.0};
    std::optional<double> max_kld;
    std::optional<double> min_accuracy;
    RunsOn runs_on = RunsOn::LlamaCpp;    // what the plan recommends among
    std::string llama_bin;                 // llama.cpp's tools, for the recommendation's commands; empty: the PATH
    int ctx = kDefaultContext;
    int threads = 0;
    // A task file of llama.cpp's (at most one), scored by the eval stage for the base and
    // every keep map, and `tasks` of its tasks (0: llama-perplexity's default).
    std::filesystem::path hellaswag, winogrande, multiple_choice;
    int64_t tasks = 0;
    // Corpus settings: unset, a manifest's own values (or the corpus defaults) hold.
    std::optional<uint64_t> seed;
    std::optional<double> eval_share;
    std::optional<uint64_t> tokens;        // calib tokens for weighted corpus sources
    std::optional<uint32_t> doc_tokens;
    std::optional<int64_t> tasks_per_domain;   // choice tasks per domain from the held-out side
    int trace_top = kDefaultTraceTop;                  // at most the model's experts
    int save_every = 16;                   // collect checkpoints, in windows
    std::string slice;                     // "", "best" or "all"
    // llama.cpp's decode measured under these RAM limits (as `measure --ram` reads them) on
    // the held-out text; the plan then takes its timing from the measurement. Empty: none.
    std::vector<std::string> measure;
    int measure_tokens = 128;
    // Every measured run that many times, interleaved, each kept at its median (measure
    // --repeats): a small model's decode drifts more between runs than the sizes compared.
    int measure_repeats = 1;
    // With `measure` and `ram`: the plan's most promising llama.cpp options measured under
    // `ram`, at most this many; the recommendation is made from their measured tokens/s.
    int measure_shortlist = 4;
    // The model's device's read-aheads (KB) the measure stage measures each limit at (root);
    // empty: the device's own.
    std::vector<uint64_t> read_ahead_kb;
    // Measure the recommended option for real at --ram (its sliced model, slicing it if
    // --slice is not given) and compare with the plan's tokens/s.
    bool verify = false;
};

// How a setting's text names files: as given, a file or folder (absolute from run.toml's
// folder, or from the working directory for a flag; empty stays empty), or corpus
// entries (a manifest, or DOMAIN=PATH with the path made absolute).
enum class SettingPaths { AsGiven, File, CorpusEntries };

using RunMember = std::variant<std::filesystem::path RunConfig::*, std::string RunConfig::*, bool RunConfig::*,
                               int RunConfig::*, int64_t RunConfig::*, double RunConfig::*, RunsOn RunConfig::*,
                               std::optional<double> RunConfig::*, std::optional<int64_t> RunConfig::*,
                               std::optional<uint64_t> RunConfig::*,
                               std::optional<uint32_t> RunConfig::*, std::vector<std::string> RunConfig::*,
                               std::vector<int64_t> RunConfig::*, std::vector<double> RunConfig::*,
                               std::vector<uint64_t> RunConfig::*>;

// Numbers within [min, max], or (min, max] with `above_min`.
struct SettingRange {
    double min = 0, max = std::numeric_limits<double>::infinity();
    bool above_min = false;
};

struct RunSetting {
    const char * key;            // run.toml
    const char * flag;           // the flag's names as CLI11 takes them ("-c,--ctx-size"); "": run.toml only
    const char * help;
    RunMember member;
    SettingPaths paths = SettingPaths::AsGiven;
    // Numbers (each of a list) within `range`; strings one of `one_of` when it is not empty.
    std::optional<SettingRange> range;
    std::vector<std::string> one_of;
    const char * comment = "";   // run.toml: after the value, with its padding
    const char * before = "";    // run.toml: a comment line before the key
    // An integer's own check beyond a range, throwing with `named` before its message.
    std::function<void(int64_t, const std::string & named)> check_integer;
};

// Every setting, in run.toml's order.
const std::vector<RunSetting> & run_settings();

// Throws an Error naming the setting (its key; the flag's check leaves that to CLI11 with
// `named` false) where `c`'s value breaks its range, spelling or own check.
void check_setting(const RunSetting & s, const RunConfig & c, bool named = true);

// The same check on one value of the setting as a flag gives it (one element of a list),
// leaving the setting's name to CLI11; text that is not a number is left to the option's
// own conversion.
void check_setting_text(const RunSetting & s, const std::string & text);

// `into` with each setting `given` says the command line gave taken from `flags`, its paths
// made absolute from `cwd`.
void merge_flags(RunConfig & into, const RunConfig & flags, const std::function<bool(const RunSetting &)> & given,
                 const std::filesystem::path & cwd);

// Reads a run.toml (every key of RunConfig; unknown keys are errors naming file, line, key).
RunConfig read_run_config(const std::filesystem::path & path);

// A corpus entry (a manifest, or DOMAIN=PATH_OR_GLOB) with its path made absolute from
// `base`, so that run.toml, read from its own folder, names what the user meant.
std::string corpus_entry_from(const std::string & entry, const std::filesystem::path & base);
// The config as run.toml writes it: every setting, human-readable.
std::string run_config_toml(const RunConfig & c);

// run.toml's keys, in the order run_config_toml writes them.
std::vector<std::string> run_config_keys();

} // namespace moeprune
