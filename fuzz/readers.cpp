#include "readers.h"

#include "formats/corpus.h"
#include "core/errors.h"
#include "corpus/manifest.h"
#include "corpus/sources.h"
#include "engine/media.h"
#include "formats/base_logits.h"
#include "formats/corpus_report.h"
#include "formats/keep_map.h"
#include "formats/measure_report.h"
#include "formats/stage_reports.h"
#include "formats/stats.h"
#include "formats/trace.h"
#include "formats/verify_summary.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "plan/plan.h"
#include "run/run.h"
#include "slice/slice.h"

#include "core/atomic_file.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>

namespace moeprune::fuzz {

namespace fs = std::filesystem;

namespace {

void keep_map(const fs::path & p) {
    const KeepMap km = read_keep_map(p);
    (void)keep_map_digest(km);
}

void stats(const fs::path & p) { (void)read_stats(p); }

// collect's, eval's and corpus' walk of a --mmproj file before libmtmd reads it.
void projector(const fs::path & p) { check_projector_file(p); }

void trace(const fs::path & p) {
    const TraceReader r = TraceReader::open(p);
    (void)r.verify();
    (void)r.token_meta();
    for (uint32_t l = 0; l < r.header().n_layer; ++l) {
        r.for_each_layer_chunk(l, [](uint64_t, uint32_t, const uint16_t *, const float *) {});
    }
}

void corpus_jsonl(const fs::path & p) { (void)read_corpus(p); }

void corpus_manifest(const fs::path & p) { (void)read_manifest(p); }

// moeprune corpus's reader of a JSONL source ("text", "messages" or "prompt" +
// "response"), grouping by a field as a manifest may ask.
void corpus_source(const fs::path & p) {
    SourceSpec s;
    s.name = "fuzz";
    s.format = SourceFormat::Jsonl;
    s.group.kind = GroupRule::Kind::Field;
    s.group.field = "session";
    SourceFiles out;
    read_source_file(s, 0, p, false, out);
}

void base_logits(const fs::path & p) {
    const BaseLogitsReader r = BaseLogitsReader::open(p);
    (void)r.read(0, std::min<uint64_t>(r.n_scored(), 64));
}

void run_config(const fs::path & p) { (void)read_run_config(p); }

// The checksums stop almost every mutated input at the first check; the resealed targets
// write them anew over the mutated bytes (as a careless tool that rewrites a file would),
// so the parsing and the range checks behind them are fuzzed too.
void put_checksum(std::string & b, size_t from, size_t n) {
    const uint64_t h = XXH3_64bits(b.data() + from, n);
    std::memcpy(b.data() + from + n, &h, 8);
}

void resealed(const fs::path & p, const std::function<void(std::string &)> & reseal, void (*read)(const fs::path &)) {
    std::string b = read_text_file(p);
    reseal(b);
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(b.data(), std::streamsize(b.size()));
    read(p);
}

void base_logits_resealed(const fs::path & p) {
    resealed(p, [](std::string & b) {
        if (b.size() < 16) {
            return;
        }
        uint32_t top = 0, hlen = 0;
        std::memcpy(&top, b.data() + 8, 4);
        std::memcpy(&hlen, b.data() + 12, 4);
        if (top == 0 || top > 65536 || 16 + uint64_t(hlen) + 8 > b.size()) {
            return;
        }
        put_checksum(b, 0, 16 + hlen);
        const uint64_t rec = base_record_bytes(top), section = kBaseSectionRecords * rec;
        for (uint64_t at = 16 + hlen + 8; at + 8 < b.size();) {
            const uint64_t n = std::min<uint64_t>(section, (b.size() - at - 8) / rec * rec);
            if (n == 0) {
                break;
            }
            put_checksum(b, size_t(at), size_t(n));
            at += n + 8;
        }
    }, base_logits);
}

void trace_resealed(const fs::path & p) {
    resealed(p, [](std::string & b) {
        uint32_t version = 0, meta_len = 0;
        if (b.size() < 24 || b.compare(0, 4, "MPTR") != 0) {
            return;
        }
        std::memcpy(&version, b.data() + 4, 4);
        std::memcpy(&meta_len, b.data() + 20, 4);
        if (version == 3 && 24 + uint64_t(meta_len) + 8 <= b.size()) {
            put_checksum(b, 0, 24 + meta_len);
        }
    }, trace);
}

// inspect's and slice's path: open (ggml's gguf reader, behind moeprune's guards),
// inspect, and plan a slice of the first k experts of every MoE layer.
void gguf(const fs::path & p) {
    const GgufModel m = GgufModel::open(p);
    const InspectReport info = inspect_model(m, {});
    if (!info.problems.empty() || info.n_expert <= 0 || info.layers.empty()) {
        return;
    }
    // The first half of every expert group (one group without groups).
    const int64_t groups = std::max<int64_t>(1, info.expert_group_count);
    const int64_t per_group = info.n_expert / groups;
    const int64_t keep_per_group = std::max<int64_t>(1, per_group / 2);
    KeepMap km;
    km.n_expert = info.n_expert;
    km.k = keep_per_group * groups;
    for (const LayerInfo & li : info.layers) {
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t e = 0; e < keep_per_group; ++e) {
                km.layers[li.layer].push_back(int32_t(g * per_group + e));
            }
        }
    }
    const fs::path keep = fs::path(p).replace_extension(".keep.json");
    write_keep_map(keep, km);
    SliceOptions opt;
    opt.model = p;
    opt.keep = keep;
    opt.output = fs::path(p).replace_extension(".sliced.gguf");
    opt.dry_run = true;
    try {
        (void)slice_model(opt);
    } catch (const Error &) {
        fs::remove(keep);
        throw;
    }
    fs::remove(keep);
}

// plan --measured's path: a moeprune-measure report priced into a plan (the geometry of
// the seeds' model, given by hand), its measured limits made options.
void measure_report(const fs::path & p) {
    PlanOptions o;
    o.expert_mb = 0.012288;
    o.layers = 2;
    o.experts = 4;
    o.used = 2;
    o.ks = {4};
    o.ram_bytes = 1e9;
    o.measured = p;
    (void)make_plan(o);
}

// run's, plan's and report's reading of select, eval, replay, plan and measure reports and
// of run's verify summary: the file is read as the report its "format" names (an eval
// report when it names none of them).
void stage_report(const fs::path & p) {
    const nlohmann::json doc = parse_json(read_text_file(p), p.string());
    const std::string format = doc.is_object() && doc.contains("format") && doc["format"].is_string()
                                   ? doc["format"].get<std::string>()
                                   : "";
    if (format == "moeprune-select") {
        (void)read_select_report(p);
    } else if (format == "moeprune-replay") {
        (void)read_replay_report(p);
    } else if (format == "moeprune-plan") {
        (void)read_plan_inputs(read_plan_report(p));
    } else if (format == "moeprune-measure") {
        (void)read_measure_report(p);
    } else if (format == "moeprune-verify") {
        (void)read_verify_summary(p);
    } else {
        (void)read_eval_report(p);
    }
}

// report's reading of corpus.json (moeprune corpus's report).
void corpus_report(const fs::path & p) { (void)read_corpus_report(p); }

} // namespace

const std::vector<Reader> & readers() {
    static const std::vector<Reader> all = {
        {"keep_map", ".json", keep_map},
        {"stats", ".json", stats},
        {"trace", ".mptrace", trace},
        {"corpus_jsonl", ".jsonl", corpus_jsonl},
        {"corpus_manifest", ".toml", corpus_manifest},
        {"corpus_source", ".jsonl", corpus_source},
        {"base_logits", ".mpkl", base_logits},
        {"base_logits_resealed", ".mpkl", base_logits_resealed},
        {"trace_resealed", ".mptrace", trace_resealed},
        {"run_config", ".toml", run_config},
        {"gguf", ".gguf", gguf},
        {"measure_report", ".json", measure_report},
        {"projector", ".gguf", projector},
        {"stage_report", ".json", stage_report},
        {"corpus_report", ".json", corpus_report},
    };
    return all;
}

const Reader & reader(const std::string & name) {
    for (const Reader & r : readers()) {
        if (r.name == name) {
            return r;
        }
    }
    throw Error("no fuzz reader " + name);
}

} // namespace moeprune::fuzz
