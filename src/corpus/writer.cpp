// The output: each side's units interleaved by source, written as JSONL, and every output
// renamed together.
#include "corpus/phases.h"

#include "core/digest.h"

#include <fmt/format.h>

namespace moeprune::corpus_build {

// Interleave: the source furthest behind its share of the side's tokens goes next, so
// every prefix holds each source (and so each domain) at its share.
void interleave(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::vector<std::array<std::vector<Unit>, 2>> & taken = b.taken;
    const std::vector<std::array<uint64_t, 2>> & taken_tokens = b.taken_tokens;
    for (int side : {kCalib, kEval}) {
        std::vector<size_t> pos(specs.size(), 0);
        std::vector<uint64_t> emitted(specs.size(), 0);
        for (size_t s = 0; s < specs.size(); ++s) {
            b.side_tokens[size_t(side)] += taken_tokens[s][size_t(side)];
        }
        for (;;) {
            long best = -1;
            double best_progress = 0;
            for (size_t s = 0; s < specs.size(); ++s) {
                const std::vector<Unit> & units = taken[s][size_t(side)];
                if (pos[s] >= units.size()) {
                    continue;
                }
                const double p = (double(emitted[s]) + 0.5 * double(units[pos[s]].tokens)) / double(taken_tokens[s][size_t(side)]);
                if (best < 0 || p < best_progress) {
                    best = long(s);
                    best_progress = p;
                }
            }
            if (best < 0) {
                break;
            }
            const Unit & u = taken[size_t(best)][size_t(side)][pos[size_t(best)]++];
            emitted[size_t(best)] += u.tokens;
            b.sequence[size_t(side)].push_back(&u);
        }
    }
}

namespace {

// A message as the corpus format reads it: a string, or text and media parts in order,
// media by absolute path (the output may live far from its sources).
json content_json(const CorpusMessage & m) {
    if (m.media.empty()) {
        return m.content;
    }
    json parts = json::array();
    size_t at = 0;
    const std::string marker = kMediaMarker;
    for (const CorpusMedia & media : m.media) {
        const size_t next = m.content.find(marker, at);
        if (next > at) {
            parts.push_back({{"type", "text"}, {"text", m.content.substr(at, next - at)}});
        }
        parts.push_back({{"type", modality_name(media.modality)}, {"path", fs::absolute(media.path).string()}});
        at = next + marker.size();
    }
    if (at < m.content.size()) {
        parts.push_back({{"type", "text"}, {"text", m.content.substr(at)}});
    }
    return parts;
}

} // namespace

// The JSONL collect and eval read, written whole under temporary names: every output
// takes its final name only once all are written, so a failed write leaves the old set.
void stage_jsonl(CorpusBuild & b) {
    for (int side : {kCalib, kEval}) {
        std::string bytes;
        for (const Unit * u : b.sequence[size_t(side)]) {
            const SourceDocument & d = b.docs[u->doc].d;
            json line;
            if (u->messages.empty()) {
                line["text"] = u->text;
            } else {
                json msgs = json::array();
                for (const CorpusMessage & m : u->messages) {
                    msgs.push_back({{"role", m.role}, {"content", content_json(m)}});
                }
                line["messages"] = std::move(msgs);
            }
            line["domain"] = b.specs[d.source].domain;
            line["group"] = d.group;
            line["source"] = b.specs[d.source].name;
            bytes += line.dump();
            bytes += '\n';
        }
        const fs::path & path = side == kCalib ? b.calib_path : b.eval_path;
        // Bound first: GCC 12 at -O2 drops members of a braced list assigned to a conditional
        // lvalue (build_report.cpp's report_domains).
        auto & output = side == kCalib ? b.report.outputs.calib : b.report.outputs.eval;
        output = {path.string(), b.sequence[size_t(side)].size(), b.side_tokens[size_t(side)], bytes.size(),
                  xxh64_hex(bytes)};
        b.staged.push_back(std::make_unique<AtomicOutput>(path));
        write_temp_file(*b.staged.back(), bytes);
    }
    b.report.outputs.tasks = {b.tasks_path.string(), b.tasks.task_domains.size(), b.tasks.file_digest,
                              b.task_set_path.string()};
    b.staged.push_back(std::make_unique<AtomicOutput>(b.tasks_path));
    write_temp_file(*b.staged.back(), b.tasks_text);
    b.staged.push_back(std::make_unique<AtomicOutput>(b.task_set_path));
    write_temp_file(*b.staged.back(), to_json(b.tasks).dump(1) + "\n");
}

// The report staged beside the JSONL (and its copy, if asked for), then every output renamed together.
void commit_outputs(CorpusBuild & b) {
    const std::string text = to_json(b.report).dump(2) + "\n";
    b.staged.push_back(std::make_unique<AtomicOutput>(b.report_path));
    write_temp_file(*b.staged.back(), text);
    if (!b.opt.report.empty()) {
        b.staged.push_back(std::make_unique<AtomicOutput>(b.opt.report));
        write_temp_file(*b.staged.back(), text);
    }
    for (const auto & out : b.staged) {
        out->commit();
    }
}

} // namespace moeprune::corpus_build
