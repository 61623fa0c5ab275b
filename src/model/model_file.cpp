#include "model/model_file.h"
#include "core/errors.h"
#include "core/file_io.h"

#include "gguf.h"
#include "llama.h"

#include <fmt/format.h>

#include <cstring>
#include <map>
#include <regex>

namespace moeprune {

namespace fs = std::filesystem;

void GgufDeleter::operator()(gguf_context * ctx) const { gguf_free(ctx); }

namespace {

// Sequential reads of a file's header through one buffer; false once past the end.
class HeaderReader {
public:
    explicit HeaderReader(const fs::path & path) : file_(File::open_read(path)), size_(file_.size()) {}
    template <class T> bool read(T & v) { return read_bytes(&v, sizeof(T)); }
    bool read_bytes(void * out, uint64_t n) {
        if (n > size_ - pos_) {
            return false;
        }
        if (pos_ < buf_at_ || pos_ + n > buf_at_ + buf_.size()) {
            buf_at_ = pos_;
            buf_.resize(size_t(std::min<uint64_t>(size_ - pos_, std::max<uint64_t>(n, 1 << 20))));
            file_.pread_exact(buf_.data(), buf_.size(), pos_);
        }
        std::memcpy(out, buf_.data() + (pos_ - buf_at_), size_t(n));
        pos_ += n;
        return true;
    }
    bool skip(uint64_t n) {
        if (n > size_ - pos_) {
            return false;
        }
        pos_ += n;
        return true;
    }

private:
    File file_;
    uint64_t size_, pos_ = 0, buf_at_ = 0;
    std::vector<uint8_t> buf_;
};

// ggml's GGUF reader loads every value type and tensor type straight into its enums (an
// uninitialized one when the file ends there) and multiplies dimensions before checking
// them: undefined behaviour on hostile files (found by fuzzing; docs/reliability.md). The
// header is walked here first, as gguf.cpp reads it, and any file the walk cannot finish
// is refused before ggml sees it.
void check_gguf_header(const fs::path & path) {
    const auto bad = [&](const std::string & what) {
        fail_file(path.string(), "not a valid GGUF file (bad magic, version or truncated header): " + what);
    };
    HeaderReader r(path);
    char magic[4];
    // Zero where a read fails: the messages below name the value read, if any.
    uint32_t version = 0;
    int64_t n_tensors = 0, n_kv = 0;
    if (!r.read(magic) || std::memcmp(magic, "GGUF", 4) != 0) {
        bad("no GGUF magic");
    }
    if (!r.read(version) || (version != 2 && version != 3)) {
        bad(fmt::format("version {}, llama.cpp reads 2 and 3", version));
    }
    if (!r.read(n_tensors) || !r.read(n_kv) || n_tensors < 0 || n_kv < 0) {
        bad("tensor or key count missing or negative");
    }
    static const std::map<uint32_t, uint64_t> scalar_bytes = {
        {GGUF_TYPE_UINT8, 1}, {GGUF_TYPE_INT8, 1},   {GGUF_TYPE_UINT16, 2},  {GGUF_TYPE_INT16, 2},
        {GGUF_TYPE_UINT32, 4}, {GGUF_TYPE_INT32, 4}, {GGUF_TYPE_FLOAT32, 4}, {GGUF_TYPE_BOOL, 1},
        {GGUF_TYPE_UINT64, 8}, {GGUF_TYPE_INT64, 8}, {GGUF_TYPE_FLOAT64, 8}};
    const auto skip_string = [&] {
        uint64_t n = 0;
        return r.read(n) && r.skip(n);
    };
    for (int64_t i = 0; i < n_kv; ++i) {
        uint32_t type = 0;
        uint64_t n = 1;
        if (!skip_string() || !r.read(type)) {
            bad(fmt::format("the file ends inside key {}", i));
        }
        if (type == GGUF_TYPE_ARRAY && (!r.read(type) || !r.read(n))) {
            bad(fmt::format("the file ends inside key {}", i));
        }
        if (type >= GGUF_TYPE_COUNT || type == GGUF_TYPE_ARRAY) {
            bad(fmt::format("key {} has value type {}, which GGUF does not define here", i, type));
        }
        if (type == GGUF_TYPE_STRING) {
            for (uint64_t j = 0; j < n; ++j) {
                if (!skip_string()) {
                    bad(fmt::format("the file ends inside key {}", i));
                }
            }
        } else {
            const uint64_t size = scalar_bytes.at(type);
            if (n > UINT64_MAX / size || !r.skip(n * size)) {
                bad(fmt::format("the file ends inside key {}", i));
            }
        }
    }
    for (int64_t i = 0; i < n_tensors; ++i) {
        uint32_t n_dims = 0, type = 0;
        uint64_t name_len = 0;
        std::string name;
        if (!r.read(name_len) || name_len >= GGML_MAX_NAME) {
            bad(fmt::format("tensor {} has no name of fewer than {} bytes", i, GGML_MAX_NAME));
        }
        name.resize(size_t(name_len));
        if (!r.read_bytes(name.data(), name_len) || !r.read(n_dims)) {
            bad(fmt::format("the file ends inside tensor {}", i));
        }
        if (n_dims > GGML_MAX_DIMS) {
            bad(fmt::format("tensor {} has {} dimensions", name, n_dims));
        }
        // ggml multiplies the dimensions before its own overflow check.
        int64_t elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            int64_t ne = 0;
            if (!r.read(ne)) {
                bad(fmt::format("the file ends inside tensor {}", name));
            }
            if (ne < 0 || __builtin_mul_overflow(elements, ne, &elements)) {
                fail_file(path.string(), fmt::format("tensor {}: dimension {} of {} elements is negative or its element "
                                                     "count overflows",
                                                     name, d, ne));
            }
        }
        if (!r.read(type)) {
            bad(fmt::format("the file ends inside tensor {}", name));
        }
        if (type >= GGML_TYPE_COUNT) {
            bad(fmt::format("tensor {} has type {}, which ggml does not define", name, type));
        }
        if (!r.skip(8)) {
            bad(fmt::format("the file ends inside tensor {}", name));
        }
    }
}

} // namespace

GgufPtr open_gguf_metadata(const fs::path & path) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
        fail_file(path.string(), fs::exists(path, ec) ? "not a regular file" : "no such file");
    }
    check_gguf_header(path);
    gguf_init_params params{/*no_alloc=*/true, /*ctx=*/nullptr};
    GgufPtr ctx(gguf_init_from_file(path.c_str(), params));
    if (!ctx) {
        fail_file(path.string(), "not a valid GGUF file (bad magic, version or truncated header)");
    }
    return ctx;
}

const char * tensor_role_name(TensorRole role) {
    switch (role) {
        case TensorRole::Expert:        return "expert";
        case TensorRole::Router:        return "router";
        case TensorRole::SelectionBias: return "selection_bias";
        case TensorRole::Shared:        return "shared";
        case TensorRole::Other:         return "other";
    }
    return "other";
}

TensorClass classify_tensor(const std::string & name) {
    static const std::regex blk_re(R"(^blk\.(\d{1,6})\.(.+)$)");
    // ffn_norm_exps (arctic) is one norm in front of all experts, not a per-expert tensor;
    // ffn_*_chexps (grovemoe) are the adjugate experts routed by the same router.
    static const std::regex expert_re(R"(^ffn_(?!norm_exps)[a-z_]*_(ch)?exps\.(weight|bias|scale|input_scale)$)");
    static const std::regex router_re(R"(^ffn_gate_inp\.(weight|bias)$)");
    static const std::regex selbias_re(R"(^exp_probs_b(_vl)?(\.bias)?$)");
    std::smatch m;
    TensorClass c;
    if (!std::regex_match(name, m, blk_re)) {
        return c;
    }
    c.layer = std::stoi(m[1].str());
    const std::string rest = m[2].str();
    if (rest.find("shexp") != std::string::npos) {
        c.role = TensorRole::Shared;
    } else if (std::regex_match(rest, expert_re)) {
        c.role = TensorRole::Expert;
    } else if (std::regex_match(rest, router_re)) {
        c.role = TensorRole::Router;
    } else if (std::regex_match(rest, selbias_re)) {
        c.role = TensorRole::SelectionBias;
    }
    return c;
}

fs::path split_shard_path(const fs::path & prefix, int split_no, int split_count) {
    char buf[4096];
    llama_split_path(buf, sizeof(buf), prefix.c_str(), split_no - 1, split_count);  // llama.cpp counts from 0
    return fs::path(buf);
}

static void read_tensors(const gguf_context * ctx, int shard, const fs::path & path, std::vector<TensorEntry> & out) {
    const size_t data_offset = gguf_get_data_offset(ctx);
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        TensorEntry t;
        t.name = gguf_get_tensor_name(ctx, i);
        t.type = gguf_get_tensor_type(ctx, i);
        const int64_t * ne = gguf_get_tensor_ne(ctx, i);
        t.n_dims = 1;
        // ggml multiplies the dimensions in int64 without a check: a product that wraps
        // would make a huge tensor look empty.
        int64_t elements = 1;
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            t.ne[d] = ne[d];
            if (ne[d] != 1) {
                t.n_dims = d + 1;
            }
            if (ne[d] < 0 || __builtin_mul_overflow(elements, ne[d], &elements)) {
                fail_file(path.string(), fmt::format("tensor {} has dimensions [{}, {}, {}, {}] whose element count "
                                                     "overflows", t.name, ne[0], ne[1], ne[2], ne[3]));
            }
        }
        if (elements / ggml_blck_size(t.type) > INT64_MAX / int64_t(ggml_type_size(t.type))) {
            fail_file(path.string(), fmt::format("tensor {} has dimensions [{}, {}, {}, {}] whose size in bytes "
                                                 "overflows", t.name, ne[0], ne[1], ne[2], ne[3]));
        }
        t.nbytes = gguf_get_tensor_size(ctx, i);
        t.shard = shard;
        t.file_offset = data_offset + gguf_get_tensor_offset(ctx, i);
        t.cls = classify_tensor(t.name);
        out.push_back(std::move(t));
    }
}

GgufModel GgufModel::open(const fs::path & path) {
    GgufModel m;
    m.meta_ = open_gguf_metadata(path);
    m.shard_paths_.push_back(path);
    std::error_code ec;
    m.file_bytes_ = fs::file_size(path, ec);
    read_tensors(m.meta_.get(), 0, path, m.tensors_);
    m.shard_bytes_.push_back(m.file_bytes_);

    const int64_t split_count = m.get_int("split.count").value_or(1);
    if (split_count > 1 && m.get_int("split.no").value_or(0) != 0) {
        fail_file(path.string(), "is shard " + std::to_string(*m.get_int("split.no") + 1) + " of " +
                  std::to_string(split_count) + "; give the first shard");
    }
    const auto arch = m.get_string("general.architecture");
    if (!arch) {
        fail_file(path.string(), "missing general.architecture: not a llama.cpp model");
    }
    m.arch_ = *arch;

    if (split_count > 1) {
        char prefix[4096];
        if (llama_split_prefix(prefix, sizeof(prefix), path.c_str(), 0, (int) split_count) == 0) {
            fail_file(path.string(), "split.count is " + std::to_string(split_count) +
                      " but the name does not end in -00001-of-" + std::to_string(split_count) + ".gguf");
        }
        for (int i = 1; i < split_count; ++i) {
            const fs::path shard = split_shard_path(prefix, i + 1, (int) split_count);
            if (!fs::exists(shard, ec)) {
                fail_file(shard.string(), "missing shard " + std::to_string(i + 1) + " of " +
                          std::to_string(split_count) + " of " + path.string());
            }
            GgufPtr sctx = open_gguf_metadata(shard);
            const int64_t no_id = gguf_find_key(sctx.get(), "split.no");
            // gguf-split writes split.no as u16; the typed getter asserts on any other type.
            if (no_id < 0 || gguf_get_kv_type(sctx.get(), no_id) != GGUF_TYPE_UINT16 ||
                gguf_get_val_u16(sctx.get(), no_id) != i) {
                fail_file(shard.string(), fmt::format("split.no does not say shard {} (a u16 of value {})", i + 1, i));
            }
            read_tensors(sctx.get(), i, shard, m.tensors_);
            m.shard_bytes_.push_back(fs::file_size(shard, ec));
            m.file_bytes_ += m.shard_bytes_.back();
            m.shard_paths_.push_back(shard);
        }
        std::map<std::string, size_t> shard_of;
        for (const TensorEntry & t : m.tensors_) {
            const auto [it, fresh] = shard_of.emplace(t.name, size_t(t.shard));
            if (!fresh) {
                fail_file(m.shard_paths_[size_t(t.shard)].string(),
                          fmt::format("holds tensor {}, which shard {} holds too (a shard copied or renumbered?)", t.name,
                                      it->second + 1));
            }
        }
        if (const auto count = m.get_int("split.tensors.count"); count && *count != (int64_t) m.tensors_.size()) {
            fail_file(path.string(), "split.tensors.count is " + std::to_string(*count) + " but the shards hold " +
                      std::to_string(m.tensors_.size()) + " tensors");
        }
    }
    return m;
}

std::optional<int64_t> GgufModel::get_int(const std::string & key) const {
    const int64_t id = gguf_find_key(meta_.get(), key.c_str());
    if (id < 0) {
        return std::nullopt;
    }
    switch (gguf_get_kv_type(meta_.get(), id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(meta_.get(), id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(meta_.get(), id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(meta_.get(), id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(meta_.get(), id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(meta_.get(), id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(meta_.get(), id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(meta_.get(), id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(meta_.get(), id);
        case GGUF_TYPE_BOOL:   return gguf_get_val_bool(meta_.get(), id) ? 1 : 0;
        default:
            fail_file(shard_paths_[0].string(), "metadata key " + key + " is not an integer");
    }
}

std::optional<bool> GgufModel::get_bool(const std::string & key) const {
    const auto v = get_int(key);
    return v ? std::optional<bool>(*v != 0) : std::nullopt;
}

std::optional<std::string> GgufModel::get_string(const std::string & key) const {
    const int64_t id = gguf_find_key(meta_.get(), key.c_str());
    if (id < 0) {
        return std::nullopt;
    }
    if (gguf_get_kv_type(meta_.get(), id) != GGUF_TYPE_STRING) {
        fail_file(shard_paths_[0].string(), "metadata key " + key + " is not a string");
    }
    return std::string(gguf_get_val_str(meta_.get(), id));
}

} // namespace moeprune
