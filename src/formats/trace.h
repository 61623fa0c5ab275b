#pragma once
// Router trace: per token, every MoE layer's top-M router candidates (expert ids and
// logits, best first) plus where the token came from. Written as a stream of
// self-describing blocks so a killed writer loses at most its last block, and laid
// out per layer inside each block so one layer reads without the others.
// Also reads the seed pipeline's Q4RT v1 files. See docs/formats.md.
#include "core/file_io.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace moeprune {

// Domain ids are stored in 16 bits.
constexpr size_t kMaxTraceDomains = 65536;

// A router logit as a trace stores it (fp16) and gives it back: what a replay of the
// trace sees, so a closed loop that decides with it agrees with the replay bit for bit.
float traced_logit(float logit);

enum class TracePhase : uint8_t { Prefill = 0, Decode = 1 };

struct TraceTokenMeta {
    int32_t token = -1;     // -1 when unknown (Q4RT files carry no token ids)
    int32_t pos = 0;
    int32_t seq = 0;
    uint16_t domain = 0;    // index into TraceHeader::domains
    TracePhase phase = TracePhase::Prefill;
};

struct TraceHeader {
    uint32_t n_layer = 0;
    uint32_t n_expert = 0;
    uint32_t top_m = 0;
    std::vector<std::string> domains;
    nlohmann::json meta = nlohmann::json::object();  // model, settings: whatever produced the trace
};

// Where an interrupted trace continues: its size and token count at a checkpoint
// (taken right after flush()).
struct TraceResumePoint {
    uint64_t bytes = 0, tokens = 0;
};

class TraceWriter {
public:
    // Blocks of `block_tokens` tokens; each layer section is zstd-compressed when `zstd_level` > 0.
    TraceWriter(const std::filesystem::path & path, TraceHeader header, uint32_t block_tokens = 256, int zstd_level = 0);
    // Continues the trace at `path` from a checkpoint: anything written after it is cut
    // off, and the file must hold exactly the checkpoint's tokens in `header`'s shape.
    TraceWriter(const std::filesystem::path & path, TraceHeader header, const TraceResumePoint & from,
                uint32_t block_tokens = 256, int zstd_level = 0);
    ~TraceWriter();
    TraceWriter(const TraceWriter &) = delete;
    TraceWriter & operator=(const TraceWriter &) = delete;

    // ids and logits: [n_layer][top_m], best candidate first.
    void append(const TraceTokenMeta & meta, const uint16_t * ids, const float * logits);
    void flush();  // writes the pending block, if any
    void close();
    uint64_t n_tokens() const { return n_written_ + pending_meta_.size(); }
    // After flush(): the checkpoint a resumed writer can continue from.
    TraceResumePoint resume_point() const { return {bytes_written_, n_written_}; }

private:
    std::filesystem::path path_;
    TraceHeader header_;
    uint32_t block_tokens_;
    int zstd_level_;
    FILE * file_ = nullptr;
    uint64_t n_written_ = 0, bytes_written_ = 0;
    std::vector<TraceTokenMeta> pending_meta_;
    std::vector<uint8_t> pending_records_;  // [token][layer] records of top_m ids then top_m f16 logits
};

// What a replay reads of a trace: from a file (TraceReader), or from memory
// (TraceInMemory) when the trace was made in the same process.
class TraceSource {
public:
    virtual ~TraceSource() = default;
    virtual const TraceHeader & header() const = 0;
    virtual uint64_t n_tokens() const = 0;
    virtual const std::string & format() const = 0;
    virtual std::vector<TraceTokenMeta> token_meta() const = 0;
    // One layer a chunk of tokens at a time, in token order: ids and logits are
    // [n][top_m], logits as a trace stores them (traced_logit).
    using LayerChunkFn = std::function<void(uint64_t first_token, uint32_t n, const uint16_t * ids, const float * logits)>;
    virtual void for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const = 0;
};

class TraceReader : public TraceSource {
public:
    static TraceReader open(const std::filesystem::path & path);

    const std::filesystem::path & path() const { return file_.path(); }
    const TraceHeader & header() const override { return header_; }
    uint64_t n_tokens() const override { return n_tokens_; }
    const std::string & format() const override { return format_; }   // "moeprune-trace v3" (v2, v1) or "Q4RT v1"
    bool has_checksums() const { return checksums_; }
    // Version 3: the file header and its metadata JSON are checksummed too.
    bool has_header_checksum() const { return header_checksum_; }
    // Reads and checks everything: every block's sections against their checksums, every
    // section decoded, every expert id and token record in range. Returns one line per
    // problem found (block, offset, section), empty when the trace is whole.
    std::vector<std::string> verify() const;
    bool truncated_tail() const { return truncated_tail_; }   // an incomplete last block was ignored

    std::vector<TraceTokenMeta> token_meta() const override;
    // One layer for all tokens: ids and logits are [n_tokens][top_m].
    void read_layer(uint32_t layer, std::vector<uint16_t> & ids, std::vector<float> & logits) const;
    // Chunks are blocks, or 1024 Q4RT tokens, so memory does not grow with the trace.
    void for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const override;

private:
    explicit TraceReader(File file) : file_(std::move(file)) {}
    // The phases of open(): the seed's Q4RT header; moeprune's header, returning where
    // the blocks begin; the block index, stopping at a torn tail.
    void open_q4rt(const std::filesystem::path & path, const uint8_t * head, uint64_t file_size);
    uint64_t read_header(const std::filesystem::path & path, uint64_t file_size);
    void index_blocks(const std::filesystem::path & path, uint64_t head_end, uint64_t file_size);
    struct Block {
        uint64_t offset = 0;
        uint64_t first_token = 0;
        uint32_t n_tokens = 0;
        uint32_t codec = 0;
        uint64_t meta_offset = 0, meta_size = 0;
        std::vector<uint64_t> layer_offset, layer_size;
        std::vector<uint64_t> hash;  // per section (0: token metadata, 1 + l: layer l); v2 only
    };
    // A section's bytes, checked against its checksum (v2) and decompressed.
    std::vector<uint8_t> read_section(const Block & b, uint32_t section, uint64_t raw_size) const;

    // Throws unless every id of a decoded layer chunk names an expert of the trace.
    void check_ids(const uint16_t * ids, uint64_t first_token, uint32_t n, uint32_t layer) const;

    File file_;
    std::string format_;
    TraceHeader header_;
    uint64_t n_tokens_ = 0;
    bool truncated_tail_ = false;
    bool q4rt_ = false;
    bool checksums_ = false;
    bool header_checksum_ = false;
    std::vector<Block> blocks_;
};

// A trace kept in memory exactly as a TraceReader would give it back, for a replay in
// the process that routed the tokens (eval's closed loop): no file written and read again.
class TraceInMemory : public TraceSource {
public:
    explicit TraceInMemory(TraceHeader header);
    // As TraceWriter::append: ids and logits are [n_layer][top_m], best candidate first.
    void append(const TraceTokenMeta & meta, const uint16_t * ids, const float * logits);

    const TraceHeader & header() const override { return header_; }
    uint64_t n_tokens() const override { return meta_.size(); }
    const std::string & format() const override { return format_; }
    std::vector<TraceTokenMeta> token_meta() const override { return meta_; }
    void for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const override;

private:
    TraceHeader header_;
    std::string format_ = "moeprune-trace (in memory)";
    std::vector<TraceTokenMeta> meta_;
    std::vector<std::vector<uint16_t>> ids_;    // per layer: [token][top_m]
    std::vector<std::vector<float>> logits_;    // per layer: [token][top_m], as traced_logit rounds them
};

// Writes numpy .npy files (ids, logits, token, pos, seq, domain, phase) into `dir`.
void export_trace_npy(const TraceReader & reader, const std::filesystem::path & dir);

nlohmann::json trace_info_json(const TraceReader & reader);

} // namespace moeprune
