#include "measure/predict.h"

#include "core/errors.h"
#include "model/inspect.h"
#include "sim/page_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <map>
#include <tuple>
#include <vector>

namespace moeprune {

namespace {

struct Range {
    size_t shard = 0;
    uint64_t offset = 0, bytes = 0;
};

// What a token reads, in the order the graph reads it: per block its tensors outside the
// routed experts, then the chosen experts' slabs; the output head after the last block.
struct Layout {
    std::map<int, std::vector<Range>> dense;                    // block -> tensors
    std::vector<std::vector<ExpertSlab>> experts;               // routed_expert_slabs
    std::map<int, int> ordinal;                                 // routed block -> trace layer
    std::vector<Range> head;
    Range embedding;                                            // the whole table; a token reads one row
    uint64_t embedding_rows = 0;
};

Layout lay_out(const GgufModel & model, const InspectReport & info) {
    Layout lay;
    const std::vector<int> routed = info.routed_layers();
    for (size_t o = 0; o < routed.size(); ++o) {
        lay.ordinal[routed[o]] = int(o);
    }
    lay.experts = routed_expert_slabs(model, info);
    std::vector<const TensorEntry *> tensors;
    for (const TensorEntry & t : model.tensors()) {
        tensors.push_back(&t);
    }
    std::sort(tensors.begin(), tensors.end(), [](const TensorEntry * a, const TensorEntry * b) {
        return std::tie(a->shard, a->file_offset) < std::tie(b->shard, b->file_offset);
    });
    const bool tied_output = std::none_of(tensors.begin(), tensors.end(), [](const TensorEntry * t) {
        return t->name == "output.weight";
    });
    for (const TensorEntry * t : tensors) {
        const int layer = t->cls.layer;
        const Range whole{size_t(t->shard), t->file_offset, t->nbytes};
        if (t->cls.role == TensorRole::Expert && lay.ordinal.count(layer)) {
            continue;   // routed_expert_slabs
        }
        if (layer >= 0) {
            if (!info.is_nextn(layer)) {   // the nextn blocks do not run in a decode
                lay.dense[layer].push_back(whole);
            }
        } else if (t->name == "token_embd.weight" && !tied_output) {
            lay.embedding = whole;
            lay.embedding_rows = uint64_t(t->outer_dim());
        } else if (t->name.rfind("output", 0) == 0 || t->name == "token_embd.weight") {
            lay.head.push_back(whole);
        }
    }
    return lay;
}

uint64_t every_token_bytes(const Layout & lay) {
    uint64_t bytes = 0;
    for (const auto & [block, ranges] : lay.dense) {
        for (const Range & r : ranges) {
            bytes += r.bytes;
        }
    }
    for (const Range & r : lay.head) {
        bytes += r.bytes;
    }
    return bytes;
}

// The chosen experts of every token in every routed block: [ordinal][token * k + j].
std::vector<std::vector<uint16_t>> chosen_experts(const TraceSource & trace, int k) {
    const TraceHeader & h = trace.header();
    std::vector<std::vector<uint16_t>> chosen(h.n_layer);
    for (uint32_t l = 0; l < h.n_layer; ++l) {
        chosen[l].reserve(trace.n_tokens() * size_t(k));
        trace.for_each_layer_chunk(l, [&](uint64_t, uint32_t n, const uint16_t * ids, const float *) {
            for (uint32_t i = 0; i < n; ++i) {
                chosen[l].insert(chosen[l].end(), ids + size_t(i) * h.top_m, ids + size_t(i) * h.top_m + k);
            }
        });
    }
    return chosen;
}

// The share of a page cache of `bytes` the kernel lets its active file list hold: its
// classic two lists keep inactive * ratio >= active, ratio the integer square root of 10
// per GiB they hold (1 below a GiB), so half of a small cache is inactive (mm/vmscan.c,
// inactive_is_low; the kernels without the multi-generational LRU).
double active_share(uint64_t bytes) {
    const uint64_t gib = bytes >> 30;
    const double ratio = gib == 0 ? 1.0 : std::floor(std::sqrt(10.0 * double(gib)));
    return ratio / (1 + ratio);
}

} // namespace

// Two regimes the simulation's one LRU list does not follow:
// - A read-around window over half the page cache: each fault's window evicts pages the
//   next tokens need before they are touched, a churn the whole-unit reclaim of the
//   simulation does not follow (docs/measure.md). Measured: at a 3 MiB cache and a 16 MiB
//   window the predicted bytes per token were a third of the measured.
// - A model that does not fit, whose weights every token reads (the blocks' dense
//   tensors and the output head) are more than the active list may hold: the kernel
//   moves them back to the inactive list, and reclaim takes them there before the next
//   token reads them again, while the simulation keeps them as the most recently used.
//   Measured: the demo's K 16 slice, 1.3 MiB larger than the page cache of a 32 MB limit
//   with a 17 MiB output head, read its whole 23 MiB file every token after the first 30
//   (40.7 tokens/s against 531-618 predicted).
std::string outside_model(uint64_t page_cache_bytes, uint64_t readaround_bytes, uint64_t file_bytes,
                          uint64_t every_token_bytes) {
    constexpr double kMiB = 1 << 20;
    if (readaround_bytes > 0 && 2 * readaround_bytes > page_cache_bytes) {
        return fmt::format("the {:.1f} MiB read-around window (the device's read-ahead, doubled by llama.cpp's "
                           "POSIX_FADV_SEQUENTIAL) is more than half the {:.1f} MiB page cache this limit leaves: each "
                           "fault's window evicts what the next tokens need, which the predictor does not model; "
                           "a smaller read-ahead or more RAM brings the limit back within it",
                           double(readaround_bytes) / kMiB, double(page_cache_bytes) / kMiB);
    }
    const double active = active_share(page_cache_bytes);
    if (file_bytes > page_cache_bytes && double(every_token_bytes) > active * double(page_cache_bytes)) {
        return fmt::format("the {:.1f} MiB every token reads (the dense weights and the output head) are more than "
                           "the {:.0f}% of the {:.1f} MiB page cache the kernel keeps on its active list, and the "
                           "{:.1f} MiB model does not fit: reclaim takes them before the next token reads them again, "
                           "which the predictor does not model (a sliced model just too large for its limit read its "
                           "whole file every token, 13x slower than predicted); more RAM, or a model that fits, "
                           "brings the limit back within it",
                           double(every_token_bytes) / kMiB, 100 * active, double(page_cache_bytes) / kMiB,
                           double(file_bytes) / kMiB);
    }
    return "";
}

namespace {

// llama.cpp's load: the whole mapping prefetched in file order (MAP_POPULATE).
void load(const GgufModel & model, MappedFileCache & cache) {
    constexpr uint64_t kStep = 2 << 20;
    for (size_t s = 0; s < model.shard_paths().size(); ++s) {
        const uint64_t size = model.shard_bytes(int(s));
        for (uint64_t off = 0; off < size; off += kStep) {
            cache.touch(s, off, std::min(kStep, size - off));
        }
    }
}

} // namespace

StreamPrediction predict_stream(const GgufModel & model, const TraceSource & trace, uint64_t warmup,
                                uint64_t limit_bytes, const StreamCalibration & c,
                                const std::vector<uint64_t> & residency_after) {
    const InspectReport info = inspect_model(model, {});
    const TraceHeader & h = trace.header();
    if (h.n_layer != info.routed_layers().size() || h.n_expert != uint64_t(info.n_expert) ||
        info.n_expert_used > int64_t(h.top_m)) {
        throw Error(fmt::format("the trace ({} layers, {} experts, top {}) was not recorded on this model ({} routed "
                                "layers, {} experts, {} used)",
                                h.n_layer, h.n_expert, h.top_m, info.routed_layers().size(), info.n_expert,
                                info.n_expert_used));
    }
    if (trace.n_tokens() <= warmup) {
        throw Error(fmt::format("the trace has {} tokens, none after the {} of the warm-up", trace.n_tokens(), warmup));
    }
    StreamPrediction p;
    p.page_cache_bytes = limit_bytes > c.process_bytes ? limit_bytes - c.process_bytes : 0;
    std::vector<uint64_t> files;
    for (size_t s = 0; s < model.shard_paths().size(); ++s) {
        files.push_back(model.shard_bytes(int(s)));
    }
    MappedFileCache cache(files, p.page_cache_bytes, c.page_bytes, c.readaround_bytes);
    load(model, cache);
    const Layout lay = lay_out(model, info);
    p.outside_model = outside_model(p.page_cache_bytes, c.readaround_bytes,
                                    std::accumulate(files.begin(), files.end(), uint64_t(0)), every_token_bytes(lay));
    const int k = int(info.n_expert_used);
    const std::vector<std::vector<uint16_t>> chosen = chosen_experts(trace, k);
    const std::vector<TraceTokenMeta> meta = trace.token_meta();
    std::map<int, int> blocks;   // every block a token passes, in order -> its trace ordinal, or -1
    for (const auto & [block, ranges] : lay.dense) {
        blocks[block] = -1;
    }
    for (const auto & [block, ordinal] : lay.ordinal) {
        blocks[block] = ordinal;
    }
    uint64_t expert_read = 0, other_read = 0, expert_faults = 0, faults = 0;
    const auto touch = [&](const Range & r, bool counted, uint64_t & read) {
        const MappedFileCache::Touch t = cache.touch(r.shard, r.offset, r.bytes);
        read += counted ? t.read_bytes : 0;
        faults += counted ? t.faults : 0;
        return counted ? t.faults : 0;
    };
    for (uint64_t t = 0; t < trace.n_tokens(); ++t) {
        const bool counted = t >= warmup;
        if (lay.embedding_rows > 0 && meta[t].token >= 0 && uint64_t(meta[t].token) < lay.embedding_rows) {
            const uint64_t row = lay.embedding.bytes / lay.embedding_rows;
            touch({lay.embedding.shard, lay.embedding.offset + uint64_t(meta[t].token) * row, row}, counted, other_read);
        }
        for (const auto & [block, ordinal] : blocks) {
            if (lay.dense.count(block)) {
                for (const Range & r : lay.dense.at(block)) {
                    touch(r, counted, other_read);
                }
            }
            if (ordinal < 0) {
                continue;
            }
            std::vector<uint16_t> ids(chosen[size_t(ordinal)].begin() + std::ptrdiff_t(t * uint64_t(k)),
                                      chosen[size_t(ordinal)].begin() + std::ptrdiff_t((t + 1) * uint64_t(k)));
            std::sort(ids.begin(), ids.end());
            ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
            for (uint16_t e : ids) {
                for (const ExpertSlab & s : lay.experts[size_t(ordinal) * size_t(info.n_expert) + e]) {
                    expert_faults += touch({size_t(s.shard), s.offset, s.bytes}, counted, expert_read);
                }
            }
        }
        for (const Range & r : lay.head) {
            touch(r, counted, other_read);
        }
        if (counted && std::binary_search(residency_after.begin(), residency_after.end(), t - warmup)) {
            std::vector<uint32_t> & resident = p.resident_experts.emplace_back();
            for (size_t e = 0; e < lay.experts.size(); ++e) {
                if (std::all_of(lay.experts[e].begin(), lay.experts[e].end(), [&](const ExpertSlab & s) {
                        return cache.resident(size_t(s.shard), s.offset, s.bytes);
                    })) {
                    resident.push_back(uint32_t(e));
                }
            }
        }
    }
    const double n = double(trace.n_tokens() - warmup);
    p.expert_read_bytes_per_token = double(expert_read) / n;
    p.other_read_bytes_per_token = double(other_read) / n;
    p.read_bytes_per_token = double(expert_read + other_read) / n;
    p.faults_per_token = double(faults) / n;
    p.expert_faults_per_token = double(expert_faults) / n;
    time_stream(p, c);
    return p;
}

uint64_t every_token_bytes(const GgufModel & model) { return every_token_bytes(lay_out(model, inspect_model(model, {}))); }

namespace {

// The bytes priced at the calibration's fitted rate; where it has no sequential rate,
// every byte.
double scattered_bytes(const StreamPrediction & p, const StreamCalibration & c) {
    return c.sequential_gbps > 0 ? p.expert_read_bytes_per_token : p.read_bytes_per_token;
}

double sequential_ms(const StreamPrediction & p, const StreamCalibration & c) {
    return c.sequential_gbps > 0 ? p.other_read_bytes_per_token / (c.sequential_gbps * 1e6) : 0;
}

} // namespace

void time_stream(StreamPrediction & p, const StreamCalibration & c) {
    // A read-around is waited for once however many of llama.cpp's threads fault on it.
    p.ms_per_token = c.compute_ms + p.faults_per_token * c.fault_ms +
                     (p.read_bytes_per_token > 0 ? c.stream_ms : 0) + sequential_ms(p, c) +
                     (c.read_gbps > 0 ? scattered_bytes(p, c) / (c.read_gbps * 1e9) * 1e3 : 0);
    p.tokens_per_second = p.ms_per_token > 0 ? 1e3 / p.ms_per_token : 0;
}

StreamFitPoint fit_point(const StreamPrediction & p, const StreamCalibration & c, double measured_ms_per_token) {
    return {scattered_bytes(p, c), measured_ms_per_token, sequential_ms(p, c)};
}

StreamFit fit_stream(std::span<const StreamFitPoint> points, double compute_ms, double most_gbps) {
    double bytes = 0, excess_ms = 0;
    const auto excess = [&](const StreamFitPoint & f) {
        return f.measured_ms_per_token - compute_ms - f.sequential_ms_per_token;
    };
    for (const StreamFitPoint & f : points) {
        bytes += f.scattered_read_bytes_per_token;
        excess_ms += excess(f);
    }
    const double n = double(points.size());
    double sxx = 0, sxy = 0;
    for (const StreamFitPoint & f : points) {
        const double dx = f.scattered_read_bytes_per_token - bytes / n;
        sxx += dx * dx;
        sxy += dx * (excess(f) - excess_ms / n);
    }
    if (points.size() >= 2 && sxx > 0 && sxy > 0) {
        const double ms_per_byte = sxy / sxx;
        const double stream_ms = excess_ms / n - ms_per_byte * bytes / n;
        const double gbps = 1 / ms_per_byte / 1e6;
        if (stream_ms >= 0 && gbps <= most_gbps) {
            return {gbps, stream_ms};
        }
    }
    const double gbps = bytes > 0 && excess_ms > 0 ? bytes / (excess_ms / 1e3) / 1e9 : 0;
    return {gbps <= most_gbps ? gbps : 0, 0};
}

} // namespace moeprune
