#pragma once
// What identifies a file across commands: digests that results record and readers compare.
#include <filesystem>
#include <string>
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

} // namespace moeprune
