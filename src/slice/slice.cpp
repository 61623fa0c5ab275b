#include "slice/slice.h"
#include "core/digest.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "model/inspect.h"

#include "gguf.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <cstring>
#include <optional>
#include <set>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool contains(const std::string & s, const char * part) { return s.find(part) != std::string::npos; }

// A name llama.cpp might give a per-expert tensor classify_tensor does not know.
bool looks_per_expert(const std::string & name) {
    const std::string rest = name.substr(name.find('.', 4) + 1);
    if (contains(rest, "shexp")) {
        return false;
    }
    return contains(rest, "_exps") || contains(rest, "exp_probs") || rest.rfind("ffn_gate_inp", 0) == 0 ||
           contains(rest, "expert");
}

struct ModelFacts {
    int64_t n_expert = 0, n_used = 0, n_block = 0, n_nextn = 0, n_group = 0, n_group_used = 0;
};

ModelFacts read_facts(const GgufModel & m) {
    const std::string & path = m.shard_paths()[0].string();
    ModelFacts f;
    const auto need = [&](const std::string & suffix) {
        const auto v = m.get_int(m.arch_key(suffix));
        if (!v) {
            fail_file(path, "missing " + m.arch_key(suffix) + ": not a MoE model llama.cpp can load");
        }
        return *v;
    };
    f.n_expert = need("expert_count");
    f.n_used = need("expert_used_count");
    f.n_block = need("block_count");
    f.n_nextn = m.get_int(m.arch_key("nextn_predict_layers")).value_or(0);
    f.n_group = m.get_int(m.arch_key("expert_group_count")).value_or(0);
    f.n_group_used = m.get_int(m.arch_key("expert_group_used_count")).value_or(0);
    if (f.n_expert <= 0) {
        fail_file(path, fmt::format("{} is {}: not a MoE model", m.arch_key("expert_count"), f.n_expert));
    }
    return f;
}

// Replaces an integer key keeping its GGUF type, so readers that insist on the
// type llama.cpp wrote still accept it.
void set_int_keeping_type(gguf_context * ctx, const std::string & key, int64_t v) {
    const int64_t id = gguf_find_key(ctx, key.c_str());
    const gguf_type type = id >= 0 ? gguf_get_kv_type(ctx, id) : GGUF_TYPE_UINT32;
    switch (type) {
        case GGUF_TYPE_UINT8:  gguf_set_val_u8(ctx, key.c_str(), uint8_t(v)); break;
        case GGUF_TYPE_INT8:   gguf_set_val_i8(ctx, key.c_str(), int8_t(v)); break;
        case GGUF_TYPE_UINT16: gguf_set_val_u16(ctx, key.c_str(), uint16_t(v)); break;
        case GGUF_TYPE_INT16:  gguf_set_val_i16(ctx, key.c_str(), int16_t(v)); break;
        case GGUF_TYPE_INT32:  gguf_set_val_i32(ctx, key.c_str(), int32_t(v)); break;
        case GGUF_TYPE_UINT64: gguf_set_val_u64(ctx, key.c_str(), uint64_t(v)); break;
        case GGUF_TYPE_INT64:  gguf_set_val_i64(ctx, key.c_str(), v); break;
        default:               gguf_set_val_u32(ctx, key.c_str(), uint32_t(v)); break;
    }
}

// gguf.h keeps its element sizes private.
size_t gguf_scalar_size(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

// Per-layer arrays (one entry per block) lose the entries of dropped MTP layers.
void truncate_per_layer_arrays(gguf_context * ctx, const std::string & arch, int64_t old_n, int64_t new_n) {
    for (int64_t id = 0; id < gguf_get_n_kv(ctx); ++id) {
        const std::string key = gguf_get_key(ctx, id);
        if (key.rfind(arch + ".", 0) != 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY ||
            int64_t(gguf_get_arr_n(ctx, id)) != old_n) {
            continue;
        }
        const gguf_type et = gguf_get_arr_type(ctx, id);
        if (et == GGUF_TYPE_STRING || et == GGUF_TYPE_ARRAY) {
            throw Error("--mtp drop: per-layer array " + key + " holds strings; cannot shorten it");
        }
        const auto * data = static_cast<const char *>(gguf_get_arr_data(ctx, id));
        const std::vector<char> kept(data, data + size_t(new_n) * gguf_scalar_size(et));
        gguf_set_arr_data(ctx, key.c_str(), et, kept.data(), size_t(new_n));
    }
}

// Byte ranges of the kept experts in a tensor whose outer axis is the expert axis,
// consecutive ids merged into one range.
std::vector<CopyPiece> kept_pieces(int source, uint64_t offset, uint64_t slab, const std::vector<int32_t> & ids) {
    std::vector<CopyPiece> pieces;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i + 1;
        while (j < ids.size() && ids[j] == ids[j - 1] + 1) {
            ++j;
        }
        pieces.push_back({source, offset + uint64_t(ids[i]) * slab, uint64_t(j - i) * slab});
        i = j;
    }
    return pieces;
}

int n_dims_of(const int64_t * ne) {
    int n = 1;
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        if (ne[d] != 1) {
            n = d + 1;
        }
    }
    return n;
}

const char * mtp_name(MtpMode m) {
    switch (m) {
        case MtpMode::Keep: return "keep";
        case MtpMode::Drop: return "drop";
        case MtpMode::Unset: break;
    }
    return "none";
}

// The layers whose routed experts the keep map must cover, after deciding what
// happens to MTP (nextn) layers.
std::vector<int> moe_layers_to_keep(const GgufModel & m, const ModelFacts & f, const KeepMap & km, MtpMode mtp,
                                    const std::string & keep_origin, std::vector<int> & dropped) {
    std::set<int> moe;
    for (const TensorEntry & t : m.tensors()) {
        if (t.cls.role == TensorRole::Expert) {
            moe.insert(t.cls.layer);
        }
    }
    if (moe.empty()) {
        fail_file(m.shard_paths()[0].string(), "has no routed-expert (ffn_*_exps) tensors: nothing to slice");
    }
    const int64_t first_mtp = f.n_block - f.n_nextn;
    std::vector<int> mtp_moe;
    for (int l : moe) {
        if (f.n_nextn > 0 && l >= first_mtp) {
            mtp_moe.push_back(l);
        }
    }
    if (mtp == MtpMode::Drop) {
        if (f.n_nextn == 0) {
            fail_file(m.shard_paths()[0].string(), "--mtp drop: the model has no MTP (nextn) layers");
        }
        for (int64_t l = first_mtp; l < f.n_block; ++l) {
            dropped.push_back(int(l));
        }
        std::vector<int> kept;
        for (int l : moe) {
            if (l < first_mtp) {
                kept.push_back(l);
            }
        }
        if (kept.empty()) {
            fail_file(m.shard_paths()[0].string(), "--mtp drop: every MoE layer is an MTP (nextn) layer; nothing would "
                                                   "remain to route");
        }
        return kept;
    }
    if (mtp == MtpMode::Unset && !mtp_moe.empty()) {
        for (int l : mtp_moe) {
            if (!km.layers.count(l)) {
                fail_file(keep_origin, fmt::format("layer {} is an MTP (nextn) layer with routed experts and the keep map "
                                                   "does not cover it; expert_count is one number for the whole model, "
                                                   "so use a keep map from moeprune select on this model's statistics "
                                                   "(collect records the MTP layers), add layer {} to the keep map (then "
                                                   "--mtp keep), or remove the MTP layers with --mtp drop",
                                                   l, l));
            }
        }
    }
    return {moe.begin(), moe.end()};
}

void check_expert_groups(const ModelFacts & f, const KeepMap & km, const std::string & origin) {
    if (f.n_group > 1 && f.n_expert % f.n_group != 0) {
        throw Error(fmt::format("expert_group_count {} does not divide expert_count {}", f.n_group, f.n_expert));
    }
    if (const std::string problem = expert_groups_problem(km, {f.n_expert, f.n_group, f.n_group_used, f.n_used});
        !problem.empty()) {
        fail_file(origin, problem);
    }
}

struct ImatrixPlan {
    StreamWriteRequest req;
    int sliced = 0;
};

ImatrixPlan plan_imatrix(const SliceOptions & opt, const GgufModel & model, const ModelFacts & f, const KeepMap & km,
                         const std::set<int> & dropped, const json & provenance) {
    const std::string origin = opt.imatrix.string();
    ImatrixPlan p;
    GgufPtr src = open_gguf_metadata(opt.imatrix);
    std::map<std::string, const TensorEntry *> model_tensors;
    for (const TensorEntry & t : model.tensors()) {
        model_tensors[t.name] = &t;
    }
    const uint64_t data_offset = gguf_get_data_offset(src.get());
    for (int64_t i = 0; i < gguf_get_n_tensors(src.get()); ++i) {
        OutputTensor out;
        out.name = gguf_get_tensor_name(src.get(), i);
        out.type = gguf_get_tensor_type(src.get(), i);
        const int64_t * ne = gguf_get_tensor_ne(src.get(), i);
        std::copy(ne, ne + GGML_MAX_DIMS, out.ne.begin());
        out.n_dims = n_dims_of(ne);
        const uint64_t offset = data_offset + gguf_get_tensor_offset(src.get(), i);
        const uint64_t bytes = gguf_get_tensor_size(src.get(), i);

        std::string base = out.name;
        for (const char * suffix : {".in_sum2", ".counts"}) {
            if (base.size() > std::strlen(suffix) && base.ends_with(suffix)) {
                base.resize(base.size() - std::strlen(suffix));
            }
        }
        if (base == out.name) {
            fail_file(origin, "entry " + out.name + " is not an imatrix entry (NAME.in_sum2 / NAME.counts): a model "
                              "given as the imatrix?");
        }
        const TensorClass cls = classify_tensor(base);
        if (cls.layer >= 0 && dropped.count(cls.layer)) {
            continue;
        }
        const int64_t outer = out.ne[size_t(out.n_dims - 1)];
        if (cls.role == TensorRole::Expert && outer != 1) {
            const auto mt = model_tensors.find(base);
            if (mt == model_tensors.end()) {
                fail_file(origin, "entry " + out.name + " is for a tensor the model does not have: made for another model?");
            }
            if (outer != f.n_expert || (out.name.ends_with(".in_sum2") && out.ne[0] != mt->second->ne[0])) {
                fail_file(origin, fmt::format("entry {} has shape [{}, {}] but the model's {} is [{}, ..., {}]: made for "
                                              "another model?",
                                              out.name, out.ne[0], outer, base, mt->second->ne[0], f.n_expert));
            }
            out.pieces = kept_pieces(0, offset, bytes / uint64_t(outer), km.layers.at(cls.layer));
            out.ne[size_t(out.n_dims - 1)] = km.k;
            p.sliced++;
        } else {
            out.pieces = {{0, offset, bytes}};
        }
        p.req.tensors.push_back(std::move(out));
    }
    if (p.sliced == 0) {
        fail_file(origin, "has no per-expert entries (*_exps.weight.in_sum2 / .counts): not an imatrix of this MoE model");
    }
    p.req.kv.reset(gguf_init_empty());
    gguf_set_kv(p.req.kv.get(), src.get());
    for (const auto & [key, value] : provenance.items()) {
        if (value.is_string()) {
            gguf_set_val_str(p.req.kv.get(), ("moeprune.slice." + key).c_str(), value.get<std::string>().c_str());
        }
    }
    p.req.sources = {opt.imatrix};
    p.req.output = opt.imatrix_out;
    p.req.progress_label = "slice imatrix";
    return p;
}

} // namespace

namespace {

// A shard cut short keeps a readable header; catch it before writing anything.
void refuse_truncated_shards(const GgufModel & model) {
    std::vector<uint64_t> shard_end(model.shard_paths().size(), 0);
    for (const TensorEntry & t : model.tensors()) {
        shard_end[size_t(t.shard)] = std::max(shard_end[size_t(t.shard)], t.file_offset + t.nbytes);
    }
    for (size_t s = 0; s < shard_end.size(); ++s) {
        const uint64_t size = fs::file_size(model.shard_paths()[s]);
        if (size < shard_end[s]) {
            fail_file(model.shard_paths()[s].string(), fmt::format("is truncated: its tensors end at byte {} but the file "
                                                                   "has {} bytes",
                                                                   shard_end[s], size));
        }
    }

}

// Every tensor's fate (dropped with an MTP layer, sliced to the kept experts, or copied)
// into `r` and the pieces to copy into `req`.
void plan_tensors(const GgufModel & model, const std::string & model_origin, const ModelFacts & f, const KeepMap & covered,
                  const std::set<int> & dropped, SliceResult & r, StreamWriteRequest & req) {
    std::vector<std::string> unsliceable;
    for (const TensorEntry & t : model.tensors()) {
        TensorChange c;
        c.name = t.name;
        c.role = t.cls.role;
        c.n_dims = t.n_dims;
        c.ne_before = c.ne_after = t.ne;
        c.bytes_before = t.nbytes;
        r.tensor_bytes_before += t.nbytes;
        if (t.cls.layer >= 0 && dropped.count(t.cls.layer)) {
            c.action = "drop";
            r.tensors.push_back(c);
            continue;
        }
        OutputTensor out{t.name, t.type, t.n_dims, t.ne, {}};
        if (is_per_expert(t.cls.role)) {
            if (t.outer_dim() != f.n_expert || t.nbytes % uint64_t(f.n_expert) != 0) {
                fail_file(model_origin, fmt::format("{} has {} experts on its outer axis but {} says {}", t.name,
                                                    t.outer_dim(), model.arch_key("expert_count"), f.n_expert));
            }
            out.pieces = kept_pieces(t.shard, t.file_offset, t.nbytes / uint64_t(f.n_expert), covered.layers.at(t.cls.layer));
            out.ne[size_t(t.n_dims - 1)] = covered.k;
            c.action = "slice";
        } else {
            if (t.cls.layer >= 0 && t.cls.role != TensorRole::Shared && looks_per_expert(t.name) &&
                std::find(t.ne.begin(), t.ne.begin() + t.n_dims, f.n_expert) != t.ne.begin() + t.n_dims) {
                unsliceable.push_back(t.name);
            }
            out.pieces = {{t.shard, t.file_offset, t.nbytes}};
            c.action = "copy";
        }
        c.ne_after = out.ne;
        for (const CopyPiece & p : out.pieces) {
            c.bytes_after += p.bytes;
        }
        r.tensor_bytes_after += c.bytes_after;
        r.tensors.push_back(c);
        req.tensors.push_back(std::move(out));
    }
    if (!unsliceable.empty()) {
        std::string list;
        for (const auto & n : unsliceable) {
            list += "\n  " + n;
        }
        fail_file(model_origin, fmt::format("these tensors look per-expert by name and have an axis of {} (the expert "
                                            "count), but moeprune does not know how to slice them; refusing to write a "
                                            "model llama.cpp could not load:{}",
                                            f.n_expert, list));
    }

}

// The source's metadata with the expert count cut to K, MTP layers dropped and the
// slice's provenance (moeprune.slice.*).
GgufPtr sliced_metadata(const GgufModel & model, const ModelFacts & f, const KeepMap & covered,
                        const std::set<int> & dropped, const json & provenance) {
    const KeepMap & km = covered;
    GgufPtr kv(gguf_init_empty());
    gguf_set_kv(kv.get(), model.meta());
    set_int_keeping_type(kv.get(), model.arch_key("expert_count"), km.k);
    if (!dropped.empty()) {
        const int64_t n_block = f.n_block - int64_t(dropped.size());
        truncate_per_layer_arrays(kv.get(), model.arch(), f.n_block, n_block);
        set_int_keeping_type(kv.get(), model.arch_key("block_count"), n_block);
        set_int_keeping_type(kv.get(), model.arch_key("nextn_predict_layers"), 0);
    }
    // Planted ids name experts of the source model; after slicing they would point at other experts.
    gguf_remove_key(kv.get(), "moeprune.synth.planted");
    gguf_set_val_str(kv.get(), "moeprune.slice.source", provenance["source"].get<std::string>().c_str());
    gguf_set_val_str(kv.get(), "moeprune.slice.source_file", provenance["source_file"].get<std::string>().c_str());
    gguf_set_val_u64(kv.get(), "moeprune.slice.source_bytes", model.file_bytes());
    gguf_set_val_str(kv.get(), "moeprune.slice.source_digest", provenance["source_digest"].get<std::string>().c_str());
    gguf_set_val_u32(kv.get(), "moeprune.slice.source_n_expert", uint32_t(f.n_expert));
    gguf_set_val_u32(kv.get(), "moeprune.slice.k", uint32_t(km.k));
    gguf_set_val_str(kv.get(), "moeprune.slice.metric", km.metric.c_str());
    gguf_set_val_str(kv.get(), "moeprune.slice.keep_digest", provenance["keep_digest"].get<std::string>().c_str());
    gguf_set_val_str(kv.get(), "moeprune.slice.keep", keep_map_to_json(covered).dump().c_str());
    gguf_set_val_str(kv.get(), "moeprune.slice.mtp", provenance["mtp"].get<std::string>().c_str());
    gguf_set_val_str(kv.get(), "moeprune.slice.version", MOEPRUNE_VERSION);
    return kv;
}

} // namespace

SliceResult slice_model(const SliceOptions & opt) {
    if (opt.imatrix.empty() != opt.imatrix_out.empty()) {
        throw Error("--imatrix and --imatrix-out go together");
    }
    const GgufModel model = GgufModel::open(opt.model);
    const std::string model_origin = opt.model.string();
    const std::string keep_origin = opt.keep.string();
    if (const InspectReport info = inspect_model(model, {}); !info.problems.empty()) {
        fail_file(model_origin, "is inconsistent (see moeprune inspect): " + fmt::format("{}", fmt::join(info.problems, "; ")));
    }
    const ModelFacts f = read_facts(model);
    const KeepMap km = read_keep_map(opt.keep);

    SliceResult r;
    r.arch = model.arch();
    r.n_expert_before = f.n_expert;
    r.n_expert_used = f.n_used;
    r.k = km.k;

    if (km.k < f.n_used) {
        fail_file(keep_origin, fmt::format("keeps {} experts per layer but the model routes every token to {} ({}); "
                                           "llama.cpp cannot load a model with fewer experts than that",
                                           km.k, f.n_used, model.arch_key("expert_used_count")));
    }
    const std::vector<int> moe_layers = moe_layers_to_keep(model, f, km, opt.mtp, keep_origin, r.dropped_layers);
    KeepMap covered = km;
    for (int l : r.dropped_layers) {
        covered.layers.erase(l);  // a map made before deciding to drop MTP may still list them
    }
    validate_keep_map_for_model(covered, keep_origin, f.n_expert, moe_layers);
    check_expert_groups(f, covered, keep_origin);
    const std::set<int> dropped(r.dropped_layers.begin(), r.dropped_layers.end());

    refuse_truncated_shards(model);

    StreamWriteRequest req;
    req.sources = model.shard_paths();
    req.output = opt.output;
    req.split_max_bytes = opt.split_max_bytes;
    req.progress_label = "slice";
    plan_tensors(model, model_origin, f, covered, dropped, r, req);
    r.provenance = {{"source", model.get_string("general.name").value_or(opt.model.filename().string())},
                    {"source_file", opt.model.filename().string()},
                    {"source_bytes", model.file_bytes()},
                    {"source_digest", model_digest(model.shard_paths())},
                    {"source_n_expert", f.n_expert},
                    {"k", km.k},
                    {"metric", km.metric},
                    {"keep_digest", keep_map_digest(covered)},
                    {"mtp", mtp_name(opt.mtp == MtpMode::Unset && !dropped.empty() ? MtpMode::Drop : opt.mtp)},
                    {"version", MOEPRUNE_VERSION}};
    req.kv = sliced_metadata(model, f, covered, dropped, r.provenance);
    std::optional<ImatrixPlan> imatrix;
    if (!opt.imatrix.empty()) {
        imatrix = plan_imatrix(opt, model, f, covered, dropped, r.provenance);
        r.imatrix_entries_sliced = imatrix->sliced;
    }

    std::vector<fs::path> inputs = model.shard_paths();
    inputs.push_back(opt.keep);
    if (imatrix) {
        inputs.push_back(opt.imatrix);
    }
    std::vector<fs::path> outputs = planned_output_paths(req);
    if (imatrix) {
        outputs.push_back(opt.imatrix_out);
    }
    refuse_output_clashes(outputs, inputs);
    if (opt.dry_run) {
        return r;
    }
    // A plan's printed slice command names a folder of sliced models that need not exist yet.
    for (const fs::path & out : outputs) {
        create_output_dir(fs::absolute(out).parent_path());
    }
    r.outputs = write_gguf_streamed(req);
    if (imatrix) {
        r.imatrix_outputs = write_gguf_streamed(imatrix->req);
    }
    return r;
}

json to_json(const SliceResult & r, bool per_tensor) {
    json j = {{"arch", r.arch},
              {"n_expert_before", r.n_expert_before},
              {"k", r.k},
              {"n_expert_used", r.n_expert_used},
              {"dropped_layers", r.dropped_layers},
              {"tensor_bytes_before", r.tensor_bytes_before},
              {"tensor_bytes_after", r.tensor_bytes_after},
              {"provenance", r.provenance}};
    json outs = json::array(), imat = json::array();
    for (const auto & p : r.outputs) {
        outs.push_back(p.string());
    }
    for (const auto & p : r.imatrix_outputs) {
        imat.push_back(p.string());
    }
    j["outputs"] = outs;
    j["imatrix_outputs"] = imat;
    j["imatrix_entries_sliced"] = r.imatrix_entries_sliced;
    std::map<std::string, int> counts;
    json tensors = json::array();
    for (const TensorChange & c : r.tensors) {
        counts[c.action]++;
        if (per_tensor) {
            tensors.push_back({{"name", c.name},
                               {"action", c.action},
                               {"role", tensor_role_name(c.role)},
                               {"ne_before", std::vector<int64_t>(c.ne_before.begin(), c.ne_before.begin() + c.n_dims)},
                               {"ne_after", std::vector<int64_t>(c.ne_after.begin(), c.ne_after.begin() + c.n_dims)},
                               {"bytes_before", c.bytes_before},
                               {"bytes_after", c.bytes_after}});
        }
    }
    j["tensor_counts"] = counts;
    if (per_tensor) {
        j["tensors"] = tensors;
    }
    return j;
}

std::string to_text(const SliceResult & r, bool per_tensor) {
    const auto mib = [](uint64_t b) { return double(b) / (1024.0 * 1024.0); };
    std::string s;
    if (per_tensor) {
        s += fmt::format("{:<40} {:<6} {:>24} {:>24} {:>12} {:>12}\n", "tensor", "action", "shape before", "shape after",
                         "MiB before", "MiB after");
        for (const TensorChange & c : r.tensors) {
            const auto shape = [&](const auto & ne) {
                return fmt::format("[{}]", fmt::join(std::vector<int64_t>(ne.begin(), ne.begin() + c.n_dims), ", "));
            };
            s += fmt::format("{:<40} {:<6} {:>24} {:>24} {:>12.3f} {:>12.3f}\n", c.name, c.action, shape(c.ne_before),
                             c.action == "drop" ? "-" : shape(c.ne_after), mib(c.bytes_before), mib(c.bytes_after));
        }
    }
    std::map<std::string, int> counts;
    for (const TensorChange & c : r.tensors) {
        counts[c.action]++;
    }
    s += fmt::format("{}: experts {} -> {} per layer (each token uses {}); tensors: {} sliced, {} copied, {} dropped\n",
                     r.arch, r.n_expert_before, r.k, r.n_expert_used, counts["slice"], counts["copy"], counts["drop"]);
    if (!r.dropped_layers.empty()) {
        s += fmt::format("MTP layers dropped: {}\n", fmt::join(r.dropped_layers, ", "));
    }
    s += fmt::format("tensor data: {:.1f} MiB -> {:.1f} MiB ({:.1f}%)\n", mib(r.tensor_bytes_before),
                     mib(r.tensor_bytes_after),
                     r.tensor_bytes_before ? 100.0 * double(r.tensor_bytes_after) / double(r.tensor_bytes_before) : 0.0);
    for (const auto & p : r.outputs) {
        s += "wrote " + p.string() + "\n";
    }
    for (const auto & p : r.imatrix_outputs) {
        s += fmt::format("wrote {} ({} per-expert entries sliced)\n", p.string(), r.imatrix_entries_sliced);
    }
    return s;
}

} // namespace moeprune
