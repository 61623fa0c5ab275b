#pragma once
// What identifies a file across commands: digests that results record and readers compare.
#include <xxhash.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moeprune {

// A file's identity for run's stage manifests: "xxh3:HEX" of its bytes; files over
// 256 MiB "xxh3-ends:SIZE:MTIME_NS:HEX" (their first and last 16 MiB), a cheap staleness
// check where an edit in place also changes the modification time.
std::string identity_digest(const std::filesystem::path & p);

// A model's identity by content alone, whatever its file is called or when it was
// copied: "xxh3:HEX" of every shard's bytes in order; a model over 256 MiB in all
// "xxh3-sampled:SIZE:HEX": each shard's size, first and last 16 MiB and 64 evenly spaced
// 1 MiB pieces (its metadata, tensor table and samples of every region of weights).
std::string model_digest(const std::vector<std::filesystem::path> & shards);

// The digest results record for a file's bytes or a structure's: xxh64, seed 0. The
// "xxh64:HEX" form names its hash; bare HEX is what corpus files have always recorded.
class Xxh64 {
public:
    Xxh64();
    Xxh64 & update(const void * p, size_t n);
    Xxh64 & update(std::string_view bytes) { return update(bytes.data(), bytes.size()); }
    uint64_t value() const;
    std::string hex() const;       // "0123456789abcdef"
    std::string named() const;     // "xxh64:0123456789abcdef"
private:
    std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t *)> state_;
};

// "xxh64:HEX" of `bytes`: how a result names an input file it read whole.
std::string content_digest(std::string_view bytes);
// Bare HEX of `bytes`, the corpus formats' spelling.
std::string xxh64_hex(std::string_view bytes);

} // namespace moeprune
