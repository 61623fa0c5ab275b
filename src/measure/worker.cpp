#include "measure/worker.h"

#include "core/errors.h"
#include "core/json.h"
#include "core/progress.h"
#include "engine/batch.h"
#include "engine/session.h"
#include "formats/measure_report.h"
#include "formats/trace.h"
#include "model/inspect.h"
#include "model/model_file.h"
#include "route/tap.h"
#include "sim/page_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <numeric>
#include <random>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moeprune {

namespace {

using Clock = std::chrono::steady_clock;

// What the kernel counts for this process, all threads together.
struct Usage {
    int64_t read_bytes = -1;   // fetched from storage (/proc/self/io); -1 without task I/O accounting
    int64_t major_faults = 0, minor_faults = 0;
};

Usage usage_now() {
    Usage u;
    rusage r{};
    ::getrusage(RUSAGE_SELF, &r);
    u.major_faults = r.ru_majflt;
    u.minor_faults = r.ru_minflt;
    std::ifstream io("/proc/self/io");
    for (std::string key; io >> key;) {
        int64_t value = 0;
        io >> value;
        if (key == "read_bytes:") {
            u.read_bytes = value;
        }
    }
    return u;
}

// RssAnon, RssFile, VmHWM and VmPTE (the page tables, charged to the memory cgroup too) of
// /proc/self/status, in bytes.
std::vector<std::pair<std::string, uint64_t>> resident_set() {
    std::vector<std::pair<std::string, uint64_t>> out;
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);) {
        for (const char * key : {"RssAnon", "RssFile", "VmHWM", "VmPTE"}) {
            if (line.rfind(std::string(key) + ":", 0) == 0) {
                out.emplace_back(key, uint64_t(std::stoll(line.substr(line.find(':') + 1))) * 1024);
            }
        }
    }
    return out;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

ContextPtr decode_context(llama_model * model, const WorkerSpec & s, ggml_backend_sched_eval_callback cb, void * ud) {
    return new_context(model, {s.ctx, 1, 1, s.threads, cb, ud});
}

// One token at position `pos`, its logits requested as a generation step requests them,
// through `one`, a batch of one row made before the timing.
void decode_one(llama_context * ctx, DecodeBatch & one, int32_t token, int pos) {
    one.clear();
    one.add(token, pos, true);
    one.decode(ctx, [&] { return fmt::format("position {}", pos); });
    llama_synchronize(ctx);
}

// After the resident run's timed pass: every token again through a router tap, the
// routing of all of them written to one trace and of the timed ones to another.
void trace_pass(llama_model * model, const WorkerSpec & s) {
    const GgufModel gguf = GgufModel::open(s.model);
    const InspectReport info = inspect_model(gguf, {});
    const MaskFacts facts = mask_facts(info);
    const int top = std::min(s.trace_top, int(info.n_expert));
    RouterTap tap(facts, top, nullptr, nullptr, nullptr, {});
    ContextPtr ctx = decode_context(model, s, &RouterTap::callback, &tap);

    TraceHeader h;
    h.n_layer = uint32_t(facts.moe_layers.size());
    h.n_expert = uint32_t(info.n_expert);
    h.top_m = uint32_t(top);
    h.domains = {"text"};
    h.meta = s.trace_meta;
    h.meta["n_expert_used"] = info.n_expert_used;
    h.meta["moe_layers"] = facts.moe_layers;
    std::optional<TraceWriter> timed;
    if (!s.trace.empty()) {
        timed.emplace(s.trace, h);
    }
    TraceWriter all(s.trace_all, h);
    DecodeBatch one(1);
    Progress progress(s.label + " (traced)", s.tokens.size(), "tokens");
    for (size_t i = 0; i < s.tokens.size(); ++i) {
        tap.begin_window(uint32_t(i), 1);
        one.clear();
        one.add(s.tokens[i], int32_t(i), true);
        one.decode(ctx.get(), [&] { return fmt::format("position {}", i); }, [&] { tap.rethrow_failure(); });
        tap.end_window();
        TraceTokenMeta meta;
        meta.token = s.tokens[i];
        meta.pos = int32_t(i);
        meta.phase = TracePhase::Decode;
        all.append(meta, tap.window_ids().data(), tap.window_logits().data());
        if (timed && int(i) >= s.warmup) {
            timed->append(meta, tap.window_ids().data(), tap.window_logits().data());
        }
        progress.advance(1);
    }
    progress.finish();
    all.close();
    if (timed) {
        timed->close();
    }
}

// The model's shards mapped without faulting anything: mincore() on them tells which
// pages the page cache holds, whoever faulted them.
class ResidencySampler {
public:
    ResidencySampler(std::vector<std::vector<ExpertSlab>> experts, const std::vector<fs::path> & shards)
        : experts_(std::move(experts)) {
        for (const fs::path & shard : shards) {
            const int fd = ::open(shard.c_str(), O_RDONLY);
            if (fd < 0) {
                fail_file(shard.string(), "cannot be opened");
            }
            const uint64_t size = fs::file_size(shard);
            void * addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
            ::close(fd);
            if (addr == MAP_FAILED) {
                fail_file(shard.string(), "cannot be mapped");
            }
            maps_.push_back({addr, size});
        }
    }
    ~ResidencySampler() {
        for (const auto & [addr, size] : maps_) {
            ::munmap(addr, size);
        }
    }
    ResidencySampler(const ResidencySampler &) = delete;
    ResidencySampler & operator=(const ResidencySampler &) = delete;

    // Indices (in routed_expert_slabs order) of the experts every page of which is cached.
    std::vector<uint32_t> resident_experts() {
        const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
        pages_.resize(maps_.size());
        for (size_t i = 0; i < maps_.size(); ++i) {
            pages_[i].resize((maps_[i].second + page - 1) / page);
            if (::mincore(maps_[i].first, maps_[i].second, pages_[i].data()) != 0) {
                throw Error(fmt::format("mincore on the model's mapping failed: {}", std::strerror(errno)));
            }
        }
        std::vector<uint32_t> out;
        for (size_t e = 0; e < experts_.size(); ++e) {
            const bool all = std::all_of(experts_[e].begin(), experts_[e].end(), [&](const ExpertSlab & slab) {
                const auto & v = pages_[size_t(slab.shard)];
                for (uint64_t p = slab.offset / page; p <= (slab.offset + slab.bytes - 1) / page; ++p) {
                    if (!(v[p] & 1)) {
                        return false;
                    }
                }
                return true;
            });
            if (all) {
                out.push_back(uint32_t(e));
            }
        }
        return out;
    }

private:
    std::vector<std::vector<ExpertSlab>> experts_;
    std::vector<std::pair<void *, uint64_t>> maps_;
    std::vector<std::vector<unsigned char>> pages_;
};

DecodeDetail decode_run(const WorkerSpec & s) {
    init_llama({});
    const Usage before_load = usage_now();
    const auto t_load = Clock::now();
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = s.repack;   // llama.cpp's --no-repack turns it off
    mp.progress_callback = [](float, void *) { return true; };
    ModelPtr model(llama_model_load_from_file(s.model.c_str(), mp), llama_model_free);
    if (!model) {
        fail_file(s.model.string(), "llama.cpp could not load it");
    }
    DecodeDetail out;
    out.load_seconds = seconds_since(t_load);
    const Usage after_load = usage_now();
    if (before_load.read_bytes >= 0) {
        out.load_read_bytes = after_load.read_bytes - before_load.read_bytes;
    }
    out.load_major_faults = after_load.major_faults - before_load.major_faults;
    ContextPtr ctx = decode_context(model.get(), s, nullptr, nullptr);
    DecodeBatch one(1);
    std::optional<ResidencySampler> sampler;
    if (s.residency_every > 0) {
        sampler.emplace(s.residency_experts, s.shards);
        out.residency.emplace();
    }
    // A pass shorter than min_seconds is too short to time (scheduling and clock changes
    // alone move it by more than 10%): the tokens are decoded again from an empty context
    // until that much decode is timed, and each token's time is its median over the passes.
    // Faults, reads and residency are the first pass's, the one the trace routes.
    constexpr int kMostPasses = 64;
    std::vector<std::vector<double>> passes;
    double timed_s = 0;
    std::optional<Progress> progress(std::in_place, s.label, s.tokens.size(), "tokens");
    do {
        const bool first = passes.empty();
        if (!first) {
            llama_memory_clear(llama_get_memory(ctx.get()), true);
        }
        std::vector<double> & wall = passes.emplace_back();
        for (size_t i = 0; i < s.tokens.size(); ++i) {
            const Usage u0 = usage_now();
            const auto t0 = Clock::now();
            decode_one(ctx.get(), one, s.tokens[i], int(i));
            const double us = seconds_since(t0) * 1e6;
            const Usage u1 = usage_now();
            if (int(i) >= s.warmup) {
                wall.push_back(us);
                timed_s += us / 1e6;
            }
            if (first && int(i) >= s.warmup) {   // what the trace routes
                out.read_bytes.push_back(u0.read_bytes < 0 ? -1 : u1.read_bytes - u0.read_bytes);
                out.major_faults.push_back(u1.major_faults - u0.major_faults);
                out.minor_faults.push_back(u1.minor_faults - u0.minor_faults);
                const int timed = int(i) - s.warmup;
                if (sampler && (timed + 1) % s.residency_every == 0) {
                    out.residency->push_back({uint64_t(timed), sampler->resident_experts()});
                }
            }
            if (progress) {
                progress->advance(1);
            }
        }
        if (progress) {
            progress->finish();
            progress.reset();
        }
    } while (timed_s < s.min_seconds && passes.size() < kMostPasses);
    std::vector<double> & wall_us = out.wall_us;
    wall_us.resize(passes.front().size());
    for (size_t t = 0; t < wall_us.size(); ++t) {
        std::vector<double> at;
        for (const std::vector<double> & pass : passes) {
            at.push_back(pass[t]);
        }
        std::nth_element(at.begin(), at.begin() + std::ptrdiff_t(at.size() / 2), at.end());
        wall_us[t] = at[at.size() / 2];
    }
    out.passes = int64_t(passes.size());
    out.timed_seconds = timed_s;
    out.read_bytes_counted = before_load.read_bytes >= 0;
    // Before the traced pass, whose tap and writer are not llama.cpp's memory.
    out.process = resident_set();
    ctx.reset();
    if (!s.trace_all.empty()) {
        trace_pass(model.get(), s);
    }
    return out;
}

// The device's sequential rate: `bytes` of routed experts from the largest expert tensor's
// start, in 4 MiB direct reads (buffered where the filesystem refuses O_DIRECT, the pages
// dropped after), so that the rate is the storage's and not the page cache's.
std::optional<ProbeResult::Sequential> sequential_read(const GgufModel & gguf, uint64_t bytes) {
    const TensorEntry * largest = nullptr;
    for (const TensorEntry & t : gguf.tensors()) {
        if (t.cls.role == TensorRole::Expert && (!largest || t.nbytes > largest->nbytes)) {
            largest = &t;
        }
    }
    if (!largest || bytes == 0) {
        return std::nullopt;
    }
    constexpr uint64_t kBlock = 4 << 20, kAlign = 4096;
    const fs::path & shard = gguf.shard_paths()[size_t(largest->shard)];
    const uint64_t from = largest->file_offset / kAlign * kAlign;
    const uint64_t to = std::min(gguf.shard_bytes(largest->shard), from + std::min(bytes, largest->nbytes)) / kAlign * kAlign;
    bool direct = true;
    int fd = ::open(shard.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) {
        direct = false;
        fd = ::open(shard.c_str(), O_RDONLY);
    }
    if (fd < 0) {
        fail_file(shard.string(), "cannot be opened");
    }
    std::unique_ptr<uint8_t, decltype(&std::free)> buffer(static_cast<uint8_t *>(std::aligned_alloc(kAlign, kBlock)),
                                                          &std::free);
    uint64_t done = 0;
    const auto t0 = Clock::now();
    for (uint64_t off = from; off < to;) {
        const ssize_t n = ::pread(fd, buffer.get(), size_t(std::min(kBlock, to - off)), off_t(off));
        if (n <= 0) {
            ::close(fd);
            fail_file(shard.string(), fmt::format("could not be read at offset {} for the storage probe", off));
        }
        off += uint64_t(n);
        done += uint64_t(n);
    }
    const double seconds = seconds_since(t0);
    if (!direct) {
        ::posix_fadvise(fd, off_t(from), off_t(to - from), POSIX_FADV_DONTNEED);
    }
    ::close(fd);
    return ProbeResult::Sequential{done, seconds, direct};
}

// The probe: the device's sequential rate, then experts in a seeded random order, every
// page of each slab through the mapping by `threads` readers as llama.cpp's threads read
// an expert's matrix, then the same reads simulated: the time beyond what the sequential
// rate transfers, per simulated read-around, is the wait a read-around adds as a decode
// meets it (docs/measure.md, "The prediction").
// The model's shards mapped as llama.cpp maps them, unmapped when it goes.
struct MappedShards {
    std::vector<const uint8_t *> maps;
    std::vector<uint64_t> sizes;
    explicit MappedShards(const GgufModel & gguf) {
        for (const fs::path & shard : gguf.shard_paths()) {
            const int fd = ::open(shard.c_str(), O_RDONLY);
            if (fd < 0) {
                fail_file(shard.string(), "cannot be opened");
            }
            const uint64_t size = fs::file_size(shard);
            ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);   // as llama.cpp's mapping advises
            void * addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
            ::close(fd);
            if (addr == MAP_FAILED) {
                fail_file(shard.string(), "cannot be mapped");
            }
            maps.push_back(static_cast<const uint8_t *>(addr));
            sizes.push_back(size);
        }
    }
    ~MappedShards() {
        for (size_t i = 0; i < maps.size(); ++i) {
            ::munmap(const_cast<uint8_t *>(maps[i]), sizes[i]);
        }
    }
    MappedShards(const MappedShards &) = delete;
    MappedShards & operator=(const MappedShards &) = delete;
};

// One expert tensor's bytes as ggml's mul_mat_id splits it for a token: chunks of 64 rows
// (the threads' count when that makes fewer than four per thread).
struct ProbeSlab {
    const volatile uint8_t * base;
    uint64_t bytes, chunk_bytes, chunks;
    size_t expert;
};

std::vector<ProbeSlab> probe_slabs(const std::vector<std::vector<ExpertSlab>> & experts, size_t n,
                                   const MappedShards & shards, int threads) {
    std::vector<ProbeSlab> slabs;
    for (size_t e = 0; e < n; ++e) {
        for (const ExpertSlab & slab : experts[e]) {
            const uint64_t rows = slab.row_bytes ? slab.bytes / slab.row_bytes : 1;
            uint64_t chunk_rows = 64;
            if ((rows + 63) / 64 < uint64_t(4 * threads)) {
                chunk_rows = (rows + uint64_t(threads) - 1) / uint64_t(threads);
            }
            const uint64_t chunk_bytes = std::max<uint64_t>(1, chunk_rows * std::max<uint64_t>(1, slab.row_bytes));
            slabs.push_back({shards.maps[size_t(slab.shard)] + slab.offset, slab.bytes, chunk_bytes,
                             (slab.bytes + chunk_bytes - 1) / chunk_bytes, e});
        }
    }
    return slabs;
}

struct ProbeReads {
    std::vector<double> expert_ms;
    uint64_t checksum = 0;
};

// Reads `slabs` as ggml's threads read them: the first chunk of each taken by each thread
// at once, the rest as they finish, a barrier after each matrix as after each node of the
// graph; the time from an expert's first chunk to its last.
ProbeReads read_as_mul_mat_id(const std::vector<ProbeSlab> & slabs, size_t n, int threads) {
    const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
    std::vector<std::atomic<uint64_t>> next_chunk(slabs.size());
    for (std::atomic<uint64_t> & c : next_chunk) {
        c = uint64_t(threads);
    }
    ProbeReads out;
    out.expert_ms.assign(n, 0);
    std::vector<std::atomic<uint64_t>> chunks_left(n);
    for (const ProbeSlab & slab : slabs) {
        chunks_left[slab.expert] += slab.chunks;
    }
    std::atomic<uint64_t> sink{0};
    std::vector<Clock::time_point> started(n, Clock::now());
    std::barrier node_done(threads);
    std::vector<std::thread> readers;
    for (int ith = 0; ith < threads; ++ith) {
        readers.emplace_back([&, ith] {
            uint64_t sum = 0;
            for (size_t i = 0; i < slabs.size(); ++i) {
                const ProbeSlab & slab = slabs[i];
                if (ith == 0 && (i == 0 || slabs[i - 1].expert != slab.expert)) {
                    started[slab.expert] = Clock::now();
                }
                for (uint64_t c = uint64_t(ith); c < slab.chunks; c = next_chunk[i].fetch_add(1)) {
                    const uint64_t end = std::min(slab.bytes, (c + 1) * slab.chunk_bytes);
                    for (uint64_t off = c * slab.chunk_bytes; off < end; off += page) {
                        sum += slab.base[off];
                    }
                    sum += slab.base[end - 1];
                    if (chunks_left[slab.expert].fetch_sub(1) == 1) {
                        out.expert_ms[slab.expert] = seconds_since(started[slab.expert]) * 1e3;
                    }
                }
                node_done.arrive_and_wait();
            }
            sink += sum;
        });
    }
    for (std::thread & r : readers) {
        r.join();
    }
    out.checksum = sink.load();
    return out;
}

// The same reads through the simulated page cache: its read-arounds are what a prediction
// counts, so the time is calibrated per read-around it would start.
MappedFileCache::Touch simulate_probe(const GgufModel & gguf, const std::vector<std::vector<ExpertSlab>> & experts,
                                      size_t n, const WorkerSpec & s) {
    std::vector<uint64_t> files;
    for (size_t shard = 0; shard < gguf.shard_paths().size(); ++shard) {
        files.push_back(gguf.shard_bytes(int(shard)));
    }
    MappedFileCache cache(files, s.probe_cache_bytes, uint64_t(::sysconf(_SC_PAGESIZE)), s.readaround_bytes);
    MappedFileCache::Touch simulated;
    for (size_t e = 0; e < n; ++e) {
        for (const ExpertSlab & slab : experts[e]) {
            const MappedFileCache::Touch t = cache.touch(size_t(slab.shard), slab.offset, slab.bytes);
            simulated.faults += t.faults;
            simulated.read_bytes += t.read_bytes;
        }
    }
    return simulated;
}

ProbeResult probe_run(const WorkerSpec & s) {
    const GgufModel gguf = GgufModel::open(s.model);
    std::vector<std::vector<ExpertSlab>> experts = routed_expert_slabs(gguf, inspect_model(gguf, {}));
    std::erase_if(experts, [](const std::vector<ExpertSlab> & e) { return e.empty(); });
    std::mt19937_64 rng(s.seed);
    std::shuffle(experts.begin(), experts.end(), rng);
    uint64_t asked = 0;
    size_t n = 0;
    while (n < experts.size() && asked < s.probe_bytes) {
        for (const ExpertSlab & slab : experts[n]) {
            asked += slab.bytes;
        }
        ++n;
    }
    ProbeResult out;
    out.sequential = sequential_read(gguf, std::min<uint64_t>(asked, uint64_t(64) << 20));
    const int threads = std::max(1, s.threads);
    ProbeReads reads;
    double seconds = 0;
    Usage u0, u1;
    {
        const MappedShards shards(gguf);
        const std::vector<ProbeSlab> slabs = probe_slabs(experts, n, shards, threads);
        u0 = usage_now();
        const auto t0 = Clock::now();
        reads = read_as_mul_mat_id(slabs, n, threads);
        seconds = seconds_since(t0);
        u1 = usage_now();
    }
    const MappedFileCache::Touch simulated = simulate_probe(gguf, experts, n, s);
    out.experts = n;
    out.bytes_needed = asked;
    if (u0.read_bytes >= 0) {
        out.bytes_read = u1.read_bytes - u0.read_bytes;
    }
    out.major_faults = uint64_t(u1.major_faults - u0.major_faults);
    out.seconds = seconds;
    out.expert_ms = reads.expert_ms;
    out.threads = threads;
    out.simulated_faults = simulated.faults;
    out.simulated_read_bytes = simulated.read_bytes;
    out.checksum = reads.checksum & 0xff;
    return out;
}

} // namespace

json to_json(const ProbeResult & r) {
    return {{"experts", r.experts},
            {"bytes_needed", r.bytes_needed},
            {"bytes_read", r.bytes_read ? json(*r.bytes_read) : json(nullptr)},
            {"major_faults", r.major_faults},
            {"seconds", r.seconds},
            {"expert_ms", r.expert_ms},
            {"threads", r.threads},
            {"sequential", r.sequential ? json{{"bytes", r.sequential->bytes},
                                                {"seconds", r.sequential->seconds},
                                                {"direct", r.sequential->direct}}
                                         : json(nullptr)},
            {"simulated_faults", r.simulated_faults},
            {"simulated_read_bytes", r.simulated_read_bytes},
            {"checksum", r.checksum}};
}

ProbeResult probe_result_from_json(const json & j, const std::string & origin) {
    const JsonFields f(j, origin);
    ProbeResult r;
    r.experts = uint64_t(f.integer("experts", 0, INT64_MAX));
    r.bytes_needed = uint64_t(f.integer("bytes_needed", 0, INT64_MAX));
    if (!f.any("bytes_read").is_null()) {
        r.bytes_read = f.integer("bytes_read", 0, INT64_MAX);
    }
    r.major_faults = uint64_t(f.integer("major_faults", 0, INT64_MAX));
    r.seconds = f.number("seconds", 0, 1e9);
    r.expert_ms = f.numbers("expert_ms", 0, 1e12);
    r.threads = int(f.integer("threads", 1, 1 << 16));
    if (!f.any("sequential").is_null()) {
        const JsonFields q = f.object("sequential");
        r.sequential = ProbeResult::Sequential{uint64_t(q.integer("bytes", 0, INT64_MAX)), q.number("seconds", 0, 1e9),
                                               q.boolean("direct")};
    }
    r.simulated_faults = uint64_t(f.integer("simulated_faults", 0, INT64_MAX));
    r.simulated_read_bytes = uint64_t(f.integer("simulated_read_bytes", 0, INT64_MAX));
    r.checksum = uint64_t(f.integer("checksum", 0, INT64_MAX));
    return r;
}

json to_json(const WorkerSpec & s) {
    return {{"mode", s.mode},         {"label", s.label},     {"model", s.model.string()}, {"threads", s.threads},
            {"tokens", s.tokens},   {"warmup", s.warmup},        {"ctx", s.ctx}, {"repack", s.repack},
            {"min_seconds", s.min_seconds},
            {"trace", s.trace.string()}, {"trace_all", s.trace_all.string()}, {"trace_top", s.trace_top}, {"trace_meta", s.trace_meta},
            {"probe_bytes", s.probe_bytes}, {"seed", s.seed}, {"probe_cache_bytes", s.probe_cache_bytes},
            {"readaround_bytes", s.readaround_bytes}, {"residency_every", s.residency_every},
            {"residency_experts", [&] {
                 json experts = json::array();
                 for (const auto & e : s.residency_experts) {
                     json slabs = json::array();
                     for (const ExpertSlab & slab : e) {
                         slabs.push_back({slab.shard, slab.offset, slab.bytes});
                     }
                     experts.push_back(std::move(slabs));
                 }
                 return experts;
             }()},
            {"shards", [&] {
                 json shards = json::array();
                 for (const fs::path & p : s.shards) {
                     shards.push_back(p.string());
                 }
                 return shards;
             }()}};
}

WorkerSpec worker_spec_from_json(const json & j, const std::string & origin) {
    return with_json_errors(origin, [&] {
        WorkerSpec s;
        s.mode = j.at("mode").get<std::string>();
        s.label = j.at("label").get<std::string>();
        s.model = j.at("model").get<std::string>();
        s.threads = j.at("threads").get<int>();
        s.tokens = j.at("tokens").get<std::vector<int32_t>>();
        s.warmup = j.at("warmup").get<int>();
        s.min_seconds = j.at("min_seconds").get<double>();
        s.ctx = j.at("ctx").get<int>();
        s.repack = j.at("repack").get<bool>();
        s.trace = j.at("trace").get<std::string>();
        s.trace_all = j.at("trace_all").get<std::string>();
        s.trace_top = j.at("trace_top").get<int>();
        s.trace_meta = j.at("trace_meta");
        s.probe_bytes = j.at("probe_bytes").get<uint64_t>();
        s.seed = j.at("seed").get<uint64_t>();
        s.probe_cache_bytes = j.at("probe_cache_bytes").get<uint64_t>();
        s.readaround_bytes = j.at("readaround_bytes").get<uint64_t>();
        s.residency_every = j.at("residency_every").get<int>();
        for (const json & e : j.at("residency_experts")) {
            std::vector<ExpertSlab> & slabs = s.residency_experts.emplace_back();
            for (const json & slab : e) {
                slabs.push_back({slab.at(0).get<int>(), slab.at(1).get<uint64_t>(), slab.at(2).get<uint64_t>()});
            }
        }
        for (const json & p : j.at("shards")) {
            s.shards.push_back(p.get<std::string>());
        }
        return s;
    });
}

json run_worker(const WorkerSpec & spec) {
    if (spec.mode == "decode") {
        return to_json(decode_run(spec));
    }
    if (spec.mode == "probe") {
        return to_json(probe_run(spec));
    }
    throw Error(fmt::format("measure worker: unknown mode \"{}\"", spec.mode));
}

} // namespace moeprune
