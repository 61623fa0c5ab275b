#include "run/config.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/threads.h"
#include "core/toml_fields.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <sstream>
#include <type_traits>

namespace moeprune {

namespace fs = std::filesystem;

namespace {

using toml_fields::value;
using toml_fields::values;

std::string toml_string(const std::string & s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
        }
        out += c;
    }
    return out + "\"";
}

template <class T> std::string toml_value(const T & v) {
    if constexpr (std::is_same_v<T, std::string>) {
        return toml_string(v);
    } else if constexpr (std::is_same_v<T, fs::path>) {
        return toml_string(v.string());
    } else {
        return fmt::format("{}", v);
    }
}

template <class T> std::string toml_array(const std::vector<T> & v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) {
        out += (i ? ", " : "") + toml_value(v[i]);
    }
    return out + "]";
}

fs::path from_base(const std::string & p, const fs::path & base) {
    return (fs::path(p).is_absolute() ? fs::path(p) : base / p).lexically_normal();
}

template <class> inline constexpr bool is_optional = false;
template <class T> inline constexpr bool is_optional<std::optional<T>> = true;
template <class> inline constexpr bool is_vector = false;
template <class T> inline constexpr bool is_vector<std::vector<T>> = true;
template <class> inline constexpr bool is_number_list = false;
template <class T> inline constexpr bool is_number_list<std::vector<T>> = std::is_arithmetic_v<T>;

// A setting's value read from run.toml at `where`; paths absolute from `base`.
template <class T> T read_value(const RunSetting & s, const toml::node & n, const std::string & where, const fs::path & base) {
    if constexpr (std::is_same_v<T, fs::path>) {
        const std::string file = value<std::string>(n, where, s.key);
        return file.empty() ? fs::path() : from_base(file, base);
    } else if constexpr (std::is_same_v<T, std::string>) {
        const std::string text = value<std::string>(n, where, s.key);
        return s.paths == SettingPaths::File && !text.empty() ? from_base(text, base).string() : text;
    } else if constexpr (std::is_same_v<T, RunsOn>) {
        const std::string text = value<std::string>(n, where, s.key);
        const std::optional<RunsOn> r = parse_runs_on(text);
        if (!r) {
            fail_file(where, fmt::format("{} is \"llama.cpp\" or \"any\", not \"{}\"", s.key, text));
        }
        return *r;
    } else if constexpr (is_optional<T>) {
        return value<typename T::value_type>(n, where, s.key);
    } else if constexpr (is_vector<T>) {
        T out = values<typename T::value_type>(n, where, s.key);
        if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            if (s.paths == SettingPaths::CorpusEntries) {
                for (std::string & e : out) {
                    e = corpus_entry_from(e, base);
                }
            }
        }
        return out;
    } else {
        return value<T>(n, where, s.key);
    }
}

// The value as run.toml writes it, or nullopt where the key is left out (an unset
// optional, an empty file name).
template <class T> std::optional<std::string> write_value(const T & v) {
    if constexpr (std::is_same_v<T, fs::path>) {
        return v.empty() ? std::nullopt : std::optional<std::string>(toml_value(v));
    } else if constexpr (std::is_same_v<T, RunsOn>) {
        return toml_string(runs_on_name(v));
    } else if constexpr (is_optional<T>) {
        return v ? write_value(*v) : std::nullopt;
    } else if constexpr (is_vector<T>) {
        return toml_array(v);
    } else {
        return toml_value(v);
    }
}

std::string range_words(const SettingRange & r) {
    const bool no_max = r.max == std::numeric_limits<double>::infinity();
    if (r.above_min) {
        return no_max ? fmt::format("above {}", r.min) : fmt::format("above {} and at most {}", r.min, r.max);
    }
    return no_max ? fmt::format("at least {}", r.min) : fmt::format("from {} to {}", r.min, r.max);
}

// `named`: the message starts with the key (a flag's leaves its name to CLI11).
void check_number(const RunSetting & s, double v, bool named) {
    if (s.range && !((s.range->above_min ? v > s.range->min : v >= s.range->min) && v <= s.range->max)) {
        throw Error(fmt::format("{}{} must be {}", named ? std::string(s.key) + " " : "", v, range_words(*s.range)));
    }
}

} // namespace

const std::vector<RunSetting> & run_settings() {
    using C = RunConfig;
    static const std::vector<RunSetting> settings = {
        {.key = "model", .flag = "-m,--model", .help = "The model (GGUF; first shard of a split model)",
         .member = &C::model, .paths = SettingPaths::File},
        {.key = "corpus", .flag = "--corpus",
         .help = "A corpus manifest (.toml) or DOMAIN=PATH_OR_GLOB sources (repeatable)", .member = &C::corpus,
         .paths = SettingPaths::CorpusEntries, .comment = "      # a manifest, or DOMAIN=PATH sources"},
        {.key = "mmproj", .flag = "--mmproj",
         .help = "The model's projector GGUF: media sources (images, audio) flow through corpus, collect and eval",
         .member = &C::mmproj, .paths = SettingPaths::File,
         .comment = "      # the projector for the corpus' images and audio"},
        {.key = "k", .flag = "-k", .help = "Experts to keep per layer, one map per K and criterion", .member = &C::ks},
        {.key = "criteria", .flag = "--criteria", .help = "Selection criteria", .member = &C::criteria},
        {.key = "ram", .flag = "--ram", .help = "RAM for the model (24G = GiB, 24GB = 10^9 bytes)", .member = &C::ram,
         .comment = "                # empty: no RAM limit"},
        {.key = "reserve", .flag = "--reserve", .help = "RAM kept for the KV cache and the OS", .member = &C::reserve,
         .comment = "        # RAM kept for KV cache and the OS; empty: measured, else 2G"},
        {.key = "ssd", .flag = "--ssd", .help = "SSD read bandwidth, GB/s", .member = &C::ssd,
         .range = SettingRange{.min = 0, .above_min = true}, .comment = "                  # GB/s"},
        {.key = "read_latency_us", .flag = "", .help = "", .member = &C::read_latency_us},
        {.key = "queue_depth", .flag = "", .help = "", .member = &C::queue_depth},
        {.key = "compute_ms", .flag = "--compute-ms", .help = "Compute time per token", .member = &C::compute_ms,
         .range = SettingRange{.min = 0}},
        {.key = "sync_us", .flag = "", .help = "", .member = &C::sync_us},
        {.key = "policies", .flag = "--policies", .help = "Cache policies to replay", .member = &C::policies},
        {.key = "cache_shares", .flag = "--cache-shares", .help = "Per-layer cache sizes as shares of K",
         .member = &C::cache_shares, .range = SettingRange{.min = 0, .max = 1, .above_min = true},
         .comment = "   # per-layer caches as shares of K"},
        {.key = "lambdas", .flag = "--lambda", .help = "Cache-aware routing strengths (0: unbiased)",
         .member = &C::lambdas},
        {.key = "max_kld", .flag = "--max-kld", .help = "Recommend the fastest option within this mean KLD",
         .member = &C::max_kld},
        {.key = "min_accuracy", .flag = "--min-accuracy",
         .help = "Recommend only options keeping this share of the base's task accuracy", .member = &C::min_accuracy,
         .range = SettingRange{.min = 0, .max = 1}},
        {.key = "runs_on", .flag = "--runs-on",
         .help = "Recommend among what stock llama.cpp runs, or any option (the simulated expert caches too)",
         .member = &C::runs_on, .comment = "          # recommend among \"llama.cpp\" options or \"any\""},
        {.key = "llama_bin", .flag = "--llama-bin",
         .help = "The folder of llama.cpp's tools the printed commands name", .member = &C::llama_bin,
         .paths = SettingPaths::File,
         .comment = "        # llama.cpp's tools for the printed commands; empty: the PATH"},
        {.key = "hellaswag", .flag = "--hellaswag",
         .help = "Task accuracy beside KLD: llama.cpp's HellaSwag file, scored by eval for the base and every "
                  "keep map as llama-perplexity scores it",
         .member = &C::hellaswag, .paths = SettingPaths::File,
         .comment = "   # llama.cpp's HellaSwag file: task accuracy beside KLD"},
        {.key = "winogrande", .flag = "--winogrande", .help = "Task accuracy: llama.cpp's WinoGrande CSV",
         .member = &C::winogrande, .paths = SettingPaths::File, .comment = "  # llama.cpp's WinoGrande CSV"},
        {.key = "multiple_choice", .flag = "--multiple-choice",
         .help = "Task accuracy: llama.cpp's binary multiple-choice file", .member = &C::multiple_choice,
         .paths = SettingPaths::File, .comment = "  # llama.cpp's binary multiple-choice file"},
        {.key = "tasks", .flag = "--tasks",
         .help = "Tasks of the task file, drawn as llama-perplexity draws them (0: its default)", .member = &C::tasks,
         .range = SettingRange{.min = 0},
         .comment = "                # of the task file; 0: llama-perplexity's default"},
        {.key = "ctx", .flag = "-c,--ctx-size", .help = "Context of collect and eval windows", .member = &C::ctx},
        {.key = "threads", .flag = "-t,--threads", .help = "Threads (0: one per core)", .member = &C::threads,
         .check_integer = [](int64_t n, const std::string & named) { check_threads(n, named); }},
        {.key = "seed", .flag = "--seed", .help = "Seed of the corpus split and order (default: the manifest's)",
         .member = &C::seed, .before = "# corpus settings given here override the manifest's\n"},
        {.key = "eval_share", .flag = "", .help = "", .member = &C::eval_share},
        {.key = "tokens", .flag = "--tokens", .help = "Calib tokens shared by weighted corpus sources",
         .member = &C::tokens},
        {.key = "doc_tokens", .flag = "", .help = "", .member = &C::doc_tokens},
        {.key = "tasks_per_domain", .flag = "--tasks-per-domain",
         .help = "Choice tasks per domain the corpus stage makes from the held-out side (default: the "
                  "manifest's; 0: none)",
         .member = &C::tasks_per_domain, .range = SettingRange{.min = 0, .max = 1 << 24}},
        {.key = "trace_top", .flag = "", .help = "", .member = &C::trace_top},
        {.key = "save_every", .flag = "", .help = "", .member = &C::save_every},
        {.key = "slice", .flag = "--slice", .help = "Write sliced GGUFs at the end: best (the recommendation) or all",
         .member = &C::slice, .one_of = {"", "best", "all"}, .comment = "                # \"\", \"best\" or \"all\""},
        {.key = "measure", .flag = "--measure",
         .help = "Measure llama.cpp's decode under these RAM limits (as measure --ram: 25%,50% or sizes) on the "
                  "held-out text; the plan's timing then comes from the measurement",
         .member = &C::measure, .comment = "      # RAM limits llama.cpp's decode is measured under; empty: none"},
        {.key = "measure_tokens", .flag = "--measure-tokens", .help = "Timed tokens per measured run",
         .member = &C::measure_tokens, .range = SettingRange{.min = 1}},
        {.key = "measure_repeats", .flag = "--measure-repeats",
         .help = "Every measured run (limits, shortlist, verify) this many times, interleaved, each kept at its "
                  "median (measure --repeats)",
         .member = &C::measure_repeats, .range = SettingRange{.min = 1, .max = 100},
         .comment = "     # each measured run's repeats, kept at the median"},
        {.key = "read_ahead_kb", .flag = "--read-ahead-kb",
         .help = "With --measure: every limit at each of these read-aheads of the model's device, in KB (root); "
                  "the plan then recommends the fastest",
         .member = &C::read_ahead_kb, .comment = "      # measure at each device read-ahead (KB, root)"},
        {.key = "measure_shortlist", .flag = "--measure-shortlist",
         .help = "With --measure and --ram: the plan's most promising llama.cpp options measured under --ram, at "
                  "most this many (0: none); the recommendation is made from what they measured",
         .member = &C::measure_shortlist, .range = SettingRange{.min = 0, .max = 64},
         .comment = "   # with measure and ram: options measured; 0: none"},
        {.key = "verify", .flag = "--verify",
         .help = "Measure the recommendation for real at --ram (its sliced model) and print predicted vs measured",
         .member = &C::verify},
    };
    return settings;
}

void check_setting(const RunSetting & s, const RunConfig & c, bool named) {
    std::visit(
        [&](auto m) {
            using T = std::remove_cvref_t<decltype(c.*m)>;
            const T & v = c.*m;
            if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
                check_number(s, double(v), named);
                if constexpr (std::is_integral_v<T>) {
                    if (s.check_integer) {
                        s.check_integer(int64_t(v), named ? s.key : "");
                    }
                }
            } else if constexpr (is_optional<T>) {
                if (v) {
                    check_number(s, double(*v), named);
                }
            } else if constexpr (is_number_list<T>) {
                for (const auto x : v) {
                    check_number(s, double(x), named);
                }
            } else if constexpr (std::is_same_v<T, std::string>) {
                if (!s.one_of.empty() && std::find(s.one_of.begin(), s.one_of.end(), v) == s.one_of.end()) {
                    throw Error(fmt::format("{}is \"{}\", not one of \"{}\"", named ? std::string(s.key) + " " : "", v,
                                            fmt::join(s.one_of, "\", \"")));
                }
            }
        },
        s.member);
}

void check_setting_text(const RunSetting & s, const std::string & text) {
    RunConfig probe;
    std::visit(
        [&](auto m) {
            using T = std::remove_cvref_t<decltype(probe.*m)>;
            const auto number = [&](auto & out) {
                std::istringstream in(text);
                in >> out;
                return !in.fail() && in.eof();
            };
            if constexpr (std::is_same_v<T, std::string>) {
                probe.*m = text;
            } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
                T v{};
                if (number(v)) {
                    probe.*m = v;
                }
            } else if constexpr (is_optional<T> || is_number_list<T>) {
                typename T::value_type v{};
                if (number(v)) {
                    probe.*m = T{v};
                }
            }
        },
        s.member);
    check_setting(s, probe, false);
}

void merge_flags(RunConfig & into, const RunConfig & flags, const std::function<bool(const RunSetting &)> & given,
                 const fs::path & cwd) {
    for (const RunSetting & s : run_settings()) {
        if (!*s.flag || !given(s)) {
            continue;
        }
        std::visit(
            [&](auto m) {
                into.*m = flags.*m;
                using T = std::remove_cvref_t<decltype(into.*m)>;
                if constexpr (std::is_same_v<T, fs::path> || std::is_same_v<T, std::string>) {
                    if (s.paths == SettingPaths::File && !fs::path(into.*m).empty()) {
                        into.*m = from_base(fs::path(into.*m).string(), cwd);
                    }
                } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
                    if (s.paths == SettingPaths::CorpusEntries) {
                        for (std::string & e : into.*m) {
                            e = corpus_entry_from(e, cwd);
                        }
                    }
                }
            },
            s.member);
    }
}

std::string corpus_entry_from(const std::string & entry, const fs::path & base) {
    const auto eq = entry.find('=');
    return eq == std::string::npos ? from_base(entry, base).string()
                                   : entry.substr(0, eq + 1) + from_base(entry.substr(eq + 1), base).string();
}

RunConfig read_run_config(const fs::path & path) {
    const std::string file = path.string();
    toml::table t;
    try {
        t = toml::parse(read_text_file(path), file);
    } catch (const toml::parse_error & e) {
        fail_file(toml_fields::where(file, e.source()), std::string("not valid TOML: ") + std::string(e.description()));
    }
    RunConfig c;
    // Absolute, so that a config read through a relative path and written again names the same files.
    const fs::path base = fs::absolute(path).parent_path();
    for (const auto & [k, n] : t) {
        const std::string key(k.str());
        const std::string where = toml_fields::where(file, k.source());
        const auto & settings = run_settings();
        const auto it = std::find_if(settings.begin(), settings.end(), [&](const RunSetting & s) { return key == s.key; });
        if (it == settings.end()) {
            fail_file(where, fmt::format("unknown key \"{}\" (docs/run.md lists the keys of run.toml)", key));
        }
        const toml::node & node = n;   // a structured binding, which clang 14's lambdas cannot capture
        std::visit([&](auto m) { c.*m = read_value<std::remove_cvref_t<decltype(c.*m)>>(*it, node, where, base); },
                   it->member);
    }
    return c;
}

std::string run_config_toml(const RunConfig & c) {
    std::string s = "# moeprune run: every setting of this run (moeprune run --config run.toml repeats it)\n";
    for (const RunSetting & k : run_settings()) {
        s += k.before;
        if (const auto v = std::visit([&](auto m) { return write_value(c.*m); }, k.member)) {
            s += fmt::format("{} = {}{}\n", k.key, *v, k.comment);
        }
    }
    return s;
}

std::vector<std::string> run_config_keys() {
    std::vector<std::string> out;
    for (const RunSetting & k : run_settings()) {
        out.push_back(k.key);
    }
    return out;
}

} // namespace moeprune
