#include "formats/trace.h"
#include "core/bytes.h"
#include "core/errors.h"
#include "core/json.h"
#include "core/atomic_file.h"

#include "ggml.h"

#include <fmt/format.h>
#include <xxhash.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr char kFileMagic[4] = {'M', 'P', 'T', 'R'};
constexpr char kBlockMagic[4] = {'M', 'P', 'B', 'K'};
// Version 2 added a checksum of every section and of the block header, version 3 one of
// the file header and its JSON; versions 1 (no checksums) and 2 are still read.
constexpr uint32_t kVersion = 3;
constexpr uint32_t kCodecRaw = 0;
constexpr uint32_t kCodecZstd = 1;
constexpr size_t kMetaBytes = 16;            // per token: token, pos, seq (i32), domain (u16), phase (u8), pad
constexpr size_t kBlockHeaderFixed = 16;     // magic, n_tokens, codec, n_sections

uint64_t checksum(const void * data, size_t size) { return XXH3_64bits(data, size); }

std::string section_name(uint32_t s) { return s == 0 ? std::string("token metadata") : fmt::format("layer {}", s - 1); }
constexpr size_t kQ4rtHeader = 16;
// zstd cannot expand a stored byte into more than this many (an RLE block of 128 KiB
// costs 4 bytes), so a section's claimed size is bounded by its stored size.
constexpr uint64_t kZstdMaxRatio = 32768;


void fwrite_exact(FILE * f, const void * data, size_t size, const fs::path & path) {
    if (std::fwrite(data, 1, size, f) != size) {
        fail_file(path.string(), std::string("write failed: ") + std::strerror(errno));
    }
}

size_t record_bytes(uint32_t top_m) { return size_t(top_m) * 4; }  // top_m u16 ids + top_m f16 logits

} // namespace

// ---------------------------------------------------------------- writer

TraceWriter::TraceWriter(const fs::path & path, TraceHeader header, uint32_t block_tokens, int zstd_level)
    : path_(path), header_(std::move(header)), block_tokens_(block_tokens), zstd_level_(zstd_level) {
    if (header_.n_layer == 0 || header_.top_m == 0 || header_.n_expert == 0) {
        fail_file(path.string(), "trace header needs n_layer, n_expert and top_m > 0");
    }
    if (header_.domains.empty() || header_.domains.size() > kMaxTraceDomains) {
        fail_file(path.string(), fmt::format("{} domains; a trace stores domain ids in 16 bits, so it holds 1 to {}",
                                             header_.domains.size(), kMaxTraceDomains));
    }
    if (header_.n_expert > 65536 || header_.top_m > header_.n_expert) {
        fail_file(path.string(), fmt::format("top_m {} of {} experts cannot be stored as 16-bit ids", header_.top_m,
                                             header_.n_expert));
    }
    file_ = std::fopen(path.c_str(), "wb");
    if (!file_) {
        fail_file(path.string(), std::string("cannot create: ") + std::strerror(errno));
    }
    const std::string meta = json{{"domains", header_.domains}, {"meta", header_.meta}}.dump();
    std::vector<uint8_t> buf(kFileMagic, kFileMagic + 4);
    put_bytes<uint32_t>(buf, kVersion);
    put_bytes<uint32_t>(buf, header_.n_layer);
    put_bytes<uint32_t>(buf, header_.n_expert);
    put_bytes<uint32_t>(buf, header_.top_m);
    put_bytes<uint32_t>(buf, uint32_t(meta.size()));
    buf.insert(buf.end(), meta.begin(), meta.end());
    put_bytes<uint64_t>(buf, checksum(buf.data(), buf.size()));
    fwrite_exact(file_, buf.data(), buf.size(), path_);
    std::fflush(file_);
    bytes_written_ = buf.size();
}

TraceWriter::TraceWriter(const fs::path & path, TraceHeader header, const TraceResumePoint & from, uint32_t block_tokens,
                         int zstd_level)
    : path_(path), header_(std::move(header)), block_tokens_(block_tokens), zstd_level_(zstd_level) {
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec || size < from.bytes) {
        fail_file(path.string(), fmt::format("cannot resume: the trace is {} bytes, the checkpoint needs {}",
                                             ec ? 0 : size, from.bytes));
    }
    fs::resize_file(path, from.bytes, ec);
    if (ec) {
        fail_file(path.string(), "cannot cut back to the checkpoint: " + ec.message());
    }
    {
        const TraceReader existing = TraceReader::open(path);
        const TraceHeader & h = existing.header();
        if (!existing.has_header_checksum()) {
            fail_file(path.string(), "cannot resume: it is a version 1 or 2 trace (its header has no checksum); start it again");
        }
        if (h.n_layer != header_.n_layer || h.n_expert != header_.n_expert || h.top_m != header_.top_m ||
            existing.n_tokens() != from.tokens || existing.truncated_tail()) {
            fail_file(path.string(), fmt::format("cannot resume: it holds {} tokens of {}x{} top-{}, the checkpoint "
                                                 "expects {} tokens of {}x{} top-{}",
                                                 existing.n_tokens(), h.n_layer, h.n_expert, h.top_m, from.tokens,
                                                 header_.n_layer, header_.n_expert, header_.top_m));
        }
    }
    file_ = std::fopen(path.c_str(), "ab");
    if (!file_) {
        fail_file(path.string(), std::string("cannot open to append: ") + std::strerror(errno));
    }
    n_written_ = from.tokens;
    bytes_written_ = from.bytes;
}

TraceWriter::~TraceWriter() {
    // A destructor cannot report a failed final write; callers that need to know call
    // close() themselves. Either way the blocks already written stay readable.
    try {
        close();
    } catch (const std::exception &) {
    }
}

void TraceWriter::append(const TraceTokenMeta & meta, const uint16_t * ids, const float * logits) {
    const uint32_t m = header_.top_m;
    pending_meta_.push_back(meta);
    for (uint32_t l = 0; l < header_.n_layer; ++l) {
        for (uint32_t i = 0; i < m; ++i) {
            if (ids[l * m + i] >= header_.n_expert) {
                fail_file(path_.string(), fmt::format("expert id {} at layer {} is not below n_expert {}", ids[l * m + i], l,
                                                      header_.n_expert));
            }
            put_bytes<uint16_t>(pending_records_, ids[l * m + i]);
        }
        for (uint32_t i = 0; i < m; ++i) {
            put_bytes<uint16_t>(pending_records_, ggml_fp32_to_fp16(logits[l * m + i]));
        }
    }
    if (pending_meta_.size() >= block_tokens_) {
        flush();
    }
}

void TraceWriter::flush() {
    if (!file_ || pending_meta_.empty()) {
        return;
    }
    const uint32_t n = uint32_t(pending_meta_.size());
    const size_t rec = record_bytes(header_.top_m);
    std::vector<std::vector<uint8_t>> sections;
    std::vector<uint8_t> meta;
    for (const auto & t : pending_meta_) {
        put_bytes<int32_t>(meta, t.token);
        put_bytes<int32_t>(meta, t.pos);
        put_bytes<int32_t>(meta, t.seq);
        put_bytes<uint16_t>(meta, t.domain);
        put_bytes<uint8_t>(meta, uint8_t(t.phase));
        put_bytes<uint8_t>(meta, 0);
    }
    sections.push_back(std::move(meta));
    for (uint32_t l = 0; l < header_.n_layer; ++l) {
        std::vector<uint8_t> layer(size_t(n) * rec);
        for (uint32_t t = 0; t < n; ++t) {
            std::memcpy(layer.data() + t * rec, pending_records_.data() + (size_t(t) * header_.n_layer + l) * rec, rec);
        }
        sections.push_back(std::move(layer));
    }
    const uint32_t codec = zstd_level_ > 0 ? kCodecZstd : kCodecRaw;
    if (codec == kCodecZstd) {
        for (auto & s : sections) {
            std::vector<uint8_t> z(ZSTD_compressBound(s.size()));
            const size_t zn = ZSTD_compress(z.data(), z.size(), s.data(), s.size(), zstd_level_);
            if (ZSTD_isError(zn)) {
                fail_file(path_.string(), std::string("zstd compression failed: ") + ZSTD_getErrorName(zn));
            }
            z.resize(zn);
            s = std::move(z);
        }
    }
    std::vector<uint8_t> block(kBlockMagic, kBlockMagic + 4);
    put_bytes<uint32_t>(block, n);
    put_bytes<uint32_t>(block, codec);
    put_bytes<uint32_t>(block, uint32_t(sections.size()));
    for (const auto & s : sections) {
        put_bytes<uint64_t>(block, s.size());
    }
    for (const auto & s : sections) {
        put_bytes<uint64_t>(block, checksum(s.data(), s.size()));
    }
    put_bytes<uint64_t>(block, checksum(block.data(), block.size()));
    for (const auto & s : sections) {
        block.insert(block.end(), s.begin(), s.end());
    }
    // One write per block and a flush, so a killed writer leaves whole blocks plus at most one torn tail.
    fwrite_exact(file_, block.data(), block.size(), path_);
    if (std::fflush(file_) != 0) {
        fail_file(path_.string(), std::string("write failed: ") + std::strerror(errno));
    }
    n_written_ += n;
    bytes_written_ += block.size();
    pending_meta_.clear();
    pending_records_.clear();
}

void TraceWriter::close() {
    if (!file_) {
        return;
    }
    flush();
    FILE * f = file_;
    file_ = nullptr;
    if (std::fclose(f) != 0) {
        fail_file(path_.string(), std::string("close failed: ") + std::strerror(errno));
    }
}

float traced_logit(float logit) { return ggml_fp16_to_fp32(ggml_fp32_to_fp16(logit)); }

// ---------------------------------------------------------------- in memory

TraceInMemory::TraceInMemory(TraceHeader header)
    : header_(std::move(header)), ids_(header_.n_layer), logits_(header_.n_layer) {}

void TraceInMemory::append(const TraceTokenMeta & meta, const uint16_t * ids, const float * logits) {
    const uint32_t m = header_.top_m;
    // Checked before anything is kept: a refused token leaves the trace as it was.
    for (uint32_t l = 0; l < header_.n_layer; ++l) {
        for (uint32_t i = 0; i < m; ++i) {
            if (ids[l * m + i] >= header_.n_expert) {
                throw Error(fmt::format("in-memory trace: expert id {} at layer {} is not below n_expert {}",
                                        ids[l * m + i], l, header_.n_expert));
            }
        }
    }
    meta_.push_back(meta);
    for (uint32_t l = 0; l < header_.n_layer; ++l) {
        ids_[l].insert(ids_[l].end(), ids + l * m, ids + (l + 1) * m);
        for (uint32_t i = 0; i < m; ++i) {
            logits_[l].push_back(traced_logit(logits[l * m + i]));
        }
    }
}

void TraceInMemory::for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const {
    if (layer >= header_.n_layer) {
        throw Error(fmt::format("in-memory trace: layer {} requested but the trace has {} layers", layer,
                                header_.n_layer));
    }
    // Chunks of at most 2^20 tokens: a chunk's count is 32 bits.
    constexpr uint64_t kChunk = uint64_t(1) << 20;
    const uint64_t m = header_.top_m;
    for (uint64_t t0 = 0; t0 < meta_.size(); t0 += kChunk) {
        const uint64_t n = std::min<uint64_t>(kChunk, meta_.size() - t0);
        fn(t0, uint32_t(n), ids_[layer].data() + t0 * m, logits_[layer].data() + t0 * m);
    }
}

// ---------------------------------------------------------------- reader

TraceReader TraceReader::open(const fs::path & path) {
    TraceReader r(File::open_read(path));
    const uint64_t file_size = r.file_.size();
    if (file_size < 16) {
        fail_file(path.string(), fmt::format("too short for a trace header ({} bytes)", file_size));
    }
    uint8_t head[16];
    r.file_.pread_exact(head, 16, 0);
    if (std::memcmp(head, "Q4RT", 4) == 0) {
        r.open_q4rt(path, head, file_size);
        return r;
    }
    if (std::memcmp(head, kFileMagic, 4) != 0) {
        fail_file(path.string(), "not a router trace (magic is neither MPTR nor Q4RT)");
    }
    r.index_blocks(path, r.read_header(path, file_size), file_size);
    return r;
}

void TraceReader::open_q4rt(const fs::path & path, const uint8_t * head, uint64_t file_size) {
    q4rt_ = true;
    const uint16_t version = get_bytes<uint16_t>(head + 4);
    if (version != 1) {
        fail_file(path.string(), fmt::format("Q4RT version {} is not supported (only 1)", version));
    }
    header_.n_layer = get_bytes<uint16_t>(head + 6);
    header_.n_expert = get_bytes<uint16_t>(head + 8);
    header_.top_m = get_bytes<uint16_t>(head + 10);
    const uint32_t header_count = get_bytes<uint32_t>(head + 12);
    if (header_.n_layer == 0 || header_.top_m == 0 || header_.top_m > header_.n_expert) {
        fail_file(path.string(), fmt::format("Q4RT header is inconsistent: {} layers, {} experts, top-{}",
                                             header_.n_layer, header_.n_expert, header_.top_m));
    }
    const uint64_t per_token = uint64_t(header_.n_layer) * record_bytes(header_.top_m);
    const uint64_t complete = (file_size - kQ4rtHeader) / per_token;
    // The seed writer only filled the count at a clean exit, so 0 means "derive it".
    if (header_count == 0) {
        n_tokens_ = complete;
    } else if (header_count > complete) {
        fail_file(path.string(), fmt::format("Q4RT header says {} tokens but the file holds only {} complete tokens",
                                             header_count, complete));
    } else {
        n_tokens_ = header_count;
    }
    truncated_tail_ = (file_size - kQ4rtHeader) % per_token != 0;
    header_.domains = {"default"};
    format_ = "Q4RT v1";
}

uint64_t TraceReader::read_header(const fs::path & path, uint64_t file_size) {
    uint8_t head[24];
    file_.pread_exact(head, 24, 0);
    const uint32_t version = get_bytes<uint32_t>(head + 4);
    if (version != 1 && version != kVersion) {
        fail_file(path.string(), fmt::format("trace version {} is not supported (1 and {})", version, kVersion));
    }
    checksums_ = version >= 2;
    header_checksum_ = version >= 3;
    header_.n_layer = get_bytes<uint32_t>(head + 8);
    header_.n_expert = get_bytes<uint32_t>(head + 12);
    header_.top_m = get_bytes<uint32_t>(head + 16);
    const uint32_t meta_len = get_bytes<uint32_t>(head + 20);
    const uint64_t head_end = 24 + uint64_t(meta_len) + (header_checksum_ ? 8 : 0);
    if (head_end > file_size) {
        fail_file(path.string(), "trace header is truncated");
    }
    std::string meta(meta_len, '\0');
    file_.pread_exact(meta.data(), meta_len, 24);
    if (header_checksum_) {
        std::vector<uint8_t> whole(head, head + 24);
        whole.insert(whole.end(), meta.begin(), meta.end());
        uint8_t stored[8];
        file_.pread_exact(stored, 8, 24 + uint64_t(meta_len));
        if (get_bytes<uint64_t>(stored) != checksum(whole.data(), whole.size())) {
            fail_file(path.string(), "trace header checksum mismatch (its counts or metadata JSON changed after writing)");
        }
    }
    if (header_.n_layer == 0 || header_.n_layer > 100000 || header_.top_m == 0 ||
        header_.top_m > header_.n_expert || header_.n_expert > 65536) {
        fail_file(path.string(), fmt::format("trace header is inconsistent: {} layers, {} experts, top-{}",
                                             header_.n_layer, header_.n_expert, header_.top_m));
    }
    with_json_errors(path.string() + ": trace header metadata", [&] {
        const json j = parse_json(meta, path.string() + ": trace header metadata");
        if (!j.is_object() || !j.contains("domains") || !j["domains"].is_array()) {
            fail_file(path.string(), "trace header metadata has no \"domains\" array");
        }
        header_.domains = j.at("domains").get<std::vector<std::string>>();
        header_.meta = j.value("meta", json::object());
    });
    if (header_.domains.empty() || header_.domains.size() > kMaxTraceDomains) {
        fail_file(path.string(), fmt::format("trace header lists {} domains; a trace holds 1 to {}",
                                             header_.domains.size(), kMaxTraceDomains));
    }
    format_ = fmt::format("moeprune-trace v{}", version);
    return head_end;
}

void TraceReader::index_blocks(const fs::path & path, uint64_t head_end, uint64_t file_size) {
    const uint32_t n_sections = header_.n_layer + 1;
    // v2: sizes, then a checksum per section, then one of everything before it.
    const size_t header_bytes = kBlockHeaderFixed + (checksums_ ? 16 : 8) * size_t(n_sections) + (checksums_ ? 8 : 0);
    const uint64_t rec = record_bytes(header_.top_m);
    std::vector<uint8_t> bh(header_bytes);
    uint64_t offset = head_end;
    while (offset < file_size) {
        if (offset + header_bytes > file_size) {
            truncated_tail_ = true;
            break;
        }
        file_.pread_exact(bh.data(), header_bytes, offset);
        const size_t block_index = blocks_.size();
        if (std::memcmp(bh.data(), kBlockMagic, 4) != 0) {
            fail_file(path.string(), fmt::format("corrupt trace: no block marker at offset {} (block {}, after {} tokens)",
                                                 offset, block_index, n_tokens_));
        }
        if (checksums_ && get_bytes<uint64_t>(bh.data() + header_bytes - 8) != checksum(bh.data(), header_bytes - 8)) {
            fail_file(path.string(), fmt::format("corrupt trace: block {} at offset {}: its header does not match its "
                                                 "checksum (changed after writing)", block_index, offset));
        }
        Block b;
        b.offset = offset;
        b.first_token = n_tokens_;
        b.n_tokens = get_bytes<uint32_t>(bh.data() + 4);
        b.codec = get_bytes<uint32_t>(bh.data() + 8);
        if (get_bytes<uint32_t>(bh.data() + 12) != n_sections || b.n_tokens == 0 || b.codec > kCodecZstd) {
            fail_file(path.string(), fmt::format("corrupt trace: bad block header at offset {} (block {})", offset,
                                                 block_index));
        }
        uint64_t pos = offset + header_bytes;
        bool torn = false;
        for (uint32_t s = 0; s < n_sections && !torn; ++s) {
            const uint64_t size = get_bytes<uint64_t>(bh.data() + kBlockHeaderFixed + 8 * s);
            // What a section stores must decode to exactly the block's tokens; checked here,
            // before anything is allocated, against what its stored bytes can possibly hold.
            const uint64_t raw = uint64_t(b.n_tokens) * (s == 0 ? kMetaBytes : rec);
            const bool fits = b.codec == kCodecRaw
                                  ? size == raw
                                  : raw / kZstdMaxRatio <= size && size <= ZSTD_compressBound(raw);
            if (!fits) {
                fail_file(path.string(), fmt::format("corrupt trace: block {} at offset {} claims {} tokens, but its {} "
                                                     "section stores {} bytes",
                                                     block_index, offset, b.n_tokens,
                                                     s == 0 ? std::string("token") : fmt::format("layer {}", s - 1), size));
            }
            if (size > file_size - pos) {
                torn = true;  // the writer died inside this block
                break;
            }
            (s == 0 ? b.meta_offset : b.layer_offset.emplace_back()) = pos;
            (s == 0 ? b.meta_size : b.layer_size.emplace_back()) = size;
            b.hash.push_back(checksums_ ? get_bytes<uint64_t>(bh.data() + kBlockHeaderFixed + 8 * (n_sections + s)) : 0);
            pos += size;
        }
        if (torn) {
            truncated_tail_ = true;
            break;
        }
        n_tokens_ += b.n_tokens;
        blocks_.push_back(std::move(b));
        offset = pos;
    }
}

std::vector<uint8_t> TraceReader::read_section(const Block & b, uint32_t section, uint64_t raw_size) const {
    const uint64_t offset = section == 0 ? b.meta_offset : b.layer_offset[section - 1];
    const uint64_t size = section == 0 ? b.meta_size : b.layer_size[section - 1];
    std::vector<uint8_t> stored(size);
    file_.pread_exact(stored.data(), size, offset);
    if (checksums_ && checksum(stored.data(), stored.size()) != b.hash[section]) {
        fail_file(path().string(), fmt::format("corrupt trace: block {} at offset {}, {}: the data at offset {} does not "
                                               "match its checksum (changed after writing)",
                                               &b - blocks_.data(), b.offset, section_name(section), offset));
    }
    if (b.codec == kCodecRaw) {
        return stored;
    }
    std::vector<uint8_t> raw(raw_size);
    const size_t n = ZSTD_decompress(raw.data(), raw.size(), stored.data(), stored.size());
    if (ZSTD_isError(n) || n != raw_size) {
        fail_file(path().string(), fmt::format("corrupt trace: zstd section at offset {} does not decompress to {} bytes",
                                               offset, raw_size));
    }
    return raw;
}

void TraceReader::check_ids(const uint16_t * ids, uint64_t first_token, uint32_t n, uint32_t layer) const {
    const uint32_t m = header_.top_m;
    for (uint64_t i = 0; i < uint64_t(n) * m; ++i) {
        if (ids[i] >= header_.n_expert) {
            const uint64_t token = first_token + i / m;
            const auto block = std::upper_bound(blocks_.begin(), blocks_.end(), token,
                                                [](uint64_t t, const Block & b) { return t < b.first_token; });
            fail_file(path().string(),
                      fmt::format("corrupt trace: {}layer {}, token {} names expert {}, but the trace has {} experts",
                                  q4rt_ ? std::string() : fmt::format("block {}, ", block - blocks_.begin() - 1), layer,
                                  token, ids[i], header_.n_expert));
        }
    }
}

std::vector<TraceTokenMeta> TraceReader::token_meta() const {
    std::vector<TraceTokenMeta> out;
    out.reserve(n_tokens_);
    if (q4rt_) {
        for (uint64_t t = 0; t < n_tokens_; ++t) {
            TraceTokenMeta m;
            m.pos = int32_t(t);
            out.push_back(m);
        }
        return out;
    }
    for (const auto & b : blocks_) {
        const auto raw = read_section(b, 0, uint64_t(b.n_tokens) * kMetaBytes);
        for (uint32_t t = 0; t < b.n_tokens; ++t) {
            const uint8_t * p = raw.data() + size_t(t) * kMetaBytes;
            TraceTokenMeta m;
            m.token = get_bytes<int32_t>(p);
            m.pos = get_bytes<int32_t>(p + 4);
            m.seq = get_bytes<int32_t>(p + 8);
            m.domain = get_bytes<uint16_t>(p + 12);
            m.phase = TracePhase(p[14]);
            if (m.phase != TracePhase::Prefill && m.phase != TracePhase::Decode) {
                fail_file(path().string(), fmt::format("corrupt trace: token {} has phase {}", b.first_token + t, p[14]));
            }
            if (m.domain >= header_.domains.size()) {
                fail_file(path().string(), fmt::format("corrupt trace: token {} has domain {} of {}", b.first_token + t,
                                                      m.domain, header_.domains.size()));
            }
            out.push_back(m);
        }
    }
    return out;
}

void TraceReader::for_each_layer_chunk(uint32_t layer, const LayerChunkFn & fn) const {
    if (layer >= header_.n_layer) {
        fail_file(path().string(), fmt::format("layer {} requested but the trace has {} layers", layer, header_.n_layer));
    }
    const uint32_t m = header_.top_m;
    const size_t rec = record_bytes(m);
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    const auto decode = [&](const uint8_t * p, uint64_t t) {
        for (uint32_t i = 0; i < m; ++i) {
            ids[t * m + i] = get_bytes<uint16_t>(p + 2 * i);
            logits[t * m + i] = ggml_fp16_to_fp32(get_bytes<ggml_fp16_t>(p + 2 * (m + i)));
        }
    };
    if (q4rt_) {
        const uint64_t per_token = uint64_t(header_.n_layer) * rec;
        constexpr uint64_t kChunk = 1024;
        std::vector<uint8_t> buf;
        for (uint64_t t0 = 0; t0 < n_tokens_; t0 += kChunk) {
            const uint64_t n = std::min(kChunk, n_tokens_ - t0);
            buf.resize(n * per_token);
            ids.resize(n * m);
            logits.resize(n * m);
            file_.pread_exact(buf.data(), buf.size(), kQ4rtHeader + t0 * per_token);
            for (uint64_t t = 0; t < n; ++t) {
                decode(buf.data() + t * per_token + layer * rec, t);
            }
            check_ids(ids.data(), t0, uint32_t(n), layer);
            fn(t0, uint32_t(n), ids.data(), logits.data());
        }
        return;
    }
    for (const auto & b : blocks_) {
        const auto raw = read_section(b, layer + 1, uint64_t(b.n_tokens) * rec);
        ids.resize(size_t(b.n_tokens) * m);
        logits.resize(size_t(b.n_tokens) * m);
        for (uint32_t t = 0; t < b.n_tokens; ++t) {
            decode(raw.data() + size_t(t) * rec, t);
        }
        check_ids(ids.data(), b.first_token, b.n_tokens, layer);
        fn(b.first_token, b.n_tokens, ids.data(), logits.data());
    }
}

void TraceReader::read_layer(uint32_t layer, std::vector<uint16_t> & ids, std::vector<float> & logits) const {
    const uint32_t m = header_.top_m;
    ids.resize(n_tokens_ * m);
    logits.resize(n_tokens_ * m);
    for_each_layer_chunk(layer, [&](uint64_t first, uint32_t n, const uint16_t * chunk_ids, const float * chunk_logits) {
        std::copy(chunk_ids, chunk_ids + size_t(n) * m, ids.begin() + long(first * m));
        std::copy(chunk_logits, chunk_logits + size_t(n) * m, logits.begin() + long(first * m));
    });
}

std::vector<std::string> TraceReader::verify() const {
    std::vector<std::string> problems;
    const auto attempt = [&](const auto & check) {
        try {
            check();
        } catch (const Error & e) {
            problems.push_back(e.what());
        }
    };
    if (q4rt_) {
        for (uint32_t l = 0; l < header_.n_layer; ++l) {
            attempt([&] { for_each_layer_chunk(l, [](uint64_t, uint32_t, const uint16_t *, const float *) {}); });
        }
        return problems;
    }
    // Block by block and section by section, so that every damaged section is listed,
    // not only the first.
    const uint32_t m = header_.top_m;
    for (const Block & b : blocks_) {
        attempt([&] {
            const auto raw = read_section(b, 0, uint64_t(b.n_tokens) * kMetaBytes);
            for (uint32_t t = 0; t < b.n_tokens; ++t) {
                const uint8_t * p = raw.data() + size_t(t) * kMetaBytes;
                if (get_bytes<uint16_t>(p + 12) >= header_.domains.size() || p[14] > uint8_t(TracePhase::Decode)) {
                    fail_file(path().string(), fmt::format("corrupt trace: block {} at offset {}, token {} has domain {} "
                                                           "and phase {}", &b - blocks_.data(), b.offset, b.first_token + t,
                                                           get_bytes<uint16_t>(p + 12), p[14]));
                }
            }
        });
        for (uint32_t l = 0; l < header_.n_layer; ++l) {
            attempt([&] {
                const auto raw = read_section(b, l + 1, uint64_t(b.n_tokens) * record_bytes(m));
                std::vector<uint16_t> ids(size_t(b.n_tokens) * m);
                for (uint32_t t = 0; t < b.n_tokens; ++t) {
                    for (uint32_t i = 0; i < m; ++i) {
                        ids[size_t(t) * m + i] = get_bytes<uint16_t>(raw.data() + size_t(t) * record_bytes(m) + 2 * i);
                    }
                }
                check_ids(ids.data(), b.first_token, b.n_tokens, l);
            });
        }
    }
    return problems;
}

// ---------------------------------------------------------------- export and info

static void write_npy(const fs::path & path, const char * descr, const std::vector<uint64_t> & shape, const void * data,
                      size_t bytes) {
    std::string shape_s = "(";
    for (size_t i = 0; i < shape.size(); ++i) {
        shape_s += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
        if (i + 1 < shape.size()) {
            shape_s += " ";
        }
    }
    shape_s += ")";
    std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape_s);
    const size_t total = 10 + header.size() + 1;
    header.append((64 - total % 64) % 64, ' ');
    header += '\n';
    std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    put_bytes<uint16_t>(out, uint16_t(header.size()));
    out.insert(out.end(), header.begin(), header.end());
    const auto * p = static_cast<const uint8_t *>(data);
    out.insert(out.end(), p, p + bytes);
    write_file_atomic(path, std::string(out.begin(), out.end()));
}

void export_trace_npy(const TraceReader & reader, const fs::path & dir) {
    std::vector<fs::path> outputs;
    for (const char * name : {"ids", "logits", "token", "pos", "seq", "domain", "phase"}) {
        outputs.push_back(dir / (std::string(name) + ".npy"));
    }
    refuse_output_clashes(outputs, {reader.path()});
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
        fail_file(dir.string(), "cannot create directory: " + ec.message());
    }
    const auto & h = reader.header();
    const uint64_t n = reader.n_tokens();
    const uint64_t m = h.top_m;
    std::vector<uint16_t> ids(n * h.n_layer * m);
    std::vector<float> logits(n * h.n_layer * m);
    std::vector<uint16_t> lid;
    std::vector<float> llog;
    for (uint32_t l = 0; l < h.n_layer; ++l) {
        reader.read_layer(l, lid, llog);
        for (uint64_t t = 0; t < n; ++t) {
            std::memcpy(&ids[(t * h.n_layer + l) * m], &lid[t * m], m * sizeof(uint16_t));
            std::memcpy(&logits[(t * h.n_layer + l) * m], &llog[t * m], m * sizeof(float));
        }
    }
    write_npy(dir / "ids.npy", "<u2", {n, h.n_layer, m}, ids.data(), ids.size() * 2);
    write_npy(dir / "logits.npy", "<f4", {n, h.n_layer, m}, logits.data(), logits.size() * 4);
    const auto meta = reader.token_meta();
    std::vector<int32_t> token(n), pos(n), seq(n);
    std::vector<uint16_t> domain(n);
    std::vector<uint8_t> phase(n);
    for (uint64_t t = 0; t < n; ++t) {
        token[t] = meta[t].token;
        pos[t] = meta[t].pos;
        seq[t] = meta[t].seq;
        domain[t] = meta[t].domain;
        phase[t] = uint8_t(meta[t].phase);
    }
    write_npy(dir / "token.npy", "<i4", {n}, token.data(), n * 4);
    write_npy(dir / "pos.npy", "<i4", {n}, pos.data(), n * 4);
    write_npy(dir / "seq.npy", "<i4", {n}, seq.data(), n * 4);
    write_npy(dir / "domain.npy", "<u2", {n}, domain.data(), n * 2);
    write_npy(dir / "phase.npy", "|u1", {n}, phase.data(), n);
}

json trace_info_json(const TraceReader & reader) {
    // Every layer is decoded once, so a corrupt section or id is reported here rather than by a later stage.
    for (uint32_t l = 0; l < reader.header().n_layer; ++l) {
        reader.for_each_layer_chunk(l, [](uint64_t, uint32_t, const uint16_t *, const float *) {});
    }
    const auto meta = reader.token_meta();
    uint64_t prefill = 0, decode = 0;
    std::vector<uint64_t> per_domain(reader.header().domains.size(), 0);
    std::vector<int32_t> seqs;
    for (const auto & m : meta) {
        (m.phase == TracePhase::Prefill ? prefill : decode)++;
        per_domain[m.domain]++;
        seqs.push_back(m.seq);
    }
    std::sort(seqs.begin(), seqs.end());
    const size_t n_seq = size_t(std::unique(seqs.begin(), seqs.end()) - seqs.begin());
    json domains = json::object();
    for (size_t d = 0; d < per_domain.size(); ++d) {
        domains[reader.header().domains[d]] = per_domain[d];
    }
    return {{"format", reader.format()}, {"n_tokens", reader.n_tokens()}, {"n_layer", reader.header().n_layer},
            {"n_expert", reader.header().n_expert}, {"top_m", reader.header().top_m},
            {"phases", {{"prefill", prefill}, {"decode", decode}}}, {"n_sequences", n_seq}, {"domains", domains},
            {"truncated_tail", reader.truncated_tail()}, {"checksums", reader.has_checksums()}, {"header_checksum", reader.has_header_checksum()},
            {"meta", reader.header().meta}};
}

} // namespace moeprune
