#pragma once
// Compact base logits (.mpkl): per scored token of an eval run, the base model's top-T
// log-probabilities with their ids, the log of the remaining tail mass and the target's
// log-probability: enough to price any later candidate against the base without the
// base model's full distributions. See docs/eval.md for how KLD is computed from it.
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

// Header: what produced the records ("model", "corpus", "settings") plus "top" and "n_scored".
class BaseLogitsWriter {
public:
    BaseLogitsWriter(File & file, const nlohmann::json & header, uint32_t top);
    void append(const BaseRecord & r);
    uint64_t written() const { return n_; }

private:
    File & file_;
    uint32_t top_;
    uint64_t offset_ = 0, n_ = 0;
    std::vector<uint8_t> buf_;
};

class BaseLogitsReader {
public:
    static BaseLogitsReader open(const std::filesystem::path & path);
    const nlohmann::json & header() const { return header_; }
    uint32_t top() const { return top_; }
    uint64_t n_scored() const { return n_scored_; }
    // Records [first, first + n), in the order they were written.
    std::vector<BaseRecord> read(uint64_t first, uint64_t n) const;

private:
    explicit BaseLogitsReader(File f) : file_(std::move(f)) {}
    File file_;
    nlohmann::json header_;
    uint32_t top_ = 0;
    uint64_t n_scored_ = 0, data_offset_ = 0;
};

uint64_t base_record_bytes(uint32_t top);

} // namespace moeprune
