#include "formats/base_logits.h"
#include "core/bytes.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace moeprune {

namespace {

constexpr char kMagic[4] = {'M', 'P', 'K', 'L'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxTop = 65536;


} // namespace

uint64_t base_record_bytes(uint32_t top) { return 12 + 8 * uint64_t(top); }

BaseLogitsWriter::BaseLogitsWriter(File & file, const nlohmann::json & header, uint32_t top) : file_(file), top_(top) {
    const std::string h = header.dump();
    std::vector<uint8_t> b(kMagic, kMagic + 4);
    put_bytes<uint32_t>(b, kVersion);
    put_bytes<uint32_t>(b, top);
    put_bytes<uint32_t>(b, uint32_t(h.size()));
    b.insert(b.end(), h.begin(), h.end());
    file_.pwrite_all(b.data(), b.size(), 0);
    offset_ = b.size();
}

void BaseLogitsWriter::append(const BaseRecord & r) {
    buf_.clear();
    put_bytes<int32_t>(buf_, r.target);
    put_bytes<float>(buf_, r.lp_target);
    put_bytes<float>(buf_, r.ln_tail);
    for (uint32_t i = 0; i < top_; ++i) {
        put_bytes<int32_t>(buf_, r.ids[i]);
    }
    for (uint32_t i = 0; i < top_; ++i) {
        put_bytes<float>(buf_, r.lp[i]);
    }
    file_.pwrite_all(buf_.data(), buf_.size(), offset_);
    offset_ += buf_.size();
    ++n_;
}

BaseLogitsReader BaseLogitsReader::open(const std::filesystem::path & path) {
    BaseLogitsReader r(File::open_read(path));
    const std::string origin = path.string();
    const uint64_t size = r.file_.size();
    if (size < 16) {
        fail_file(origin, "too short for an eval base file");
    }
    uint8_t head[16];
    r.file_.pread_exact(head, 16, 0);
    if (std::memcmp(head, kMagic, 4) != 0) {
        fail_file(origin, "not an eval base file (magic is not MPKL; made by moeprune eval --base-out)");
    }
    if (get_bytes<uint32_t>(head + 4) != kVersion) {
        fail_file(origin, fmt::format("eval base version {} is not supported (only {})", get_bytes<uint32_t>(head + 4), kVersion));
    }
    r.top_ = get_bytes<uint32_t>(head + 8);
    const uint32_t header_len = get_bytes<uint32_t>(head + 12);
    if (r.top_ == 0 || r.top_ > kMaxTop || 16 + uint64_t(header_len) > size) {
        fail_file(origin, fmt::format("header is inconsistent: top {} and {} header bytes in a file of {}", r.top_,
                                      header_len, size));
    }
    std::string text(header_len, '\0');
    r.file_.pread_exact(text.data(), header_len, 16);
    r.header_ = parse_json(text, origin + ": header");
    if (!r.header_.is_object() || !r.header_.contains("n_scored") || !r.header_["n_scored"].is_number_unsigned()) {
        fail_file(origin, "header has no \"n_scored\" count");
    }
    r.n_scored_ = r.header_["n_scored"].get<uint64_t>();
    r.data_offset_ = 16 + header_len;
    const uint64_t rec = base_record_bytes(r.top_);
    if ((size - r.data_offset_) / rec != r.n_scored_ || (size - r.data_offset_) % rec != 0) {
        fail_file(origin, fmt::format("holds {} bytes of records, but {} records of top {} need {} (truncated?)",
                                      size - r.data_offset_, r.n_scored_, r.top_, r.n_scored_ * rec));
    }
    return r;
}

std::vector<BaseRecord> BaseLogitsReader::read(uint64_t first, uint64_t n) const {
    if (first > n_scored_ || n > n_scored_ - first) {
        fail_file(file_.path().string(), fmt::format("records {}..{} requested but the file holds {}", first, first + n,
                                                     n_scored_));
    }
    const uint64_t rec = base_record_bytes(top_);
    std::vector<uint8_t> raw(n * rec);
    file_.pread_exact(raw.data(), raw.size(), data_offset_ + first * rec);
    std::vector<BaseRecord> out(n);
    for (uint64_t i = 0; i < n; ++i) {
        const uint8_t * p = raw.data() + i * rec;
        BaseRecord & r = out[i];
        r.target = get_bytes<int32_t>(p);
        r.lp_target = get_bytes<float>(p + 4);
        r.ln_tail = get_bytes<float>(p + 8);
        r.ids.resize(top_);
        r.lp.resize(top_);
        std::memcpy(r.ids.data(), p + 12, 4 * size_t(top_));
        std::memcpy(r.lp.data(), p + 12 + 4 * size_t(top_), 4 * size_t(top_));
        if (!std::isfinite(r.lp_target) || std::isnan(r.ln_tail) || r.ln_tail > 0) {
            fail_file(file_.path().string(), fmt::format("record {} is corrupt (non-finite probabilities)", first + i));
        }
    }
    return out;
}

} // namespace moeprune
