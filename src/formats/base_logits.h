#pragma once
// Compact base logits (.mpkl): per scored token of an eval run, the base model's top-T
// log-probabilities with their ids, the log of the remaining tail mass and the target's
// log-probability: enough to price any later candidate against the base without the
// base model's full distributions. See docs/eval.md for how KLD is computed from it and
// docs/formats.md for the layout (version 2: the header and every section of records
// checksummed, every record checked on reading).
#include "core/file_io.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <vector>

namespace moeprune {

struct BaseRecord {
    int32_t target = 0;        // the token that follows
    float lp_target = 0;       // ln p_base(target)
    float ln_tail = 0;         // ln of the mass outside ids (-inf when ids hold it all)
    std::vector<int32_t> ids;  // top-T ids, most probable first
    std::vector<float> lp;     // their ln p_base
};

// Records per checksummed section.
constexpr uint64_t kBaseSectionRecords = 1024;

// Header: what produced the records ("format", "model", "corpus", "settings") plus
// "top", "n_vocab" and "n_scored", which the body must match.
class BaseLogitsWriter {
public:
    BaseLogitsWriter(File & file, const nlohmann::json & header, uint32_t top);
    void append(const BaseRecord & r);
    // Writes the last, partial section; the file is whole only after it.
    void finish();
    uint64_t written() const { return n_; }

private:
    void write_section();
    File & file_;
    uint32_t top_;
    uint64_t offset_ = 0, n_ = 0;
    std::vector<uint8_t> section_;
};

class BaseLogitsReader {
public:
    // Checks the magic, version, header checksum, the header's fields against the binary
    // ones, and that the size is exactly the header plus n_scored records in sections.
    static BaseLogitsReader open(const std::filesystem::path & path);
    const nlohmann::json & header() const { return header_; }
    uint32_t top() const { return top_; }
    uint64_t n_scored() const { return n_scored_; }
    int32_t n_vocab() const { return n_vocab_; }
    // Records [first, first + n), in the order they were written: their sections'
    // checksums verified and every record checked to be a possible distribution.
    std::vector<BaseRecord> read(uint64_t first, uint64_t n) const;

private:
    explicit BaseLogitsReader(File f) : file_(std::move(f)) {}
    File file_;
    nlohmann::json header_;
    uint32_t top_ = 0;
    int32_t n_vocab_ = 0;
    uint64_t n_scored_ = 0, data_offset_ = 0;
};

uint64_t base_record_bytes(uint32_t top);

} // namespace moeprune
