#include "measure/measure.h"

#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/json.h"
#include "core/sizes.h"
#include "core/threads.h"
#include "formats/corpus.h"
#include "formats/trace.h"
#include "engine/session.h"
#include "measure/cgroup.h"
#include "measure/child.h"
#include "measure/figures.h"
#include "measure/predict.h"
#include "measure/read_ahead.h"
#include "measure/worker.h"
#include "model/inspect.h"
#include "model/model_file.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <optional>
#include <thread>
#include <chrono>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moeprune {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string mib(uint64_t bytes) { return fmt::format("{:.1f} MiB", double(bytes) / kMiB); }

// The first bytes of a program's output, safe to print: control bytes as '?'.
std::string printable_prefix(const std::string & text) {
    std::string out = text.substr(0, 40);
    for (char & c : out) {
        c = (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
    }
    return out;
}

// One measured run, start to end: the phases of run_measure.
class Measurement {
public:
    explicit Measurement(const MeasureOptions & opt) : opt_(opt) {}

    MeasureReport run() {
        print_left_read_ahead();
        check_options();
        read_model();
        read_text();
        find_cgroups();
        resident_run();
        resolve_limits();
        limited_runs();
        rep_.busy = machine_was_busy(rep_);
        if (rep_.busy.empty()) {
            predict();
        }
        DeferredSignals::check();
        return finish();
    }

private:
    void check_options();
    void read_model();
    void read_text();
    void find_cgroups();
    void resident_run();
    void resolve_limits();
    double resident_compute_ms(size_t n);
    void probe_storage(std::optional<uint64_t> read_ahead_kb);
    void limited_runs();
    MeasuredRun limited_run(size_t i, size_t n, std::optional<uint64_t> read_ahead_kb);
    void predict();
    MeasureReport finish();
    WorkerSpec decode_spec(const std::string & label) const;
    WorkerExit run_worker_in(const WorkerSpec & spec, const MemoryCgroup & cgroup, const std::string & name,
                             const std::string & what);
    json llama_bench_once(uint64_t limit, const std::string & ram, const std::string & name);
    void bracketed(MeasuredRun & r, uint64_t limit, const std::string & name, const std::function<void()> & decode);

    const MeasureOptions & opt_;
    MeasureReport rep_;
    std::optional<GgufModel> gguf_;
    InspectReport info_;
    std::vector<int32_t> tokens_;
    int threads_ = 1, ctx_ = 0;
    std::vector<RamLimit> ram_limits_;
    double longest_worker_s_ = 0;
    CgroupSupport cgroups_;
    DeferredSignals signals_;
    MeasureScratch scratch_;
    std::optional<AtomicOutput> trace_out_;
    fs::path all_tokens_trace_;   // warm-up and timed tokens, for the prediction
    json storage_;
    uint64_t readaround_bytes_ = 0;
    std::vector<uint64_t> limits_;
    std::optional<ReadAhead> read_ahead_;   // with --read-ahead-kb; puts the device's back when destroyed
};

void Measurement::check_options() {
    if (!opt_.read_ahead_kb.empty() && ::geteuid() != 0) {
        throw Error("--read-ahead-kb changes the read-ahead of the model's device, which needs root (nothing was changed)");
    }
    constexpr int kMostTokens = 1 << 20;  // a context llama.cpp can hold; their sum must fit an int
    if (opt_.tokens < 1 || opt_.tokens > kMostTokens || opt_.warmup < 0 || opt_.warmup > kMostTokens || opt_.ctx < 0 ||
        opt_.ctx > 2 * kMostTokens) {
        throw Error(fmt::format("--tokens {} and --warmup {}: tokens 1 to {}, warm-up 0 to {}; -c {}: 0 to {}",
                                opt_.tokens, opt_.warmup, kMostTokens, kMostTokens, opt_.ctx, 2 * kMostTokens));
    }
    if (!(opt_.min_seconds >= 0 && opt_.min_seconds <= 600)) {
        throw Error(fmt::format("--min-seconds {}: 0 (one pass) to 600 seconds of timed decode per run", opt_.min_seconds));
    }
    if (opt_.repeats < 1 || opt_.repeats > 100) {
        throw Error(fmt::format("--repeats {}: every limit is measured 1 to 100 times", opt_.repeats));
    }
    if (opt_.probe_mib < 0 || opt_.probe_mib > (int64_t(1) << 24)) {
        throw Error(fmt::format("--probe-mib {}: the storage probe reads 0 (none) to {} MiB (16 TiB)", opt_.probe_mib,
                                int64_t(1) << 24));
    }
    if (opt_.ram.empty()) {
        throw Error("--ram needs at least one limit");
    }
    for (const std::string & ram : opt_.ram) {
        ram_limits_.push_back(parse_ram_limit(ram, "--ram"));
    }
    if (!opt_.llama_bench.empty() && ::access(opt_.llama_bench.c_str(), X_OK) != 0) {
        fail_file(opt_.llama_bench.string(), fmt::format("--llama-bench: is not a program this user can run ({})",
                                                         std::strerror(errno)));
    }
    if (!(std::isfinite(opt_.llama_bench_timeout) && opt_.llama_bench_timeout >= 0)) {
        throw Error(fmt::format("--llama-bench-timeout {}: seconds >= 0 (0: chosen from the model)", opt_.llama_bench_timeout));
    }
    refuse_unwritable_output(opt_.json_out, "--json");
    refuse_unwritable_output(opt_.trace_out, "--trace");
    threads_ = check_threads(opt_.threads, "-t");
    ctx_ = opt_.ctx > 0 ? opt_.ctx : opt_.warmup + opt_.tokens;
    if (ctx_ < opt_.warmup + opt_.tokens) {
        throw Error(fmt::format("-c {} cannot hold --warmup {} + --tokens {} tokens", ctx_, opt_.warmup, opt_.tokens));
    }
}

void Measurement::read_model() {
    gguf_.emplace(GgufModel::open(opt_.model));
    info_ = inspect_model(*gguf_, {});
    if (!info_.problems.empty()) {
        fail_file(opt_.model.string(), "is inconsistent (see moeprune inspect): " + fmt::format("{}", fmt::join(info_.problems, "; ")));
    }
    std::vector<fs::path> inputs = gguf_->shard_paths();
    inputs.push_back(opt_.text);
    if (!opt_.llama_bench.empty()) {
        inputs.push_back(opt_.llama_bench);
    }
    refuse_output_clashes({opt_.json_out, opt_.trace_out}, inputs);
    for (const fs::path & shard : gguf_->shard_paths()) {
        refuse_ram_filesystem(shard);
    }
    // llama.cpp advises POSIX_FADV_SEQUENTIAL, which doubles the file's readahead window.
    storage_ = storage_of(gguf_->shard_paths().front());
    readaround_bytes_ = storage_.value("read_ahead_kb", uint64_t(128)) * 1024 * 2;
    if (!opt_.read_ahead_kb.empty()) {
        if (!storage_.contains("read_ahead_file")) {
            fail_file(opt_.model.string(), "is on a file system with no block device whose read-ahead can be set "
                                           "(--read-ahead-kb; nothing was changed)");
        }
        read_ahead_.emplace(storage_.at("read_ahead_file").get<std::string>(), read_ahead_state_dir());
    }
    const std::vector<double> per_expert = info_.routed_layer_expert_bytes();
    for (double b : per_expert) {
        rep_.routed_expert_bytes += uint64_t(b) * uint64_t(info_.n_expert);
    }
    if (rep_.routed_expert_bytes == 0) {
        fail_file(opt_.model.string(), "has no routed experts: there is nothing to stream");
    }
    rep_.resident_weight_bytes = info_.file_bytes - rep_.routed_expert_bytes;
    rep_.model = {{"path", opt_.model.string()}, {"digest", model_digest(gguf_->shard_paths())},
                  {"file_bytes", info_.file_bytes}, {"arch", info_.arch}, {"name", info_.name},
                  {"n_expert", info_.n_expert}, {"n_expert_used", info_.n_expert_used},
                  {"routed_layers", info_.routed_layers()}, {"routed_layer_expert_bytes", per_expert}};
}

void Measurement::read_text() {
    init_llama({});
    const ModelPtr vocab_model = load_vocabulary(opt_.model);
    // A corpus (JSONL) is decoded as one text: its documents in order, a conversation's turns as plain lines.
    Corpus corpus = read_corpus(opt_.text);
    refuse_output_clashes({opt_.json_out, opt_.trace_out}, media_paths(corpus));
    if (opt_.text_only) {
        drop_media_documents(corpus);
    }
    refuse_media(corpus, "measure times llama.cpp decoding text, so its corpus holds text only");
    std::string text;
    for (const CorpusDocument & d : corpus.documents) {
        text += text.empty() ? "" : "\n\n";
        text += d.text;
        for (const CorpusMessage & m : d.messages) {
            text += (d.text.empty() && &m == &d.messages.front() ? "" : "\n") + m.content;
        }
    }
    const std::vector<llama_token> t =
        tokenize(llama_model_get_vocab(vocab_model.get()), text, false, opt_.text.string());
    const size_t needed = size_t(opt_.warmup + opt_.tokens);
    if (t.size() < needed) {
        fail_file(opt_.text.string(), fmt::format("has {} tokens; --warmup {} and --tokens {} need {}", t.size(),
                                                  opt_.warmup, opt_.tokens, needed));
    }
    tokens_.assign(t.begin(), t.begin() + std::ptrdiff_t(needed));
    rep_.text = {{"path", opt_.text.string()}, {"digest", identity_digest(opt_.text)}, {"tokens_available", t.size()}};
}

void Measurement::find_cgroups() {
    cgroups_ = find_memory_cgroup();
    if (cgroups_.version == 0) {
        throw Error(cgroups_.problem);
    }
    sweep_stale_measures(cgroups_, scratch_, "a measure");
}

WorkerSpec Measurement::decode_spec(const std::string & label) const {
    WorkerSpec s;
    s.mode = "decode";
    s.label = label;
    s.model = opt_.model;
    s.threads = threads_;
    s.tokens = tokens_;
    s.warmup = opt_.warmup;
    s.min_seconds = opt_.min_seconds;
    s.ctx = ctx_;
    s.repack = opt_.repack;
    return s;
}

WorkerExit Measurement::run_worker_in(const WorkerSpec & spec, const MemoryCgroup & cgroup, const std::string & name,
                                      const std::string & what) {
    WorkerExit w = spawn_worker(opt_.worker_exe, spec, &cgroup, scratch_, name);
    longest_worker_s_ = std::max(longest_worker_s_, w.seconds);
    if (w.signal == SIGKILL && cgroup.oom_kills() > 0) {
        throw Error(fmt::format("{}: the memory cgroup's limit of {} was too small; the kernel killed the run for "
                                "memory. The model needs {} resident (weights outside the experts and the process's "
                                "own memory) plus room for the experts of one token",
                                what, mib(cgroup.limit_bytes()), mib(rep_.resident_need_bytes)));
    }
    if (w.signal != 0 || w.status != 0) {
        throw Error(fmt::format("{}: the measure worker {} (see its messages above)", what,
                                w.signal ? fmt::format("was killed by signal {}", w.signal)
                                         : fmt::format("failed with status {}", w.status)));
    }
    return w;
}


// Fully resident and warm (llama.cpp prefetches the whole mapping at load): the timed
// pass gives compute time per token, a traced pass the routing. Its cgroup has no limit
// and only counts memory.
void Measurement::resident_run() {
    WorkerSpec spec = decode_spec("measure resident");
    if (!opt_.trace_out.empty()) {
        trace_out_.emplace(opt_.trace_out);
        spec.trace = trace_out_->temp_path();
    }
    spec.trace_all = scratch_.path() / "all-tokens.mptrace";
    spec.trace_meta = {{"model", rep_.model},
                       {"text", rep_.text},
                       {"settings", {{"warmup", opt_.warmup}, {"tokens", opt_.tokens}, {"ctx", ctx_}, {"threads", threads_}}},
                       {"producer", "moeprune measure (resident run)"}};
    MeasuredRun & r = rep_.resident;
    r.ram = "resident";
    r.cache_bytes = rep_.routed_expert_bytes;
    bracketed(r, 0, "resident", [&] {
        drop_model_pages(gguf_->shard_paths());
        MemoryCgroup cgroup(cgroups_, 0, scratch_);
        const WorkerExit w = run_worker_in(spec, cgroup, "resident", "the resident run");
        r.peak_bytes = cgroup.peak_bytes();
        r.detail = read_decode_detail(JsonFields(w.result, "the resident run's result"));
        r.decode = decode_figures(*r.detail);
        // The page tables count: mapping a 2 GB model in 4 KiB pages takes 4 MiB of them,
        // and a limit of exactly RssAnon and the model then streamed under reclaim.
        rep_.process_bytes = r.detail->process_value("RssAnon") + r.detail->process_value("VmPTE");
    });
    rep_.resident_need_bytes = rep_.resident_weight_bytes + rep_.process_bytes;
    all_tokens_trace_ = spec.trace_all;
}

// llama.cpp's own benchmark of the same decode under the same limit, when asked for:
// llama-bench's text generation (batch 1, one token per llama_decode, random tokens from
// position 0, the model loaded with llama.cpp's defaults), in a fresh cgroup of the same
// limit after the model's pages are dropped. Its first repetition starts cold, as
// measure's warm-up does; the later ones are timed in the state the limit lets the cache
// reach, as measure's timed tokens are. It runs right before and right after measure's
// own run, and their mean is compared, so that a machine drifting in speed during the
// run shifts both sides alike.
json Measurement::llama_bench_once(uint64_t limit, const std::string & ram, const std::string & name) {
    drop_model_pages(gguf_->shard_paths());
    MemoryCgroup cgroup(cgroups_, limit, scratch_);
    const fs::path out = scratch_.path() / (name + ".llama-bench.json"), log = scratch_.path() / (name + ".llama-bench.log");
    const std::vector<std::string> args = {opt_.llama_bench.string(), "-m", opt_.model.string(), "-p", "0", "-n",
                                           std::to_string(opt_.tokens), "-r", "3", "-t", std::to_string(threads_),
                                           "-o", "json"};
    // Bounded: cold reads of the whole model at a slow disk's 50 MB/s for its load and 3
    // repetitions, and far more than measure's own slowest run so far.
    const double timeout = opt_.llama_bench_timeout > 0
                               ? opt_.llama_bench_timeout
                               : 300 + 4 * double(info_.file_bytes) / 50e6 + 20 * longest_worker_s_;
    const WorkerExit w = spawn_in(args, &cgroup, out, log, timeout);
    const std::string program = opt_.llama_bench.string();
    const auto messages = [&] {
        std::string tail;
        try {
            tail = read_text_file(log);
        } catch (const std::exception &) {
        }
        tail = tail.substr(tail.size() > 2000 ? tail.size() - 2000 : 0);
        return tail.empty() ? std::string("; it printed no messages") : "; its last messages:\n" + tail;
    };
    if (w.timed_out) {
        throw Error(fmt::format("{} under --ram {}: did not finish in {:.3g} s, so it and every process it started were "
                                "killed (--llama-bench-timeout sets the bound){}",
                                program, ram, timeout, messages()));
    }
    if (w.signal != 0 || w.status != 0) {
        throw Error(fmt::format("{} under --ram {}: {}{}", program, ram,
                                w.signal ? fmt::format("killed by signal {}", w.signal) : fmt::format("exited with status {}", w.status),
                                messages()));
    }
    std::vector<double> samples;
    const std::string printed = read_text_file(out);
    const json tests = json::parse(printed, nullptr, /*allow_exceptions=*/false);
    if (tests.is_discarded()) {
        throw Error(fmt::format("{} under --ram {}: its standard output is not JSON, as llama-bench -o json prints "
                                "({} bytes, starting \"{}\"){}", program, ram, printed.size(),
                                printable_prefix(printed), messages()));
    }
    const json * ts = tests.is_array() && !tests.empty() && tests[0].is_object() && tests[0].contains("samples_ts")
                          ? &tests[0]["samples_ts"]
                          : nullptr;
    if (!ts || !ts->is_array() || !std::all_of(ts->begin(), ts->end(), [](const json & v) { return v.is_number(); })) {
        throw Error(fmt::format("{} under --ram {}: its JSON has no list of numbers \"samples_ts\" in its first test, "
                                "as llama-bench -o json prints{}", program, ram, messages()));
    }
    samples = ts->get<std::vector<double>>();
    if (samples.size() < 2) {
        throw Error(fmt::format("{} under --ram {}: printed {} repetitions, fewer than the 3 asked for", program, ram,
                                samples.size()));
    }
    for (const double t : samples) {
        if (!(std::isfinite(t) && t > 0 && t < 1e9)) {
            throw Error(fmt::format("{} under --ram {}: printed samples_ts [{}]: tokens/s must be finite and > 0", program,
                                    ram, fmt::join(samples, ", ")));
        }
    }
    const double steady = std::accumulate(samples.begin() + 1, samples.end(), 0.0) / double(samples.size() - 1);
    return json{{"command", fmt::format("{}", fmt::join(args, " "))}, {"samples_ts", samples}, {"tokens_per_second", steady}};
}

// measure's run `decode` between two llama-bench runs under the same limit (each when asked for).
void Measurement::bracketed(MeasuredRun & r, uint64_t limit, const std::string & name, const std::function<void()> & decode) {
    if (opt_.llama_bench.empty()) {
        decode();
        return;
    }
    json before = llama_bench_once(limit, r.ram, name + "-before");
    decode();
    json after = llama_bench_once(limit, r.ram, name + "-after");
    const double peer = (before.at("tokens_per_second").get<double>() + after.at("tokens_per_second").get<double>()) / 2;
    const std::string command = before.at("command").get<std::string>();
    before.erase("command");
    after.erase("command");
    r.llama_bench = {{"command", command},
                     {"before", before},
                     {"after", after},
                     {"tokens_per_second", peer},
                     {"difference", std::abs(r.decode.tokens_per_second - peer) / peer}};
}

// Every --ram as bytes of the whole child process, refused below what must stay resident.
void Measurement::resolve_limits() {
    for (size_t i = 0; i < opt_.ram.size(); ++i) {
        const std::string & ram = opt_.ram[i];
        const RamLimit & given = ram_limits_[i];
        const uint64_t limit = given.share ? rep_.resident_need_bytes +
                                                 uint64_t(given.value / 100.0 * double(rep_.routed_expert_bytes))
                                           : uint64_t(given.value);
        if (limit < rep_.resident_need_bytes) {
            throw Error(fmt::format(
                "--ram {}: {} is below what {} needs resident, {} ({} of weights outside the routed experts and {} of "
                "process memory, measured in the resident run); give at least that, or a share such as 25%",
                ram, mib(limit), opt_.model.string(), mib(rep_.resident_need_bytes), mib(rep_.resident_weight_bytes),
                mib(rep_.process_bytes)));
        }
        limits_.push_back(limit);
    }
}

// The storage's sequential rate, then random experts read cold through page faults, with
// reclaim making room as they come.
void Measurement::probe_storage(std::optional<uint64_t> read_ahead_kb) {
    WorkerSpec spec;
    spec.mode = "probe";
    spec.label = "measure probe";
    spec.model = opt_.model;
    spec.threads = threads_;
    spec.probe_bytes = std::min<uint64_t>(uint64_t(opt_.probe_mib) << 20, rep_.routed_expert_bytes);
    spec.seed = opt_.seed;
    // Under a limit of a quarter of what it reads, plus room for the worker's own memory
    // (at most the decoding process's), so that most of its faults wait for reclaim as a
    // limited decode's do.
    const uint64_t own = std::max<uint64_t>(rep_.process_bytes, uint64_t(64) << 20);
    const uint64_t limit = std::min(*std::min_element(limits_.begin(), limits_.end()), own + spec.probe_bytes / 4);
    spec.probe_cache_bytes = limit > own ? limit - own : 0;
    spec.readaround_bytes = read_ahead_kb ? *read_ahead_kb * 1024 * 2 : readaround_bytes_;
    drop_model_pages(gguf_->shard_paths());
    MemoryCgroup cgroup(cgroups_, limit, scratch_);
    const std::string name = fmt::format("probe{}", rep_.probes.size());
    const WorkerExit w = run_worker_in(spec, cgroup, name, "the storage probe");
    ProbeFigures & p = rep_.probes.emplace_back(
        probe_figures(probe_result_from_json(w.result, "the storage probe's result"), limit));
    p.read_ahead_kb = read_ahead_kb;
    if (p.bytes_read == 0 || p.major_faults == 0) {
        throw Error(fmt::format("the storage probe{} read nothing from the device ({} major faults, {} bytes): the "
                                "read-ahead brought in the experts it reads before it read them, so it measured no "
                                "storage; measure at a read-ahead well under the model's {:.0f} MB",
                                read_ahead_kb ? fmt::format(" at a read-ahead of {} KB", *read_ahead_kb) : "",
                                p.major_faults, p.bytes_read, double(rep_.routed_expert_bytes) / 1e6));
    }
}

// A resident decode at the read-ahead set now, for its speed alone: the folios a smaller
// read-ahead brings in are smaller, and the same weights then cost more TLB misses.
double Measurement::resident_compute_ms(size_t n) {
    WorkerSpec spec = decode_spec("measure resident");
    drop_model_pages(gguf_->shard_paths());
    MemoryCgroup cgroup(cgroups_, 0, scratch_);
    const WorkerExit w = run_worker_in(spec, cgroup, fmt::format("resident{}", n), "the resident run");
    return decode_figures(read_decode_detail(JsonFields(w.result, "the resident run's result"))).ms_mean;
}

// The run of the median tokens/s among a limit's repeats (the lower of the two middle ones
// for an even count), carrying all of them.
MeasuredRun median_run(std::vector<MeasuredRun> repeats) {
    std::vector<double> speeds;
    for (const MeasuredRun & r : repeats) {
        speeds.push_back(r.decode.tokens_per_second);
    }
    std::vector<size_t> order(repeats.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return speeds[a] < speeds[b]; });
    MeasuredRun kept = std::move(repeats[order[(order.size() - 1) / 2]]);
    if (speeds.size() > 1) {
        kept.repeats_tokens_per_second = std::move(speeds);
    }
    return kept;
}

// At each read-ahead: what its predictions are computed from (a resident decode and a
// probe at that setting), then every limit; with --repeats, that round again (the
// probe once), and each limit and resident decode kept at its median.
void Measurement::limited_runs() {
    std::vector<std::optional<uint64_t>> read_aheads(opt_.read_ahead_kb.begin(), opt_.read_ahead_kb.end());
    if (read_aheads.empty()) {
        read_aheads.push_back(std::nullopt);   // the device's own
    }
    const std::optional<uint64_t> own =
        storage_.contains("read_ahead_kb") ? std::optional(storage_.at("read_ahead_kb").get<uint64_t>()) : std::nullopt;
    // [read-ahead][limit]: every repeat's run; [read-ahead]: every repeat's compute time.
    std::vector<std::vector<std::vector<MeasuredRun>>> runs(read_aheads.size(),
                                                            std::vector<std::vector<MeasuredRun>>(limits_.size()));
    std::vector<std::vector<double>> compute(read_aheads.size());
    size_t n = 0, residents = 0;
    for (int repeat = 0; repeat < opt_.repeats; ++repeat) {
        for (size_t a = 0; a < read_aheads.size(); ++a) {
            if (read_aheads[a]) {
                read_ahead_->set(*read_aheads[a]);
            }
            const std::optional<uint64_t> at = read_aheads[a] ? read_aheads[a] : own;
            compute[a].push_back(repeat == 0 && at == own ? rep_.resident.decode.ms_mean : resident_compute_ms(residents++));
            if (repeat == 0 && opt_.probe_mib > 0) {
                probe_storage(at);
            }
            for (size_t i = 0; i < limits_.size(); ++i, ++n) {
                runs[a][i].push_back(limited_run(i, n, at));
                if (read_aheads[a]) {
                    read_ahead_->check();
                }
            }
        }
    }
    read_ahead_.reset();
    for (size_t a = 0; a < read_aheads.size(); ++a) {
        const std::optional<uint64_t> at = read_aheads[a] ? read_aheads[a] : own;
        StreamCalibration & c = rep_.calibrations.emplace_back();
        c.read_ahead_kb = at;
        c.readaround_bytes = at ? *at * 1024 * 2 : readaround_bytes_;   // doubled by POSIX_FADV_SEQUENTIAL
        c.compute_ms = quantile(compute[a], 0.5);
        if (compute[a].size() > 1) {
            c.compute_ms_repeats = compute[a];
        }
        for (std::vector<MeasuredRun> & repeats : runs[a]) {
            rep_.runs.push_back(median_run(std::move(repeats)));
        }
    }
    if (!rep_.probes.empty()) {
        const auto own_probe = std::find_if(rep_.probes.begin(), rep_.probes.end(),
                                            [&](const ProbeFigures & p) { return p.read_ahead_kb == own; });
        rep_.probe = own_probe == rep_.probes.end() ? rep_.probes.front() : *own_probe;
        rep_.probed = true;
    }
}

MeasuredRun Measurement::limited_run(size_t i, size_t n, std::optional<uint64_t> read_ahead_kb) {
    const std::string & ram = opt_.ram[i];
    MeasuredRun r;
    r.ram = ram;
    r.limit_bytes = limits_[i];
    r.cache_bytes = limits_[i] - rep_.resident_need_bytes;
    r.read_ahead_kb = read_ahead_kb;
    bracketed(r, limits_[i], fmt::format("run{}", n), [&] {
        drop_model_pages(gguf_->shard_paths());
        MemoryCgroup cgroup(cgroups_, limits_[i], scratch_);
        WorkerSpec spec = decode_spec(fmt::format("measure {} ({})", ram, mib(limits_[i])));
        spec.residency_every = std::max(1, opt_.tokens / 16);
        spec.residency_experts = routed_expert_slabs(*gguf_, info_);
        spec.shards = gguf_->shard_paths();
        const WorkerExit w = run_worker_in(spec, cgroup, fmt::format("run{}", n), fmt::format("--ram {}", ram));
        r.peak_bytes = cgroup.peak_bytes();
        r.detail = read_decode_detail(JsonFields(w.result, fmt::format("the result of --ram {}", ram)));
        r.decode = decode_figures(*r.detail);
    });
    return r;
}

// Each limited run predicted from the resident run, the trace and a read rate that never
// saw it: the decode's own, fitted on the other limits at its read-ahead
// (fit_stream), or the storage probe's where no other limit streamed. The
// calibration kept for the plan is fitted on every limit that streamed.
void Measurement::predict() {
    if (!rep_.probed) {
        return;
    }
    for (size_t i = 0; i < rep_.calibrations.size(); ++i) {
        StreamCalibration & c = rep_.calibrations[i];
        const ProbeFigures & p = rep_.probes[i];
        c.process_bytes = rep_.process_bytes;
        c.page_bytes = uint64_t(::sysconf(_SC_PAGESIZE));
        // Without a sequential read, or per-process I/O counts, the probe's own rate stands
        // in for the device's, its waits folded into it.
        c.read_gbps = p.sequential_gbps > 0 && p.fault_ms >= 0 ? p.sequential_gbps
                      : p.read_gbps > 0                        ? p.read_gbps
                                                               : p.effective_gbps;
        c.fault_ms = p.sequential_gbps > 0 && p.fault_ms >= 0 ? p.fault_ms : 0;
        c.sequential_gbps = std::max(0.0, p.sequential_gbps);
    }
    const TraceReader trace = TraceReader::open(all_tokens_trace_);
    const auto calibration_of = [&](const MeasuredRun & r) {
        return std::find_if(rep_.calibrations.begin(), rep_.calibrations.end(),
                            [&](const StreamCalibration & c) { return c.read_ahead_kb == r.read_ahead_kb; });
    };
    for (MeasuredRun & r : rep_.runs) {
        const std::vector<ResidencySample> samples = r.detail && r.detail->residency ? *r.detail->residency
                                                                                       : std::vector<ResidencySample>{};
        std::vector<uint64_t> after;
        for (const ResidencySample & sample : samples) {
            after.push_back(sample.token);
        }
        r.prediction = predict_stream(*gguf_, trace, uint64_t(opt_.warmup), r.limit_bytes, *calibration_of(r), after);
        r.predicted = true;
        r.residency = residency_agreement(samples, r.prediction.resident_experts,
                                          info_.routed_layers().size() * size_t(info_.n_expert));
    }
    // The limits at one read-ahead that streamed, but for `left_out`.
    const auto fit_points = [&](const StreamCalibration & c, const MeasuredRun * left_out, std::vector<std::string> * on) {
        std::vector<StreamFitPoint> points;
        for (const MeasuredRun & r : rep_.runs) {
            if (&r != left_out && r.read_ahead_kb == c.read_ahead_kb && r.prediction.read_bytes_per_token > 0) {
                points.push_back(fit_point(r.prediction, c, r.decode.ms_mean));
                if (on) {
                    on->push_back(r.ram);
                }
            }
        }
        return points;
    };
    std::vector<double> errors;
    for (MeasuredRun & r : rep_.runs) {
        StreamCalibration c = *calibration_of(r);
        if (const StreamFit fit = fit_stream(fit_points(c, &r, nullptr), c.compute_ms, c.read_gbps); fit.read_gbps > 0) {
            c.read_gbps = fit.read_gbps;
            c.stream_ms = fit.stream_ms;
            c.fault_ms = 0;
        }
        time_stream(r.prediction, c);
        r.error = std::abs(r.prediction.tokens_per_second - r.decode.tokens_per_second) / r.decode.tokens_per_second;
        errors.push_back(r.error);
    }
    for (StreamCalibration & c : rep_.calibrations) {
        std::vector<std::string> on;
        if (const StreamFit fit = fit_stream(fit_points(c, nullptr, &on), c.compute_ms, c.read_gbps); fit.read_gbps > 0) {
            c.read_gbps = fit.read_gbps;
            c.stream_ms = fit.stream_ms;
            c.fault_ms = 0;
            c.fitted_on = on;
        }
        if (c.read_ahead_kb == rep_.probe.read_ahead_kb) {
            rep_.calibration = c;
        }
    }
    if (!errors.empty()) {
        rep_.median_error = quantile(errors, 0.5);
        rep_.max_error = *std::max_element(errors.begin(), errors.end());
    }
}

MeasureReport Measurement::finish() {
    utsname u{};
    ::uname(&u);
    rep_.settings = {{"ram", opt_.ram},       {"tokens", opt_.tokens},       {"warmup", opt_.warmup}, {"min_seconds", opt_.min_seconds}, {"repeats", opt_.repeats},
                     {"ctx", ctx_},           {"threads", threads_},         {"probe_mib", opt_.probe_mib},
                     {"seed", opt_.seed},     {"batch", 1},                  {"mmap", true},
                     {"repack", opt_.repack}, {"text_only", opt_.text_only}, {"read_ahead_kb", opt_.read_ahead_kb}};
    rep_.threads = threads_;
    rep_.system = {{"kernel", fmt::format("{} {}", u.sysname, u.release)},
                   {"machine", u.machine},
                   {"cpus", std::thread::hardware_concurrency()},
                   {"page_size", ::sysconf(_SC_PAGESIZE)},
                   {"cgroup_version", cgroups_.version},
                   {"cgroup_parent", cgroups_.parent.string()},
                   {"storage", storage_}};
    std::optional<AtomicOutput> json_out;
    if (!opt_.json_out.empty()) {
        json_out.emplace(opt_.json_out);
    }
    if (trace_out_) {
        rep_.trace = opt_.trace_out.string();
    }
    if (json_out) {
        write_temp_file(*json_out, to_json(rep_).dump(2) + "\n");
    }
    if (trace_out_) {
        trace_out_->commit();
    }
    if (json_out) {
        json_out->commit();
    }
    return rep_;
}

} // namespace

std::string to_text(const MeasureReport & r) {
    std::string out = fmt::format("model {}: {} of routed experts, {} resident ({} weights + {} process)\n",
                                  r.model.value("path", ""), mib(r.routed_expert_bytes), mib(r.resident_need_bytes),
                                  mib(r.resident_weight_bytes), mib(r.process_bytes));
    const auto line = [](const MeasuredRun & m) {
        const DecodeFigures & d = m.decode;
        return fmt::format("{:>12} {:>12} {:>12} {:>10.2f} {:>10.2f} {:>12.2f} {:>14} {:>12} {:>14} {:>8} {:>8}\n", m.ram,
                           m.limit_bytes ? mib(m.limit_bytes) : "-", mib(m.cache_bytes), d.tokens_per_second,
                           d.ms_median, d.major_faults_per_token,
                           d.read_bytes_per_token < 0 ? "-" : mib(uint64_t(d.read_bytes_per_token)),
                           m.predicted ? fmt::format("{:.2f}", m.prediction.tokens_per_second) : "-",
                           m.predicted ? mib(uint64_t(m.prediction.read_bytes_per_token)) : "-",
                           m.predicted ? fmt::format("{:.0f}%", 100 * m.error) : "-",
                           m.read_ahead_kb ? std::to_string(*m.read_ahead_kb) : "-");
    };
    out += fmt::format("{:>12} {:>12} {:>12} {:>10} {:>10} {:>12} {:>14} {:>12} {:>14} {:>8} {:>8}\n", "ram", "limit",
                       "expert cache", "tok/s", "ms median", "faults/tok", "read/tok", "pred tok/s", "pred read/tok",
                       "error", "RA KB");
    out += line(r.resident);
    for (const MeasuredRun & m : r.runs) {
        out += line(m);
    }
    if (!r.runs.empty() && r.runs.front().repeats_tokens_per_second.size() > 1) {
        std::vector<std::string> each;
        for (const MeasuredRun & m : r.runs) {
            each.push_back(fmt::format("{} {:.3g}", m.ram, fmt::join(m.repeats_tokens_per_second, "/")));
        }
        out += fmt::format("each limit is the median of {} runs, the rounds interleaved (tok/s: {})\n",
                           r.runs.front().repeats_tokens_per_second.size(), fmt::join(each, ", "));
    }
    for (const ProbeFigures & p : r.probes) {
        out += fmt::format("probe at read-ahead {}: {} experts ({}) cold through page faults, {} threads: {:.3f} GB/s "
                           "needed", p.read_ahead_kb ? fmt::format("{} KB", *p.read_ahead_kb) : "(unknown)", p.experts,
                           mib(p.bytes_needed), p.threads, p.effective_gbps);
        if (p.read_gbps >= 0) {
            out += fmt::format(", {:.3f} GB/s read, readahead x{:.2f}", p.read_gbps, p.readahead_amplification);
        }
        out += fmt::format(", {:.0f} us per major fault", p.fault_latency_us);
        if (p.fault_ms >= 0) {
            out += fmt::format(" ({:.2f} ms beyond the {:.3f} GB/s of sequential reads)", p.fault_ms, p.sequential_gbps);
        }
        out += fmt::format(", {:.2f} ms per expert (median)\n", p.expert_ms_median);
    }
    for (const StreamCalibration & c : r.calibrations) {
        if (r.median_error < 0) {
            break;   // not calibrated: a busy machine, or no probe
        }
        const std::string at = c.read_ahead_kb ? fmt::format("{} KB", *c.read_ahead_kb) : "(unknown)";
        if (c.fitted_on.empty()) {
            out += fmt::format("calibration at read-ahead {}: {:.2f} ms per token resident, {:.2f} ms per read-around, "
                               "{:.3f} GB/s (the probe's)\n", at, c.compute_ms, c.fault_ms, c.read_gbps);
        } else {
            out += fmt::format("calibration at read-ahead {}: {:.2f} ms per token resident, {:.3f} GB/s of {} "
                               "simulated reads{} and {:.2f} ms per token that reads, as llama.cpp decoded under {}\n",
                               at, c.compute_ms, c.read_gbps, c.sequential_gbps > 0 ? "the experts'" : "the",
                               c.sequential_gbps > 0 ? fmt::format(" (the rest at the {:.3f} GB/s of sequential reads)",
                                                                   c.sequential_gbps)
                                                     : "",
                               c.stream_ms, fmt::join(c.fitted_on, ", "));
        }
    }
    for (const MeasuredRun * m : all_runs(r)) {
        if (!m->llama_bench.is_null()) {
            out += fmt::format("llama-bench under {}: {:.2f} tokens/s (before and after measure's run, repetitions after the first), measure {:.2f}: {:.1f}% apart\n",
                               m->ram, m->llama_bench.at("tokens_per_second").get<double>(), m->decode.tokens_per_second,
                               100 * m->llama_bench.at("difference").get<double>());
        }
    }
    if (!r.busy.empty()) {
        out += fmt::format("the machine was busy: {}: measure again on a quiet machine (nothing is calibrated on these "
                           "figures, and plan --measured refuses them)\n", r.busy);
    }
    if (r.median_error >= 0) {
        out += fmt::format("each limit predicted from the resident run, the trace and the read rate of the other limits "
                           "at its read-ahead (the probe's where none streamed): median error {:.1f}%, max {:.1f}%\n",
                           100 * r.median_error, 100 * r.max_error);
    }
    for (const MeasuredRun & m : r.runs) {
        if (m.predicted && !m.prediction.outside_model.empty()) {
            out += fmt::format("at {}, the prediction is not an answer: {}\n", m.ram, m.prediction.outside_model);
        }
    }
    return out;
}

RamLimit parse_ram_limit(const std::string & ram, const std::string & flag) {
    RamLimit out;
    if (!ram.empty() && ram.back() == '%') {
        double share = -1;
        try {
            size_t used = 0;
            share = std::stod(ram.substr(0, ram.size() - 1), &used);
            share = used == ram.size() - 1 && ram.find_first_not_of("0123456789.%") == std::string::npos ? share : -1;
        } catch (const std::exception &) {
            share = -1;
        }
        if (!(share >= 0 && share <= 1000)) {
            throw Error(fmt::format("{} \"{}\": not a share of the expert bytes (0% to 1000%, e.g. 50%)", flag, ram));
        }
        out.share = true;
        out.value = share;
        return out;
    }
    if (ram.empty()) {
        throw Error(fmt::format("{}: an empty limit; give sizes (768M, 2G) or shares (50%), separated by commas", flag));
    }
    out.value = parse_size(ram, flag);
    return out;
}

MeasureReport run_measure(const MeasureOptions & opt) {
    Measurement m(opt);
    return m.run();
}

} // namespace moeprune
