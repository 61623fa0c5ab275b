#include "corpus/manifest.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/toml_fields.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <cmath>
#include <regex>
#include <set>

namespace moeprune {

namespace {

using toml_fields::check_keys;

std::string at(const std::string & file, const toml::node & n) { return toml_fields::where(file, n.source()); }

SourceFormat get_format(const toml::node & n, const std::string & where) {
    return toml_fields::choice<SourceFormat>(n, where, "format", {{"auto", SourceFormat::Auto}, {"text", SourceFormat::Text},
                                                         {"markdown", SourceFormat::Markdown}, {"jsonl", SourceFormat::Jsonl}});
}
SplitSide get_split(const toml::node & n, const std::string & where) {
    return toml_fields::choice<SplitSide>(n, where, "split", {{"both", SplitSide::Both}, {"calib", SplitSide::Calib}, {"eval", SplitSide::Eval}});
}
Truncate get_truncate(const toml::node & n, const std::string & where) {
    return toml_fields::choice<Truncate>(n, where, "truncate", {{"left", Truncate::Left}, {"pieces", Truncate::Pieces}});
}

} // namespace

const char * to_string(SplitSide s) {
    return s == SplitSide::Both ? "both" : s == SplitSide::Calib ? "calib" : "eval";
}

GroupRule parse_group_rule(const std::string & text, const std::string & group_on, const std::string & origin) {
    GroupRule g;
    g.written = text;
    const auto prefixed = [&](const char * p) { return text.rfind(p, 0) == 0; };
    if (text == "file") {
        g.kind = GroupRule::Kind::File;
    } else if (text == "document") {
        g.kind = GroupRule::Kind::Document;
    } else if (prefixed("field:") && text.size() > 6) {
        g.kind = GroupRule::Kind::Field;
        g.field = text.substr(6);
    } else if (prefixed("path:")) {
        g.kind = GroupRule::Kind::PathComponent;
        const std::string n = text.substr(5);
        static const std::regex integer("-?[0-9]{1,4}");
        if (!std::regex_match(n, integer)) {
            fail_file(origin, fmt::format("group \"{}\": path:N needs an integer N (negative counts from the end)", text));
        }
        g.component = std::stoi(n);
    } else if (prefixed("regex:") && text.size() > 6) {
        g.kind = GroupRule::Kind::Regex;
        g.pattern = text.substr(6);
        try {
            std::regex check(g.pattern);
        } catch (const std::regex_error & e) {
            fail_file(origin, fmt::format("group \"{}\": not a regular expression ({})", text, e.what()));
        }
        if (group_on.rfind("field:", 0) == 0 && group_on.size() > 6) {
            g.field = group_on.substr(6);
        } else if (!group_on.empty() && group_on != "path") {
            fail_file(origin, fmt::format("group_on \"{}\" is neither \"path\" nor \"field:NAME\"", group_on));
        }
    } else {
        fail_file(origin, fmt::format("group \"{}\" is not one of file, document, field:NAME, path:N, regex:PATTERN", text));
    }
    if (!group_on.empty() && g.kind != GroupRule::Kind::Regex) {
        fail_file(origin, "group_on applies only to a regex: group");
    }
    return g;
}

namespace {

// [corpus] also holds the defaults of every source key a source leaves out.
struct SourceDefaults {
    std::string group = "file", group_on;
    std::optional<double> weight;
    SourceFormat format = SourceFormat::Auto;
    SplitSide split = SplitSide::Both;
    Truncate truncate = Truncate::Auto;
};

void read_corpus_table(const toml::node & c, const std::string & file, CorpusSpec & spec, SourceDefaults & defaults) {
    if (!c.is_table()) {
        fail_file(at(file, c), "[corpus] must be a table");
    }
    const toml::table & t = *c.as_table();
    check_keys(t, file,
               {"seed", "near_dup", "eval_share", "tokens", "doc_tokens", "strip_boilerplate", "task_context", "task_ending",
                "tasks_per_domain", "group", "group_on",
                "weight", "format", "split", "truncate"},
               "[corpus]");
    for (const auto & [k, n] : t) {
        const std::string key(k.str());
        const std::string where = at(file, n);
        if (key == "seed") {
            spec.seed = toml_fields::count(n, where, key, 0);
        } else if (key == "near_dup") {
            spec.near_dup = toml_fields::value<double>(n, where, key);
            if (!(spec.near_dup > 0 && spec.near_dup <= 1)) {
                fail_file(where, "\"near_dup\" must be a Jaccard similarity in (0, 1]");
            }
        } else if (key == "eval_share") {
            spec.eval_share = toml_fields::value<double>(n, where, key);
            if (!(spec.eval_share >= 0 && spec.eval_share < 1)) {
                fail_file(where, "\"eval_share\" must be in [0, 1)");
            }
        } else if (key == "tokens") {
            spec.tokens = toml_fields::count(n, where, key, 1);
        } else if (key == "doc_tokens") {
            spec.doc_tokens = uint32_t(std::min<uint64_t>(toml_fields::count(n, where, key, 16), 1u << 24));
        } else if (key == "task_context" || key == "task_ending") {
            const uint64_t tokens = toml_fields::count(n, where, key, 1);
            if (tokens > kMostTaskTokens) {
                fail_file(where, fmt::format("\"{}\" is {} tokens: at most {}", key, tokens, kMostTaskTokens));
            }
            (key == "task_context" ? spec.task_context : spec.task_ending) = int64_t(tokens);
        } else if (key == "tasks_per_domain") {
            spec.tasks_per_domain = int64_t(std::min<uint64_t>(toml_fields::count(n, where, key, 0), 1u << 24));
        } else if (key == "strip_boilerplate") {
            spec.strip_boilerplate = toml_fields::value<bool>(n, where, key);
        } else if (key == "group") {
            defaults.group = toml_fields::value<std::string>(n, where, key);
        } else if (key == "group_on") {
            defaults.group_on = toml_fields::value<std::string>(n, where, key);
        } else if (key == "weight") {
            defaults.weight = toml_fields::value<double>(n, where, key);
        } else if (key == "format") {
            defaults.format = get_format(n, where);
        } else if (key == "split") {
            defaults.split = get_split(n, where);
        } else if (key == "truncate") {
            defaults.truncate = get_truncate(n, where);
        }
    }
}

SourceSpec read_source(const toml::node & sn, const std::string & file, const SourceDefaults & defaults) {
    const toml::table & t = *sn.as_table();
    const std::string where = at(file, sn);
    check_keys(t, file,
               {"name", "path", "domain", "group", "group_on", "tokens", "eval_tokens", "weight", "format", "split",
                "truncate", "media", "prompt"},
               "[[source]]");
    SourceSpec s;
    s.format = defaults.format;
    s.split = defaults.split;
    s.truncate = defaults.truncate;
    std::string group = defaults.group, group_on = defaults.group_on;
    std::optional<double> weight;
    for (const auto & [k, n] : t) {
        const std::string key(k.str());
        const std::string w = at(file, n);
        if (key == "name") {
            s.name = toml_fields::value<std::string>(n, w, key);
        } else if (key == "path") {
            s.path = toml_fields::value<std::string>(n, w, key);
        } else if (key == "domain") {
            s.domain = toml_fields::value<std::string>(n, w, key);
        } else if (key == "group") {
            group = toml_fields::value<std::string>(n, w, key);
        } else if (key == "group_on") {
            group_on = toml_fields::value<std::string>(n, w, key);
        } else if (key == "tokens") {
            s.tokens = toml_fields::count(n, w, key, 1);
        } else if (key == "eval_tokens") {
            s.eval_tokens = toml_fields::count(n, w, key, 0);
        } else if (key == "weight") {
            weight = toml_fields::value<double>(n, w, key);
        } else if (key == "format") {
            s.format = get_format(n, w);
        } else if (key == "split") {
            s.split = get_split(n, w);
        } else if (key == "truncate") {
            s.truncate = get_truncate(n, w);
        } else if (key == "media") {
            s.media = toml_fields::choice<Modality>(n, w, key, {{"image", Modality::Image}, {"audio", Modality::Audio}});
        } else if (key == "prompt") {
            s.prompt = toml_fields::value<std::string>(n, w, key);
        }
    }
    if (!s.prompt.empty() && s.media == Modality::Text) {
        fail_file(where, "\"prompt\" is the words beside each file of a media source: give \"media\" too");
    }
    if (s.path.empty() || s.domain.empty()) {
        fail_file(where, "a [[source]] needs a non-empty \"path\" and \"domain\"");
    }
    if (s.tokens && weight) {
        fail_file(where, "give a source \"tokens\" or \"weight\", not both");
    }
    if (!s.tokens) {
        s.weight = weight ? weight : defaults.weight ? defaults.weight : std::optional<double>(1.0);
        if (!(*s.weight > 0 && std::isfinite(*s.weight))) {
            fail_file(where, "\"weight\" must be a positive number");
        }
    }
    s.group = parse_group_rule(group, group_on, where);
    if (s.name.empty()) {
        s.name = s.path;
    }
    return s;
}

} // namespace

CorpusSpec read_manifest(const std::filesystem::path & path) {
    const std::string file = path.string();
    const std::string text = read_text_file(path);
    toml::table root;
    try {
        root = toml::parse(text, file);
    } catch (const toml::parse_error & e) {
        const auto & b = e.source().begin;
        fail_file(fmt::format("{}:{}:{}", file, b.line, b.column), std::string("not valid TOML: ") + std::string(e.description()));
    }
    check_keys(root, file, {"corpus", "source"}, "the manifest");
    CorpusSpec spec;
    spec.manifest = path;
    spec.base_dir = path.parent_path();

    SourceDefaults defaults;
    if (const toml::node * c = root.get("corpus")) {
        read_corpus_table(*c, file, spec, defaults);
    }

    const toml::node * sources = root.get("source");
    if (!sources || !sources->is_array_of_tables() || sources->as_array()->empty()) {
        fail_file(file, "has no [[source]] tables: nothing to build a corpus from");
    }
    std::set<std::string> names;
    for (const toml::node & sn : *sources->as_array()) {
        SourceSpec s = read_source(sn, file, defaults);
        if (!names.insert(s.name).second) {
            fail_file(at(file, sn), fmt::format("two sources are named \"{}\": give each a \"name\"", s.name));
        }
        spec.sources.push_back(std::move(s));
    }
    return spec;
}

SourceSpec source_from_flag(const std::string & flag) {
    const auto eq = flag.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == flag.size()) {
        throw Error(fmt::format("--source \"{}\" is not DOMAIN=PATH_OR_GLOB", flag));
    }
    SourceSpec s;
    s.domain = flag.substr(0, eq);
    s.path = flag.substr(eq + 1);
    s.name = s.path;
    s.weight = 1.0;
    s.group = parse_group_rule("file", "", "--source");
    return s;
}

} // namespace moeprune
