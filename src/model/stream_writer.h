#pragma once
// Writes a GGUF (one file, or shards in gguf-split's layout) whose tensor data is
// streamed from byte ranges of existing files, never held in memory. Each output
// is written under a temporary name with its magic zeroed, so an interrupted file
// is not a GGUF at all; the magic goes in last, the result is re-opened and every
// tensor's offset and size checked, and only then is it renamed into place.
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "ggml.h"
#include "model/model_file.h"

namespace moeprune {

struct CopyPiece {
    int source;        // index into StreamWriteRequest::sources
    uint64_t offset;   // absolute offset in that file
    uint64_t bytes;
};

struct OutputTensor {
    std::string name;
    ggml_type type;
    int n_dims;
    std::array<int64_t, GGML_MAX_DIMS> ne;
    std::vector<CopyPiece> pieces;  // concatenated in order, they are the tensor's data
};

struct StreamWriteRequest {
    // Metadata of the (first) output. The writer adds split.* keys and the tensor
    // infos to this context itself rather than to a copy: a large vocabulary makes
    // every copy cost tens of MiB.
    GgufPtr kv;
    std::vector<std::filesystem::path> sources;
    std::vector<OutputTensor> tensors;
    std::filesystem::path output;       // with split_max_bytes: OUT.gguf names OUT-0000i-of-0000N.gguf
    uint64_t split_max_bytes = 0;       // 0: one file
    std::string progress_label = "write";
};

// The files a request will produce, in shard order (known before writing, so
// callers can refuse to overwrite their inputs).
std::vector<std::filesystem::path> planned_output_paths(const StreamWriteRequest & req);

// Returns the paths written.
std::vector<std::filesystem::path> write_gguf_streamed(StreamWriteRequest & req);

} // namespace moeprune
