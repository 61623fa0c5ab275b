#include "slice/slice_support.h"
#include "core/file_io.h"
#include "model/model_file.h"
#include "support/test_support.h"

#include "gguf.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <regex>

namespace moeprune::test {

namespace fs = std::filesystem;

KeepMap keep_all_but(int64_t n_expert, const std::map<int, std::vector<int32_t>> & drop, int n_layer) {
    KeepMap km;
    km.n_expert = n_expert;
    km.metric = "test";
    for (int l = 0; l < n_layer; ++l) {
        const auto it = drop.find(l);
        for (int32_t e = 0; e < n_expert; ++e) {
            if (it == drop.end() || std::find(it->second.begin(), it->second.end(), e) == it->second.end()) {
                km.layers[l].push_back(e);
            }
        }
    }
    km.k = int64_t(km.layers.begin()->second.size());
    return km;
}

void write_keep(const fs::path & path, const KeepMap & km) { write_text(path, keep_map_to_json(km).dump()); }

namespace {

constexpr uint64_t kProbe = 4096;

std::string read_range(const File & f, uint64_t offset, uint64_t n) {
    std::string s(n, '\0');
    f.pread_exact(s.data(), n, offset);
    return s;
}

// Equal bytes, or equal first and last kProbe bytes for large ranges.
void expect_same_range(const File & a, uint64_t a_off, const File & b, uint64_t b_off, uint64_t n, const std::string & what) {
    if (n <= 4 * kProbe) {
        EXPECT_TRUE(read_range(a, a_off, n) == read_range(b, b_off, n)) << what;
        return;
    }
    EXPECT_TRUE(read_range(a, a_off, kProbe) == read_range(b, b_off, kProbe)) << what << " (head)";
    EXPECT_TRUE(read_range(a, a_off + n - kProbe, kProbe) == read_range(b, b_off + n - kProbe, kProbe)) << what << " (tail)";
}

} // namespace

void expect_sliced_bytes(const fs::path & source, const fs::path & sliced, const KeepMap & km) {
    const GgufModel src = GgufModel::open(source);
    const GgufModel out = GgufModel::open(sliced);
    std::vector<File> src_files, out_files;
    for (const auto & p : src.shard_paths()) {
        src_files.push_back(File::open_read(p));
    }
    for (const auto & p : out.shard_paths()) {
        out_files.push_back(File::open_read(p));
    }
    ASSERT_FALSE(out.tensors().empty());
    for (const TensorEntry & o : out.tensors()) {
        const auto s = std::find_if(src.tensors().begin(), src.tensors().end(),
                                    [&](const TensorEntry & t) { return t.name == o.name; });
        ASSERT_NE(s, src.tensors().end()) << o.name << " is not in the source";
        EXPECT_EQ(o.type, s->type) << o.name;
        const File & of = out_files[size_t(o.shard)];
        const File & sf = src_files[size_t(s->shard)];
        if (is_per_expert(o.cls.role)) {
            ASSERT_EQ(o.outer_dim(), km.k) << o.name;
            const uint64_t slab = s->nbytes / uint64_t(s->outer_dim());
            ASSERT_EQ(o.nbytes, slab * uint64_t(km.k)) << o.name;
            const auto & ids = km.layers.at(o.cls.layer);
            for (size_t i = 0; i < ids.size(); ++i) {
                expect_same_range(of, o.file_offset + i * slab, sf, s->file_offset + uint64_t(ids[i]) * slab, slab,
                                  fmt::format("{} slot {} should hold expert {}", o.name, i, ids[i]));
            }
        } else {
            ASSERT_EQ(o.nbytes, s->nbytes) << o.name;
            EXPECT_TRUE(std::equal(o.ne.begin(), o.ne.end(), s->ne.begin())) << o.name;
            expect_same_range(of, o.file_offset, sf, s->file_offset, o.nbytes, o.name + " should be copied unchanged");
        }
    }
}

Kld kl_divergence(const fs::path & base, const fs::path & model, const fs::path & dir) {
    const fs::path text = dir / "kld-text.txt";
    const fs::path logits = dir / (base.stem().string() + ".kld");
    const std::string common = fmt::format("{} -f {} -c 128 -b 128 -t 2 --kl-divergence-base {}",
                                           bin("llama-perplexity").string(), text.string(), logits.string());
    Kld k;
    if (!fs::exists(logits)) {
        write_text(text, mixed_text());
        const auto r = run_command(fmt::format("{} -m {}", common, base.string()));
        if (r.exit_code != 0) {
            k.log = r.output;
            return k;
        }
    }
    const auto r = run_command(fmt::format("{} -m {} --kl-divergence", common, model.string()));
    k.log = r.output;
    std::smatch m;
    if (std::regex_search(k.log, m, std::regex(R"(Mean\s+KLD:\s+(-?[0-9.eE+-]+))"))) {
        k.mean = std::stod(m[1].str());
    }
    if (std::regex_search(k.log, m, std::regex(R"(Same top p:\s+([0-9.]+))"))) {
        k.same_top_p = std::stod(m[1].str());
    }
    return k;
}

void write_fake_moe(const fs::path & path, const FakeMoe & spec) {
    GgufPtr ctx(gguf_init_empty());
    const std::string a = spec.arch;
    gguf_set_val_str(ctx.get(), "general.architecture", a.c_str());
    gguf_set_val_str(ctx.get(), "general.name", "fake-moe");
    gguf_set_val_u32(ctx.get(), (a + ".block_count").c_str(), uint32_t(spec.n_layer));
    gguf_set_val_u32(ctx.get(), (a + ".expert_count").c_str(), uint32_t(spec.n_expert));
    gguf_set_val_u32(ctx.get(), (a + ".expert_used_count").c_str(), uint32_t(spec.n_used));
    if (spec.n_nextn > 0) {
        gguf_set_val_u32(ctx.get(), (a + ".nextn_predict_layers").c_str(), uint32_t(spec.n_nextn));
    }
    if (spec.n_group > 0) {
        gguf_set_val_u32(ctx.get(), (a + ".expert_group_count").c_str(), uint32_t(spec.n_group));
        gguf_set_val_u32(ctx.get(), (a + ".expert_group_used_count").c_str(), 1);
    }
    std::vector<uint32_t> heads(size_t(spec.n_layer));
    for (size_t i = 0; i < heads.size(); ++i) {
        heads[i] = uint32_t(i + 1);
    }
    gguf_set_arr_data(ctx.get(), (a + ".attention.head_count").c_str(), GGUF_TYPE_UINT32, heads.data(), heads.size());

    ggml_init_params gp{/*mem_size=*/size_t(256) * ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
    std::unique_ptr<ggml_context, decltype(&ggml_free)> gctx(ggml_init(gp), ggml_free);
    const auto add = [&](const std::string & name, std::vector<int64_t> ne) {
        ggml_tensor * t = ggml_new_tensor(gctx.get(), GGML_TYPE_F32, int(ne.size()), ne.data());
        ggml_set_name(t, name.c_str());
        gguf_add_tensor(ctx.get(), t);
    };
    add("token_embd.weight", {spec.n_embd, 32});
    for (int l = 0; l < spec.n_layer; ++l) {
        const std::string b = fmt::format("blk.{}.", l);
        add(b + "attn_norm.weight", {spec.n_embd});
        add(b + "ffn_gate_inp.weight", {spec.n_embd, spec.n_expert});
        add(b + "exp_probs_b.bias", {spec.n_expert});
        add(b + "ffn_up_exps.weight", {spec.n_embd, spec.n_ff, spec.n_expert});
        if (spec.with_down) {
            add(b + "ffn_down_exps.weight", {spec.n_ff, spec.n_embd, spec.n_expert});
        }
        for (const auto & extra : spec.extra_per_layer) {
            add(b + extra, {spec.n_embd, spec.n_expert});
        }
    }

    std::vector<char> meta(gguf_get_meta_size(ctx.get()));
    gguf_get_meta_data(ctx.get(), meta.data());
    File f = File::create_new(path);
    f.pwrite_all(meta.data(), meta.size(), 0);
    uint64_t end = meta.size();
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx.get()); ++i) {
        const uint64_t at = meta.size() + gguf_get_tensor_offset(ctx.get(), i);
        const uint64_t bytes = gguf_get_tensor_size(ctx.get(), i);
        end = std::max(end, at + (bytes + 31) / 32 * 32);
    }
    f.truncate(end);
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx.get()); ++i) {
        const uint64_t at = meta.size() + gguf_get_tensor_offset(ctx.get(), i);
        const uint64_t bytes = gguf_get_tensor_size(ctx.get(), i);
        const int64_t * ne = gguf_get_tensor_ne(ctx.get(), i);
        int n_dims = 1;
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            n_dims = ne[d] != 1 ? d + 1 : n_dims;
        }
        const uint64_t n_slab = uint64_t(ne[n_dims - 1]);
        const uint64_t slab = bytes / n_slab;
        for (uint64_t e = 0; e < n_slab; ++e) {
            const float mark = float(i * 100000 + int64_t(e));
            f.pwrite_all(&mark, sizeof(mark), at + e * slab);
            f.pwrite_all(&mark, sizeof(mark), at + (e + 1) * slab - sizeof(mark));
        }
    }
}

} // namespace moeprune::test
