#include "collect/collect.h"
#include "formats/corpus.h"
#include "collect/imatrix.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/progress.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "engine/media.h"
#include "engine/mtp.h"
#include "engine/router_graph.h"
#include "engine/session.h"

#include "ggml-backend.h"
#include "llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

namespace moeprune {

namespace fs = std::filesystem;

using nlohmann::json;

namespace {

// One token as the run knows it, for the trace and the per-domain statistics.
struct TokenInfo {
    TraceTokenMeta meta;
    int domain = -1;   // index into the corpus' domains, -1 for none
    bool traced = false;
};

// What one MoE layer's nodes gave for the current micro-batch.
struct LayerCapture {
    std::vector<float> topk, probs, selection, logits, weights, softmax_weights;
    Gating gating = Gating::Unknown;
    // Per (token, slot) of the final expert output f: its L2 norm and largest |value|;
    // NaN norm when any value is not finite.
    std::vector<double> f_norm, f_max;
    int64_t n_tokens = -1;
    void clear() { *this = LayerCapture(); }
};

class Collector : public GraphObserverFailure {
public:
    Collector(const CollectOptions & opt, std::string arch, std::vector<int> moe_layers, int n_expert, int n_expert_used,
              int n_embd, std::string down_node, const std::vector<std::string> & domains, SaliencyStats & stats,
              ImatrixAccumulator * imatrix)
        : opt_(opt), imatrix_(imatrix), arch_(std::move(arch)), moe_layers_(std::move(moe_layers)), n_expert_(n_expert),
          n_expert_used_(n_expert_used), n_embd_(n_embd), down_node_(std::move(down_node)), domains_(domains),
          stats_(stats), capture_(moe_layers_.size()), done_tokens_(moe_layers_.size(), 0),
          trace_count_(moe_layers_.size(), std::vector<uint64_t>(size_t(n_expert), 0)),
          prob_drops_(moe_layers_.size(), 0), routed_this_graph_(moe_layers_.size(), 0) {
        for (size_t i = 0; i < moe_layers_.size(); ++i) {
            ordinal_[moe_layers_[i]] = int(i);
        }
        trace_m_ = std::min(opt.trace_top, n_expert);
    }

    static bool callback(ggml_tensor * t, bool ask, void * ud) {
        auto * self = static_cast<Collector *>(ud);
        return self->guarded([&] { return self->on_node(t, ask); });
    }

    // The tokens of the next llama_decode, in batch order.
    void begin_batch(std::vector<TokenInfo> tokens) {
        batch_ = std::move(tokens);
        std::fill(done_tokens_.begin(), done_tokens_.end(), 0);
        std::fill(routed_this_graph_.begin(), routed_this_graph_.end(), 0);
        trace_ids_.assign(batch_.size() * moe_layers_.size() * size_t(trace_m_), 0);
        trace_logits_.assign(trace_ids_.size(), 0.0f);
    }

    // After llama_decode: every MoE layer must have seen every token of the batch.
    void end_batch(TraceWriter * trace) {
        rethrow_failure();
        for (size_t l = 0; l < moe_layers_.size(); ++l) {
            if (done_tokens_[l] != batch_.size()) {
                throw Error(fmt::format("{}: layer {} reported {} of the batch's {} tokens: its node {}-{} was not "
                                        "computed for every token (architecture not supported as built)",
                                        arch_, moe_layers_[l], done_tokens_[l], batch_.size(), down_node_, moe_layers_[l]));
            }
        }
        if (trace) {
            const size_t per_token = moe_layers_.size() * size_t(trace_m_);
            for (size_t i = 0; i < batch_.size(); ++i) {
                if (batch_[i].traced) {
                    trace->append(batch_[i].meta, trace_ids_.data() + i * per_token, trace_logits_.data() + i * per_token);
                }
            }
        }
    }

    // The MTP head's graph runs too, after the trunk's, between begin_batch and end_batch.
    void runs_mtp() { runs_mtp_ = true; }
    void in_mtp_graph(bool on) { in_mtp_graph_ = on; }

    Gating gating() const { return gating_; }
    // Graph evaluations stopped before the output head.
    uint64_t head_stops() const { return head_stops_; }
    uint64_t repeat_routings() const { return repeat_routings_; }
    int trace_m() const { return trace_m_; }
    const std::vector<std::vector<uint64_t>> & trace_count() const { return trace_count_; }
    void set_trace_count(std::vector<std::vector<uint64_t>> c) { trace_count_ = std::move(c); }
    // Tokens per layer whose router probabilities were not finite (left out of prob_sum).
    const std::vector<uint64_t> & prob_drops() const { return prob_drops_; }
    void set_prob_drops(std::vector<uint64_t> d) { prob_drops_ = std::move(d); }

private:
    bool on_node(ggml_tensor * t, bool ask) {
        // Every MoE layer is done once the final norm is computed: stopping the graph there
        // spares the output head, the largest matmul of a small-expert model, which only
        // feeds logits nobody reads (nor the imatrix, which leaves the head out).
        if (std::strcmp(t->name, "result_norm") == 0) {
            if (!ask) {
                std::fill(routed_this_graph_.begin(), routed_this_graph_.end(), 0);
            }
            // The MTP head reads the trunk's outputs, and its own graph routes only output rows.
            if (opt_.generate == 0 && !runs_mtp_) {
                head_stops_ += !ask;
                return ask;
            }
            return true;
        }
        // llama-imatrix runs no MTP head: the importance matrix stays the trunk's.
        const bool for_imatrix = imatrix_ && !in_mtp_graph_ && ImatrixAccumulator::wants(t);
        if (ask) {
            return on_router_node(t, true) || for_imatrix;
        }
        if (for_imatrix) {
            imatrix_->observe(t);
        }
        on_router_node(t, false);
        return true;
    }

    bool on_router_node(ggml_tensor * t, bool ask) {
        const char * name = t->name;
        const RouterNode parsed = parse_router_node(name);
        if (parsed.layer < 0) {
            return false;
        }
        const std::string & node = parsed.name;
        // Every watched node splits llama.cpp's graph there, so only what this run uses:
        // logits and selection scores only for a trace; all gate stages, since the last
        // one present is the gate the model applies; f only at its final stage, where the
        // layer is complete.
        static const std::vector<std::string> kAlways = {"ffn_moe_probs",        "ffn_moe_topk",
                                                         "ffn_moe_weights",      "ffn_moe_weights_softmax",
                                                         "ffn_moe_weights_norm", "ffn_moe_weights_scaled"};
        static const std::vector<std::string> kForTrace = {"ffn_moe_logits", "ffn_moe_logits_biased", "ffn_moe_probs_biased",
                                                           "ffn_moe_probs_masked"};
        const bool watched = node == down_node_ || std::find(kAlways.begin(), kAlways.end(), node) != kAlways.end() ||
                             (!opt_.trace.empty() && std::find(kForTrace.begin(), kForTrace.end(), node) != kForTrace.end());
        if (!watched) {
            return false;
        }
        if (ask) {
            return true;
        }
        const int il = parsed.layer;
        const auto it = ordinal_.find(il);
        if (it == ordinal_.end()) {
            throw Error(fmt::format("{}: node {} belongs to layer {}, which has no routed experts in the model's tensors",
                                    arch_, name, il));
        }
        // A second routing of a layer in one graph (grovemoe's adjugate experts, chosen by the
        // same router from the same probabilities) adds no routing decision of its own.
        if (routed_this_graph_[size_t(it->second)]) {
            repeat_routings_ += node == down_node_;
            return true;
        }
        LayerCapture & c = capture_[size_t(it->second)];
        if (t->type != GGML_TYPE_F32 && !(node == "ffn_moe_topk" && t->type == GGML_TYPE_I32)) {
            throw Error(fmt::format("{}: node {} has type {}, expected {}", arch_, name, ggml_type_name(t->type),
                                    node == "ffn_moe_topk" ? "i32" : "f32"));
        }
        if (node == "ffn_moe_topk") {
            expect_shape(t, {n_expert_used_, -1}, name);
            c.n_tokens = t->ne[1];
            c.topk = read_node_f32(t, raw_);
        } else if (node == "ffn_moe_probs") {
            expect_shape(t, {n_expert_, -1}, name);
            c.gating = gating_of(t);
            if (c.gating == Gating::Unknown) {
                throw Error(fmt::format("{}: node {} comes from op {}, not a gating function moeprune knows", arch_, name,
                                        ggml_op_desc(t)));
            }
            gating_ = c.gating;
            c.probs = read_node_f32(t, raw_);
            c.selection = c.probs;
            if (c.gating == Gating::SoftmaxWeight) {
                c.logits = c.probs;
            }
        } else if (node == "ffn_moe_probs_biased" || node == "ffn_moe_probs_masked") {
            expect_shape(t, {n_expert_, -1}, name);
            c.selection = read_node_f32(t, raw_);
        } else if (node == "ffn_moe_logits" || node == "ffn_moe_logits_biased") {
            expect_shape(t, {n_expert_, -1}, name);
            c.logits = read_node_f32(t, raw_);
        } else if (node.rfind("ffn_moe_weights", 0) == 0) {
            // [1, k, tokens], or [k, tokens] where build_moe_ffn reshaped to normalize.
            expect_shape(t, t->ne[0] == 1 ? std::vector<int64_t>{1, n_expert_used_, -1} : std::vector<int64_t>{n_expert_used_, -1},
                         name);
            c.weights = read_node_f32(t, raw_);
            if (node == "ffn_moe_weights_softmax") {
                c.softmax_weights = c.weights;
            }
        } else if (node == down_node_) {
            expect_shape(t, {n_embd_, n_expert_used_, -1}, name);
            reduce_down(t, c);
            process(it->second, c, il);
            c.clear();
            routed_this_graph_[size_t(it->second)] = 1;
        }
        return true;
    }

    void expect_shape(const ggml_tensor * t, std::vector<int64_t> ne, const char * name) const {
        bool ok = true;
        for (size_t i = 0; i < ne.size(); ++i) {
            ok = ok && (ne[i] < 0 || t->ne[i] == ne[i]);
        }
        for (size_t i = ne.size(); i < GGML_MAX_DIMS; ++i) {
            ok = ok && t->ne[i] == 1;
        }
        if (!ok) {
            throw Error(fmt::format("{}: node {} has shape [{}, {}, {}, {}], expected [{}] (-1: the token count)", arch_, name,
                                    t->ne[0], t->ne[1], t->ne[2], t->ne[3], fmt::join(ne, ", ")));
        }
    }

    void reduce_down(const ggml_tensor * t, LayerCapture & c) {
        const std::vector<float> f = read_node_f32(t, raw_);
        const int64_t slots = t->ne[1] * t->ne[2];
        c.f_norm.assign(size_t(slots), 0.0);
        c.f_max.assign(size_t(slots), 0.0);
        for (int64_t s = 0; s < slots; ++s) {
            double sq = 0, mx = 0;
            bool finite = true;
            for (int64_t i = 0; i < t->ne[0]; ++i) {
                const double v = f[size_t(s * t->ne[0] + i)];
                finite = finite && std::isfinite(v);
                sq += v * v;
                mx = std::max(mx, std::fabs(v));
            }
            c.f_norm[size_t(s)] = finite ? std::sqrt(sq) : std::nan("");
            c.f_max[size_t(s)] = mx;
        }
    }

    void process(int li, LayerCapture & c, int il) {
        const auto missing = [&](const char * what) {
            return Error(fmt::format("{}: layer {} computed {} without {}: this graph variant is not supported "
                                     "(refusing to record zeros)",
                                     arch_, il, down_node_, what));
        };
        if (c.topk.empty()) {
            throw missing("ffn_moe_topk");
        }
        if (c.probs.empty()) {
            throw missing("ffn_moe_probs");
        }
        if (c.weights.empty()) {
            throw missing("ffn_moe_weights");
        }
        if (c.logits.empty() && !opt_.trace.empty()) {
            throw missing("ffn_moe_logits");
        }
        const int64_t T = c.n_tokens;
        const size_t first = done_tokens_[size_t(li)];
        if (first + size_t(T) > batch_.size()) {
            throw Error(fmt::format("{}: layer {} saw more tokens than the batch holds", arch_, il));
        }
        const int k = n_expert_used_, E = n_expert_;
        LayerStats & L = stats_.layers[size_t(li)];
        std::vector<int32_t> chosen(static_cast<size_t>(k));
        for (int64_t r = 0; r < T; ++r) {
            const TokenInfo & tok = batch_[first + size_t(r)];
            LayerStats * D = tok.domain >= 0 ? &stats_.domains[domains_[size_t(tok.domain)]].layers[size_t(li)] : nullptr;
            for (int j = 0; j < k; ++j) {
                const float id = c.topk[size_t(r * k + j)];
                if (!(id >= 0 && id < float(E))) {
                    throw Error(fmt::format("{}: ffn_moe_topk-{} holds expert id {} (n_expert {})", arch_, il, id, E));
                }
                chosen[size_t(j)] = int32_t(id);
            }
            // Router probability per expert, in the model's own gating function.
            bool probs_finite = true;
            const float * p = c.probs.data() + r * E;
            for (int e = 0; e < E && c.gating != Gating::SoftmaxWeight; ++e) {
                probs_finite = probs_finite && std::isfinite(p[e]);
            }
            const float * w = c.weights.data() + r * k;
            for (int j = 0; j < k; ++j) {
                probs_finite = probs_finite && std::isfinite(w[j]);
            }
            if (!probs_finite) {
                drop(L, D, il, tok, -1);
                ++prob_drops_[size_t(li)];
            } else if (c.gating == Gating::SoftmaxWeight) {
                // The probabilities are the softmax over the selected experts: ffn_moe_weights_softmax.
                if (c.softmax_weights.empty()) {
                    throw missing("ffn_moe_weights_softmax");
                }
                for (int j = 0; j < k; ++j) {
                    add_prob(L, D, chosen[size_t(j)], c.softmax_weights[size_t(r * k + j)]);
                }
            } else {
                for (int e = 0; e < E; ++e) {
                    add_prob(L, D, e, p[e]);
                }
            }
            for (int j = 0; j < k; ++j) {
                const int32_t e = chosen[size_t(j)];
                ++L.count[size_t(e)];
                if (D) {
                    ++D->count[size_t(e)];
                }
                if (tok.traced) {
                    ++trace_count_[size_t(li)][size_t(e)];
                }
                const double g = w[j], fn = c.f_norm[size_t(r * k + j)], fm = c.f_max[size_t(r * k + j)];
                if (!std::isfinite(g) || !std::isfinite(fn)) {
                    if (probs_finite) {
                        drop(L, D, il, tok, e);
                    }
                    continue;
                }
                // Weights applied before the experts (llama4) are already inside f.
                const double reap = arch_ == "llama4" ? fn : g * fn;
                for (LayerStats * S : {&L, D}) {
                    if (!S) {
                        continue;
                    }
                    S->reap_sum[size_t(e)] += reap;
                    S->reap_sq_sum[size_t(e)] += reap * reap;
                    S->ean_sum[size_t(e)] += fn;
                    S->max_act[size_t(e)] = std::max(S->max_act[size_t(e)], fm);
                }
            }
            if (opt_.coact && !L.coact.empty()) {
                std::vector<int32_t> sorted = chosen;
                std::sort(sorted.begin(), sorted.end());
                for (int a = 0; a < k; ++a) {
                    for (int b = a + 1; b < k; ++b) {
                        ++L.coact[LayerStats::pair_index(size_t(E), size_t(sorted[size_t(a)]), size_t(sorted[size_t(b)]))];
                    }
                }
            }
            if (tok.traced) {
                trace_row(li, first + size_t(r), c, r, chosen);
            }
        }
        done_tokens_[size_t(li)] += size_t(T);
    }

    void add_prob(LayerStats & L, LayerStats * D, int e, double p) {
        L.prob_sum[size_t(e)] += p;
        if (D) {
            D->prob_sum[size_t(e)] += p;
        }
    }

    void drop(LayerStats & L, LayerStats * D, int il, const TokenInfo & tok, int expert) {
        if (opt_.strict) {
            throw Error(fmt::format("{}: non-finite router or expert output at layer {}, token position {} of sequence {}{} "
                                    "(--strict)",
                                    arch_, il, tok.meta.pos, tok.meta.seq,
                                    expert >= 0 ? fmt::format(", expert {}", expert) : std::string()));
        }
        ++L.nonfinite_drops;
        ++stats_.nonfinite_drops;
        if (D) {
            ++D->nonfinite_drops;
        }
    }

    // The trace's candidates (rank_candidates), logits alongside.
    void trace_row(int li, size_t token, const LayerCapture & c, int64_t r, const std::vector<int32_t> & chosen) {
        const int E = n_expert_;
        const float * sel = c.selection.data() + r * E;
        const float * z = c.logits.data() + r * E;
        order_.resize(size_t(E));
        for (int e = 0; e < E; ++e) {
            order_[size_t(e)] = e;
        }
        is_chosen_.assign(size_t(E), 0);
        for (int32_t e : chosen) {
            is_chosen_[size_t(e)] = 1;
        }
        rank_candidates(order_, size_t(E), size_t(trace_m_), is_chosen_, sel);
        const size_t base = (token * moe_layers_.size() + size_t(li)) * size_t(trace_m_);
        for (int m = 0; m < trace_m_; ++m) {
            trace_ids_[base + size_t(m)] = uint16_t(order_[size_t(m)]);
            trace_logits_[base + size_t(m)] = z[order_[size_t(m)]];
        }
    }

    const CollectOptions & opt_;
    ImatrixAccumulator * imatrix_;
    std::string arch_;
    std::vector<int> moe_layers_;
    std::map<int, int> ordinal_;
    int n_expert_, n_expert_used_, n_embd_;
    std::string down_node_;
    const std::vector<std::string> & domains_;
    SaliencyStats & stats_;
    std::vector<LayerCapture> capture_;
    std::vector<size_t> done_tokens_;
    std::vector<TokenInfo> batch_;
    std::vector<uint16_t> trace_ids_;
    std::vector<float> trace_logits_;
    std::vector<std::vector<uint64_t>> trace_count_;
    std::vector<uint64_t> prob_drops_;
    std::vector<int32_t> order_;
    std::vector<char> is_chosen_;
    std::vector<uint8_t> raw_;
    int trace_m_ = 0;
    uint64_t head_stops_ = 0;
    bool runs_mtp_ = false, in_mtp_graph_ = false;
    std::vector<char> routed_this_graph_;  // per MoE layer, until the graph's result_norm
    uint64_t repeat_routings_ = 0;
    Gating gating_ = Gating::Unknown;
};

} // namespace

namespace {

// A window of one document: what llama_decode sees from a clean context.
// A window of a document: its rows, and for a document with media the prompt libmtmd made
// (a media row holds LLAMA_TOKEN_NULL; a document with media is one window).
struct Window {
    size_t doc = 0;
    std::vector<llama_token> tokens;
    std::shared_ptr<const MediaPrompt> media;
};

// Which expert-output node is f before gating: the last of down, its per-expert scale,
// its bias, as build_moe_ffn applies them.
std::string down_node_of(const GgufModel & model, int layer) {
    bool scale = false, bias = false;
    const std::string prefix = fmt::format("blk.{}.ffn_down_exps.", layer);
    for (const TensorEntry & t : model.tensors()) {
        scale = scale || t.name == prefix + "scale";
        bias = bias || t.name == prefix + "bias";
    }
    return bias ? "ffn_moe_down_biased" : scale ? "ffn_moe_down_scaled" : "ffn_moe_down";
}

// The settings that change what is counted: a resumed run must use the same.
json result_settings(const CollectOptions & o) {
    return {{"ctx", o.ctx},           {"parse_special", o.parse_special}, {"generate", o.generate},
            {"seed", o.seed},         {"trace", !o.trace.empty()},         {"trace_top", o.trace_top},
            {"trace_tokens", o.trace_tokens}, {"chunks", o.chunks},        {"coact", o.coact},
            {"mtp", o.mtp},           {"mmproj", o.mmproj.empty() ? json() : json(o.mmproj.string())}};
}

struct Invariant {
    std::string name;
    bool ok;
    std::string detail;
};

} // namespace

fs::path collect_checkpoint_path(const fs::path & output) {
    fs::path p = output;
    p += ".checkpoint";
    return p;
}

namespace {

void check_collect_options(const CollectOptions & opt) {
    if (opt.ctx < 8 || opt.batch < 1 || opt.ubatch < 1 || opt.trace_top < 1) {
        throw Error("-c must be at least 8, -b, -ub and --trace-top at least 1");
    }
    if (opt.threads < 0 || opt.gpu_layers < 0 || opt.chunks == 0 || opt.chunks < -1 || opt.save_every < 0) {
        throw Error("-t, -ngl and --save-every must be >= 0, --chunks >= 1 (or -1 for all)");
    }
    if (opt.generate < 0 || opt.generate >= opt.ctx / 2) {
        throw Error(fmt::format("--generate {} must be below half the context ({})", opt.generate, opt.ctx));
    }
    if (opt.resume && opt.save_every <= 0) {
        throw Error("--resume continues from the checkpoints of --save-every N: give it too");
    }
    if (!opt.imatrix.empty() && opt.save_every > 0) {
        throw Error(
            "--imatrix is gathered in one uninterrupted run: checkpoints (--save-every, --resume) do not hold it");
    }
}

// The model's routed layers, refused before llama.cpp loads it when collect cannot run.
InspectReport inspect_for_collect(const CollectOptions & opt, const GgufModel & gguf) {
    InspectReport info = inspect_model(gguf, {});
    if (!info.problems.empty()) {
        fail_file(opt.model.string(), "is inconsistent: " + fmt::format("{}", fmt::join(info.problems, "; ")));
    }
    if (info.routed_layers().empty()) {
        fail_file(opt.model.string(),
                  "has routed experts only in MTP (nextn) layers, which a forward pass does not run");
    }
    if (!opt.trace.empty() && opt.trace_top < info.n_expert_used) {
        throw Error(fmt::format("--trace-top {} is below the {} experts the model uses per token", opt.trace_top,
                                info.n_expert_used));
    }
    return info;
}

// The layers collect records: the trunk's routed ones, then the MTP head's unless --no-mtp.
std::vector<int> collected_layers(const CollectOptions & opt, const InspectReport & info) {
    std::vector<int> layers = info.routed_layers();
    if (opt.mtp) {
        const std::vector<int> mtp = info.mtp_layers();
        layers.insert(layers.end(), mtp.begin(), mtp.end());
    }
    return layers;
}

// A document with media, as libmtmd tokenizes it: one window, which must fit.
Window media_window(const CollectOptions & opt, const MediaEncoder & media, const std::string & text,
                    const CorpusDocument & doc, size_t d, const std::string & where) {
    // Rendered for generation, the conversation stops at its last user turn: its media
    // are the first ones, as many as the text holds markers.
    std::vector<CorpusMedia> parts = media_of(doc.messages);
    size_t markers = 0;
    for (size_t at = text.find(kMediaMarker); at != std::string::npos; at = text.find(kMediaMarker, at + 1)) {
        ++markers;
    }
    parts.resize(std::min(parts.size(), markers));
    auto prompt = std::make_shared<MediaPrompt>(media.tokenize(text, parts, opt.parse_special, where));
    const size_t window = size_t(opt.ctx - opt.generate);
    if (prompt->tokens.size() > window) {
        fail_file(where, fmt::format("takes {} rows with its media, more than a window of {} (-c {} less --generate {}); "
                                     "a document with media is not split: raise -c",
                                     prompt->tokens.size(), window, opt.ctx, opt.generate));
    }
    return {d, prompt->tokens, std::move(prompt)};
}

// Windows of every document, in corpus order, the first --chunks of them; `total` counts
// them all.
std::vector<Window> corpus_windows(const CollectOptions & opt, const Corpus & corpus, const llama_model * model,
                                   const MediaEncoder * media, size_t & total) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<Window> windows;
    const size_t window = size_t(opt.ctx - opt.generate);
    for (size_t d = 0; d < corpus.documents.size(); ++d) {
        const CorpusDocument & doc = corpus.documents[d];
        const std::string where = doc.line ? fmt::format("{}:{}", opt.corpus.string(), doc.line) : opt.corpus.string();
        const std::string text = document_text(model, doc, opt.generate > 0, where);
        const std::vector<CorpusMedia> doc_media = media_of(doc.messages);
        if (!doc_media.empty()) {
            if (!media) {
                const CorpusMedia & first = doc_media.front();
                fail_file(where, fmt::format("has an {} ({}), but no projector was given to encode it (--mmproj FILE)",
                                             modality_name(first.modality), first.path.string()));
            }
            windows.push_back(media_window(opt, *media, text, doc, d, where));
            continue;
        }
        const std::vector<llama_token> toks = tokenize(vocab, text, opt.parse_special, where);
        for (size_t i = 0; i < toks.size(); i += window) {
            windows.push_back({d, std::vector<llama_token>(toks.begin() + long(i),
                                                           toks.begin() + long(std::min(toks.size(), i + window))),
                               nullptr});
        }
    }
    total = windows.size();
    if (opt.chunks >= 0 && size_t(opt.chunks) < windows.size()) {
        std::fprintf(stderr, "moeprune collect: --chunks %lld: evaluating %lld of the corpus' %zu windows\n",
                     (long long)opt.chunks, (long long)opt.chunks, windows.size());
        windows.resize(size_t(opt.chunks));
    }
    return windows;
}

SaliencyStats empty_stats(const CollectOptions & opt, const GgufModel & gguf, const InspectReport & info,
                          const Corpus & corpus) {
    const std::vector<int> moe_layers = collected_layers(opt, info);
    SaliencyStats stats = SaliencyStats::empty(int64_t(moe_layers.size()), info.n_expert, info.n_expert_used);
    stats.model = {{"digest", model_digest(gguf.shard_paths())},
                   {"arch", info.arch},         {"name", info.name},           {"file_bytes", info.file_bytes},
                   {"n_expert", info.n_expert}, {"n_expert_used", info.n_expert_used}, {"moe_layers", moe_layers},
                   {"expert_group_count", std::max<int64_t>(1, info.expert_group_count)}};
    if (opt.mtp && !info.mtp_layers().empty()) {
        stats.model["mtp_layers"] = info.mtp_layers();
    }
    for (const std::string & d : corpus.domains) {
        stats.domains[d] = {0, std::vector<LayerStats>(moe_layers.size(), LayerStats(size_t(info.n_expert)))};
    }
    if (opt.coact) {
        for (LayerStats & L : stats.layers) {
            L.coact.assign(size_t(info.n_expert) * size_t(info.n_expert - 1) / 2, 0);
        }
    }
    return stats;
}

// The trace, growing under `partial`; continued from `resume_at` when resuming.
std::unique_ptr<TraceWriter> open_trace(const CollectOptions & opt, const InspectReport & info, const Corpus & corpus,
                                        const json & model, const json & settings, int top_m, const fs::path & partial,
                                        const std::optional<TraceResumePoint> & resume_at) {
    const std::vector<int> moe_layers = collected_layers(opt, info);
    TraceHeader h;
    h.n_layer = uint32_t(moe_layers.size());
    h.n_expert = uint32_t(info.n_expert);
    h.top_m = uint32_t(top_m);
    h.domains = {""};
    h.domains.insert(h.domains.end(), corpus.domains.begin(), corpus.domains.end());
    h.meta = {{"n_expert_used", info.n_expert_used}, {"moe_layers", moe_layers}, {"model", model},
              {"corpus", opt.corpus.string()},          {"settings", settings}};
    if (model.contains("mtp_layers")) {
        h.meta["mtp_layers"] = model["mtp_layers"];
    }
    return resume_at ? std::make_unique<TraceWriter>(partial, h, *resume_at) : std::make_unique<TraceWriter>(partial, h);
}

// A context whose graph callback is the collector.
ContextPtr collect_context(const CollectOptions & opt, llama_model * model, int threads, Collector & collector) {
    return new_context(model, {opt.ctx, opt.batch, std::min(opt.ubatch, opt.batch), threads, &Collector::callback,
                               &collector});
}

// Where a resumed run continues: what its checkpoint had counted.
struct ResumePoint {
    size_t first_window = 0;
    std::optional<TraceResumePoint> trace_from;
    std::vector<std::vector<uint64_t>> trace_count;
    std::vector<uint64_t> prob_drops;
};

// Reads the checkpoint into `stats` and `res` after checking it is this run's.
ResumePoint resume_from_checkpoint(const CollectOptions & opt, const Corpus & corpus, const json & settings,
                                   const fs::path & trace_partial, SaliencyStats & stats, CollectResult & res) {
    ResumePoint at;
    const fs::path checkpoint_path = collect_checkpoint_path(opt.output);
    std::error_code ec;
    if (!fs::exists(checkpoint_path, ec)) {
        if (fs::exists(opt.output, ec)) {
            fail_file(opt.output.string(),
                      "is a finished run: nothing to resume (no checkpoint " + checkpoint_path.string() + ")");
        }
        fail_file(checkpoint_path.string(), "no such checkpoint to resume from (written by --save-every)");
    }
    const SaliencyStats saved = read_stats(checkpoint_path);
    const json & prog = saved.settings.value("progress", json());
    const std::string origin = checkpoint_path.string();
    if (!prog.is_object() || prog.value("complete", true)) {
        fail_file(origin, "is not a collect checkpoint (settings.progress with \"complete\": false)");
    }
    if (saved.model != stats.model) {
        // The same model, with or without its MTP head's layers.
        const auto trunk_of = [](json m) {
            const json mtp = m.value("mtp_layers", json::array());
            if (m.contains("moe_layers") && m["moe_layers"].is_array()) {
                json trunk = json::array();
                for (const json & l : m["moe_layers"]) {
                    if (std::find(mtp.begin(), mtp.end(), l) == mtp.end()) {
                        trunk.push_back(l);
                    }
                }
                m["moe_layers"] = trunk;
            }
            m.erase("mtp_layers");
            return m;
        };
        if (trunk_of(saved.model) == trunk_of(stats.model)) {
            const bool had_mtp = saved.model.contains("mtp_layers");
            fail_file(origin, fmt::format("was collected {} the MTP head's layers: resume {} --no-mtp, as it was started",
                                          had_mtp ? "with" : "without", had_mtp ? "without" : "with"));
        }
        fail_file(origin, "was collected on another model: " + saved.model.dump());
    }
    if (saved.settings.value("corpus_digest", "") != corpus.digest) {
        fail_file(origin, "was collected on another corpus (its digest differs from " + opt.corpus.string() + ")");
    }
    if (saved.settings.value("result_settings", json()) != settings) {
        fail_file(origin, "was collected with other settings: " +
                              saved.settings.value("result_settings", json()).dump() + " vs " + settings.dump());
    }
    stats.layers = saved.layers;
    stats.domains = saved.domains;
    stats.n_tokens = saved.n_tokens;
    stats.nonfinite_drops = saved.nonfinite_drops;
    at.first_window = prog.at("windows").get<size_t>();
    res.traced_tokens = prog.value("traced_tokens", uint64_t(0));
    at.prob_drops = prog.at("prob_drops").get<std::vector<uint64_t>>();
    if (!opt.trace.empty()) {
        // Killed between naming the trace and writing the final statistics.
        std::error_code ec;
        if (!fs::exists(trace_partial) && fs::exists(opt.trace)) {
            fs::rename(opt.trace, trace_partial, ec);
            if (ec) {
                fail_file(opt.trace.string(), "cannot take it back to resume: " + ec.message());
            }
        }
        at.trace_from = TraceResumePoint{prog.at("trace_bytes").get<uint64_t>(), res.traced_tokens};
        at.trace_count = prog.at("trace_count").get<std::vector<std::vector<uint64_t>>>();
    }
    return at;
}

// The forward passes over the windows, with what the statistics' settings record.
class CollectPass {
public:
    CollectPass(const CollectOptions & opt, const Corpus & corpus, llama_context * ctx, MtpHead * mtp,
                const MediaEncoder * media, Collector & collector, TraceWriter * trace, CollectResult & res, json settings,
                size_t total_windows, int threads)
        : opt(opt), corpus(corpus), ctx(ctx), mtp(mtp), media(media), vocab(llama_model_get_vocab(llama_get_model(ctx))),
          collector(collector), trace(trace), res(res), stats(res.stats), settings(std::move(settings)),
          total_windows(total_windows), threads(threads) {}

    // Returns the seconds the passes took.
    double run(const std::vector<Window> & windows, size_t first_window) {
        uint64_t todo_tokens = 0;
        for (size_t w = first_window; w < windows.size(); ++w) {
            todo_tokens += windows[w].tokens.size() + size_t(opt.generate);
        }
        Progress progress("collect", todo_tokens, "tokens");
        progress_ = &progress;
        std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)> sampler(nullptr, llama_sampler_free);
        const auto started = std::chrono::steady_clock::now();
        for (size_t wi = first_window; wi < windows.size(); ++wi) {
            const Window & w = windows[wi];
            llama_memory_clear(llama_get_memory(ctx), true);
            if (mtp) {
                mtp->reset();
            }
            const int32_t pos = prefill(w);
            if (opt.generate > 0) {
                // Greedy, or sampled with a seed per window so a resumed run generates the same text.
                sampler.reset(opt.seed < 0 ? llama_sampler_init_greedy()
                                           : llama_sampler_init_dist(uint32_t(opt.seed + int64_t(wi))));
                for (int g = 0; g < opt.generate; ++g) {
                    const llama_token next = llama_sampler_sample(sampler.get(), ctx, -1);
                    if (llama_vocab_is_eog(vocab, next)) {
                        break;
                    }
                    decode({token_info(w, next, pos + g, TracePhase::Decode)});
                }
            }
            if (opt.save_every > 0 && (wi + 1) % size_t(opt.save_every) == 0 && wi + 1 < windows.size()) {
                checkpoint(wi + 1);
            }
        }
        progress.finish();
        progress_ = nullptr;
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }

    // The statistics' settings: the run, its result settings and how far it got.
    void describe(size_t windows_done, bool complete) {
        json prog = {{"windows", windows_done},
                     {"traced_tokens", res.traced_tokens},
                     {"prob_drops", collector.prob_drops()},
                     {"complete", complete}};
        if (trace) {
            trace->flush();
            prog["trace_bytes"] = trace->resume_point().bytes;
            prog["trace_count"] = collector.trace_count();
        }
        stats.settings = {{"model_file", opt.model.string()},
                          {"corpus", opt.corpus.string()},
                          {"corpus_digest", corpus.digest},
                          {"corpus_windows", total_windows},
                          {"trace", opt.trace.empty() ? json() : json(opt.trace.string())},
                          {"batch", opt.batch},
                          {"ubatch", opt.ubatch},
                          {"threads", threads},
                          {"gpu_layers", opt.gpu_layers},
                          {"rpc", opt.rpc},
                          {"result_settings", settings},
                          {"progress", prog},
                          {"tool", "moeprune collect"}};
    }

private:
    void checkpoint(size_t windows_done) {
        describe(windows_done, false);
        write_stats(collect_checkpoint_path(opt.output), stats);
    }

    // The window's prompt: text in batches of -b, each media span encoded and decoded
    // through the projector. Returns the next position.
    int32_t prefill(const Window & w) {
        const std::vector<MediaSpan> no_media;
        return walk_rows(
            w.media ? w.media->media : no_media, w.tokens.size(), size_t(opt.batch),
            [&](size_t first, size_t n, int32_t pos0) {
                std::vector<TokenInfo> infos;
                for (size_t i = 0; i < n; ++i) {
                    infos.push_back(token_info(w, w.tokens[first + i], pos0 + int32_t(i), TracePhase::Prefill));
                }
                decode(std::move(infos));
            },
            [&](const MediaSpan & span, int32_t pos0) { return decode_media(w, span, pos0); });
    }

    // A media span's rows, recorded under its modality's domain with no token id.
    int32_t decode_media(const Window & w, const MediaSpan & span, int32_t pos0) {
        size_t rows = 0;
        const auto before = [&](size_t first, size_t n) {
            std::vector<TokenInfo> infos;
            for (size_t r = first - span.offset; r < first - span.offset + n; ++r) {
                // Rows past the positions an M-RoPE image takes share its last one.
                infos.push_back(media_info(w, span.modality,
                                           pos0 + int32_t(std::min<size_t>(r, size_t(std::max(span.n_pos, 1) - 1)))));
            }
            rows = n;
            collector.begin_batch(std::move(infos));
        };
        const auto after = [&] { finish_batch(rows); };
        try {
            return media->decode(ctx, *w.media, span, pos0, opt.batch, before, after);
        } catch (const Error &) {
            collector.rethrow_failure();
            throw;
        }
    }

    void finish_batch(size_t n) {
        collector.rethrow_failure();
        collector.end_batch(trace);
        ++res.decodes;
        stats.n_tokens += n;
        res.tokens += n;
        progress_->advance(n);
    }

    void decode(std::vector<TokenInfo> infos) {
        llama_batch batch = llama_batch_init(int32_t(infos.size()), 0, 1);
        for (size_t i = 0; i < infos.size(); ++i) {
            batch.token[i] = infos[i].meta.token;
            batch.pos[i] = infos[i].meta.pos;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = true; // every row through the last layer
        }
        batch.n_tokens = int32_t(infos.size());
        const size_t n = infos.size();
        std::vector<llama_token> tokens(batch.token, batch.token + n);
        const int32_t pos0 = infos.front().meta.pos;
        collector.begin_batch(std::move(infos));
        const int rc = llama_decode(ctx, batch);
        llama_batch_free(batch);
        collector.rethrow_failure();
        if (rc != 0) {
            throw Error(fmt::format("llama_decode failed ({}) on a batch of {} tokens", rc, n));
        }
        if (mtp) {
            collector.in_mtp_graph(true);
            try {
                mtp->decode(tokens, pos0);
            } catch (const Error &) {
                collector.rethrow_failure();
                throw;
            }
            collector.in_mtp_graph(false);
            collector.rethrow_failure();
        }
        finish_batch(n);
    }

    TokenInfo token_info(const Window & w, llama_token tok, int32_t pos, TracePhase phase) {
        return row_info(w, corpus.documents[w.doc].domain, tok, pos, phase);
    }

    TokenInfo media_info(const Window & w, Modality modality, int32_t pos) {
        return row_info(w, modality_name(modality), LLAMA_TOKEN_NULL, pos, TracePhase::Prefill);
    }

    TokenInfo row_info(const Window & w, const std::string & domain, llama_token tok, int32_t pos, TracePhase phase) {
        const CorpusDocument & doc = corpus.documents[w.doc];
        TokenInfo t;
        t.meta.token = tok;
        t.meta.pos = pos;
        t.meta.seq = int32_t(doc.session ? *doc.session : int64_t(w.doc));
        t.meta.phase = phase;
        const auto it = std::find(corpus.domains.begin(), corpus.domains.end(), domain);
        t.domain = domain.empty() ? -1 : int(it - corpus.domains.begin());
        t.meta.domain = uint16_t(t.domain + 1);
        t.traced = trace && (opt.trace_tokens == 0 || res.traced_tokens < opt.trace_tokens);
        res.traced_tokens += t.traced;
        if (t.domain >= 0) {
            ++stats.domains[domain].n_tokens;
        }
        return t;
    }

    const CollectOptions & opt;
    const Corpus & corpus;
    llama_context * ctx;
    MtpHead * mtp;
    const MediaEncoder * media;
    const llama_vocab * vocab;
    Collector & collector;
    TraceWriter * trace;
    CollectResult & res;
    SaliencyStats & stats;
    const json settings;
    const size_t total_windows;
    const int threads;
    Progress * progress_ = nullptr;
};

// Invariants, recorded in the file and fatal when broken.
std::vector<Invariant> check_invariants(const SaliencyStats & stats, const InspectReport & info,
                                        const std::vector<int> & moe_layers, const Collector & collector,
                                        const fs::path & trace_partial, bool traced, const CollectResult & res) {
    std::vector<Invariant> inv;
    const uint64_t k = uint64_t(info.n_expert_used);
    for (size_t l = 0; l < stats.layers.size(); ++l) {
        uint64_t picks = 0;
        double prob = 0;
        for (size_t e = 0; e < size_t(info.n_expert); ++e) {
            picks += stats.layers[l].count[e];
            prob += stats.layers[l].prob_sum[e];
        }
        if (picks != stats.n_tokens * k) {
            inv.push_back({"count_sum", false, fmt::format("layer {}: sum of counts {} != tokens {} x k {}", moe_layers[l],
                                                           picks, stats.n_tokens, k)});
        }
        const Gating g = collector.gating();
        const uint64_t finite_tokens = stats.n_tokens - collector.prob_drops()[l];
        if ((g == Gating::Softmax || g == Gating::SoftmaxWeight) &&
            std::fabs(prob - double(finite_tokens)) > 1e-3 * double(std::max<uint64_t>(1, finite_tokens))) {
            inv.push_back({"prob_sum", false, fmt::format("layer {}: sum of router probabilities {} != tokens {}",
                                                          moe_layers[l], prob, finite_tokens)});
        }
    }
    if (traced) {
        const TraceReader reader = TraceReader::open(trace_partial);
        for (uint32_t l = 0; l < reader.header().n_layer; ++l) {
            std::vector<uint64_t> recount(static_cast<size_t>(info.n_expert), 0);
            reader.for_each_layer_chunk(l, [&](uint64_t, uint32_t n, const uint16_t * ids, const float *) {
                for (uint32_t t = 0; t < n; ++t) {
                    for (uint64_t j = 0; j < k; ++j) {
                        ++recount[ids[size_t(t) * reader.header().top_m + j]];
                    }
                }
            });
            if (recount != collector.trace_count()[l] || reader.n_tokens() != res.traced_tokens) {
                inv.push_back({"trace_counts", false,
                               fmt::format("layer {}: the trace's top-{} counts differ from the statistics over its {} "
                                           "tokens", moe_layers[l], k, res.traced_tokens)});
            }
        }
    }
    return inv;
}

// What the statistics record of how the run went: gating, the expert-output node,
// ignored second routings, the output head, timing and the invariants.
void record_run(SaliencyStats & stats, CollectResult & res, const Collector & collector, const std::string & down_node,
                double seconds, const std::vector<Invariant> & inv) {
    const bool ok = inv.empty();
    stats.settings["gating"] = gating_name(collector.gating());
    stats.settings["expert_output_node"] = down_node;
    // Second routings of a layer within one graph (grovemoe's adjugate experts) were not counted.
    stats.settings["repeated_routings_ignored"] = collector.repeat_routings();
    // This process's forward passes only: a resumed run times what it evaluated.
    // Skipped on every evaluation unless --generate samples from the logits.
    res.head_skipped = res.decodes > 0 && collector.head_stops() >= res.decodes;
    stats.settings["output_head"] = res.head_skipped ? "skipped" : "computed";
    stats.settings["timing"] = {{"tokens", res.tokens}, {"seconds", seconds},
                                {"tok_per_s", seconds > 0 ? double(res.tokens) / seconds : 0.0}};
    stats.settings["invariants"] = {{"ok", ok},
                                    {"checked", {"count_sum", "prob_sum (softmax gating)", "trace_counts"}},
                                    {"violations", json::array()}};
    for (const Invariant & i : inv) {
        stats.settings["invariants"]["violations"].push_back({{"name", i.name}, {"detail", i.detail}});
    }
}

} // namespace

namespace {

// Without checkpoints nothing can resume a failed run's trace: it goes with the failure.
struct PartialTrace {
    fs::path path;
    bool keep = false, committed = false;
    ~PartialTrace() {
        if (!committed && !keep && !path.empty()) {
            std::error_code ec;
            fs::remove(path, ec);
        }
    }
};

// Every output is written whole under a temporary name before any takes its final
// one, the statistics last: a failed write (disk full) leaves no finished trace or
// imatrix beside no statistics. Only a failed rename between the renames could.
// `trace_partial`: the closed trace to rename into place, or empty.
void commit_outputs(const CollectOptions & opt, SaliencyStats & stats, std::optional<ImatrixAccumulator> & imatrix,
                    const fs::path & trace_partial) {
    std::optional<AtomicOutput> imatrix_out;
    if (imatrix) {
        imatrix_out.emplace(opt.imatrix);
        imatrix->write(*imatrix_out, {opt.corpus.string()}, uint32_t(opt.ctx));
        stats.settings["imatrix"] = opt.imatrix.string();
    }
    AtomicOutput stats_out(opt.output);
    write_stats(stats_out, stats);
    if (imatrix_out) {
        imatrix_out->commit();
    }
    if (!trace_partial.empty()) {
        std::error_code ec;
        fs::rename(trace_partial, opt.trace, ec);
        if (ec) {
            fail_file(opt.trace.string(), "cannot rename " + trace_partial.string() + " into place: " + ec.message());
        }
    }
    stats_out.commit();
}

} // namespace

CollectResult collect(const CollectOptions & opt) {
    check_collect_options(opt);
    const GgufModel gguf = GgufModel::open(opt.model);
    std::vector<std::filesystem::path> inputs = gguf.shard_paths();
    inputs.push_back(opt.corpus);
    inputs.push_back(opt.mmproj);
    Corpus corpus = read_corpus(opt.corpus);
    for (const fs::path & m : media_paths(corpus)) {
        inputs.push_back(m);
    }
    refuse_output_clashes({opt.output, opt.trace, opt.imatrix, collect_checkpoint_path(opt.output)}, inputs);
    add_modality_domains(corpus);
    if (!opt.trace.empty() && corpus.domains.size() + 1 > kMaxTraceDomains) {
        fail_file(opt.corpus.string(), fmt::format("has {} domains; a trace stores domain ids in 16 bits and holds at most "
                                                   "{} besides \"no domain\"", corpus.domains.size(), kMaxTraceDomains - 1));
    }
    const InspectReport info = inspect_for_collect(opt, gguf);
    const std::vector<int> moe_layers = collected_layers(opt, info);
    const bool with_mtp = moe_layers.size() > info.routed_layers().size();

    if ((!opt.mmproj.empty() || multimodal_arch(info.arch)) && corpus.media_modalities.empty()) {
        std::fprintf(stderr,
                     "moeprune collect: WARNING: %s calibrates a multimodal model (%s) with no images or audio: experts "
                     "that only media route to will look dead in these statistics. Add image or audio parts to the "
                     "corpus (docs/formats.md) and give --mmproj.\n",
                     opt.corpus.c_str(),
                     opt.mmproj.empty() ? (info.arch + " is a vision-language architecture").c_str()
                                        : ("a projector was given, " + opt.mmproj.string()).c_str());
    }
    if (with_mtp && !corpus.media_modalities.empty()) {
        fail_file(opt.corpus.string(), "holds media, and the model's MTP head drafts from token ids, which media "
                                       "positions have none: give --no-mtp");
    }

    init_llama(opt.rpc);
    const ModelPtr model = load_model(opt.model, opt.gpu_layers, with_mtp);
    const int n_embd = llama_model_n_embd(model.get());
    const int threads = opt.threads > 0 ? opt.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    std::unique_ptr<MediaEncoder> media;
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, model.get(), threads, opt.gpu_layers > 0);
    }
    size_t total_windows = 0;
    const std::vector<Window> windows = corpus_windows(opt, corpus, model.get(), media.get(), total_windows);

    CollectResult res;
    SaliencyStats & stats = res.stats;
    stats = empty_stats(opt, gguf, info, corpus);
    const json settings = result_settings(opt);
    // The trace grows under TRACE.partial and takes its name only when the statistics are
    // complete, so a killed or failed run never leaves a trace that reads as whole.
    const fs::path trace_partial = opt.trace.empty() ? fs::path() : fs::path(opt.trace.string() + ".partial");
    // Checkpoints live under their own name: a reader that never looks at "complete"
    // cannot take one for finished statistics.
    const fs::path checkpoint_path = collect_checkpoint_path(opt.output);
    const ResumePoint resumed =
        opt.resume ? resume_from_checkpoint(opt, corpus, settings, trace_partial, stats, res) : ResumePoint{};

    const std::string down_node = down_node_of(gguf, moe_layers.front());
    std::optional<ImatrixAccumulator> imatrix;
    if (!opt.imatrix.empty()) {
        imatrix.emplace();
    }
    Collector collector(opt, info.arch, moe_layers, int(info.n_expert), int(info.n_expert_used), n_embd, down_node,
                        corpus.domains, stats, imatrix ? &*imatrix : nullptr);
    if (!resumed.trace_count.empty()) {
        collector.set_trace_count(resumed.trace_count);
    }
    if (!resumed.prob_drops.empty()) {
        collector.set_prob_drops(resumed.prob_drops);
    }
    PartialTrace trace_guard{trace_partial, opt.save_every > 0};
    const std::unique_ptr<TraceWriter> trace =
        opt.trace.empty() ? nullptr : open_trace(opt, info, corpus, stats.model, settings, collector.trace_m(),
                                                 trace_partial, resumed.trace_from);
    const ContextPtr ctx = collect_context(opt, model.get(), threads, collector);
    std::unique_ptr<MtpHead> mtp;
    if (with_mtp) {
        collector.runs_mtp();
        mtp = std::make_unique<MtpHead>(model.get(), ctx.get(),
                                        ContextSettings{opt.ctx, opt.batch, std::min(opt.ubatch, opt.batch), threads,
                                                        &Collector::callback, &collector});
    }

    CollectPass pass(opt, corpus, ctx.get(), mtp.get(), media.get(), collector, trace.get(), res, settings, total_windows,
                     threads);
    const double seconds = pass.run(windows, resumed.first_window);
    res.windows = windows.size();
    if (trace) {
        trace->close();
    }
    const std::vector<Invariant> inv =
        check_invariants(stats, info, moe_layers, collector, trace_partial, trace != nullptr, res);
    const bool ok = inv.empty();
    pass.describe(windows.size(), true);
    record_run(stats, res, collector, down_node, seconds, inv);
    if (!ok) {
        std::filesystem::path bad = opt.output;
        bad += ".invalid";
        write_stats(bad, stats);
        throw Error(fmt::format("{} invariant(s) broken, statistics kept in {} for inspection: {}", inv.size(),
                                bad.string(), inv.front().detail));
    }
    commit_outputs(opt, stats, imatrix, trace ? trace_partial : fs::path());
    trace_guard.committed = true;
    std::error_code ec;
    fs::remove(checkpoint_path, ec);  // a leftover checkpoint only makes a later --resume refuse
    return res;
}

} // namespace moeprune
