#include "run/config.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/toml_fields.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <functional>

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

// One key of run.toml: how it is read into a RunConfig and written back.
struct ConfigKey {
    const char * key;
    // Reads the value at `where` (FILE:LINE:COLUMN); paths are made absolute from `base`.
    std::function<void(RunConfig &, const toml::node &, const std::string & where, const fs::path & base)> read;
    // The value as TOML, or nullopt where the key is left out.
    std::function<std::optional<std::string>(const RunConfig &)> write;
    const char * comment = "";  // after the value, with its padding
    const char * before = "";   // a comment line written before the key
};

template <class T> ConfigKey one(const char * key, T RunConfig::*m, const char * comment = "", const char * before = "") {
    return {key, [key, m](RunConfig & c, const toml::node & n, const std::string & where, const fs::path &) { c.*m = value<T>(n, where, key); },
            [m](const RunConfig & c) -> std::optional<std::string> { return toml_value(c.*m); }, comment, before};
}

template <class T>
ConfigKey maybe(const char * key, std::optional<T> RunConfig::*m, const char * comment = "", const char * before = "") {
    return {key, [key, m](RunConfig & c, const toml::node & n, const std::string & where, const fs::path &) { c.*m = value<T>(n, where, key); },
            [m](const RunConfig & c) -> std::optional<std::string> {
                return c.*m ? std::optional<std::string>(toml_value(*(c.*m))) : std::nullopt;
            },
            comment, before};
}

template <class T> ConfigKey list(const char * key, std::vector<T> RunConfig::*m, const char * comment = "") {
    return {key, [key, m](RunConfig & c, const toml::node & n, const std::string & where, const fs::path &) { c.*m = values<T>(n, where, key); },
            [m](const RunConfig & c) -> std::optional<std::string> { return toml_array(c.*m); }, comment};
}

// A file named relative to run.toml's folder, written only when given.
ConfigKey task_file(const char * key, fs::path RunConfig::*m, const char * comment) {
    return {key, [key, m](RunConfig & c, const toml::node & n, const std::string & where, const fs::path & base) {
                const std::string file = value<std::string>(n, where, key);
                c.*m = file.empty() ? fs::path() : from_base(file, base);
            },
            [m](const RunConfig & c) -> std::optional<std::string> {
                return (c.*m).empty() ? std::nullopt : std::optional<std::string>(toml_value(c.*m));
            },
            comment};
}

const std::vector<ConfigKey> & config_keys() {
    static const std::vector<ConfigKey> keys = {
        {"model", [](RunConfig & c, const toml::node & n, const std::string & where, const fs::path & base) {
             c.model = from_base(value<std::string>(n, where, "model"), base);
         }, [](const RunConfig & c) -> std::optional<std::string> { return toml_value(c.model); }},
        {"corpus", [](RunConfig & c, const toml::node & n, const std::string & where, const fs::path & base) {
             c.corpus.clear();
             for (const std::string & s : values<std::string>(n, where, "corpus")) {
                 c.corpus.push_back(corpus_entry_from(s, base));
             }
         }, [](const RunConfig & c) -> std::optional<std::string> { return toml_array(c.corpus); },
         "      # a manifest, or DOMAIN=PATH sources"},
        {"mmproj", [](RunConfig & c, const toml::node & n, const std::string & where, const fs::path & base) {
             c.mmproj = from_base(value<std::string>(n, where, "mmproj"), base);
         }, [](const RunConfig & c) -> std::optional<std::string> {
             return c.mmproj.empty() ? std::nullopt : std::optional<std::string>(toml_value(c.mmproj));
         }, "      # the projector for the corpus' images and audio"},
        list("k", &RunConfig::ks),
        list("criteria", &RunConfig::criteria),
        one("ram", &RunConfig::ram, "                # empty: no RAM limit"),
        one("reserve", &RunConfig::reserve, "        # RAM kept for KV cache and the OS; empty: measured, else 2G"),
        one("ssd", &RunConfig::ssd, "                  # GB/s"),
        one("read_latency_us", &RunConfig::read_latency_us),
        one("queue_depth", &RunConfig::queue_depth),
        one("compute_ms", &RunConfig::compute_ms),
        one("sync_us", &RunConfig::sync_us),
        list("policies", &RunConfig::policies),
        list("cache_shares", &RunConfig::cache_shares, "   # per-layer caches as shares of K"),
        list("lambdas", &RunConfig::lambdas),
        maybe("max_kld", &RunConfig::max_kld),
        maybe("min_accuracy", &RunConfig::min_accuracy),
        one("runs_on", &RunConfig::runs_on, "          # recommend among \"llama.cpp\" options or \"any\""),
        {"llama_bin", [](RunConfig & c, const toml::node & n, const std::string & where, const fs::path & base) {
             const std::string dir = value<std::string>(n, where, "llama_bin");
             c.llama_bin = dir.empty() ? dir : from_base(dir, base).string();
         }, [](const RunConfig & c) -> std::optional<std::string> { return toml_value(c.llama_bin); },
         "        # llama.cpp's tools for the printed commands; empty: the PATH"},
        task_file("hellaswag", &RunConfig::hellaswag, "   # llama.cpp's HellaSwag file: task accuracy beside KLD"),
        task_file("winogrande", &RunConfig::winogrande, "  # llama.cpp's WinoGrande CSV"),
        task_file("multiple_choice", &RunConfig::multiple_choice, "  # llama.cpp's binary multiple-choice file"),
        one("tasks", &RunConfig::tasks, "                # of the task file; 0: llama-perplexity's default"),
        one("ctx", &RunConfig::ctx),
        one("threads", &RunConfig::threads),
        maybe("seed", &RunConfig::seed, "", "# corpus settings given here override the manifest's\n"),
        maybe("eval_share", &RunConfig::eval_share),
        maybe("tokens", &RunConfig::tokens),
        maybe("doc_tokens", &RunConfig::doc_tokens),
        one("trace_top", &RunConfig::trace_top),
        one("save_every", &RunConfig::save_every),
        one("slice", &RunConfig::slice, "                # \"\", \"best\" or \"all\""),
        list("measure", &RunConfig::measure, "      # RAM limits llama.cpp's decode is measured under; empty: none"),
        one("measure_tokens", &RunConfig::measure_tokens),
        one("measure_repeats", &RunConfig::measure_repeats, "     # each measured run's repeats, kept at the median"),
        list("read_ahead_kb", &RunConfig::read_ahead_kb, "      # measure at each device read-ahead (KB, root)"),
        one("measure_shortlist", &RunConfig::measure_shortlist, "   # with measure and ram: options measured; 0: none"),
        one("verify", &RunConfig::verify),
    };
    return keys;
}

} // namespace

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
        const auto & keys = config_keys();
        const auto it = std::find_if(keys.begin(), keys.end(), [&](const ConfigKey & ck) { return key == ck.key; });
        if (it == keys.end()) {
            fail_file(where, fmt::format("unknown key \"{}\" (docs/run.md lists the keys of run.toml)", key));
        }
        it->read(c, n, where, base);
    }
    return c;
}

std::string run_config_toml(const RunConfig & c) {
    std::string s = "# moeprune run: every setting of this run (moeprune run --config run.toml repeats it)\n";
    for (const ConfigKey & k : config_keys()) {
        s += k.before;
        if (const auto v = k.write(c)) {
            s += fmt::format("{} = {}{}\n", k.key, *v, k.comment);
        }
    }
    return s;
}

std::vector<std::string> run_config_keys() {
    std::vector<std::string> out;
    for (const ConfigKey & k : config_keys()) {
        out.push_back(k.key);
    }
    return out;
}

} // namespace moeprune
