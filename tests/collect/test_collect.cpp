// moeprune collect on synthesized models: the planted truth comes back out of the
// statistics, the invariants hold in every layer, shards merge to the single run,
// the trace agrees, a killed run resumes, RPC matches local, and the REAP numbers
// agree with a plain C++ recomputation from the model's weights.
#include "collect/collect.h"
#include "core/errors.h"
#include "formats/stats.h"
#include "formats/trace.h"
#include "model/model_file.h"
#include "support/test_support.h"
#include "synth/synth.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <numeric>
#include <thread>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/wait.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Documents of one text kind each, labelled with their domain.
std::string planted_corpus(int rounds) {
    std::string out;
    for (int i = 0; i < rounds; ++i) {
        out += json{{"text", fmt::format("int main() {{ return f(x) == g[{}] && h != 0; }}\nstd::vector<int> v{{1, 2}}; "
                                         "const int* p = &v[0];\nstruct S {{ void run() const; }};\n",
                                         i)},
                    {"domain", "code"}}
                   .dump() +
               "\n";
        out += json{{"text", "専門家の混合モデルは、入力ごとに一部の専門家だけを使います。東京の天気は晴れです。"
                             "我们在笔记本电脑上运行大型语言模型，需要减少内存使用。"},
                    {"domain", "cjk"}}
                   .dump() +
               "\n";
        out += json{{"text", fmt::format("The expert cache keeps the most useful experts resident while the rest stream "
                                         "from disk, round {}.",
                                         i)},
                    {"domain", "english"}}
                   .dump() +
               "\n";
    }
    return out;
}

struct Model {
    fs::path path;
    json planted;
};

Model synth_model(const fs::path & dir, const std::string & arch, bool planted, ggml_type type = GGML_TYPE_F32) {
    SynthOptions o = test::synth_options();
    o.arch = arch;
    o.n_layer = 3;
    o.n_expert = 12;
    o.n_expert_used = 3;
    o.expert_type = type;
    o.dead = planted ? 2 : 0;
    o.specialists = planted;
    o.output = dir / (arch + ".gguf");
    const SynthResult r = synthesize(o);
    return {r.files.front(), r.planted};
}

CollectOptions options(const Model & m, const fs::path & corpus, const fs::path & out) {
    CollectOptions o;
    o.model = m.path;
    o.corpus = corpus;
    o.output = out;
    o.ctx = 128;
    o.batch = 64;
    o.ubatch = 32;
    o.threads = 2;
    return o;
}

void expect_invariants(const SaliencyStats & s) {
    for (size_t l = 0; l < s.layers.size(); ++l) {
        uint64_t picks = 0;
        double prob = 0;
        for (size_t e = 0; e < size_t(s.n_expert); ++e) {
            picks += s.layers[l].count[e];
            prob += s.layers[l].prob_sum[e];
        }
        EXPECT_EQ(picks, s.n_tokens * uint64_t(s.n_expert_used)) << "layer " << l;
        EXPECT_NEAR(prob, double(s.n_tokens), 1e-3 * double(s.n_tokens)) << "layer " << l;
    }
    EXPECT_TRUE(s.settings["invariants"]["ok"].get<bool>()) << s.settings.dump();
}

// A port nothing listens on now: the kernel picks it for a socket bound to port 0.
int free_loopback_port() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr *>(&addr), &len) != 0) {
        throw Error("cannot find a free loopback port");
    }
    close(fd);
    return ntohs(addr.sin_port);
}

// Whether something accepts connections on the loopback port within ten seconds.
bool wait_for_listener(int port) {
    for (int attempt = 0; attempt < 500; ++attempt) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(uint16_t(port));
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        const bool up = connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) == 0;
        close(fd);
        if (up) {
            return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
}

class CollectPlanted : public ::testing::TestWithParam<std::string> {};

} // namespace

// Dead experts have count 0 in every layer, each specialist leads its domain, and the
// invariants hold in every layer, the last included.
TEST_P(CollectPlanted, RecoversThePlantedTruth) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), GetParam(), true);
    test::write_text(dir / "corpus.jsonl", planted_corpus(4));
    const CollectResult r = collect(options(m, dir / "corpus.jsonl", dir / "stats.json"));
    const SaliencyStats s = read_stats(dir / "stats.json");
    EXPECT_EQ(s.n_tokens, r.stats.n_tokens);
    ASSERT_EQ(s.n_layer, 3);
    expect_invariants(s);
    EXPECT_EQ(s.settings["gating"], "softmax");
    uint64_t domain_tokens = 0;
    for (const auto & [name, d] : s.domains) {
        domain_tokens += d.n_tokens;
    }
    EXPECT_EQ(domain_tokens, s.n_tokens);
    for (int l = 0; l < 3; ++l) {
        for (int e : m.planted["dead"][std::to_string(l)].get<std::vector<int>>()) {
            EXPECT_EQ(s.layers[size_t(l)].count[size_t(e)], 0u) << "dead expert " << e << " layer " << l;
        }
        // A specialist fires on its kind's tokens and almost nowhere else; a generic expert
        // may still be busier in absolute terms, so "leads" is measured as the domain's
        // share minus the share elsewhere: the specialist's is the largest of all experts.
        for (const auto & [id, kind] : m.planted["specialists"][std::to_string(l)].items()) {
            const DomainStats & own = s.domains.at(kind.get<std::string>());
            const double rest_tokens = double(s.n_tokens - own.n_tokens);
            const auto lift = [&](size_t e) {
                const double in = double(own.layers[size_t(l)].count[e]);
                return in / double(own.n_tokens) - (double(s.layers[size_t(l)].count[e]) - in) / rest_tokens;
            };
            const size_t spec = std::stoul(id);
            EXPECT_GE(double(own.layers[size_t(l)].count[spec]) / double(own.n_tokens), 0.4) << kind << " layer " << l;
            EXPECT_LE((double(s.layers[size_t(l)].count[spec]) - double(own.layers[size_t(l)].count[spec])) / rest_tokens, 0.05)
                << kind << " specialist " << spec << " fires outside its domain in layer " << l;
            for (size_t e = 0; e < size_t(s.n_expert); ++e) {
                if (e != spec) {
                    EXPECT_GT(lift(spec), lift(e)) << kind << " specialist " << spec << " vs expert " << e << " layer " << l;
                }
            }
        }
        for (size_t e = 0; e < size_t(s.n_expert); ++e) {
            if (s.layers[size_t(l)].count[e] > 0) {
                EXPECT_GT(s.layers[size_t(l)].reap_sum[e], 0.0) << "expert " << e << " routed but no REAP mass";
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Archs, CollectPlanted, ::testing::Values("qwen3moe", "qwen2moe"));

// The trace's top-k reproduces the statistics; tokens carry sequence, domain, position
// and phase; --generate adds decode tokens.
TEST(Collect, TraceAgreesWithStatisticsAndRecordsDecode) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", true);
    test::write_text(dir / "corpus.jsonl", planted_corpus(2));
    CollectOptions o = options(m, dir / "corpus.jsonl", dir / "stats.json");
    o.trace = dir / "run.trace";
    o.trace_top = 8;
    o.generate = 5;
    o.coact = true;
    collect(o);
    const SaliencyStats s = read_stats(dir / "stats.json");
    expect_invariants(s);
    EXPECT_EQ(s.settings["output_head"], "computed") << "--generate samples from the logits";
    const TraceReader t = TraceReader::open(dir / "run.trace");
    ASSERT_EQ(t.n_tokens(), s.n_tokens);
    EXPECT_EQ(t.header().top_m, 8u);
    EXPECT_EQ(t.header().meta["n_expert_used"], 3);
    for (uint32_t l = 0; l < 3; ++l) {
        std::vector<uint16_t> ids;
        std::vector<float> logits;
        t.read_layer(l, ids, logits);
        std::vector<uint64_t> count(12, 0);
        for (size_t i = 0; i < t.n_tokens(); ++i) {
            for (int j = 0; j < 3; ++j) {
                ++count[ids[i * 8 + size_t(j)]];
            }
        }
        EXPECT_EQ(count, s.layers[l].count) << "layer " << l;
        uint64_t pairs = 0;
        for (uint64_t c : s.layers[l].coact) {
            pairs += c;
        }
        EXPECT_EQ(pairs, s.n_tokens * 3) << "three pairs per token at top-3";
    }
    const auto meta = t.token_meta();
    uint64_t decode = 0;
    int32_t last_seq = -1;
    for (size_t i = 0; i < meta.size(); ++i) {
        decode += meta[i].phase == TracePhase::Decode;
        EXPECT_GE(meta[i].seq, last_seq);
        if (meta[i].seq != last_seq) {
            EXPECT_EQ(meta[i].pos, 0) << "each document starts a clean context";
            last_seq = meta[i].seq;
        }
        EXPECT_EQ(t.header().domains.at(meta[i].domain).empty(), false);
    }
    EXPECT_EQ(last_seq, 5);  // six documents
    EXPECT_GT(decode, 0u);
    EXPECT_LE(decode, 6u * 5u);
}

// Every graph variant synth can build: softmax with renormalized gates (qwen3moe),
// without (qwen2moe, shared expert), per-expert output scales (ffn_moe_down_scaled)
// and merged gate/up projections with scales (qwen4exp).
TEST(Collect, EveryGraphVariantSynthBuildsKeepsTheInvariants) {
    test::TempDir dir;
    test::write_text(dir / "corpus.jsonl", planted_corpus(1));
    struct Variant {
        std::string arch;
        bool gate_up, scales;
        std::string f_node;
    };
    for (const Variant & v : {Variant{"qwen3moe", false, true, "ffn_moe_down_scaled"},
                              Variant{"qwen4exp", true, true, "ffn_moe_down_scaled"},
                              Variant{"qwen4exp", false, false, "ffn_moe_down"},
                              Variant{"dots1", false, false, "ffn_moe_down"}}) {
        SynthOptions so = test::synth_options();
        so.arch = v.arch;
        so.n_layer = v.arch == "dots1" ? 3 : 2;  // dots1's first layer is dense
        so.n_expert = 8;
        so.n_expert_used = 2;
        so.gate_up = v.gate_up;
        so.expert_scales = v.scales;
        so.output = dir / fmt::format("{}-{}-{}.gguf", v.arch, v.gate_up, v.scales);
        const Model m{synthesize(so).files.front(), {}};
        CollectOptions o = options(m, dir / "corpus.jsonl", dir / "s.json");
        o.trace = dir / "t.trace";
        const CollectResult r = collect(o);
        const SaliencyStats s = read_stats(dir / "s.json");
        EXPECT_EQ(s.settings["expert_output_node"], v.f_node) << v.arch;
        // Statistics alone need no logits: every evaluation stopped before the output head.
        EXPECT_TRUE(r.head_skipped) << v.arch;
        EXPECT_GT(r.decodes, 0u);
        EXPECT_EQ(s.settings["output_head"], "skipped") << v.arch;
        EXPECT_EQ(s.settings["timing"]["tokens"], s.n_tokens);
        EXPECT_GT(s.settings["timing"]["tok_per_s"].get<double>(), 0.0);
        if (v.arch == "dots1") {
            // Sigmoid gating: probabilities do not sum to one; routing still must.
            EXPECT_EQ(s.settings["gating"], "sigmoid");
            EXPECT_EQ(s.model["moe_layers"], json::array({1, 2}));
            EXPECT_TRUE(s.settings["invariants"]["ok"].get<bool>());
            for (const LayerStats & L : s.layers) {
                EXPECT_EQ(std::accumulate(L.count.begin(), L.count.end(), uint64_t(0)), s.n_tokens * 2);
            }
        } else {
            expect_invariants(s);
            EXPECT_EQ(s.settings["gating"], "softmax") << v.arch;
        }
        double reap = 0;
        for (const LayerStats & L : s.layers) {
            for (double r : L.reap_sum) {
                reap += r;
            }
        }
        EXPECT_GT(reap, 0.0) << v.arch;
    }
}

// Conversations are rendered with the model's chat template, special tokens parse
// by default (and not with --no-parse-special), and --generate answers the last user
// turn with decode tokens.
TEST(Collect, RendersConversationsAndParsesSpecialTokens) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    test::write_text(dir / "chat.jsonl",
                     json{{"messages", {{{"role", "user"}, {"content", "hello there"}}, {{"role", "assistant"}, {"content", "hi"}}}},
                          {"session", 7}}
                             .dump() + "\n");
    CollectOptions o = options(m, dir / "chat.jsonl", dir / "s.json");
    o.trace = dir / "t.trace";
    o.generate = 3;
    collect(o);
    const TraceReader t = TraceReader::open(dir / "t.trace");
    const auto meta = t.token_meta();
    ASSERT_GT(meta.size(), 4u);
    EXPECT_EQ(meta[0].token, test::special_token_id(m.path, "<|im_start|>")) << "<|im_start|> must be one special token";
    EXPECT_EQ(meta[0].seq, 7) << "the session is the sequence";
    size_t decode = 0;
    for (const auto & tm : meta) {
        decode += tm.phase == TracePhase::Decode;
    }
    EXPECT_GE(decode, 1u);
    EXPECT_LE(decode, 3u);
    test::write_text(dir / "plain.txt", "<|im_start|>user\nhello<|im_end|>\n");
    o = options(m, dir / "plain.txt", dir / "p.json");
    o.trace = dir / "p.trace";
    o.parse_special = false;
    collect(o);
    EXPECT_NE(TraceReader::open(dir / "p.trace").token_meta()[0].token, test::special_token_id(m.path, "<|im_start|>"));
}

// A NaN planted in one expert's weights: every row routed there is counted in
// nonfinite_drops (its layer, never summed into REAP), and --strict stops naming it.
TEST(Collect, NonFiniteExpertOutputsAreCountedOrFatal) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    const GgufModel g = GgufModel::open(m.path);
    const TensorEntry * down = nullptr;
    for (const TensorEntry & t : g.tensors()) {
        down = t.name == "blk.1.ffn_down_exps.weight" ? &t : down;
    }
    ASSERT_NE(down, nullptr);
    ASSERT_EQ(down->type, GGML_TYPE_F32);
    const uint64_t per_expert = down->nbytes / uint64_t(down->outer_dim());
    {
        std::fstream f(m.path, std::ios::in | std::ios::out | std::ios::binary);
        const float nan = std::nanf("");
        for (int e = 0; e < 12; ++e) {  // every expert of layer 1: whatever the routing, rows go non-finite
            f.seekp(std::streamoff(down->file_offset + uint64_t(e) * per_expert));
            f.write(reinterpret_cast<const char *>(&nan), sizeof nan);
        }
    }
    test::write_text(dir / "c.txt", "The expert cache keeps the most useful experts resident.");
    collect(options(m, dir / "c.txt", dir / "s.json"));
    const SaliencyStats s = read_stats(dir / "s.json");
    EXPECT_EQ(s.layers[0].nonfinite_drops, 0u);
    EXPECT_EQ(s.layers[1].nonfinite_drops, s.n_tokens * 3) << "every routed row of layer 1";
    EXPECT_EQ(s.nonfinite_drops, s.layers[1].nonfinite_drops + s.layers[2].nonfinite_drops);
    for (double r : s.layers[1].reap_sum) {
        EXPECT_EQ(r, 0.0);
    }
    uint64_t picks = 0;
    for (uint64_t c : s.layers[1].count) {
        picks += c;
    }
    EXPECT_EQ(picks, s.n_tokens * 3) << "routing is still counted";
    CollectOptions o = options(m, dir / "c.txt", dir / "strict.json");
    o.strict = true;
    try {
        collect(o);
        ADD_FAILURE() << "--strict accepted a NaN";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("at layer 1"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "strict.json"));
}

// --trace-tokens traces a prefix and the statistics still cover everything; the trace
// invariant is checked over the traced tokens.
TEST(Collect, TraceTokensLimitsOnlyTheTrace) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    test::write_text(dir / "corpus.jsonl", planted_corpus(2));
    CollectOptions o = options(m, dir / "corpus.jsonl", dir / "s.json");
    o.trace = dir / "t.trace";
    o.trace_tokens = 25;
    const CollectResult r = collect(o);
    EXPECT_EQ(TraceReader::open(dir / "t.trace").n_tokens(), 25u);
    EXPECT_EQ(r.traced_tokens, 25u);
    const SaliencyStats s = read_stats(dir / "s.json");
    EXPECT_GT(s.n_tokens, 25u);
    expect_invariants(s);
}

// The disk fills while the statistics are written, after the trace (one token, far
// smaller) is whole: neither output may appear, or a finished trace would stand beside
// no statistics.
TEST(Collect, AFailedStatisticsWriteLeavesNoTrace) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    test::write_text(dir / "corpus.jsonl", planted_corpus(2));
    const std::string args = fmt::format("collect -m {} -f {} -c 128 -t 2 --trace-tokens 1", m.path.string(),
                                         (dir / "corpus.jsonl").string());
    const std::string collect = test::bin("moeprune").string() + " " + args;
    const auto free = test::run_command(fmt::format("{} -o {} --trace {}", collect, (dir / "free.json").string(),
                                                    (dir / "free.trace").string()));
    ASSERT_EQ(free.exit_code, 0) << free.output;
    const uint64_t limit = 2048;  // bash's ulimit -f 2, in KiB
    ASSERT_LT(fs::file_size(dir / "free.trace"), limit);
    ASSERT_GT(fs::file_size(dir / "free.json"), limit);
    const fs::path out = dir / "s.json", trace = dir / "t.trace";
    const auto full = test::run_command(fmt::format("bash -c 'ulimit -f 2; exec \"$0\" \"$@\"' {} -o {} --trace {}", collect,
                                                    out.string(), trace.string()));
    EXPECT_NE(full.exit_code, 0) << full.output;
    EXPECT_NE(full.output.find(out.string() + ".partial"), std::string::npos) << full.output;
    EXPECT_NE(full.output.find("File too large"), std::string::npos) << full.output;
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(fs::exists(trace));
    for (const auto & e : fs::directory_iterator(dir.path())) {
        EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << e.path();
    }
}

// A corpus in two shards, collected separately and merged, gives the single run's counts.
TEST(Collect, ShardsMergeToTheSingleRun) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", true);
    const std::string corpus = planted_corpus(3);
    test::write_text(dir / "all.jsonl", corpus);
    const size_t cut = corpus.find('\n', corpus.size() / 2) + 1;
    test::write_text(dir / "a.jsonl", corpus.substr(0, cut));
    test::write_text(dir / "b.jsonl", corpus.substr(cut));
    collect(options(m, dir / "all.jsonl", dir / "all.json"));
    collect(options(m, dir / "a.jsonl", dir / "a.json"));
    collect(options(m, dir / "b.jsonl", dir / "b.json"));
    const auto r = test::run_command(fmt::format("{} merge {} {} -o {}", test::bin("moeprune").string(),
                                                 (dir / "a.json").string(), (dir / "b.json").string(),
                                                 (dir / "ab.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const SaliencyStats all = read_stats(dir / "all.json"), ab = read_stats(dir / "ab.json");
    EXPECT_EQ(ab.n_tokens, all.n_tokens);
    for (size_t l = 0; l < 3; ++l) {
        EXPECT_EQ(ab.layers[l].count, all.layers[l].count) << "layer " << l;
        for (size_t e = 0; e < 12; ++e) {
            EXPECT_NEAR(ab.layers[l].reap_sum[e], all.layers[l].reap_sum[e], 1e-9 * (1 + all.layers[l].reap_sum[e]));
            EXPECT_NEAR(ab.layers[l].prob_sum[e], all.layers[l].prob_sum[e], 1e-9 * (1 + all.layers[l].prob_sum[e]));
        }
        for (const auto & [name, d] : all.domains) {
            EXPECT_EQ(ab.domains.at(name).layers[l].count, d.layers[l].count) << name;
        }
    }
}

// A run killed with SIGKILL after a checkpoint resumes to exactly the uninterrupted
// result, trace included.
TEST(Collect, KilledRunResumesToTheSameResult) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", true);
    test::write_text(dir / "corpus.jsonl", planted_corpus(60));
    const std::string base = fmt::format("{} collect -m {} -f {} -c 128 -b 64 -ub 32 -t 1 --save-every 2 --trace-top 6",
                                         test::bin("moeprune").string(), m.path.string(), (dir / "corpus.jsonl").string());
    const auto full = test::run_command(fmt::format("{} -o {} --trace {}", base, (dir / "full.json").string(),
                                                    (dir / "full.trace").string()));
    ASSERT_EQ(full.exit_code, 0) << full.output;

    const fs::path out = dir / "killed.json";
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const std::string cmd = fmt::format("exec {} -o {} --trace {} >/dev/null 2>&1", base, out.string(),
                                            (dir / "killed.trace").string());
        execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
        _exit(127);
    }
    // Kill as soon as the first checkpoint is on disk.
    const fs::path checkpoint = dir / "killed.json.checkpoint";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!fs::exists(checkpoint) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(fs::exists(checkpoint));
    // The checkpoint has its own name: nothing under the statistics' name for a reader
    // that never looks at "complete" to take for finished statistics.
    EXPECT_FALSE(fs::exists(out));
    const SaliencyStats partial = read_stats(checkpoint);
    ASSERT_FALSE(partial.settings["progress"]["complete"].get<bool>()) << "the run finished before it could be killed";
    EXPECT_LT(partial.n_tokens, read_stats(dir / "full.json").n_tokens);
    // The unfinished trace is not under the trace's name, and nothing takes the checkpoint for statistics.
    EXPECT_FALSE(fs::exists(dir / "killed.trace"));
    EXPECT_TRUE(fs::exists(dir / "killed.trace.partial"));
    const auto merged = test::run_command(fmt::format("{} merge {} {} -o {}", test::bin("moeprune").string(),
                                                      (dir / "full.json").string(), checkpoint.string(),
                                                      (dir / "merged.json").string()));
    EXPECT_NE(merged.exit_code, 0);
    EXPECT_NE(merged.output.find("checkpoint"), std::string::npos) << merged.output;
    EXPECT_FALSE(fs::exists(dir / "merged.json"));

    const auto resumed = test::run_command(fmt::format("{} -o {} --trace {} --resume", base, out.string(),
                                                       (dir / "killed.trace").string()));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const SaliencyStats a = read_stats(dir / "full.json"), b = read_stats(out);
    EXPECT_EQ(b.n_tokens, a.n_tokens);
    for (size_t l = 0; l < 3; ++l) {
        EXPECT_EQ(b.layers[l].count, a.layers[l].count) << "layer " << l;
        for (size_t e = 0; e < 12; ++e) {
            EXPECT_NEAR(b.layers[l].reap_sum[e], a.layers[l].reap_sum[e], 1e-9 * (1 + a.layers[l].reap_sum[e]));
        }
    }
    EXPECT_FALSE(fs::exists(dir / "killed.trace.partial"));
    EXPECT_FALSE(fs::exists(checkpoint)) << "the finished run left its checkpoint";
    const TraceReader ta = TraceReader::open(dir / "full.trace"), tb = TraceReader::open(dir / "killed.trace");
    ASSERT_EQ(tb.n_tokens(), ta.n_tokens());
    for (uint32_t l = 0; l < 3; ++l) {
        std::vector<uint16_t> ia, ib;
        std::vector<float> za, zb;
        ta.read_layer(l, ia, za);
        tb.read_layer(l, ib, zb);
        EXPECT_EQ(ia, ib) << "layer " << l;
    }
    const auto again = test::run_command(fmt::format("{} -o {} --resume", base, out.string()));
    EXPECT_NE(again.exit_code, 0);
    EXPECT_NE(again.output.find("finished run"), std::string::npos) << again.output;
}

// REAP recomputed in plain C++ from the GGUF's f32 weights and the layer's input
// (captured from the graph): router softmax, top-k, renormalized gates, SwiGLU experts.
TEST(Collect, ReapAgreesWithAnIndependentComputation) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    const std::string text = "The expert cache keeps the most useful experts resident. def f(x): return x * 2\n";
    test::write_text(dir / "corpus.txt", text);
    collect(options(m, dir / "corpus.txt", dir / "stats.json"));
    const SaliencyStats s = read_stats(dir / "stats.json");
    const int layer = 1;

    // The layer's input for every token, from llama.cpp's own graph.
    struct Capture {
        std::vector<std::vector<float>> x;
    } cap;
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(m.path.c_str(), llama_model_default_params());
    ASSERT_NE(model, nullptr);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> toks(text.size() + 8);
    const int n = llama_tokenize(vocab, text.data(), int32_t(text.size()), toks.data(), int32_t(toks.size()), true, true);
    ASSERT_EQ(uint64_t(n), s.n_tokens);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 128;
    cp.n_batch = 128;
    cp.n_ubatch = 128;
    cp.cb_eval = [](ggml_tensor * t, bool ask, void * ud) {
        if (std::string(t->name) != "ffn_norm-" + std::to_string(layer)) {
            return false;
        }
        if (ask) {
            return true;
        }
        auto & c = *static_cast<Capture *>(ud);
        std::vector<float> buf(size_t(ggml_nelements(t)));
        ggml_backend_tensor_get(t, buf.data(), 0, buf.size() * sizeof(float));
        for (int64_t r = 0; r < t->ne[1]; ++r) {
            c.x.emplace_back(buf.begin() + r * t->ne[0], buf.begin() + (r + 1) * t->ne[0]);
        }
        return true;
    };
    cp.cb_eval_user_data = &cap;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = toks[size_t(i)];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;
    }
    batch.n_tokens = n;
    ASSERT_EQ(llama_decode(ctx, batch), 0);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    ASSERT_EQ(cap.x.size(), size_t(n));

    // The weights, straight from the file.
    ggml_context * wctx = nullptr;
    gguf_context * g = gguf_init_from_file(m.path.c_str(), {false, &wctx});
    ASSERT_NE(g, nullptr);
    const auto tensor = [&](const std::string & name) {
        ggml_tensor * t = ggml_get_tensor(wctx, fmt::format("blk.{}.{}", layer, name).c_str());
        EXPECT_NE(t, nullptr) << name;
        EXPECT_EQ(t->type, GGML_TYPE_F32) << name;
        return t;
    };
    const ggml_tensor * router = tensor("ffn_gate_inp.weight");  // [n_embd, E]
    const ggml_tensor * gate = tensor("ffn_gate_exps.weight");   // [n_embd, n_ff, E]
    const ggml_tensor * up = tensor("ffn_up_exps.weight");
    const ggml_tensor * down = tensor("ffn_down_exps.weight");   // [n_ff, n_embd, E]
    const int64_t n_embd = router->ne[0], E = router->ne[1], n_ff = gate->ne[1], k = s.n_expert_used;
    const auto at = [](const ggml_tensor * t, int64_t i0, int64_t i1, int64_t i2) {
        return double(*reinterpret_cast<const float *>(static_cast<const char *>(t->data) + i0 * t->nb[0] + i1 * t->nb[1] +
                                                       i2 * t->nb[2]));
    };
    std::vector<double> reap(static_cast<size_t>(E), 0.0);
    std::vector<uint64_t> count(static_cast<size_t>(E), 0);
    for (const auto & x : cap.x) {
        std::vector<double> z(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
            for (int64_t i = 0; i < n_embd; ++i) {
                z[size_t(e)] += at(router, i, e, 0) * x[size_t(i)];
            }
        }
        const double zmax = *std::max_element(z.begin(), z.end());
        std::vector<double> p(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
            p[size_t(e)] = std::exp(z[size_t(e)] - zmax);
        }
        std::vector<int64_t> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) { return p[size_t(a)] > p[size_t(b)]; });
        double chosen_sum = 0;
        for (int64_t j = 0; j < k; ++j) {
            chosen_sum += p[size_t(order[size_t(j)])];
        }
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = order[size_t(j)];
            const double gw = p[size_t(e)] / chosen_sum;  // qwen3moe renormalizes the top-k gates
            std::vector<double> h(static_cast<size_t>(n_ff));
            for (int64_t f = 0; f < n_ff; ++f) {
                double a = 0, b = 0;
                for (int64_t i = 0; i < n_embd; ++i) {
                    a += at(gate, i, f, e) * x[size_t(i)];
                    b += at(up, i, f, e) * x[size_t(i)];
                }
                h[size_t(f)] = a / (1.0 + std::exp(-a)) * b;
            }
            double norm = 0;
            for (int64_t o = 0; o < n_embd; ++o) {
                double y = 0;
                for (int64_t f = 0; f < n_ff; ++f) {
                    y += at(down, f, o, e) * h[size_t(f)];
                }
                norm += y * y;
            }
            reap[size_t(e)] += gw * std::sqrt(norm);
            ++count[size_t(e)];
        }
    }
    gguf_free(g);
    ggml_free(wctx);
    EXPECT_EQ(count, s.layers[layer].count);
    int compared = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (count[size_t(e)] > 0) {
            EXPECT_NEAR(s.layers[layer].reap_sum[size_t(e)], reap[size_t(e)], 1e-4 * reap[size_t(e)]) << "expert " << e;
            ++compared;
        }
    }
    EXPECT_GT(compared, 4);
}

// llama.cpp's RPC backend on loopback gives the local run's statistics.
TEST(Collect, RpcServerOnLoopbackMatchesLocal) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", true);
    test::write_text(dir / "corpus.jsonl", planted_corpus(2));
    collect(options(m, dir / "corpus.jsonl", dir / "local.json"));
    const int port = free_loopback_port();
    const pid_t server = fork();
    ASSERT_GE(server, 0);
    if (server == 0) {
        const std::string cmd = fmt::format("exec {} -H 127.0.0.1 -p {} >/dev/null 2>&1", test::bin("ggml-rpc-server").string(), port);
        execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
        _exit(127);
    }
    ASSERT_TRUE(wait_for_listener(port)) << "ggml-rpc-server did not start listening on port " << port;
    const auto r = test::run_command(fmt::format("{} collect -m {} -f {} -o {} -c 128 -b 64 -ub 32 -t 2 -ngl 99 --rpc 127.0.0.1:{}",
                                                 test::bin("moeprune").string(), m.path.string(),
                                                 (dir / "corpus.jsonl").string(), (dir / "rpc.json").string(), port));
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const SaliencyStats a = read_stats(dir / "local.json"), b = read_stats(dir / "rpc.json");
    EXPECT_EQ(b.settings["rpc"][0], fmt::format("127.0.0.1:{}", port));
    EXPECT_EQ(b.n_tokens, a.n_tokens);
    for (size_t l = 0; l < 3; ++l) {
        EXPECT_EQ(b.layers[l].count, a.layers[l].count) << "layer " << l;
        for (size_t e = 0; e < 12; ++e) {
            EXPECT_NEAR(b.layers[l].reap_sum[e], a.layers[l].reap_sum[e], 1e-5 * (1 + a.layers[l].reap_sum[e]));
        }
    }
}

TEST(Collect, RefusesBadCorporaNamingFileAndLine) {
    test::TempDir dir;
    const Model m = synth_model(dir.path(), "qwen3moe", false);
    test::write_text(dir / "bad.jsonl", "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n");
    try {
        collect(options(m, dir / "bad.jsonl", dir / "s.json"));
        ADD_FAILURE() << "a document without text was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "s.json"));
    test::write_text(dir / "broken.jsonl", "{\"text\": \"fine\"}\n{not json\n");
    EXPECT_THROW(collect(options(m, dir / "broken.jsonl", dir / "s.json")), Error);
    test::write_text(dir / "ok.txt", "hello world");
    CollectOptions o = options(m, dir / "ok.txt", dir / "s.json");
    o.resume = true;
    EXPECT_THROW(collect(o), Error);  // --resume without --save-every
}
