// corpus.json: each domain's shares, each source's row, and the report of every phase.
#include "corpus/phases.h"
#include "engine/session.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

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
        std::vector<CorpusPrefixShares> & rows = side == kCalib ? b.report.calib_prefix_shares : b.report.eval_prefix_shares;
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
            std::map<std::string, double> shares;
            double worst = 0;
            for (size_t d = 0; d < domains.size(); ++d) {
                const double share = seen > 0 ? got[d] / seen : 0;
                shares[domains[d]] = share;
                if (target_sum > 0) {
                    worst = std::max(worst, std::abs(share - target[d] / target_sum));
                }
            }
            rows.push_back({f, uint64_t(seen), shares, worst});
        }
        for (size_t d = 0; d < domains.size(); ++d) {
            if (side == kCalib) {
                b.report.domains.push_back({domains[d], {}, {}});
            }
            CorpusDomainRow & row = b.report.domains[d];
            // Bound first: GCC 12 at -O2 drops members of a braced list assigned to a
            // conditional lvalue (source_report's eval budget came out null in corpus.json).
            auto & side_row = side == kCalib ? row.calib : row.eval;
            side_row = {uint64_t(reached[d]), target_sum > 0 ? target[d] / target_sum : 0,
                        total > 0 ? reached[d] / double(total) : 0};
        }
    }
}

namespace {

// One source's row of the report: its files, what was dropped, and what each side took.
CorpusSourceRow source_report(const CorpusBuild & b, size_t s) {
    const SourceSpec & src = b.specs[s];
    const std::vector<SourceFile> & files = b.files;
    CorpusSourceRow row{.name = src.name,
                        .path = src.path,
                        .domain = src.domain,
                        .group = src.group.written,
                        .split = to_string(src.split),
                        .media = modality_name(src.media)};
    for (size_t i = 0; i < files.size(); ++i) {
        if (b.jobs[i].first == s) {  // files are in the order of the reading jobs
            row.files.push_back({files[i].path.string(), files[i].bytes, files[i].digest});
        }
    }
    row.documents_read = b.read_docs[s];
    row.empty_skipped = b.empty_skipped[s];
    row.binary_skipped = b.binary_skipped[s];
    row.not_media_skipped = b.not_media_skipped[s];
    row.exact_duplicates = b.exact_dropped[s];
    row.near_duplicates = b.near_dropped[s];
    row.boilerplate_only = b.boiler_only[s];
    if (src.tokens) {
        row.tokens = *src.tokens;
    } else {
        row.weight = *src.weight;
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
        CorpusSourceSide & side_row = side == kCalib ? row.calib : row.eval;   // bound first: see report_domains
        side_row = {.budget = budget == kAll ? std::nullopt : std::optional(budget),
                    .tokens = tokens,
                    .shortfall = budget != kAll && tokens < budget ? budget - tokens : 0,
                    .documents = whole.size(),
                    .units = taken.size(),
                    .pieces = pieces,
                    .truncated = truncated,
                    .documents_available = b.order[s][size_t(side)].size(),
                    .groups_available = b.groups[s][size_t(side)].size()};
    }
    return row;
}

} // namespace

// The rest of the report (corpus.json): inputs, settings, each source, and the duplicates dropped.
void finish_report(CorpusBuild & b, const llama_model * model, const LshIndex & lsh) {
    const CorpusOptions & opt = b.opt;
    const CorpusSpec & spec = b.spec;
    CorpusReport & r = b.report;
    for (size_t s = 0; s < b.specs.size(); ++s) {
        r.sources.push_back(source_report(b, s));
    }
    for (size_t s = 0; s < b.specs.size(); ++s) {
        r.dedupe.exact += b.exact_dropped[s];
        r.dedupe.near += b.near_dropped[s];
    }
    std::error_code ec;
    r.inputs = {.model = {.path = opt.model.string(),
                          .bytes = fs::file_size(opt.model, ec),
                          .digest = b.model_identity,
                          .vocab = vocab_digest(llama_model_get_vocab(model))},
                .manifest = spec.manifest.empty() ? std::nullopt : std::optional(spec.manifest.string()),
                .mmproj = opt.mmproj.empty() ? std::nullopt : std::optional(opt.mmproj.string()),
                .bytes = b.total_bytes};
    r.settings = {.seed = spec.seed,
                  .near_dup = spec.near_dup,
                  .eval_share = spec.eval_share,
                  .tokens = spec.tokens,
                  .doc_tokens = spec.doc_tokens,
                  .strip_boilerplate = spec.strip_boilerplate,
                  .allow_shortfall = opt.allow_shortfall,
                  .tokens_counted_as = "llama.cpp tokenizer with BOS where the model adds one, special tokens parsed; "
                                       "conversations rendered with the model's chat template",
                  .minhash = {kShingleUnits, kSignatureSize, lsh.rows(), lsh.bands()},
                  .task_context = spec.task_context,
                  .task_ending = spec.task_ending,
                  .tasks_per_domain = spec.tasks_per_domain};
}

} // namespace moeprune::corpus_build
