#include "corpus/similarity.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

namespace moeprune {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer: every input bit reaches every output bit
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

bool word_byte(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Hashes of every run of n consecutive values, by a polynomial rolling hash (mixed after).
template <class Out> void rolling(const std::vector<TextUnit> & units, size_t n, Out out) {
    constexpr uint64_t base = 0x100000001b3ull;
    uint64_t top = 1;  // base^(n-1)
    for (size_t k = 1; k < n; ++k) {
        top *= base;
    }
    uint64_t h = 0;
    for (size_t i = 0; i < units.size(); ++i) {
        if (i >= n) {
            h -= units[i - n].hash * top;
        }
        h = h * base + units[i].hash;
        if (i + 1 >= n) {
            out(mix(h ^ n), units[i + 1 - n].offset);
        }
    }
}

} // namespace

std::vector<TextUnit> text_units(std::string_view text) {
    std::vector<TextUnit> units;
    units.reserve(text.size() / 5);
    const auto * s = reinterpret_cast<const unsigned char *>(text.data());
    const size_t n = text.size();
    size_t i = 0;
    while (i < n) {
        const unsigned char c = s[i];
        if (word_byte(c)) {
            const size_t start = i;
            uint64_t h = 0xcbf29ce484222325ull;
            while (i < n && word_byte(s[i])) {
                const unsigned char lower = (s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i];
                h = (h ^ lower) * 0x100000001b3ull;
                ++i;
            }
            units.push_back({mix(h), uint32_t(start)});
        } else if (c >= 0x80) {
            const size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
            uint64_t cp = 0;
            for (size_t k = 0; k < len && i + k < n; ++k) {
                cp = (cp << 8) | s[i + k];
            }
            units.push_back({mix(cp | (1ull << 40)), uint32_t(i)});
            i += len;
        } else {
            ++i;
        }
    }
    return units;
}

std::vector<uint64_t> shingle_set(std::string_view text, int n) {
    const std::vector<TextUnit> units = text_units(text);
    std::vector<uint64_t> out;
    if (units.empty()) {
        return out;
    }
    const size_t width = std::min(units.size(), size_t(n));
    out.reserve(units.size());
    rolling(units, width, [&](uint64_t h, uint32_t) { out.push_back(h); });
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

double jaccard(const std::vector<uint64_t> & a, const std::vector<uint64_t> & b) {
    if (a.empty() && b.empty()) {
        return 1.0;
    }
    size_t i = 0, j = 0, common = 0;
    while (i < a.size() && j < b.size()) {
        if (a[i] == b[j]) {
            ++common, ++i, ++j;
        } else if (a[i] < b[j]) {
            ++i;
        } else {
            ++j;
        }
    }
    return double(common) / double(a.size() + b.size() - common);
}

Signature minhash(const std::vector<uint64_t> & shingles) {
    constexpr uint32_t empty = std::numeric_limits<uint32_t>::max();
    Signature sig;
    sig.fill(empty);
    std::array<bool, kSignatureSize> filled{};
    for (const uint64_t h : shingles) {
        const uint64_t m = mix(h + 0x9e3779b97f4a7c15ull);
        const size_t bucket = size_t(m >> 57);
        const uint32_t v = uint32_t(m);
        if (!filled[bucket] || v < sig[bucket]) {
            sig[bucket] = v;
            filled[bucket] = true;
        }
    }
    // An empty bucket borrows the next filled one to its right, offset by the distance,
    // so two sets agree on it exactly when they agree on the bucket it borrowed.
    if (shingles.empty()) {
        return sig;
    }
    for (size_t b = 0; b < kSignatureSize; ++b) {
        if (filled[b]) {
            continue;
        }
        size_t d = 1;
        while (!filled[(b + d) % kSignatureSize]) {
            ++d;
        }
        sig[b] = uint32_t(mix(uint64_t(sig[(b + d) % kSignatureSize]) * 0x9e3779b1u + d));
    }
    return sig;
}

std::string normalized_digest(std::string_view text) {
    XXH3_state_t * st = XXH3_createState();
    XXH3_128bits_reset(st);
    char buf[4096];
    size_t used = 0;
    bool pending_space = false, started = false;
    for (const char ch : text) {
        const unsigned char c = static_cast<unsigned char>(ch);
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
            pending_space = started;
            continue;
        }
        if (used + 2 > sizeof(buf)) {
            XXH3_128bits_update(st, buf, used);
            used = 0;
        }
        if (pending_space) {
            buf[used++] = ' ';
            pending_space = false;
        }
        buf[used++] = char(c >= 'A' && c <= 'Z' ? c + 32 : c);
        started = true;
    }
    XXH3_128bits_update(st, buf, used);
    const XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

LshIndex::LshIndex(double threshold) {
    rows_ = 1;
    for (int r = 8; r >= 1; --r) {
        const int b = kSignatureSize / r;
        if (1.0 - std::pow(1.0 - std::pow(threshold, r), b) >= 0.99) {
            rows_ = r;
            break;
        }
    }
    bands_ = kSignatureSize / rows_;
    tables_.resize(size_t(bands_));
}

uint64_t LshIndex::band_key(const Signature & s, int band) const {
    return XXH3_64bits_withSeed(s.data() + size_t(band * rows_), sizeof(uint32_t) * size_t(rows_), uint64_t(band));
}

void LshIndex::add(uint32_t id, const Signature & s) {
    for (int b = 0; b < bands_; ++b) {
        tables_[size_t(b)][band_key(s, b)].push_back(id);
    }
}

std::vector<uint32_t> LshIndex::candidates(const Signature & s) const {
    std::vector<uint32_t> out;
    for (int b = 0; b < bands_; ++b) {
        const auto & t = tables_[size_t(b)];
        if (auto it = t.find(band_key(s, b)); it != t.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
        }
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

std::vector<Ngram> sampled_ngrams(std::string_view text) {
    const std::vector<TextUnit> units = text_units(text);
    std::vector<Ngram> out;
    rolling(units, kLeakNgramUnits, [&](uint64_t h, uint32_t offset) {
        if (h % kLeakNgramSample == 0) {
            out.push_back({h, offset});
        }
    });
    return out;
}

std::vector<Boilerplate> find_boilerplate(const std::vector<std::string_view> & bodies, size_t min_chars,
                                          size_t min_documents) {
    std::unordered_map<uint64_t, std::vector<size_t>> by_head;
    std::vector<uint64_t> order;  // first-seen order keeps the report stable
    for (size_t i = 0; i < bodies.size(); ++i) {
        if (bodies[i].size() < min_chars) {
            continue;
        }
        const uint64_t key = XXH3_64bits(bodies[i].data(), min_chars);
        auto & members = by_head[key];
        if (members.empty()) {
            order.push_back(key);
        }
        members.push_back(i);
    }
    std::vector<Boilerplate> out;
    for (const uint64_t key : order) {
        const std::vector<size_t> & members = by_head[key];
        if (members.size() < min_documents) {
            continue;
        }
        std::string_view common = bodies[members[0]];
        for (const size_t m : members) {
            const std::string_view b = bodies[m];
            const size_t limit = std::min(common.size(), b.size());
            size_t k = 0;
            while (k < limit && common[k] == b[k]) {
                ++k;
            }
            common = common.substr(0, k);
        }
        // Whole lines only, so no document is left starting mid-word or mid-character.
        const size_t cut = common.rfind('\n');
        if (cut == std::string_view::npos || cut + 1 < min_chars) {
            continue;
        }
        out.push_back({std::string(common.substr(0, cut + 1)), members});
    }
    return out;
}

} // namespace moeprune
