// corpus.json: each domain's shares, each source's row, and the report of every phase.
#include "corpus/phases.h"
#include "engine/session.h"

#include <algorithm>
#include <cmath>

namespace moeprune::corpus_build {

namespace {

constexpr double kPrefixes[] = {0.10, 0.25, 0.50, 1.00};

} // namespace

// Domains: target shares from budgets, reached shares, and shares of every prefix.
void report_domains(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::string> domains;
    for (const SourceSpec & s : specs) {
        if (std::find(domains.begin(), domains.end(), s.domain) == domains.end()) {
            domains.push_back(s.domain);
        }
    }
    const auto domain_of = [&](size_t s) { return size_t(std::find(domains.begin(), domains.end(), specs[s].domain) - domains.begin()); };
    for (int side : {kCalib, kEval}) {
        std::vector<double> target(domains.size(), 0), reached(domains.size(), 0);
        double target_sum = 0;
        for (size_t s = 0; s < specs.size(); ++s) {
            const uint64_t budget = b.budget[s][size_t(side)];
            const double t = budget == kAll ? double(b.taken_tokens[s][size_t(side)]) : double(budget);
            target[domain_of(s)] += t;
            target_sum += t;
            reached[domain_of(s)] += double(b.taken_tokens[s][size_t(side)]);
        }
        json rows = json::array();
        const uint64_t total = b.side_tokens[size_t(side)];
        for (const double f : kPrefixes) {
            const double cutoff = f * double(total);
            std::vector<double> got(domains.size(), 0);
            double seen = 0;
            for (const Unit * u : b.sequence[size_t(side)]) {
                if (seen >= cutoff) {
                    break;
                }
                const double part = std::min(double(u->tokens), cutoff - seen);
                got[domain_of(b.docs[u->doc].d.source)] += part;
                seen += part;
            }
            json shares = json::object();
            double worst = 0;
            for (size_t d = 0; d < domains.size(); ++d) {
                const double share = seen > 0 ? got[d] / seen : 0;
                shares[domains[d]] = share;
                if (target_sum > 0) {
                    worst = std::max(worst, std::abs(share - target[d] / target_sum));
                }
            }
            rows.push_back({{"prefix", f}, {"tokens", uint64_t(seen)}, {"shares", shares}, {"max_abs_error_vs_target", worst}});
        }
        b.prefix_report[kSideName[side]] = rows;
        for (size_t d = 0; d < domains.size(); ++d) {
            if (side == kCalib) {
                b.domain_report.push_back({{"domain", domains[d]}});
            }
            b.domain_report[d][kSideName[side]] = {{"tokens", uint64_t(reached[d])},
                                                   {"target_share", target_sum > 0 ? target[d] / target_sum : 0},
                                                   {"share", total > 0 ? reached[d] / double(total) : 0}};
        }
    }
}

namespace {

// One source's row of the report: its files, what was dropped, and what each side took.
json source_report(const CorpusBuild & b, size_t s) {
    const SourceSpec & src = b.specs[s];
    const std::vector<SourceFile> & files = b.files;
    json f = json::array();
    for (size_t i = 0; i < files.size(); ++i) {
        if (b.jobs[i].first == s) {  // files are in the order of the reading jobs
            f.push_back({{"path", files[i].path.string()}, {"bytes", files[i].bytes}, {"digest", files[i].digest}});
        }
    }
    json row = {{"name", src.name},
                {"path", src.path},
                {"domain", src.domain},
                {"group", src.group.written},
                {"split", to_string(src.split)},
                {"media", modality_name(src.media)},
                {"files", f},
                {"documents_read", b.read_docs[s]},
                {"empty_skipped", b.empty_skipped[s]},
                {"binary_skipped", b.binary_skipped[s]},
                {"not_media_skipped", b.not_media_skipped[s]},
                {"exact_duplicates", b.exact_dropped[s]},
                {"near_duplicates", b.near_dropped[s]},
                {"boilerplate_only", b.boiler_only[s]}};
    if (src.tokens) {
        row["tokens"] = *src.tokens;
    } else {
        row["weight"] = *src.weight;
    }
    for (int side : {kCalib, kEval}) {
        const std::vector<Unit> & taken = b.taken[s][size_t(side)];
        uint64_t pieces = 0, truncated = 0;
        std::set<size_t> whole;
        for (const Unit & u : taken) {
            pieces += u.piece;
            truncated += u.truncated;
            whole.insert(u.doc);
        }
        const uint64_t budget = b.budget[s][size_t(side)];
        const uint64_t tokens = b.taken_tokens[s][size_t(side)];
        row[kSideName[side]] = {{"budget", budget == kAll ? json(nullptr) : json(budget)},
                                {"tokens", tokens},
                                {"shortfall", budget != kAll && tokens < budget ? budget - tokens : 0},
                                {"documents", whole.size()},
                                {"units", taken.size()},
                                {"pieces", pieces},
                                {"truncated", truncated},
                                {"documents_available", b.order[s][size_t(side)].size()},
                                {"groups_available", b.groups[s][size_t(side)].size()}};
    }
    return row;
}

} // namespace

// The report (corpus.json): inputs, settings, and what every phase did.
json corpus_report(const CorpusBuild & b, const llama_model * model, const LshIndex & lsh, const json & leaks,
                   const json & seconds) {
    const CorpusOptions & opt = b.opt;
    const CorpusSpec & spec = b.spec;
    json sources = json::array();
    for (size_t s = 0; s < b.specs.size(); ++s) {
        sources.push_back(source_report(b, s));
    }
    uint64_t exact_total = 0, near_total = 0;
    for (size_t s = 0; s < b.specs.size(); ++s) {
        exact_total += b.exact_dropped[s];
        near_total += b.near_dropped[s];
    }
    std::error_code ec;
    return {
        {"format", "moeprune-corpus"},
        {"version", 1},
        {"inputs",
         {{"model", {{"path", opt.model.string()}, {"bytes", fs::file_size(opt.model, ec)},
                     {"digest", b.model_identity}, {"vocab", vocab_digest(llama_model_get_vocab(model))}}},
          {"manifest", spec.manifest.empty() ? json(nullptr) : json(spec.manifest.string())},
          {"mmproj", opt.mmproj.empty() ? json(nullptr) : json(opt.mmproj.string())},
          {"bytes", b.total_bytes}}},
        {"settings",
         {{"seed", spec.seed},
          {"near_dup", spec.near_dup},
          {"eval_share", spec.eval_share},
          {"tokens", spec.tokens ? json(*spec.tokens) : json(nullptr)},
          {"doc_tokens", spec.doc_tokens},
          {"strip_boilerplate", spec.strip_boilerplate},
          {"allow_shortfall", opt.allow_shortfall},
          {"tokens_counted_as", "llama.cpp tokenizer with BOS where the model adds one, special tokens parsed; "
                                "conversations rendered with the model's chat template"},
          {"minhash", {{"shingle_units", kShingleUnits}, {"signature", kSignatureSize}, {"lsh_rows", lsh.rows()}, {"lsh_bands", lsh.bands()}}}}},
        {"sources", sources},
        {"domains", b.domain_report},
        {"dedupe", {{"exact", exact_total}, {"near", near_total}, {"examples", b.dedupe_examples}}},
        {"boilerplate", b.boilerplate},
        {"leak_check", leaks},
        {"prefix_shares", b.prefix_report},
        {"shortfalls", b.shortfalls},
        {"tokenized_bytes", b.tokenized_bytes},
        {"seconds", seconds},
        {"outputs", {{"calib", b.output_report[kCalib]}, {"eval", b.output_report[kEval]}}}};
}

} // namespace moeprune::corpus_build
