#include "collect/imatrix.h"
#include "core/atomic_file.h"
#include "core/errors.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace moeprune {

namespace {

// A weight's own name from a node's source name, which a backend may wrap as
// BACKEND#NAME#COPY.
std::string weight_name(const char * name) {
    const char * p = std::strchr(name, '#');
    if (!p) {
        return name;
    }
    const char * q = std::strchr(p + 1, '#');
    return q ? std::string(p + 1, q) : std::string(p + 1);
}

bool all_finite(const float * v, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(v[i])) {
            return false;
        }
    }
    return true;
}

} // namespace

bool ImatrixAccumulator::wants(const ggml_tensor * t) {
    if (t->op == GGML_OP_MUL_MAT_ID) {
        return true;
    }
    if (t->op != GGML_OP_MUL_MAT) {
        return false;
    }
    const ggml_tensor * src1 = t->src[1];
    if (src1->ne[1] < 16 || src1->type != GGML_TYPE_F32) {
        return false;
    }
    return weight_name(t->src[0]->name).rfind("blk.", 0) == 0;
}

void ImatrixAccumulator::observe(const ggml_tensor * t) {
    const ggml_tensor * src0 = t->src[0];
    const ggml_tensor * src1 = t->src[1];
    const std::string name = weight_name(src0->name);
    if (src1->type != GGML_TYPE_F32 || src1->nb[0] != sizeof(float)) {
        throw Error(fmt::format("imatrix: the input of {} ({}) is not contiguous f32", t->name, name));
    }
    const char * data = static_cast<const char *>(src1->data);
    if (!ggml_backend_buffer_is_host(src1->buffer)) {
        host_.resize(ggml_nbytes(src1));
        ggml_backend_tensor_get(src1, host_.data(), 0, host_.size());
        data = host_.data();
    }
    const int64_t ne0 = src1->ne[0];
    Entry & e = entries_[name];
    const auto non_finite = [&] {
        return Error(fmt::format("imatrix: non-finite squared activations for {} (node {})", name, t->name));
    };
    if (t->op == GGML_OP_MUL_MAT_ID) {
        // src1 [columns, slots, tokens], ids [slots, tokens]: one matrix per expert.
        const ggml_tensor * ids = t->src[2];
        const int64_t n_as = src0->ne[2], n_ids = ids->ne[0], n_tokens = src1->ne[2];
        if (ids->ne[1] != n_tokens || ggml_nrows(src1) != src1->ne[1] * src1->ne[2]) {
            throw Error(fmt::format("imatrix: node {} has ids or inputs of a shape llama-imatrix does not read", t->name));
        }
        ids_.resize(ggml_nbytes(ids));
        ggml_backend_tensor_get(ids, ids_.data(), 0, ids_.size());
        if (e.in_sum2.empty()) {
            e.in_sum2.assign(size_t(ne0 * n_as), 0.0f);
            e.counts.assign(size_t(n_as), 0);
        } else if (e.in_sum2.size() != size_t(ne0 * n_as) || e.counts.size() != size_t(n_as)) {
            throw Error(fmt::format("imatrix: {} seen with inconsistent shapes", name));
        }
        std::vector<uint8_t> touched(size_t(n_as), 0);
        // Slot-major, then token, as llama-imatrix adds them: float sums in the same order.
        for (int64_t slot = 0; slot < n_ids; ++slot) {
            for (int64_t row = 0; row < n_tokens; ++row) {
                int32_t ex;
                std::memcpy(&ex, ids_.data() + row * ids->nb[1] + slot * ids->nb[0], sizeof(ex));
                if (ex < 0 || ex >= n_as) {
                    throw Error(fmt::format("imatrix: node {} routes to expert {} of {}", t->name, ex, n_as));
                }
                const float * x = reinterpret_cast<const float *>(data + (slot % src1->ne[1]) * src1->nb[1] + row * src1->nb[2]);
                float * acc = e.in_sum2.data() + ex * ne0;
                ++e.counts[size_t(ex)];
                touched[size_t(ex)] = 1;
                for (int64_t j = 0; j < ne0; ++j) {
                    acc[j] += x[j] * x[j];
                }
            }
        }
        for (int64_t ex = 0; ex < n_as; ++ex) {
            if (touched[size_t(ex)] && !all_finite(e.in_sum2.data() + ex * ne0, size_t(ne0))) {
                throw non_finite();
            }
        }
        return;
    }
    const int64_t n_mat = src0->ne[2] * src0->ne[3];
    if (e.in_sum2.empty()) {
        e.in_sum2.assign(size_t(ne0 * n_mat), 0.0f);
        e.counts.assign(1, 0);
    } else if (e.in_sum2.size() != size_t(ne0 * n_mat)) {
        throw Error(fmt::format("imatrix: {} seen with inconsistent shapes", name));
    }
    for (int64_t i3 = 0; i3 < src1->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < src1->ne[2]; ++i2) {
            // A 2-D weight over 3-D activations takes them all as one matrix.
            const int64_t mat = (i3 % src0->ne[3]) * src0->ne[2] + (i2 % src0->ne[2]);
            float * acc = e.in_sum2.data() + mat * ne0;
            for (int64_t row = 0; row < src1->ne[1]; ++row) {
                const float * x = reinterpret_cast<const float *>(data + row * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3]);
                for (int64_t j = 0; j < ne0; ++j) {
                    acc[j] += x[j] * x[j];
                }
            }
        }
    }
    if (!all_finite(e.in_sum2.data(), e.in_sum2.size())) {
        throw non_finite();
    }
    for (int64_t & c : e.counts) {
        c += ggml_nrows(src1) / n_mat;
    }
}

void ImatrixAccumulator::write(const AtomicOutput & file, const std::vector<std::string> & datasets,
                               uint32_t chunk_size) const {
    size_t bytes = 0;
    int64_t most = 0;
    for (const auto & [name, e] : entries_) {
        bytes += GGML_PAD(ggml_tensor_overhead() + sizeof(float) * e.in_sum2.size(), GGML_MEM_ALIGN);
        bytes += GGML_PAD(ggml_tensor_overhead() + sizeof(float) * e.counts.size(), GGML_MEM_ALIGN);
        most = std::max(most, *std::max_element(e.counts.begin(), e.counts.end()));
    }
    std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init({bytes, nullptr, false}), ggml_free);
    std::unique_ptr<gguf_context, decltype(&gguf_free)> out(gguf_init_empty(), gguf_free);
    if (!ctx || !out) {
        throw Error("imatrix: out of memory for " + file.final_path().string());
    }
    std::vector<const char *> names;
    for (const std::string & d : datasets) {
        names.push_back(d.c_str());
    }
    gguf_set_val_str(out.get(), "general.type", "imatrix");
    gguf_set_arr_str(out.get(), "imatrix.datasets", names.data(), names.size());
    // llama-imatrix's chunk count: the most rows any matrix saw, in whole chunks.
    gguf_set_val_u32(out.get(), "imatrix.chunk_count", uint32_t(chunk_size ? most / chunk_size : 0));
    gguf_set_val_u32(out.get(), "imatrix.chunk_size", chunk_size);
    for (const auto & [name, e] : entries_) {
        const int64_t n_mat = int64_t(e.counts.size());
        ggml_tensor * sums = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, int64_t(e.in_sum2.size()) / n_mat, n_mat);
        ggml_tensor * counts = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, 1, n_mat);
        ggml_format_name(sums, "%s.in_sum2", name.c_str());
        ggml_format_name(counts, "%s.counts", name.c_str());
        std::memcpy(sums->data, e.in_sum2.data(), e.in_sum2.size() * sizeof(float));
        for (int64_t j = 0; j < n_mat; ++j) {
            static_cast<float *>(counts->data)[j] = float(e.counts[size_t(j)]);
        }
        gguf_add_tensor(out.get(), sums);
        gguf_add_tensor(out.get(), counts);
    }
    if (!gguf_write_to_file(out.get(), file.temp_path().c_str(), false)) {
        fail_file(file.final_path().string(), "cannot be written (imatrix)");
    }
}

} // namespace moeprune
