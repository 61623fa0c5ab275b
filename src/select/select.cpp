#include "select/select.h"
#include "select/criteria/criteria.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "engine/arch_quirks.h"
#include "formats/trace.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <set>

namespace moeprune {

using nlohmann::json;

std::vector<std::string> select_metrics() {
    std::vector<std::string> names;
    for (const Criterion & c : criteria()) {
        names.push_back(c.name);
    }
    return names;
}

namespace {

std::string gating_of(const SaliencyStats & s) { return s.settings.value("gating", std::string("softmax")); }

double sum(const std::vector<double> & v) { return std::accumulate(v.begin(), v.end(), 0.0); }

// Model layer index of stats layer l.
int model_layer(const SaliencyStats & s, size_t l) {
    if (s.model.contains("moe_layers") && s.model["moe_layers"].is_array() && s.model["moe_layers"].size() > l) {
        return s.model["moe_layers"][l].get<int>();
    }
    return int(l);
}

struct Retention {
    double count_share = 0, reap_share = 0, prob_share = 0;
    uint64_t min_kept_count = 0, kept_under_100 = 0, kept_rare = 0;
    json rare = json::array();  // kept experts with fewer than --rare-hits hits: [layer, expert, hits]
};

Retention retention(const LayerStats & L, const std::vector<int32_t> & kept, int layer, uint64_t rare_hits) {
    Retention r;
    double c = 0, rs = 0, p = 0;
    r.min_kept_count = UINT64_MAX;
    for (int32_t e : kept) {
        c += double(L.count[size_t(e)]);
        rs += L.reap_sum[size_t(e)];
        p += L.prob_sum[size_t(e)];
        r.min_kept_count = std::min(r.min_kept_count, L.count[size_t(e)]);
        r.kept_under_100 += L.count[size_t(e)] < 100;
        if (L.count[size_t(e)] < rare_hits) {
            ++r.kept_rare;
            r.rare.push_back({layer, e, L.count[size_t(e)]});
        }
    }
    const double ct = double(std::accumulate(L.count.begin(), L.count.end(), uint64_t(0)));
    r.count_share = ct > 0 ? c / ct : 0;
    r.reap_share = sum(L.reap_sum) > 0 ? rs / sum(L.reap_sum) : 0;
    r.prob_share = sum(L.prob_sum) > 0 ? p / sum(L.prob_sum) : 0;
    return r;
}

json retention_json(const Retention & r) {
    return {{"count_share", r.count_share},
            {"reap_share", r.reap_share},
            {"prob_share", r.prob_share},
            {"min_kept_count", r.min_kept_count},
            {"kept_under_100", r.kept_under_100},
            {"kept_rare", r.kept_rare},
            {"rare", r.rare}};
}

// Mean over layers of the per-layer shares; min and sums over layers.
Retention whole_model(const std::vector<Retention> & per_layer) {
    Retention w;
    w.min_kept_count = UINT64_MAX;
    for (const Retention & r : per_layer) {
        w.count_share += r.count_share / double(per_layer.size());
        w.reap_share += r.reap_share / double(per_layer.size());
        w.prob_share += r.prob_share / double(per_layer.size());
        w.min_kept_count = std::min(w.min_kept_count, r.min_kept_count);
        w.kept_under_100 += r.kept_under_100;
        w.kept_rare += r.kept_rare;
        w.rare.insert(w.rare.end(), r.rare.begin(), r.rare.end());
    }
    return w;
}

// REAP's super experts: largest activation above both the layer's 99.5th percentile
// and a tenth of the largest activation anywhere.
std::vector<std::vector<int32_t>> super_experts(const SaliencyStats & s) {
    double global = 0;
    for (const LayerStats & L : s.layers) {
        for (double m : L.max_act) {
            global = std::max(global, m);
        }
    }
    std::vector<std::vector<int32_t>> out(s.layers.size());
    for (size_t l = 0; l < s.layers.size(); ++l) {
        std::vector<double> v = s.layers[l].max_act;
        std::sort(v.begin(), v.end());
        const double pos = 0.995 * double(v.size() - 1);
        const size_t lo = size_t(std::floor(pos));
        const double p995 = v[lo] + (pos - double(lo)) * (v[std::min(lo + 1, v.size() - 1)] - v[lo]);
        const double threshold = std::max(p995, global / 10.0);
        for (size_t e = 0; e < s.layers[l].n_expert(); ++e) {
            if (s.layers[l].max_act[e] > threshold) {
                out[l].push_back(int32_t(e));
            }
        }
    }
    return out;
}

} // namespace

std::vector<double> criterion_scores(const SaliencyStats & s, size_t layer, const std::string & metric,
                                     const SelectOptions & opt) {
    return criterion(metric).scores({s, layer, s.layers[layer], opt});
}

void validate_stats_for_selection(const SaliencyStats & s, const std::string & origin, const std::vector<int64_t> & ks) {
    const auto refuse = [&](const std::string & check, const std::string & detail) {
        fail_file(origin, fmt::format("fails the {} check: {}", check, detail));
    };
    if (is_checkpoint(s)) {
        refuse("complete", "it is a checkpoint of an unfinished collect (resume it with --resume)");
    }
    if (s.settings.contains("invariants") && !s.settings["invariants"].value("ok", true)) {
        refuse("invariants", "collect recorded broken invariants: " + s.settings["invariants"].dump());
    }
    if (s.n_tokens == 0) {
        refuse("tokens", "it covers no tokens");
    }
    if (int64_t(s.layers.size()) != s.n_layer || s.n_layer == 0) {
        refuse("layers", fmt::format("{} layers present, n_layer says {}", s.layers.size(), s.n_layer));
    }
    const std::string gating = gating_of(s);
    for (size_t l = 0; l < s.layers.size(); ++l) {
        const LayerStats & L = s.layers[l];
        const uint64_t picks = std::accumulate(L.count.begin(), L.count.end(), uint64_t(0));
        if (picks != s.n_tokens * uint64_t(s.n_expert_used)) {
            refuse("count sum", fmt::format("layer {}: counts sum to {}, expected n_tokens {} x n_expert_used {} = {}",
                                            model_layer(s, l), picks, s.n_tokens, s.n_expert_used,
                                            s.n_tokens * uint64_t(s.n_expert_used)));
        }
        if (gating == "softmax" || gating == "softmax-over-selected") {
            const double p = sum(L.prob_sum);
            const double expect = double(s.n_tokens);
            if (std::fabs(p - expect) > 1e-3 * expect) {
                refuse("probability sum", fmt::format("layer {}: router probabilities sum to {}, expected about {} ({} gating)",
                                                      model_layer(s, l), p, expect, gating));
            }
        }
        for (size_t e = 0; e < L.n_expert(); ++e) {
            if (L.reap_sum[e] < 0 || L.prob_sum[e] < 0 || L.ean_sum[e] < 0 || L.reap_sq_sum[e] < 0) {
                refuse("sign", fmt::format("layer {} expert {}: a sum is negative", model_layer(s, l), e));
            }
            if (L.count[e] == 0 && (L.reap_sum[e] != 0 || L.ean_sum[e] != 0)) {
                refuse("consistency", fmt::format("layer {} expert {}: no hits but REAP/EAN mass", model_layer(s, l), e));
            }
        }
    }
    const int64_t groups = s.model.value("expert_group_count", int64_t(1));
    for (int64_t k : ks) {
        if (k < s.n_expert_used || k > s.n_expert) {
            // The flag is wrong, not the file: say so first.
            throw Error(fmt::format("-k {}: the experts kept per layer are between the {} each token uses and the {} "
                                    "of the model {} was collected on", k, s.n_expert_used, s.n_expert, origin));
        }
        if (groups > 1 && k % groups != 0) {
            refuse("expert groups", fmt::format("K = {} does not split evenly over {} expert groups", k, groups));
        }
    }
}

std::vector<int32_t> select_layer(const LayerStats & L, const std::vector<double> & score, int64_t k,
                                  const std::vector<int32_t> & forced, int64_t n_groups) {
    const int64_t n = int64_t(L.n_expert());
    const int64_t groups = std::max<int64_t>(1, n_groups);
    const int64_t per_group = n / groups, keep_per_group = k / groups;
    std::vector<char> is_forced(static_cast<size_t>(n), 0);
    for (int32_t e : forced) {
        is_forced[size_t(e)] = 1;
    }
    const auto before = [&](int32_t a, int32_t b) {
        if (is_forced[size_t(a)] != is_forced[size_t(b)]) {
            return is_forced[size_t(a)] > is_forced[size_t(b)];
        }
        const bool ha = L.count[size_t(a)] > 0, hb = L.count[size_t(b)] > 0;
        if (ha != hb) {
            return ha;  // an expert never routed to is dropped while K allows it, whatever the criterion says
        }
        if (score[size_t(a)] != score[size_t(b)]) {
            return score[size_t(a)] > score[size_t(b)];
        }
        if (L.prob_sum[size_t(a)] != L.prob_sum[size_t(b)]) {
            return L.prob_sum[size_t(a)] > L.prob_sum[size_t(b)];
        }
        if (L.count[size_t(a)] != L.count[size_t(b)]) {
            return L.count[size_t(a)] > L.count[size_t(b)];
        }
        return a < b;
    };
    std::vector<int32_t> kept;
    for (int64_t g = 0; g < groups; ++g) {
        std::vector<int32_t> ids(static_cast<size_t>(per_group));
        std::iota(ids.begin(), ids.end(), int32_t(g * per_group));
        std::sort(ids.begin(), ids.end(), before);
        const int64_t forced_here = std::count_if(ids.begin(), ids.end(), [&](int32_t e) { return is_forced[size_t(e)]; });
        if (forced_here > keep_per_group) {
            throw Error(fmt::format("{} protected super experts in group {} do not fit in its {} slots", forced_here, g,
                                    keep_per_group));
        }
        kept.insert(kept.end(), ids.begin(), ids.begin() + keep_per_group);
    }
    std::sort(kept.begin(), kept.end());
    return kept;
}

SubstitutionScreen substitution_screen(const std::filesystem::path & trace_path, const KeepMap & km, int k,
                                       int max_examples) {
    const TraceReader reader = TraceReader::open(trace_path);
    const TraceHeader & h = reader.header();
    if (h.n_layer != km.layers.size()) {
        fail_file(trace_path.string(), fmt::format("has {} MoE layers, the keep map {}", h.n_layer, km.layers.size()));
    }
    if (uint32_t(k) > h.top_m) {
        fail_file(trace_path.string(), fmt::format("holds the top {} candidates, fewer than k = {}", h.top_m, k));
    }
    SubstitutionScreen sc;
    uint32_t l = 0;
    for (const auto & entry : km.layers) {
        const int layer = entry.first;  // a plain variable: lambdas below capture it
        const std::vector<int32_t> & ids = entry.second;
        std::vector<char> kept(h.n_expert, 0);
        for (int32_t e : ids) {
            if (uint32_t(e) >= h.n_expert) {
                fail_file(trace_path.string(), fmt::format("has {} experts; the keep map names expert {}", h.n_expert, e));
            }
            kept[size_t(e)] = 1;
        }
        const uint64_t slots_before = sc.slots, replaced_before = sc.replaced, token_layers_before = sc.token_layers;
        const double moved_before = sc.moved_mass;
        reader.for_each_layer_chunk(l, [&](uint64_t first, uint32_t n, const uint16_t * cand, const float * z) {
            for (uint32_t t = 0; t < n; ++t) {
                const uint16_t * c = cand + size_t(t) * h.top_m;
                const float * zt = z + size_t(t) * h.top_m;
                double all = 0, moved = 0;
                int lost = 0;
                for (int j = 0; j < k; ++j) {
                    const double w = std::exp(double(zt[j]) - double(zt[0]));
                    all += w;
                    if (!kept[c[j]]) {
                        moved += w;
                        ++lost;
                    }
                }
                int survivors_in_top_k = k - lost, filled = survivors_in_top_k;
                for (uint32_t m = uint32_t(k); m < h.top_m && filled < k; ++m) {
                    if (kept[c[m]]) {
                        ++filled;
                        ++sc.substitutes;
                        sc.substitute_rank += double(m);
                    }
                }
                ++sc.token_layers;
                sc.slots += uint64_t(k);
                sc.replaced += uint64_t(lost);
                sc.moved_mass += moved / all;
                if (filled < k) {
                    ++sc.ran_out;
                    if (int(sc.ran_out_examples.size()) < max_examples) {
                        sc.ran_out_examples.push_back({{"token", first + t}, {"layer", layer}, {"survivors", filled}});
                    }
                }
            }
        });
        const uint64_t slots = sc.slots - slots_before, token_layers = sc.token_layers - token_layers_before;
        sc.layers.push_back({{"layer", layer},
                             {"replaced_share", slots ? double(sc.replaced - replaced_before) / double(slots) : 0.0},
                             {"moved_mass", token_layers ? (sc.moved_mass - moved_before) / double(token_layers) : 0.0}});
        ++l;
    }
    return sc;
}

namespace {

void check_select_options(const SelectOptions & opt, const std::vector<std::filesystem::path> & outputs) {
    if (opt.ks.empty() || opt.metrics.empty()) {
        throw Error("give -k and --metric");
    }
    if (!std::isfinite(opt.lcb_z) || opt.lcb_z < 0 || opt.lcb_z > 10) {
        throw Error(fmt::format("--lcb-z must be a number from 0 to 10, got {}", opt.lcb_z));
    }
    if (!std::isfinite(opt.lcb_prior) || opt.lcb_prior < 0) {
        throw Error(fmt::format("--lcb-prior must be a finite number >= 0, got {}", opt.lcb_prior));
    }
    if (opt.rare_hits < 1) {
        throw Error(fmt::format("--rare-hits must be at least 1, got {}", opt.rare_hits));
    }
    std::vector<std::filesystem::path> all_outputs = outputs;
    if (!opt.out_dir.empty()) {
        for (const std::string & metric : opt.metrics) {
            for (int64_t k : opt.ks) {
                all_outputs.push_back(opt.out_dir / keep_map_file_name(metric, k));
            }
        }
    }
    refuse_output_clashes(all_outputs, {opt.stats, opt.heldout, opt.trace});
    for (const std::string & m : opt.metrics) {
        criterion(m);
    }
    for (const std::string & m : opt.hybrid_of) {
        per_expert_criterion(m, "--hybrid-of");
    }
    per_expert_criterion(opt.domain_metric, "--domain-metric");
}

struct SelectInputs {
    SaliencyStats stats;
    std::optional<SaliencyStats> held;
    int64_t groups = 1;
    std::vector<std::vector<int32_t>> supers;   // per stats layer: kept in every map
    std::vector<int64_t> ks;                    // ascending, distinct
    // Per media modality the stats record ("image", "audio"), per stats layer: the experts
    // that take most of their hits from that modality's positions.
    std::map<std::string, std::vector<std::vector<int32_t>>> media_experts;
};

std::map<std::string, std::vector<std::vector<int32_t>>> media_experts_of(const SaliencyStats & s,
                                                                          const std::string & origin) {
    std::map<std::string, std::vector<std::vector<int32_t>>> out;
    for (const char * modality : {"image", "audio"}) {
        const auto d = s.domains.find(modality);
        if (d == s.domains.end()) {
            continue;
        }
        // Per position, not per hit: media can be most of a corpus' positions (a 30-second
        // clip is 750 rows), and then every expert they touch takes most of its hits there.
        // An expert is the modality's when its positions choose it at least 9 times as
        // often as the other positions do.
        // A modality's rows and hits are part of the whole; more would make the rates negative.
        if (d->second.n_tokens > s.n_tokens) {
            fail_file(origin, fmt::format("domain {} holds {} tokens, more than the {} of the whole", modality,
                                          d->second.n_tokens, s.n_tokens));
        }
        const double rows = double(d->second.n_tokens), other_rows = double(s.n_tokens) - rows;
        auto & layers = out[modality];
        for (size_t l = 0; l < s.layers.size(); ++l) {
            layers.emplace_back();
            for (size_t e = 0; e < size_t(s.n_expert); ++e) {
                if (d->second.layers[l].count[e] > s.layers[l].count[e]) {
                    fail_file(origin, fmt::format("domain {} gives expert {} of layer {} more hits than the whole", modality,
                                                  e, l));
                }
                const double hits = double(d->second.layers[l].count[e]);
                const double rate = rows > 0 ? hits / rows : 0;
                const double other_rate = other_rows > 0 ? (double(s.layers[l].count[e]) - hits) / other_rows : 0;
                if (rate > 0 && rate >= 9 * other_rate) {
                    layers.back().push_back(int32_t(e));
                }
            }
        }
    }
    return out;
}

// A model that takes media calibrated with none: the experts only media route to look
// dead and go first. Names the experts with no hit, among which they are.
std::string missing_media_warning(const SelectOptions & opt, const SaliencyStats & s) {
    const json & rs = s.settings.contains("result_settings") ? s.settings["result_settings"] : json::object();
    const bool projector = rs.is_object() && rs.contains("mmproj") && rs["mmproj"].is_string();
    const std::string arch = s.model.contains("arch") && s.model["arch"].is_string() ? s.model["arch"].get<std::string>() : "";
    if (s.domains.count("image") || s.domains.count("audio") || (!projector && !arch_quirks(arch).vision_language)) {
        return "";
    }
    size_t n = 0;
    std::string which;
    for (size_t l = 0; l < s.layers.size(); ++l) {
        for (size_t e = 0; e < size_t(s.n_expert); ++e) {
            if (s.layers[l].count[e] == 0 && n++ < 12) {
                which += fmt::format("{}blk.{} e{}", n > 1 ? ", " : "", model_layer(s, l), e);
            }
        }
    }
    return fmt::format("WARNING: {} calibrates a multimodal model ({}) with no images or audio: experts that only media "
                       "route to look dead here and are pruned first, so these keep maps must not be used or judged on "
                       "media. {} experts have no hit at all{}{}. Calibrate with media (collect --mmproj, a corpus with "
                       "image or audio parts) and protect them with domain-max or domain-mix.",
                       opt.stats.string(),
                       projector ? "collect was given the projector " + rs["mmproj"].get<std::string>()
                                 : arch + " is a vision-language architecture",
                       n, n ? ": " : "", which + (n > 12 ? fmt::format(" and {} more", n - 12) : ""));
}

SelectInputs read_select_inputs(const SelectOptions & opt) {
    SelectInputs in;
    in.stats = read_stats(opt.stats);
    const SaliencyStats & s = in.stats;
    validate_stats_for_selection(s, opt.stats.string(), opt.ks);
    if (!opt.heldout.empty()) {
        in.held = read_stats(opt.heldout);
        validate_stats_for_selection(*in.held, opt.heldout.string(), opt.ks);
        if (in.held->n_layer != s.n_layer || in.held->n_expert != s.n_expert || in.held->model != s.model) {
            fail_file(opt.heldout.string(), "describes another model than " + opt.stats.string());
        }
    }
    if (!opt.trace.empty()) {
        // Checked before any keep map is written: a trace of another model or of nothing
        // would make every map's screen read as perfect or index out of range.
        const TraceReader trace = TraceReader::open(opt.trace);
        const TraceHeader & h = trace.header();
        if (int64_t(h.n_expert) != s.n_expert || int64_t(h.n_layer) != s.n_layer) {
            fail_file(opt.trace.string(), fmt::format("records {} layers x {} experts, but {} describes {} x {}: another "
                                                      "model", h.n_layer, h.n_expert, opt.stats.string(), s.n_layer,
                                                      s.n_expert));
        }
        if (trace.n_tokens() == 0) {
            fail_file(opt.trace.string(), "holds no tokens: there is nothing to screen the keep maps with");
        }
    }
    in.groups = s.model.value("expert_group_count", int64_t(1));
    in.supers = opt.protect_super ? super_experts(s) : std::vector<std::vector<int32_t>>(s.layers.size());
    in.ks = opt.ks;
    std::sort(in.ks.begin(), in.ks.end());
    in.ks.erase(std::unique(in.ks.begin(), in.ks.end()), in.ks.end());
    in.media_experts = media_experts_of(s, opt.stats.string());
    return in;
}

std::string table_header(const SelectOptions & opt, const SelectInputs & in) {
    const SaliencyStats & s = in.stats;
    const bool held = in.held.has_value();
    return fmt::format("{} layers x {} experts (top-{}), {} tokens{}\n", s.n_layer, s.n_expert, s.n_expert_used,
                       s.n_tokens, held ? fmt::format("; held out: {} tokens", in.held->n_tokens) : "") +
           fmt::format("{:<11} {:>5} {:>8} {:>8} {:>8} {:>9} {:>6} {:>6}{}{}\n", "metric", "K", "count%", "reap%", "prob%",
                       "min hits", "<100", fmt::format("<{}", opt.rare_hits),
                       held ? fmt::format(" {:>9} {:>9}", "ho reap%", "ho prob%") : "",
                       opt.trace.empty() ? "" : fmt::format(" {:>9} {:>7} {:>8} {:>8}", "replaced%", "moved", "sub rank",
                                                            "ran out"));
}

// One criterion's map at one K, with its retention, screen, table row and the note on
// rarely routed experts it kept.
struct MapResult {
    KeepMap km;
    json result;
    std::string row, rare_note;
};

MapResult make_map(const SelectOptions & opt, const SelectInputs & in, const std::string & metric,
                   const std::vector<std::vector<double>> & scores, int64_t k) {
    const SaliencyStats & s = in.stats;
    const std::optional<SaliencyStats> & held = in.held;
    MapResult m;
    KeepMap & km = m.km;
    km.n_expert = s.n_expert;
    km.k = k;
    km.metric = metric;
    km.source = {{"stats", opt.stats.string()},
                 {"n_tokens", s.n_tokens},
                 {"model", s.model},
                 {"protect_super", opt.protect_super}};
    km.source.update(criterion(metric).settings(opt));
    std::vector<Retention> per_layer, held_layers;
    json layers = json::array();
    for (size_t l = 0; l < s.layers.size(); ++l) {
        const std::vector<int32_t> kept = select_layer(s.layers[l], scores[l], k, in.supers[l], in.groups);
        km.layers[model_layer(s, l)] = kept;
        per_layer.push_back(retention(s.layers[l], kept, model_layer(s, l), uint64_t(opt.rare_hits)));
        json jl = retention_json(per_layer.back());
        jl["layer"] = model_layer(s, l);
        if (held) {
            held_layers.push_back(retention(held->layers[l], kept, model_layer(s, l), uint64_t(opt.rare_hits)));
            jl["heldout"] = retention_json(held_layers.back());
        }
        layers.push_back(jl);
    }
    const Retention w = whole_model(per_layer);
    json r = {{"metric", metric}, {"k", k}, {"whole", retention_json(w)}, {"layers", layers}};
    for (const auto & [modality, per_layer_ids] : in.media_experts) {
        size_t all = 0, kept = 0;
        for (size_t l = 0; l < per_layer_ids.size(); ++l) {
            const std::vector<int32_t> & keep = km.layers.at(model_layer(s, l));
            for (int32_t e : per_layer_ids[l]) {
                ++all;
                kept += std::count(keep.begin(), keep.end(), e) > 0;
            }
        }
        r["media_experts_kept"][modality] = {{"kept", kept}, {"of", all}};
    }
    m.row = fmt::format("{:<11} {:>5} {:>8.2f} {:>8.2f} {:>8.2f} {:>9} {:>6} {:>6}", metric, k, 100 * w.count_share,
                        100 * w.reap_share, 100 * w.prob_share, w.min_kept_count, w.kept_under_100, w.kept_rare);
    if (held) {
        const Retention hw = whole_model(held_layers);
        r["whole"]["heldout"] = retention_json(hw);
        m.row += fmt::format(" {:>9.2f} {:>9.2f}", 100 * hw.reap_share, 100 * hw.prob_share);
    }
    if (!opt.trace.empty()) {
        const SubstitutionScreen sc = substitution_screen(opt.trace, km, int(s.n_expert_used), opt.trace_examples);
        const double replaced = sc.slots ? double(sc.replaced) / double(sc.slots) : 0;
        const double moved = sc.token_layers ? sc.moved_mass / double(sc.token_layers) : 0;
        const double rank = sc.substitutes ? sc.substitute_rank / double(sc.substitutes) : 0;
        r["screen"] = {{"token_layers", sc.token_layers},
                       {"replaced_share", replaced},
                       {"moved_mass", moved},
                       {"substitute_rank", rank},
                       {"ran_out", sc.ran_out},
                       {"ran_out_examples", sc.ran_out_examples},
                       {"layers", sc.layers}};
        m.row += fmt::format(" {:>9.2f} {:>7.4f} {:>8.2f} {:>8}", 100 * replaced, moved, rank, sc.ran_out);
    }
    if (w.kept_rare > 0) {
        std::string which;
        for (size_t i = 0; i < std::min<size_t>(w.rare.size(), 6); ++i) {
            which += fmt::format("{}blk.{} e{} ({} hits)", i ? ", " : "", w.rare[i][0].get<int>(),
                                 w.rare[i][1].get<int>(), w.rare[i][2].get<uint64_t>());
        }
        m.rare_note =
            fmt::format("  {} K={}: {} kept experts with fewer than {} hits: {}{}{}\n", metric, k, w.kept_rare,
                        opt.rare_hits, which, w.rare.size() > 6 ? ", ..." : "", criterion(metric).rare_note);
    }
    m.result = std::move(r);
    return m;
}

// Whether a criterion's maps nest (K1 ⊂ K2 ⊂ ...), and how much criteria agree.
using MapsByName = std::map<std::pair<std::string, int64_t>, KeepMap>;

json nesting_of(const MapsByName & maps, const std::vector<std::string> & metrics, const std::vector<int64_t> & ks) {
    json nesting = json::object();
    for (const std::string & metric : metrics) {
        bool nested = true;
        for (size_t i = 1; i < ks.size(); ++i) {
            for (const auto & [layer, small] : maps.at({metric, ks[i - 1]}).layers) {
                const auto & big = maps.at({metric, ks[i]}).layers.at(layer);
                nested = nested && std::includes(big.begin(), big.end(), small.begin(), small.end());
            }
        }
        nesting[metric] = nested;
    }
    return nesting;
}

json overlap_of(const MapsByName & maps, const std::vector<std::string> & metrics, const std::vector<int64_t> & ks) {
    json overlap = json::array();
    for (int64_t k : ks) {
        for (size_t a = 0; a < metrics.size(); ++a) {
            for (size_t b = a + 1; b < metrics.size(); ++b) {
                double share = 0;
                const KeepMap & ma = maps.at({metrics[a], k});
                const KeepMap & mb = maps.at({metrics[b], k});
                for (const auto & [layer, ids] : ma.layers) {
                    std::vector<int32_t> both;
                    const auto & other = mb.layers.at(layer);
                    std::set_intersection(ids.begin(), ids.end(), other.begin(), other.end(), std::back_inserter(both));
                    share += double(both.size()) / double(k) / double(ma.layers.size());
                }
                overlap.push_back({{"k", k}, {"a", metrics[a]}, {"b", metrics[b]}, {"shared", share}});
            }
        }
    }
    return overlap;
}

json super_experts_json(const SelectInputs & in, size_t & n_super) {
    const SaliencyStats & s = in.stats;
    const auto & supers = in.supers;
    json super = json::object();
    n_super = 0;
    for (size_t l = 0; l < supers.size(); ++l) {
        if (!supers[l].empty()) {
            super[std::to_string(model_layer(s, l))] = supers[l];
            n_super += supers[l].size();
        }
    }
    return super;
}

json select_json(const SelectOptions & opt, const SelectInputs & in, const json & results, const json & nesting,
                 const json & overlap, const json & super) {
    const SaliencyStats & s = in.stats;
    const std::vector<int64_t> & ks = in.ks;
    return {{"format", "moeprune-select"},
            {"version", 1},
            {"inputs",
             {{"stats", opt.stats.string()},
              {"stats_tokens", s.n_tokens},
              {"model", s.model},
              {"heldout", opt.heldout.empty() ? json() : json(opt.heldout.string())},
              {"trace", opt.trace.empty() ? json() : json(opt.trace.string())},
              {"ks", ks},
              {"metrics", opt.metrics},
              {"hybrid_of", opt.hybrid_of},
              {"domain_metric", opt.domain_metric},
              {"domain_weights", opt.domain_weights},
              {"lcb_z", opt.lcb_z},
              {"lcb_prior", opt.lcb_prior},
              {"rare_hits", opt.rare_hits},
              {"protect_super", opt.protect_super},
              {"seed", opt.seed}}},
            {"super_experts", super},
            {"results", results},
            {"nested", nesting},
            {"overlap", overlap}};
}

} // namespace

SelectReport run_select(const SelectOptions & opt, const std::vector<std::filesystem::path> & outputs) {
    check_select_options(opt, outputs);
    const SelectInputs in = read_select_inputs(opt);
    SelectReport rep;
    rep.text = table_header(opt, in);
    if (!opt.out_dir.empty()) {
        create_output_dir(opt.out_dir);
    }
    json results = json::array();
    MapsByName maps;
    std::string rare_notes;
    for (const std::string & metric : opt.metrics) {
        std::vector<std::vector<double>> scores;
        for (size_t l = 0; l < in.stats.layers.size(); ++l) {
            scores.push_back(criterion_scores(in.stats, l, metric, opt));
        }
        for (int64_t k : in.ks) {
            MapResult m = make_map(opt, in, metric, scores, k);
            rep.text += m.row + "\n";
            rare_notes += m.rare_note;
            if (!opt.out_dir.empty()) {
                const std::filesystem::path file = opt.out_dir / keep_map_file_name(metric, k);
                write_keep_map(file, m.km);
                rep.written.push_back(file);
                m.result["file"] = file.string();
            }
            results.push_back(std::move(m.result));
            maps[{metric, k}] = std::move(m.km);
        }
    }
    if (!rare_notes.empty()) {
        rep.text += "\nkept on little evidence:\n" + rare_notes;
    }
    const json nesting = nesting_of(maps, opt.metrics, in.ks);
    const json overlap = overlap_of(maps, opt.metrics, in.ks);
    size_t n_super = 0;
    const json super = super_experts_json(in, n_super);
    rep.text += "nested: ";
    for (const auto & [metric, nested] : nesting.items()) {
        rep.text += fmt::format("{}={} ", metric, nested.get<bool>() ? "yes" : "no");
    }
    rep.text += "\n";
    if (opt.protect_super) {
        rep.text += fmt::format("super experts kept in every map: {} ({})\n", n_super, super.dump());
    }
    json media = json::object();
    for (const auto & [modality, per_layer_ids] : in.media_experts) {
        media[modality] = json::object();
        size_t n = 0;
        for (size_t l = 0; l < per_layer_ids.size(); ++l) {
            if (!per_layer_ids[l].empty()) {
                media[modality][std::to_string(model_layer(in.stats, l))] = per_layer_ids[l];
                n += per_layer_ids[l].size();
            }
        }
        rep.text += fmt::format("{} experts (most of their hits from {} positions): {} ({})\n", modality, modality, n,
                                media[modality].dump());
    }
    const std::string warning = missing_media_warning(opt, in.stats);
    if (!warning.empty()) {
        rep.warnings.push_back(warning);
        rep.text += warning + "\n";
    }
    rep.json = select_json(opt, in, results, nesting, overlap, super);
    rep.json["media_experts"] = media;
    rep.json["warnings"] = rep.warnings;
    return rep;
}

} // namespace moeprune
