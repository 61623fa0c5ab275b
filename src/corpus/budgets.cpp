// Budgets in the model's tokens: planned per source and side, taken unit by unit, and
// checked for shortfalls and empty sides.
#include "core/errors.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "corpus/phases.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace moeprune::corpus_build {

// Budgets: fixed ones first; weighted sources share the corpus budget, or without one
// take as much as every weighted source can give in proportion (kAll until take_budgets).
void plan_budgets(CorpusBuild & b) {
    const CorpusSpec & spec = b.spec;
    uint64_t fixed = 0;
    double weight_sum = 0;
    for (const SourceSpec & s : b.specs) {
        if (s.split != SplitSide::Eval) {
            fixed += s.tokens.value_or(0);
            weight_sum += s.tokens ? 0 : *s.weight;
        }
    }
    if (spec.tokens && weight_sum > 0 && *spec.tokens <= fixed) {
        throw Error(fmt::format("the corpus budget of {} tokens leaves nothing for the weighted sources after the {} "
                                "tokens the others ask for", *spec.tokens, fixed));
    }
    for (size_t s = 0; s < b.specs.size(); ++s) {
        const SourceSpec & src = b.specs[s];
        if (src.split == SplitSide::Eval) {
            b.budget[s][kEval] = src.eval_tokens ? *src.eval_tokens : src.tokens ? *src.tokens : kAll;
            continue;
        }
        if (src.tokens) {
            b.budget[s][kCalib] = *src.tokens;
        } else if (spec.tokens) {
            b.budget[s][kCalib] = uint64_t(std::llround(double(*spec.tokens - fixed) * *src.weight / weight_sum));
        } else {
            b.budget[s][kCalib] = kAll;
        }
    }
}

namespace {

// Taking units from one source and side in order, tokenizing in parallel batches.
void take_units(CorpusBuild & b, const Tokenizer & tokenizer, size_t s, int side, uint64_t budget, Progress & progress) {
    std::vector<Unit> & out = b.taken[s][size_t(side)];
    const std::vector<size_t> & ids = b.order[s][size_t(side)];
    std::vector<Unit> & pending = b.spare[s][size_t(side)];
    uint64_t & taken_tokens = b.taken_tokens[s][size_t(side)];
    size_t & next_doc = b.next_doc[s][size_t(side)];
    const size_t batch = 64;
    while (taken_tokens < budget) {
        if (pending.empty()) {
            const size_t from = next_doc;
            if (from >= ids.size()) {
                return;
            }
            const size_t n = std::min(batch, ids.size() - from);
            std::vector<std::vector<Unit>> made(n);
            run_parallel(n, b.opt.threads, [&](size_t k) {
                const Doc & d = b.docs[ids[from + k]];
                made[k] = tokenizer.units(ids[from + k], d.d, b.specs[s].truncate, label(b.files, d.d));
            });
            next_doc = from + n;
            for (size_t k = 0; k < n; ++k) {
                b.report.tokenized_bytes += content_text(b.docs[ids[from + k]].d).size();
                for (Unit & u : made[k]) {
                    pending.push_back(std::move(u));
                }
            }
            std::reverse(pending.begin(), pending.end());
        }
        while (!pending.empty() && taken_tokens < budget) {
            taken_tokens += pending.back().tokens;
            progress.advance(pending.back().tokens);
            out.push_back(std::move(pending.back()));
            pending.pop_back();
        }
    }
}

} // namespace

// Every source's budgets taken: the open budgets of weighted sources settled first, then
// each source's calib and eval side.
void take_budgets(CorpusBuild & b, const Tokenizer & tokenizer) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::array<uint64_t, 2>> & budget = b.budget;
    const double eval_ratio = b.spec.eval_share / (1.0 - b.spec.eval_share);
    const auto eval_budget_for = [&](const SourceSpec & s, uint64_t calib) -> uint64_t {
        return s.eval_tokens ? *s.eval_tokens : uint64_t(std::llround(double(calib) * eval_ratio));
    };
    uint64_t planned = 0;
    bool weighted_open = false;
    for (size_t s = 0; s < specs.size(); ++s) {
        weighted_open = weighted_open || budget[s][kCalib] == kAll;
        planned += budget[s][kCalib] == kAll ? 0 : budget[s][kCalib];
    }
    Progress progress("tokenizing", std::max<uint64_t>(planned, 1), "tokens");
    if (weighted_open) {
        // Everything the weighted sources have, then the largest budget all can meet.
        double scale = std::numeric_limits<double>::infinity();
        for (size_t s = 0; s < specs.size(); ++s) {
            if (budget[s][kCalib] == kAll) {
                take_units(b, tokenizer, s, kCalib, kAll, progress);
                scale = std::min(scale, double(b.taken_tokens[s][kCalib]) / *specs[s].weight);
            }
        }
        for (size_t s = 0; s < specs.size(); ++s) {
            if (budget[s][kCalib] == kAll) {
                budget[s][kCalib] = uint64_t(std::floor(scale * *specs[s].weight));
                // Give back what is past the budget, whole units, in the order taken.
                std::vector<Unit> & out = b.taken[s][kCalib];
                uint64_t sum = 0;
                size_t keep = 0;
                while (keep < out.size() && sum < budget[s][kCalib]) {
                    sum += out[keep++].tokens;
                }
                out.resize(keep);
                b.taken_tokens[s][kCalib] = sum;
            }
        }
    }
    for (size_t s = 0; s < specs.size(); ++s) {
        if (specs[s].split == SplitSide::Both) {
            budget[s][kEval] = eval_budget_for(specs[s], budget[s][kCalib]);
        }
        for (int side : {kCalib, kEval}) {
            take_units(b, tokenizer, s, side, budget[s][size_t(side)], progress);
        }
    }
    progress.finish();
}

// Shortfalls: a budget a source could not meet.
//
// An eval budget derived from the eval share is a cap: how many groups fall on the
// eval side is chance. Calib budgets and eval budgets asked for by number are demands.
void check_shortfalls(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::vector<std::vector<fs::path>> & paths = b.paths;
    bool demand_missed = false;
    for (size_t s = 0; s < specs.size(); ++s) {
        for (int side : {kCalib, kEval}) {
            const uint64_t budget = b.budget[s][size_t(side)];
            const uint64_t taken = b.taken_tokens[s][size_t(side)];
            if (budget != kAll && taken < budget) {
                demand_missed = demand_missed || side == kCalib || specs[s].eval_tokens || specs[s].split == SplitSide::Eval;
                b.report.shortfalls.push_back(fmt::format(
                    "source \"{}\" ({}) has {} {} tokens, short of its budget of {}: {} documents in {} groups fell on "
                    "that side after deduplication and the split by group \"{}\"",
                    specs[s].name, paths[s].size() == 1 ? paths[s][0].string() : specs[s].path, taken, kSideName[side],
                    budget, b.order[s][size_t(side)].size(), b.groups[s][size_t(side)].size(), specs[s].group.written));
            }
        }
    }
    if (demand_missed && !b.opt.allow_shortfall) {
        std::string msg = "budgets cannot be met (--allow-shortfall builds the corpus anyway and reports them):";
        for (const std::string & m : b.report.shortfalls) {
            msg += "\n  " + m;
        }
        throw Error(msg);
    }
    for (const std::string & m : b.report.shortfalls) {
        std::fprintf(stderr, "moeprune corpus: shortfall: %s\n", m.c_str());
    }
}

// A side nothing was written to is an error unless the sources ask for it to be empty
// (no source can give eval documents when the eval share is 0 and none is split "eval";
// every source split "eval" leaves calib empty): collect or eval would read an empty file.
void refuse_empty_sides(const CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const CorpusSpec & spec = b.spec;
    const std::vector<std::array<uint64_t, 2>> & taken_tokens = b.taken_tokens;
    const std::vector<uint64_t> & read_docs = b.read_docs;
    const std::vector<uint64_t> & exact_dropped = b.exact_dropped;
    const std::vector<uint64_t> & near_dropped = b.near_dropped;
    const std::vector<uint64_t> & boiler_only = b.boiler_only;
    const std::vector<std::array<std::set<std::string>, 2>> & groups = b.groups;
    const std::vector<std::array<uint64_t, 2>> & budget = b.budget;
    for (int side : {kCalib, kEval}) {
        bool asked = false;
        uint64_t tokens = 0;
        for (size_t s = 0; s < specs.size(); ++s) {
            const SourceSpec & src = specs[s];
            asked = asked || (side == kCalib ? src.split != SplitSide::Eval
                                             : src.split == SplitSide::Eval ||
                                                   (src.split == SplitSide::Both && (spec.eval_share > 0 || src.eval_tokens.value_or(0) > 0)));
            tokens += taken_tokens[s][size_t(side)];
        }
        if (!asked || tokens > 0) {
            continue;
        }
        std::string msg = fmt::format("the {} side would be empty:", kSideName[side]);
        for (size_t s = 0; s < specs.size(); ++s) {
            const SourceSpec & src = specs[s];
            if (side == kCalib ? src.split == SplitSide::Eval : src.split == SplitSide::Calib) {
                continue;
            }
            const uint64_t kept = read_docs[s] - exact_dropped[s] - near_dropped[s] - boiler_only[s];
            msg += fmt::format("\n  source \"{}\": {} documents read, {} exact and {} near duplicates dropped, {} only "
                               "boilerplate; {} groups on this side, a budget of {} tokens",
                               src.name, read_docs[s], exact_dropped[s], near_dropped[s], boiler_only[s],
                               groups[s][size_t(side)].size(),
                               budget[s][size_t(side)] == std::numeric_limits<uint64_t>::max() ? std::string("all")
                                                                                              : std::to_string(budget[s][size_t(side)]));
            if (kept == 0 && read_docs[s] > 0) {
                msg += " (every document is a duplicate of another source's or only boilerplate)";
            } else if (side == kEval && groups[s][kCalib].size() + groups[s][kEval].size() == 1) {
                msg += " (one group: it cannot be on both sides; group = \"document\" puts each JSONL document in a "
                       "group of its own, and group = \"field:NAME\" groups them by a field such as an id)";
            }
        }
        throw Error(msg + (side == kEval ? "\n(--eval-share 0 asks for no eval side)" : ""));
    }
}

} // namespace moeprune::corpus_build
