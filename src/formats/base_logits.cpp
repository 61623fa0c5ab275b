#include "formats/base_logits.h"
#include "core/bytes.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace moeprune {

namespace {

constexpr char kMagic[4] = {'M', 'P', 'K', 'L'};
constexpr uint32_t kVersion = 2;
constexpr uint32_t kMaxTop = 65536;
constexpr uint64_t kFixedHead = 16;
constexpr uint64_t kChecksumBytes = 8;
// How far the top entries plus the tail may sum from 1: float log-probabilities of a
// full distribution are accurate to a few ulps, a damaged record is off by far more.
constexpr double kMassSlack = 1e-3;

uint64_t checksum(const void * data, size_t size) { return XXH3_64bits(data, size); }

uint64_t sections_of(uint64_t n_records) { return (n_records + kBaseSectionRecords - 1) / kBaseSectionRecords; }

// Why a record cannot be a base distribution's top-T, or empty when it can be one.
std::string record_problem(const BaseRecord & r, int32_t n_vocab) {
    if (r.target < 0 || r.target >= n_vocab) {
        return fmt::format("target {} is outside the {}-token vocabulary", r.target, n_vocab);
    }
    if (!std::isfinite(r.lp_target) || r.lp_target > 0) {
        return fmt::format("ln p(target) is {}, not a finite value <= 0", r.lp_target);
    }
    if (std::isnan(r.ln_tail) || r.ln_tail > 0 || r.ln_tail == std::numeric_limits<float>::infinity()) {
        return fmt::format("ln tail mass is {}, not a value <= 0 (or -inf)", r.ln_tail);
    }
    double mass = std::exp(double(r.ln_tail));
    for (size_t i = 0; i < r.ids.size(); ++i) {
        if (r.ids[i] < 0 || r.ids[i] >= n_vocab) {
            return fmt::format("id {} is outside the {}-token vocabulary", r.ids[i], n_vocab);
        }
        if (!std::isfinite(r.lp[i]) || r.lp[i] > 0) {
            return fmt::format("ln p of id {} is {}, not a finite value <= 0", r.ids[i], r.lp[i]);
        }
        if (i > 0 && r.lp[i] > r.lp[i - 1]) {
            return fmt::format("entry {} is more probable than entry {} (the top must be in descending order)", i, i - 1);
        }
        mass += std::exp(double(r.lp[i]));
    }
    std::vector<int32_t> sorted = r.ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        return "names one id twice in its top";
    }
    if (std::fabs(mass - 1) > kMassSlack) {
        return fmt::format("the top's mass plus the tail's is {}, not 1", mass);
    }
    const auto at = std::find(r.ids.begin(), r.ids.end(), r.target);
    if (at != r.ids.end() ? r.lp[size_t(at - r.ids.begin())] != r.lp_target
                          : !r.lp.empty() && r.lp_target > r.lp.back()) {
        return fmt::format("ln p(target) {} disagrees with the top's entries", r.lp_target);
    }
    return {};
}

} // namespace

uint64_t base_record_bytes(uint32_t top) { return 12 + 8 * uint64_t(top); }

BaseLogitsWriter::BaseLogitsWriter(File & file, const nlohmann::json & header, uint32_t top) : file_(file), top_(top) {
    const std::string h = header.dump();
    std::vector<uint8_t> b(kMagic, kMagic + 4);
    put_bytes<uint32_t>(b, kVersion);
    put_bytes<uint32_t>(b, top);
    put_bytes<uint32_t>(b, uint32_t(h.size()));
    b.insert(b.end(), h.begin(), h.end());
    put_bytes<uint64_t>(b, checksum(b.data(), b.size()));
    file_.pwrite_all(b.data(), b.size(), 0);
    offset_ = b.size();
    section_.reserve(size_t(kBaseSectionRecords * base_record_bytes(top) + kChecksumBytes));
}

void BaseLogitsWriter::append(const BaseRecord & r) {
    put_bytes<int32_t>(section_, r.target);
    put_bytes<float>(section_, r.lp_target);
    put_bytes<float>(section_, r.ln_tail);
    for (uint32_t i = 0; i < top_; ++i) {
        put_bytes<int32_t>(section_, r.ids[i]);
    }
    for (uint32_t i = 0; i < top_; ++i) {
        put_bytes<float>(section_, r.lp[i]);
    }
    if (++n_ % kBaseSectionRecords == 0) {
        write_section();
    }
}

void BaseLogitsWriter::finish() {
    if (!section_.empty()) {
        write_section();
    }
}

void BaseLogitsWriter::write_section() {
    put_bytes<uint64_t>(section_, checksum(section_.data(), section_.size()));
    file_.pwrite_all(section_.data(), section_.size(), offset_);
    offset_ += section_.size();
    section_.clear();
}

BaseLogitsReader BaseLogitsReader::open(const std::filesystem::path & path) {
    BaseLogitsReader r(File::open_read(path));
    const std::string origin = path.string();
    const uint64_t size = r.file_.size();
    if (size < kFixedHead) {
        fail_file(origin, "too short for an eval base file");
    }
    uint8_t head[kFixedHead];
    r.file_.pread_exact(head, kFixedHead, 0);
    if (std::memcmp(head, kMagic, 4) != 0) {
        fail_file(origin, "not an eval base file (magic is not MPKL; made by moeprune eval --base-out)");
    }
    const uint32_t version = get_bytes<uint32_t>(head + 4);
    if (version != kVersion) {
        fail_file(origin, fmt::format("eval base version {} is not supported (only {}, with checksums; write it again "
                                      "with eval --base-out)", version, kVersion));
    }
    r.top_ = get_bytes<uint32_t>(head + 8);
    const uint32_t header_len = get_bytes<uint32_t>(head + 12);
    if (r.top_ == 0 || r.top_ > kMaxTop || kFixedHead + uint64_t(header_len) + kChecksumBytes > size) {
        fail_file(origin, fmt::format("header is inconsistent: top {} and {} header bytes in a file of {}", r.top_,
                                      header_len, size));
    }
    std::vector<uint8_t> whole_head(kFixedHead + header_len + kChecksumBytes);
    r.file_.pread_exact(whole_head.data(), whole_head.size(), 0);
    if (get_bytes<uint64_t>(whole_head.data() + kFixedHead + header_len) != checksum(whole_head.data(), kFixedHead + header_len)) {
        fail_file(origin, "header checksum mismatch (the header or its JSON is damaged)");
    }
    r.header_ = parse_json(std::string(whole_head.begin() + kFixedHead, whole_head.begin() + long(kFixedHead + header_len)),
                           origin + ": header");
    const nlohmann::json & h = r.header_;
    if (!h.is_object() || h.value("format", nlohmann::json()) != "moeprune-eval-base") {
        fail_file(origin, "header: \"format\" is not \"moeprune-eval-base\"");
    }
    for (const char * key : {"top", "n_scored", "n_vocab"}) {
        if (!h.contains(key) || !h[key].is_number_unsigned()) {
            fail_file(origin, fmt::format("header: \"{}\" is missing or not a count", key));
        }
    }
    for (const char * key : {"model", "corpus", "settings"}) {
        if (!h.contains(key) || !h[key].is_object()) {
            fail_file(origin, fmt::format("header: \"{}\" is missing or not an object", key));
        }
    }
    if (!h["corpus"].contains("digest") || !h["corpus"]["digest"].is_string()) {
        fail_file(origin, "header: \"corpus\" has no \"digest\" string");
    }
    if (h["top"].get<uint64_t>() != r.top_) {
        fail_file(origin, fmt::format("header: \"top\" is {}, the records hold {} entries", h["top"].get<uint64_t>(), r.top_));
    }
    const uint64_t n_vocab = h["n_vocab"].get<uint64_t>();
    if (n_vocab < r.top_ || n_vocab > uint64_t(std::numeric_limits<int32_t>::max())) {
        fail_file(origin, fmt::format("header: \"n_vocab\" {} is not a vocabulary of at least top {} tokens", n_vocab, r.top_));
    }
    r.n_vocab_ = int32_t(n_vocab);
    r.n_scored_ = h["n_scored"].get<uint64_t>();
    r.data_offset_ = whole_head.size();
    const uint64_t rec = base_record_bytes(r.top_);
    const uint64_t body = size - r.data_offset_;
    // Bounded before multiplying: a huge n_scored cannot wrap the expected size.
    if (r.n_scored_ > body / rec || r.n_scored_ * rec + sections_of(r.n_scored_) * kChecksumBytes != body) {
        fail_file(origin, fmt::format("holds {} bytes of records, but {} records of top {} in sections of {} need {} "
                                      "(truncated?)", body, r.n_scored_, r.top_, kBaseSectionRecords,
                                      r.n_scored_ <= body / rec ? r.n_scored_ * rec + sections_of(r.n_scored_) * kChecksumBytes
                                                                : body + 1));
    }
    return r;
}

std::vector<BaseRecord> BaseLogitsReader::read(uint64_t first, uint64_t n) const {
    const std::string origin = file_.path().string();
    if (first > n_scored_ || n > n_scored_ - first) {
        fail_file(origin, fmt::format("records {}..{} requested but the file holds {}", first, first + n, n_scored_));
    }
    const uint64_t rec = base_record_bytes(top_);
    const uint64_t section_bytes = kBaseSectionRecords * rec + kChecksumBytes;
    std::vector<BaseRecord> out(n);
    std::vector<uint8_t> raw;
    for (uint64_t s = first / kBaseSectionRecords; n > 0 && s * kBaseSectionRecords < first + n; ++s) {
        const uint64_t s_first = s * kBaseSectionRecords;
        const uint64_t s_n = std::min(kBaseSectionRecords, n_scored_ - s_first);
        raw.resize(size_t(s_n * rec + kChecksumBytes));
        file_.pread_exact(raw.data(), raw.size(), data_offset_ + s * section_bytes);
        if (get_bytes<uint64_t>(raw.data() + s_n * rec) != checksum(raw.data(), size_t(s_n * rec))) {
            fail_file(origin, fmt::format("checksum mismatch in records {}..{} (the file is damaged)", s_first,
                                          s_first + s_n - 1));
        }
        for (uint64_t i = std::max(first, s_first); i < std::min(first + n, s_first + s_n); ++i) {
            const uint8_t * p = raw.data() + (i - s_first) * rec;
            BaseRecord & r = out[i - first];
            r.target = get_bytes<int32_t>(p);
            r.lp_target = get_bytes<float>(p + 4);
            r.ln_tail = get_bytes<float>(p + 8);
            r.ids.resize(top_);
            r.lp.resize(top_);
            std::memcpy(r.ids.data(), p + 12, 4 * size_t(top_));
            std::memcpy(r.lp.data(), p + 12 + 4 * size_t(top_), 4 * size_t(top_));
            if (const std::string why = record_problem(r, n_vocab_); !why.empty()) {
                fail_file(origin, fmt::format("record {}: {}", i, why));
            }
        }
    }
    return out;
}

} // namespace moeprune
