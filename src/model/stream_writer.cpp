#include "model/stream_writer.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/progress.h"
#include "model/model_file.h"

#include "gguf.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace moeprune {

namespace fs = std::filesystem;

namespace {

// gguf_add_tensor lays tensors out at this alignment whatever general.alignment
// says, so outputs use the default and drop that key.
constexpr uint64_t kAlignment = GGUF_DEFAULT_ALIGNMENT;

uint64_t tensor_bytes(const OutputTensor & t) {
    const size_t row = ggml_row_size(t.type, t.ne[0]);
    uint64_t n = row;
    for (int d = 1; d < GGML_MAX_DIMS; ++d) {
        n *= uint64_t(t.ne[d]);
    }
    return n;
}

uint64_t padded(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// Shard index of every tensor: a new shard starts when the next tensor would push
// the current one over the limit, as gguf-split does.
std::vector<int> assign_shards(const StreamWriteRequest & req, int & n_shards) {
    std::vector<int> shard(req.tensors.size(), 0);
    n_shards = 1;
    uint64_t used = 0;
    for (size_t i = 0; i < req.tensors.size(); ++i) {
        const uint64_t b = padded(tensor_bytes(req.tensors[i]));
        if (req.split_max_bytes > 0 && used > 0 && used + b > req.split_max_bytes) {
            ++n_shards;
            used = 0;
        }
        used += b;
        shard[i] = n_shards - 1;
    }
    return shard;
}

fs::path split_prefix(const fs::path & output) {
    fs::path prefix = output;
    if (prefix.extension() == ".gguf") {
        prefix.replace_extension();
    }
    return prefix;
}

struct GgmlCtxDeleter { void operator()(ggml_context * c) const { ggml_free(c); } };

struct ShardMeta {
    gguf_context * gguf = nullptr;  // the request's own context for the first shard
    GgufPtr owned;                  // later shards
    std::unique_ptr<ggml_context, GgmlCtxDeleter> tensors;
    std::vector<size_t> members;    // indices into req.tensors
};

ShardMeta build_shard_meta(StreamWriteRequest & req, const std::vector<int> & shard_of, int shard, int n_shards) {
    ShardMeta m;
    if (shard == 0) {
        m.gguf = req.kv.get();
        gguf_remove_key(m.gguf, GGUF_KEY_GENERAL_ALIGNMENT);
        for (const char * k : {"split.no", "split.count", "split.tensors.count"}) {
            gguf_remove_key(m.gguf, k);
        }
    } else {
        m.owned.reset(gguf_init_empty());
        m.gguf = m.owned.get();
    }
    if (req.split_max_bytes > 0) {
        gguf_set_val_u16(m.gguf, "split.no", uint16_t(shard));
        gguf_set_val_u16(m.gguf, "split.count", uint16_t(n_shards));
        gguf_set_val_i32(m.gguf, "split.tensors.count", int32_t(req.tensors.size()));
    }
    for (size_t i = 0; i < req.tensors.size(); ++i) {
        if (shard_of[i] == shard) {
            m.members.push_back(i);
        }
    }
    ggml_init_params p{/*mem_size=*/(m.members.size() + 1) * ggml_tensor_overhead(), /*mem_buffer=*/nullptr,
                       /*no_alloc=*/true};
    m.tensors.reset(ggml_init(p));
    for (size_t i : m.members) {
        const OutputTensor & t = req.tensors[i];
        ggml_tensor * g = ggml_new_tensor(m.tensors.get(), t.type, GGML_MAX_DIMS, t.ne.data());
        ggml_set_name(g, t.name.c_str());
        gguf_add_tensor(m.gguf, g);
    }
    return m;
}

// Re-reads what was written and checks it against the intended layout.
void verify_written(const fs::path & path, const gguf_context * intended, uint64_t data_offset, uint64_t expected_size) {
    gguf_init_params params{/*no_alloc=*/true, /*ctx=*/nullptr};
    GgufPtr got(gguf_init_from_file(path.c_str(), params));
    if (!got) {
        fail_file(path.string(), "the file just written does not read back as GGUF");
    }
    const auto mismatch = [&](const std::string & what) {
        fail_file(path.string(), "the file just written differs from the intended layout: " + what);
    };
    if (gguf_get_n_tensors(got.get()) != gguf_get_n_tensors(intended) ||
        gguf_get_n_kv(got.get()) != gguf_get_n_kv(intended)) {
        mismatch("tensor or key count");
    }
    if (gguf_get_data_offset(got.get()) != data_offset) {
        mismatch("data offset");
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(intended); ++i) {
        const char * name = gguf_get_tensor_name(intended, i);
        if (std::strcmp(name, gguf_get_tensor_name(got.get(), i)) != 0 ||
            gguf_get_tensor_type(got.get(), i) != gguf_get_tensor_type(intended, i) ||
            gguf_get_tensor_offset(got.get(), i) != gguf_get_tensor_offset(intended, i) ||
            gguf_get_tensor_size(got.get(), i) != gguf_get_tensor_size(intended, i)) {
            mismatch(std::string("tensor ") + name);
        }
    }
    const uint64_t size = fs::file_size(path);
    if (size != expected_size) {
        mismatch(fmt::format("size {} instead of {}", size, expected_size));
    }
}

} // namespace

std::vector<fs::path> planned_output_paths(const StreamWriteRequest & req) {
    if (req.split_max_bytes == 0) {
        return {req.output};
    }
    int n_shards = 0;
    assign_shards(req, n_shards);
    std::vector<fs::path> paths;
    for (int s = 0; s < n_shards; ++s) {
        paths.push_back(split_shard_path(split_prefix(req.output), s + 1, n_shards));
    }
    return paths;
}

namespace {

// Copying only fills the page cache; the disk work would all wait for the final fsync,
// doubling the time a plain `cp; sync` takes. Each stretch goes to the device as soon
// as it is copied, and the copy waits for the stretch before it, so writing overlaps
// copying and dirty pages stay bounded. Tensors are copied in file order.
class WriteBehind {
public:
    explicit WriteBehind(File & out) : out_(out) {}
    void copied_to(uint64_t end) {
        if (end < start_ + kStretch) {
            return;
        }
        out_.write_back(start_, end - start_, false);
        if (prev_len_ > 0) {
            out_.write_back(prev_start_, prev_len_, true);
        }
        prev_start_ = start_;
        prev_len_ = end - start_;
        start_ = end;
    }

private:
    static constexpr uint64_t kStretch = uint64_t(32) << 20;
    File & out_;
    uint64_t start_ = 0, prev_start_ = 0, prev_len_ = 0;
};

} // namespace

std::vector<fs::path> write_gguf_streamed(StreamWriteRequest & req) {
    int n_shards = 0;
    const std::vector<int> shard_of = assign_shards(req, n_shards);
    const std::vector<fs::path> paths = planned_output_paths(req);
    if (n_shards > 65535) {
        throw Error(fmt::format("{}: {} shards is more than GGUF's split.count can hold", req.output.string(), n_shards));
    }

    for (const OutputTensor & t : req.tensors) {
        uint64_t total = 0;
        for (const CopyPiece & p : t.pieces) {
            total += p.bytes;
        }
        if (total != tensor_bytes(t)) {
            throw Error(fmt::format("internal: tensor {} has {} bytes of pieces for {} bytes of data", t.name, total,
                                    tensor_bytes(t)));
        }
    }

    std::vector<File> sources;
    for (const fs::path & s : req.sources) {
        sources.push_back(File::open_read(s));
    }
    uint64_t total_bytes = 0;
    for (const OutputTensor & t : req.tensors) {
        total_bytes += tensor_bytes(t);
    }
    Progress progress(req.progress_label, total_bytes, "MiB", 1.0 / (1024.0 * 1024.0));
    std::vector<char> buffer;  // sized only if the kernel cannot copy between these files

    std::vector<std::unique_ptr<AtomicOutput>> outputs;
    for (int s = 0; s < n_shards; ++s) {
        const ShardMeta meta = build_shard_meta(req, shard_of, s, n_shards);
        outputs.push_back(std::make_unique<AtomicOutput>(paths[size_t(s)]));
        File out = File::create_new(outputs.back()->temp_path());

        // ggml writes the header straight into the file just created: serialized in
        // memory it would be held twice (a tokenizer's worth, tens of MiB each). Its
        // magic stays zero until the data is complete, so no reader takes a partial
        // file for a model.
        std::array<char, 4> magic{};
        errno = 0;
        if (!gguf_write_to_file(meta.gguf, out.path().c_str(), /*only_meta=*/true)) {
            const int err = errno;
            fail_file(out.path().string(),
                      "cannot write the GGUF header" + (err ? std::string(": ") + std::strerror(err) : std::string()));
        }
        const uint64_t data_offset = out.size();
        out.pread_exact(magic.data(), magic.size(), 0);
        out.pwrite_all(std::array<char, 4>{}.data(), magic.size(), 0);
        uint64_t end = data_offset;
        WriteBehind behind(out);
        for (size_t j = 0; j < meta.members.size(); ++j) {
            const OutputTensor & t = req.tensors[meta.members[j]];
            uint64_t at = data_offset + gguf_get_tensor_offset(meta.gguf, int64_t(j));
            for (const CopyPiece & p : t.pieces) {
                out.copy_from(sources[size_t(p.source)], p.offset, at, p.bytes, buffer);
                at += p.bytes;
                behind.copied_to(at);
                progress.advance(p.bytes);
            }
            end = data_offset + gguf_get_tensor_offset(meta.gguf, int64_t(j)) + padded(tensor_bytes(t));
        }
        out.truncate(end);  // the alignment padding after each tensor reads as zeros
        out.sync();
        out.pwrite_all(magic.data(), magic.size(), 0);
        out.sync();
        verify_written(out.path(), meta.gguf, data_offset, end);
    }
    progress.finish();
    // The first shard is what a loader opens: it goes into place last.
    for (auto it = outputs.rbegin(); it != outputs.rend(); ++it) {
        (*it)->commit();
    }
    return paths;
}

} // namespace moeprune
