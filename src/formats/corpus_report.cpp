// corpus.json written from its record, and read back into one with every value checked.
#include "formats/corpus_report.h"
#include "core/atomic_file.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace moeprune {

namespace {

using nlohmann::json;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();
// A share summed in another order than its total can pass 1 by rounding.
constexpr double kShareMax = 1.0 + 1e-9;

json optional_json(const std::optional<std::string> & s) { return s ? json(*s) : json(nullptr); }
json optional_json(const std::optional<uint64_t> & n) { return n ? json(*n) : json(nullptr); }

json side_json(const CorpusSourceSide & s) {
    return {{"budget", optional_json(s.budget)},
            {"tokens", s.tokens},
            {"shortfall", s.shortfall},
            {"documents", s.documents},
            {"units", s.units},
            {"pieces", s.pieces},
            {"truncated", s.truncated},
            {"documents_available", s.documents_available},
            {"groups_available", s.groups_available}};
}

json source_json(const CorpusSourceRow & s) {
    json files = json::array();
    for (const CorpusSourceFile & f : s.files) {
        files.push_back({{"path", f.path}, {"bytes", f.bytes}, {"digest", f.digest}});
    }
    json row = {{"name", s.name},
                {"path", s.path},
                {"domain", s.domain},
                {"group", s.group},
                {"split", s.split},
                {"media", s.media},
                {"files", files},
                {"documents_read", s.documents_read},
                {"empty_skipped", s.empty_skipped},
                {"binary_skipped", s.binary_skipped},
                {"not_media_skipped", s.not_media_skipped},
                {"exact_duplicates", s.exact_duplicates},
                {"near_duplicates", s.near_duplicates},
                {"boilerplate_only", s.boilerplate_only},
                {"calib", side_json(s.calib)},
                {"eval", side_json(s.eval)}};
    if (s.tokens) {
        row["tokens"] = *s.tokens;
    } else {
        row["weight"] = s.weight.value_or(0);
    }
    return row;
}

json prefix_json(const std::vector<CorpusPrefixShares> & rows) {
    json out = json::array();
    for (const CorpusPrefixShares & p : rows) {
        out.push_back({{"prefix", p.prefix},
                       {"tokens", p.tokens},
                       {"shares", p.shares},
                       {"max_abs_error_vs_target", p.max_abs_error_vs_target}});
    }
    return out;
}

json output_json(const CorpusOutput & o) {
    return {{"path", o.path}, {"documents", o.documents}, {"tokens", o.tokens}, {"bytes", o.bytes}, {"digest", o.digest}};
}

uint64_t count(const JsonFields & f, const std::string & key) { return uint64_t(f.integer(key, 0, kMaxCount)); }

std::optional<std::string> optional_string(const JsonFields & f, const std::string & key) {
    return f.has(key) ? std::optional(f.string(key)) : std::nullopt;
}

// A seed is any 64-bit value, past what JsonFields::integer reads.
uint64_t seed_of(const JsonFields & f) {
    const json & v = f.any("seed");
    if (!v.is_number_unsigned()) {
        f.fail("seed", "is not an integer in [0, 2^64)");
    }
    return v.get<uint64_t>();
}

CorpusInputs inputs_of(const JsonFields & in) {
    const JsonFields m = in.object("model");
    CorpusInputs out;
    out.model = {m.string("path"), count(m, "bytes"), m.string("digest"), m.string("vocab")};
    out.manifest = optional_string(in, "manifest");
    out.mmproj = optional_string(in, "mmproj");
    out.bytes = count(in, "bytes");
    return out;
}

CorpusSettings settings_of(const JsonFields & s) {
    CorpusSettings out;
    out.seed = seed_of(s);
    out.near_dup = s.number("near_dup", std::numeric_limits<double>::min(), 1);
    out.eval_share = s.number("eval_share", 0, std::nextafter(1.0, 0.0));
    if (s.has("tokens")) {
        out.tokens = uint64_t(s.integer("tokens", 1, kMaxCount));
    }
    out.doc_tokens = s.integer("doc_tokens", 16, 1 << 24);
    out.strip_boilerplate = s.boolean("strip_boilerplate");
    out.allow_shortfall = s.boolean("allow_shortfall");
    out.tokens_counted_as = s.string("tokens_counted_as");
    out.task_context = s.integer("task_context", 1, 1 << 16);
    out.task_ending = s.integer("task_ending", 1, 1 << 16);
    out.tasks_per_domain = s.integer("tasks_per_domain", 0, 1 << 24);
    const JsonFields mh = s.object("minhash");
    out.minhash = {mh.integer("shingle_units", 1, 1 << 20), mh.integer("signature", 1, 1 << 20),
                   mh.integer("lsh_rows", 1, 1 << 20), mh.integer("lsh_bands", 1, 1 << 20)};
    return out;
}

CorpusSourceSide source_side_of(const JsonFields & s) {
    CorpusSourceSide out;
    if (s.has("budget")) {
        out.budget = uint64_t(s.integer("budget", 0, kMaxCount));
    }
    out.tokens = count(s, "tokens");
    out.shortfall = count(s, "shortfall");
    if (out.shortfall != (out.budget && out.tokens < *out.budget ? *out.budget - out.tokens : 0)) {
        s.fail("shortfall", fmt::format("is {}, but the side took {} tokens of a budget of {}", out.shortfall, out.tokens,
                                        out.budget ? std::to_string(*out.budget) : std::string("all")));
    }
    out.documents = count(s, "documents");
    out.units = count(s, "units");
    out.pieces = count(s, "pieces");
    out.truncated = count(s, "truncated");
    out.documents_available = count(s, "documents_available");
    out.groups_available = count(s, "groups_available");
    return out;
}

CorpusSourceRow source_of(const JsonFields & s) {
    CorpusSourceRow out;
    out.name = s.string("name");
    out.path = s.string("path");
    out.domain = s.string("domain");
    out.group = s.string("group");
    out.split = s.string("split");
    out.media = s.string("media");
    for (const JsonFields & f : s.objects("files")) {
        out.files.push_back({f.string("path"), count(f, "bytes"), f.string("digest")});
    }
    out.documents_read = count(s, "documents_read");
    out.empty_skipped = count(s, "empty_skipped");
    out.binary_skipped = s.strings("binary_skipped");
    out.not_media_skipped = s.strings("not_media_skipped");
    out.exact_duplicates = count(s, "exact_duplicates");
    out.near_duplicates = count(s, "near_duplicates");
    out.boilerplate_only = count(s, "boilerplate_only");
    if (s.has("tokens")) {
        out.tokens = count(s, "tokens");
    } else {
        out.weight = s.number("weight", std::numeric_limits<double>::min(), std::numeric_limits<double>::max());
    }
    out.calib = source_side_of(s.object("calib"));
    out.eval = source_side_of(s.object("eval"));
    return out;
}

CorpusDomainSide domain_side_of(const JsonFields & s) {
    return {count(s, "tokens"), s.number("target_share", 0, kShareMax), s.number("share", 0, kShareMax)};
}

CorpusLeakCheck leak_check_of(const JsonFields & l) {
    CorpusLeakCheck out;
    out.exact = count(l, "exact");
    out.near = count(l, "near");
    out.shared_ngrams = count(l, "shared_ngrams");
    out.shared_ngram_hashes = count(l, "shared_ngram_hashes");
    out.shared_groups = count(l, "shared_groups");
    out.ngram_units = l.integer("ngram_units", 1, 1 << 20);
    out.ngram_sample = l.integer("ngram_sample", 1, 1 << 20);
    out.clean = l.boolean("clean");
    if (out.clean != (out.exact + out.near + out.shared_ngrams + out.shared_groups == 0)) {
        l.fail("clean", fmt::format("is {} beside {} exact, {} near, {} n-gram and {} group leaks", out.clean, out.exact,
                                    out.near, out.shared_ngrams, out.shared_groups));
    }
    out.examples = l.array("examples");
    return out;
}

std::vector<CorpusPrefixShares> prefix_shares_of(const JsonFields & sides, const std::string & side) {
    std::vector<CorpusPrefixShares> out;
    for (const JsonFields & p : sides.objects(side)) {
        CorpusPrefixShares row;
        row.prefix = p.number("prefix", 0, 1);
        row.tokens = count(p, "tokens");
        const JsonFields shares = p.object("shares");
        for (const auto & [domain, unused] : p.any("shares").items()) {
            row.shares[domain] = shares.number(domain, 0, kShareMax);
        }
        row.max_abs_error_vs_target = p.number("max_abs_error_vs_target", 0, kShareMax);
        out.push_back(std::move(row));
    }
    return out;
}

CorpusSeconds seconds_of(const JsonFields & s) {
    return {s.number("read", 0, kInf), s.number("dedupe", 0, kInf), s.number("tokenize", 0, kInf),
            s.number("leak_check", 0, kInf), s.number("write", 0, kInf)};
}

CorpusOutput output_of(const JsonFields & o) {
    return {o.string("path"), count(o, "documents"), count(o, "tokens"), count(o, "bytes"), o.string("digest")};
}

} // namespace

void to_json(json & j, const CorpusDomainRow & d) {
    const auto side = [](const CorpusDomainSide & s) {
        return json{{"tokens", s.tokens}, {"target_share", s.target_share}, {"share", s.share}};
    };
    j = {{"domain", d.domain}, {"calib", side(d.calib)}, {"eval", side(d.eval)}};
}

void to_json(json & j, const CorpusDedupe & d) { j = {{"exact", d.exact}, {"near", d.near}, {"examples", d.examples}}; }

void to_json(json & j, const CorpusBoilerplate & b) {
    j = {{"source", b.source},
         {"chars", b.chars},
         {"documents", b.documents},
         {"share_of_their_bytes", b.share_of_their_bytes},
         {"begins", b.begins},
         {"stripped", b.stripped}};
}

void to_json(json & j, const CorpusLeakCheck & l) {
    j = {{"exact", l.exact},
         {"near", l.near},
         {"shared_ngrams", l.shared_ngrams},
         {"shared_ngram_hashes", l.shared_ngram_hashes},
         {"shared_groups", l.shared_groups},
         {"ngram_units", l.ngram_units},
         {"ngram_sample", l.ngram_sample},
         {"clean", l.clean},
         {"examples", l.examples}};
}

void to_json(json & j, const CorpusOutputs & o) {
    j = {{"calib", output_json(o.calib)},
         {"eval", output_json(o.eval)},
         {"tasks", {{"path", o.tasks.path}, {"tasks", o.tasks.tasks}, {"digest", o.tasks.digest}, {"domains", o.tasks.domains}}}};
}

void to_json(json & j, const CorpusReport & r) { j = to_json(r); }

json to_json(const CorpusReport & r) {
    const CorpusModelInput & m = r.inputs.model;
    const CorpusSettings & s = r.settings;
    json sources = json::array();
    for (const CorpusSourceRow & row : r.sources) {
        sources.push_back(source_json(row));
    }
    return {
        {"format", "moeprune-corpus"},
        {"version", 1},
        {"inputs",
         {{"model", {{"path", m.path}, {"bytes", m.bytes}, {"digest", m.digest}, {"vocab", m.vocab}}},
          {"manifest", optional_json(r.inputs.manifest)},
          {"mmproj", optional_json(r.inputs.mmproj)},
          {"bytes", r.inputs.bytes}}},
        {"settings",
         {{"seed", s.seed},
          {"near_dup", s.near_dup},
          {"eval_share", s.eval_share},
          {"tokens", optional_json(s.tokens)},
          {"doc_tokens", s.doc_tokens},
          {"strip_boilerplate", s.strip_boilerplate},
          {"allow_shortfall", s.allow_shortfall},
          {"tokens_counted_as", s.tokens_counted_as},
          {"task_context", s.task_context},
          {"task_ending", s.task_ending},
          {"tasks_per_domain", s.tasks_per_domain},
          {"minhash", {{"shingle_units", s.minhash.shingle_units}, {"signature", s.minhash.signature},
                       {"lsh_rows", s.minhash.lsh_rows}, {"lsh_bands", s.minhash.lsh_bands}}}}},
        {"sources", sources},
        {"domains", r.domains},
        {"dedupe", r.dedupe},
        {"boilerplate", r.boilerplate},
        {"leak_check", r.leak_check},
        {"prefix_shares", {{"calib", prefix_json(r.calib_prefix_shares)}, {"eval", prefix_json(r.eval_prefix_shares)}}},
        {"shortfalls", r.shortfalls},
        {"tokenized_bytes", r.tokenized_bytes},
        {"seconds", {{"read", r.seconds.read}, {"dedupe", r.seconds.dedupe}, {"tokenize", r.seconds.tokenize},
                     {"leak_check", r.seconds.leak_check}, {"write", r.seconds.write}}},
        {"outputs", r.outputs}};
}

CorpusReport read_corpus_report(const std::filesystem::path & path) {
    const json doc = parse_json(read_text_file(path), path.string());
    if (!doc.is_object() || doc.value("format", json()) != "moeprune-corpus") {
        fail_file(path.string(), "is not a moeprune corpus report (\"format\")");
    }
    const JsonFields f(doc, path.string());
    (void)f.integer("version", 1, 1);
    CorpusReport out;
    out.inputs = inputs_of(f.object("inputs"));
    out.settings = settings_of(f.object("settings"));
    for (const JsonFields & s : f.objects("sources")) {
        out.sources.push_back(source_of(s));
    }
    for (const JsonFields & d : f.objects("domains")) {
        out.domains.push_back({d.string("domain"), domain_side_of(d.object("calib")), domain_side_of(d.object("eval"))});
    }
    const JsonFields dedupe = f.object("dedupe");
    out.dedupe = {count(dedupe, "exact"), count(dedupe, "near"), dedupe.array("examples")};
    for (const JsonFields & b : f.objects("boilerplate")) {
        out.boilerplate.push_back({b.string("source"), count(b, "chars"), count(b, "documents"),
                                   b.number("share_of_their_bytes", 0, kShareMax), b.string("begins"), b.boolean("stripped")});
    }
    out.leak_check = leak_check_of(f.object("leak_check"));
    const JsonFields prefixes = f.object("prefix_shares");
    out.calib_prefix_shares = prefix_shares_of(prefixes, "calib");
    out.eval_prefix_shares = prefix_shares_of(prefixes, "eval");
    out.shortfalls = f.strings("shortfalls");
    out.tokenized_bytes = count(f, "tokenized_bytes");
    out.seconds = seconds_of(f.object("seconds"));
    const JsonFields outputs = f.object("outputs");
    const JsonFields tasks = outputs.object("tasks");
    out.outputs = {output_of(outputs.object("calib")), output_of(outputs.object("eval")),
                   {tasks.string("path"), count(tasks, "tasks"), tasks.string("digest"), tasks.string("domains")}};
    return out;
}

} // namespace moeprune
