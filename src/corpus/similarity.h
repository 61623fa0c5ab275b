#pragma once
// Text similarity for deduplication and the leak check, the same for every script:
// text is read as units (a run of ASCII letters, digits and '_', lower-cased, or one
// non-ASCII code point, so CJK text has units without spaces; everything else separates
// them), shingles are runs of kShingleUnits units, and similarity is the Jaccard index of
// two documents' shingle sets. MinHash signatures with LSH bands only propose candidate
// pairs; every merge is decided on the exact Jaccard index.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moeprune {

constexpr int kShingleUnits = 5;
constexpr int kSignatureSize = 128;
// Shared n-grams in the leak check: runs this long of the same units, a sentence or more.
constexpr int kLeakNgramUnits = 25;
// One n-gram hash in kLeakNgramSample is kept, chosen by its value, so two texts
// sharing a span of about kLeakNgramUnits + 4 * kLeakNgramSample units almost surely share one.
constexpr uint64_t kLeakNgramSample = 8;

struct TextUnit {
    uint64_t hash;
    uint32_t offset;  // byte offset of the unit in the text
};
std::vector<TextUnit> text_units(std::string_view text);

// Sorted, distinct hashes of every run of n units (a text of fewer units: one shingle of all).
std::vector<uint64_t> shingle_set(std::string_view text, int n = kShingleUnits);

double jaccard(const std::vector<uint64_t> & sorted_a, const std::vector<uint64_t> & sorted_b);

// One-permutation MinHash with rotation densification.
using Signature = std::array<uint32_t, kSignatureSize>;
Signature minhash(const std::vector<uint64_t> & shingles);

// Hex digest of the text with ASCII letters lower-cased and every run of whitespace one
// space: texts that differ only there are exact duplicates.
std::string normalized_digest(std::string_view text);

// Banded LSH over signatures: rows per band chosen so a pair at Jaccard `threshold`
// becomes a candidate with probability at least 0.99.
class LshIndex {
public:
    explicit LshIndex(double threshold);
    int rows() const { return rows_; }
    int bands() const { return bands_; }
    void add(uint32_t id, const Signature & s);
    // Ids sharing at least one band with `s`, each once, in insertion order of first hit.
    std::vector<uint32_t> candidates(const Signature & s) const;

private:
    uint64_t band_key(const Signature & s, int band) const;
    int rows_, bands_;
    std::vector<std::unordered_map<uint64_t, std::vector<uint32_t>>> tables_;
};

// Sampled hashes of every kLeakNgramUnits-unit run, with the byte offset where each starts.
struct Ngram {
    uint64_t hash;
    uint32_t offset;
};
std::vector<Ngram> sampled_ngrams(std::string_view text);

// A long prefix shared by several documents of one source, such as a system preamble.
struct Boilerplate {
    std::string prefix;
    std::vector<size_t> members;  // indices into the bodies given, in order
};
// Prefixes of at least `min_chars` bytes (cut back to the end of a line) shared by at
// least `min_documents` bodies.
std::vector<Boilerplate> find_boilerplate(const std::vector<std::string_view> & bodies, size_t min_chars = 256,
                                          size_t min_documents = 3);

} // namespace moeprune
