// The leak check: eval against calib, of what is written.
#include "corpus/leak_check.h"
#include "core/parallel.h"
#include "corpus/phases.h"

#include <set>
#include <string_view>
#include <unordered_map>

namespace moeprune {

using corpus_build::char_start;
using corpus_build::kExamples;
using nlohmann::json;

namespace {

// Calib's side, computed once: where each normalized text, sampled n-gram and group
// first occurs, and the LSH index of the signatures.
struct CalibIndex {
    explicit CalibIndex(double near_dup) : lsh(near_dup) {}
    std::unordered_map<std::string, size_t> digest_at;
    std::unordered_map<uint64_t, std::pair<size_t, uint32_t>> gram_at;
    std::unordered_map<std::string, size_t> group_at;
    LshIndex lsh;
};

CalibIndex index_calib(const std::vector<LeakDocument> & calib, double near_dup, int threads) {
    std::vector<std::string> digests(calib.size());
    std::vector<Signature> sigs(calib.size());
    std::vector<std::vector<Ngram>> grams(calib.size());
    run_parallel(calib.size(), threads, [&](size_t i) {
        const std::string_view compared = std::string_view(calib[i].text).substr(calib[i].skip);
        digests[i] = normalized_digest(calib[i].text);
        sigs[i] = minhash(shingle_set(compared));
        grams[i] = sampled_ngrams(compared);
    });
    CalibIndex index(near_dup);
    for (size_t i = 0; i < calib.size(); ++i) {
        index.digest_at.emplace(digests[i], i);
        index.lsh.add(uint32_t(i), sigs[i]);
        for (const Ngram & g : grams[i]) {
            index.gram_at.emplace(g.hash, std::pair{i, g.offset});
        }
        grams[i].clear();
        grams[i].shrink_to_fit();
        index.group_at.emplace(calib[i].group, i);
    }
    return index;
}

// What one eval document shares with calib: the calib document of each kind of hit (-1: none).
struct Hit {
    int exact = -1, near = -1, gram = -1;
    double jaccard = 0;
    uint32_t gram_count = 0, eval_offset = 0, calib_offset = 0;
};

std::vector<Hit> find_hits(const std::vector<LeakDocument> & calib, const std::vector<LeakDocument> & eval,
                           const CalibIndex & index, double near_dup, int threads) {
    std::vector<Hit> hits(eval.size());
    run_parallel(eval.size(), threads, [&](size_t i) {
        Hit & h = hits[i];
        const LeakDocument & e = eval[i];
        if (auto it = index.digest_at.find(normalized_digest(e.text)); it != index.digest_at.end()) {
            h.exact = int(it->second);
            return;
        }
        const std::string_view compared = std::string_view(e.text).substr(e.skip);
        const std::vector<uint64_t> shingles = shingle_set(compared);
        for (const uint32_t c : index.lsh.candidates(minhash(shingles))) {
            const double j = jaccard(shingles, shingle_set(std::string_view(calib[c].text).substr(calib[c].skip)));
            if (j >= near_dup && j > h.jaccard) {
                h.near = int(c);
                h.jaccard = j;
            }
        }
        for (const Ngram & g : sampled_ngrams(compared)) {
            if (auto it = index.gram_at.find(g.hash); it != index.gram_at.end()) {
                if (h.gram < 0) {
                    h.gram = int(it->second.first);
                    h.calib_offset = it->second.second;
                    h.eval_offset = uint32_t(g.offset + e.skip);
                }
                ++h.gram_count;
            }
        }
    });
    return hits;
}

} // namespace

CorpusLeakCheck leak_check(const std::vector<LeakDocument> & calib, const std::vector<LeakDocument> & eval, double near_dup, int threads) {
    json examples = json::array();
    const auto example = [&](const char * kind, const LeakDocument & c, const LeakDocument & e, json extra) {
        if (examples.size() < 3 * kExamples) {
            json x = {{"kind", kind}, {"calib", c.label}, {"eval", e.label}};
            x.update(extra);
            examples.push_back(std::move(x));
        }
    };
    const CalibIndex index = index_calib(calib, near_dup, threads);
    const std::vector<Hit> hits = find_hits(calib, eval, index, near_dup, threads);
    uint64_t exact = 0, near = 0, ngram_docs = 0, shared_ngrams = 0;
    std::set<std::string> shared_groups;
    const auto snippet = [](const std::string & text, size_t at) {
        return text.substr(at, char_start(text, std::min(text.size(), at + 80)) - at);
    };
    for (size_t i = 0; i < eval.size(); ++i) {
        const Hit & h = hits[i];
        if (h.exact >= 0) {
            ++exact;
            example("exact", calib[size_t(h.exact)], eval[i], json::object());
        }
        if (h.near >= 0) {
            ++near;
            example("near", calib[size_t(h.near)], eval[i], {{"jaccard", h.jaccard}});
        }
        if (h.gram >= 0) {
            ++ngram_docs;
            shared_ngrams += h.gram_count;
            example("ngram", calib[size_t(h.gram)], eval[i], {{"text", snippet(eval[i].text, h.eval_offset)}});
        }
        if (auto it = index.group_at.find(eval[i].group); it != index.group_at.end() && shared_groups.insert(eval[i].group).second) {
            example("group", calib[it->second], eval[i], {{"group", eval[i].group}});
        }
    }
    return {.exact = exact,
            .near = near,
            .shared_ngrams = ngram_docs,
            .shared_ngram_hashes = shared_ngrams,
            .shared_groups = shared_groups.size(),
            .ngram_units = kLeakNgramUnits,
            .ngram_sample = kLeakNgramSample,
            .clean = exact + near + ngram_docs + shared_groups.size() == 0,
            .examples = examples};
}

namespace corpus_build {

// Leak check of what is written.
CorpusLeakCheck check_leaks(const CorpusBuild & b) {
    std::array<std::vector<LeakDocument>, 2> leak_docs;
    for (int side : {kCalib, kEval}) {
        for (const Unit * u : b.sequence[size_t(side)]) {
            const Doc & d = b.docs[u->doc];
            SourceDocument view;
            view.text = u->text;
            view.messages = u->messages;
            view.media_key = d.d.media_key;
            const std::string text = content_text(view);
            const size_t skip = d.boiler_skip && !u->truncated && !u->piece ? d.boiler_skip : 0;
            leak_docs[size_t(side)].push_back({text, d.d.group, label(b.files, d.d), std::min(skip, text.size())});
        }
    }
    return leak_check(leak_docs[kCalib], leak_docs[kEval], b.spec.near_dup, b.opt.threads);
}

} // namespace corpus_build

} // namespace moeprune
