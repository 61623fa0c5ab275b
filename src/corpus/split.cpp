// The split into calib and eval by group, stratified per source, and each side's seeded order.
#include "corpus/phases.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <unordered_map>
#include <unordered_set>

namespace moeprune::corpus_build {

namespace {

double group_draw(uint64_t seed, const std::string & group) {
    return double(XXH64(group.data(), group.size(), seed) >> 11) * 0x1.0p-53;
}

// The side of every group of the sources split by group, stratified per source: its
// groups in a seeded random order, the first round(eval_share x groups) to eval, at least
// one when it has two groups or more and an eval share, never all of them. A group an
// earlier source already placed (sources may share group keys) keeps its side and counts.
std::unordered_map<std::string, int> split_groups(const std::vector<SourceSpec> & specs, const std::vector<Doc> & docs,
                                                  const CorpusSpec & spec) {
    std::unordered_map<std::string, int> side;
    for (size_t s = 0; s < specs.size(); ++s) {
        if (specs[s].split != SplitSide::Both) {
            continue;
        }
        std::vector<std::string> mine;
        std::unordered_set<std::string> seen;
        for (const Doc & d : docs) {
            if (!d.dropped && d.d.source == s && seen.insert(d.d.group).second) {
                mine.push_back(d.d.group);
            }
        }
        const size_t n = mine.size();
        const bool wants_eval = spec.eval_share > 0 || specs[s].eval_tokens.value_or(0) > 0;
        size_t want = size_t(std::llround(spec.eval_share * double(n)));
        if (wants_eval && n >= 2) {
            want = std::clamp<size_t>(want, 1, n - 1);
        }
        std::vector<std::string> open;
        for (const std::string & g : mine) {
            if (auto it = side.find(g); it != side.end()) {
                want -= want > 0 && it->second == kEval ? 1 : 0;
            } else {
                open.push_back(g);
            }
        }
        std::sort(open.begin(), open.end(), [&](const std::string & a, const std::string & b) {
            const double da = group_draw(spec.seed, a), db = group_draw(spec.seed, b);
            return da != db ? da < db : a < b;
        });
        for (size_t i = 0; i < open.size(); ++i) {
            side[open[i]] = i < want ? kEval : kCalib;
        }
    }
    return side;
}

} // namespace

// Sides by group; each source's documents of a side in a seeded random order.
void split_sides(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::unordered_map<std::string, int> group_side = split_groups(specs, b.docs, b.spec);
    for (size_t i = 0; i < b.docs.size(); ++i) {
        Doc & d = b.docs[i];
        if (d.dropped) {
            continue;
        }
        const SourceSpec & s = specs[d.d.source];
        d.side = s.split == SplitSide::Calib ? kCalib : s.split == SplitSide::Eval ? kEval : group_side.at(d.d.group);
        b.order[d.d.source][size_t(d.side)].push_back(i);
        b.groups[d.d.source][size_t(d.side)].insert(d.d.group);
    }
    for (size_t s = 0; s < specs.size(); ++s) {
        for (int side : {kCalib, kEval}) {
            std::mt19937_64 rng(XXH64(specs[s].name.data(), specs[s].name.size(), b.spec.seed * 2 + uint64_t(side)));
            std::shuffle(b.order[s][size_t(side)].begin(), b.order[s][size_t(side)].end(), rng);
        }
    }
}

} // namespace moeprune::corpus_build
