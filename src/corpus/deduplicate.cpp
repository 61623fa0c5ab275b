// Deduplication: exact duplicates across sources, boilerplate per source, and near duplicates.
#include "core/parallel.h"
#include "corpus/phases.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>

namespace moeprune::corpus_build {

namespace {

json doc_ref(const std::vector<SourceFile> & files, const std::vector<SourceSpec> & specs, const SourceDocument & d) {
    return {{"source", specs[d.source].name}, {"at", label(files, d)}};
}

} // namespace

// Exact duplicates, across sources, the first kept.
void drop_exact_duplicates(CorpusBuild & b) {
    std::vector<Doc> & docs = b.docs;
    std::vector<std::string> digests(docs.size());
    run_parallel(docs.size(), b.opt.threads,
                 [&](size_t i) { digests[i] = normalized_digest(content_text(docs[i].d)); });
    std::unordered_map<std::string, size_t> first;
    for (size_t i = 0; i < docs.size(); ++i) {
        auto [it, fresh] = first.emplace(digests[i], i);
        if (!fresh) {
            docs[i].dropped = true;
            ++b.exact_dropped[docs[i].d.source];
            if (b.report.dedupe.examples.size() < kExamples) {
                b.report.dedupe.examples.push_back({{"kind", "exact"},
                                                    {"kept", doc_ref(b.files, b.specs, docs[it->second].d)},
                                                    {"dropped", doc_ref(b.files, b.specs, docs[i].d)}});
            }
        }
    }
}

// Boilerplate, per source; never compared, and with --strip-boilerplate kept once.
void mark_boilerplate(CorpusBuild & b) {
    std::vector<Doc> & docs = b.docs;
    const bool strip = b.spec.strip_boilerplate;
    for (size_t s = 0; s < b.specs.size(); ++s) {
        std::vector<size_t> ids;
        std::vector<std::string_view> bodies;
        for (size_t i = 0; i < docs.size(); ++i) {
            if (docs[i].d.source == s && !docs[i].dropped && docs[i].d.media_key.empty()) {
                ids.push_back(i);
                bodies.push_back(body(docs[i].d));
            }
        }
        // Shared by one document in a hundred at least: a prefix a few near copies share
        // is theirs, not boilerplate.
        const size_t min_documents = std::max<size_t>(3, (bodies.size() + 99) / 100);
        for (const Boilerplate & found : find_boilerplate(bodies, 256, min_documents)) {
            const std::string & prefix = found.prefix;
            uint64_t bytes = 0;
            for (const size_t m : found.members) {
                Doc & d = docs[ids[m]];
                bytes += content_text(d.d).size();
                d.boiler_skip = prefix.size();
            }
            b.report.boilerplate.push_back({b.specs[s].name, prefix.size(), found.members.size(),
                                            double(prefix.size() * found.members.size()) / double(bytes),
                                            prefix.substr(0, char_start(prefix, std::min<size_t>(80, prefix.size()))), strip});
            if (strip) {
                for (size_t k = 1; k < found.members.size(); ++k) {
                    Doc & d = docs[ids[found.members[k]]];
                    body(d.d).erase(0, prefix.size());
                    d.boiler_skip = 0;
                    if (content_text(d.d).find_first_not_of(" \t\r\n") == std::string::npos) {
                        d.dropped = true;
                        ++b.boiler_only[s];
                    }
                }
            }
        }
    }
}

// Near duplicates: each document against those kept before it, decided on exact Jaccard.
void drop_near_duplicates(CorpusBuild & b, LshIndex & lsh) {
    std::vector<Doc> & docs = b.docs;
    const auto similarity_text = [&](const Doc & d) {
        const std::string c = content_text(d.d);
        return d.boiler_skip < c.size() ? c.substr(d.boiler_skip) : std::string();
    };
    std::vector<Signature> sigs(docs.size());
    std::vector<uint8_t> has_units(docs.size(), 0);
    run_parallel(docs.size(), b.opt.threads, [&](size_t i) {
        if (!docs[i].dropped) {
            const std::vector<uint64_t> sh = shingle_set(similarity_text(docs[i]));
            has_units[i] = !sh.empty();
            sigs[i] = minhash(sh);
        }
    });
    for (size_t i = 0; i < docs.size(); ++i) {
        if (docs[i].dropped || !has_units[i]) {
            continue;
        }
        const std::vector<uint32_t> cands = lsh.candidates(sigs[i]);
        bool dup = false;
        if (!cands.empty()) {
            const std::vector<uint64_t> mine = shingle_set(similarity_text(docs[i]));
            for (const uint32_t c : cands) {
                const double j = jaccard(mine, shingle_set(similarity_text(docs[c])));
                if (j >= b.spec.near_dup) {
                    dup = true;
                    docs[i].dropped = true;
                    ++b.near_dropped[docs[i].d.source];
                    if (b.report.dedupe.examples.size() < 2 * kExamples) {
                        b.report.dedupe.examples.push_back({{"kind", "near"},
                                                            {"jaccard", j},
                                                            {"kept", doc_ref(b.files, b.specs, docs[c].d)},
                                                            {"dropped", doc_ref(b.files, b.specs, docs[i].d)}});
                    }
                    break;
                }
            }
        }
        if (!dup) {
            lsh.add(uint32_t(i), sigs[i]);
        }
    }
}

} // namespace moeprune::corpus_build
