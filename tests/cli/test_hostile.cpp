// Hostile and careless input (issue 19): every case ends in a clear error that names
// the file and the problem, a non-zero exit, inputs byte-identical and no output under
// its final name; or, where the input is valid, in a correct answer.
#include "formats/stats.h"
#include "formats/trace.h"
#include "slice/slice_support.h"
#include "support/test_support.h"

#include "gguf.h"

#include <gtest/gtest.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <sys/stat.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string moeprune_cmd(const std::string & args) {
    // A hang is a failure too: every command gets a deadline.
    return "timeout 60 " + test::bin("moeprune").string() + " " + args;
}

// Runs `args`, expects a refusal whose message holds every one of `says`, the
// `inputs` unchanged and none of `outputs` written.
void expect_refused(const std::string & args, const std::vector<std::string> & says,
                    const std::vector<fs::path> & inputs = {}, const std::vector<fs::path> & outputs = {}) {
    std::map<fs::path, std::string> before;
    for (const auto & p : inputs) {
        before[p] = test::read_bytes(p);
    }
    const auto r = test::run_command(moeprune_cmd(args));
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    for (const auto & s : says) {
        EXPECT_NE(r.output.find(s), std::string::npos) << args << "\nexpected: " << s << "\ngot: " << r.output;
    }
    for (const auto & [p, bytes] : before) {
        EXPECT_TRUE(test::read_bytes(p) == bytes) << p << " changed by: " << args;
    }
    for (const auto & p : outputs) {
        EXPECT_FALSE(fs::exists(p)) << p << " written by: " << args;
    }
}

std::string s(const fs::path & p) { return p.string(); }

// One small model, corpus, statistics (plain and with --coact) and trace for every test.
class Hostile : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        dir_ = new test::TempDir();
        const auto r = test::run_command(moeprune_cmd(
            fmt::format("synth --arch qwen3moe --layers 2 --experts 8 --used 2 -o {}", s(path("m.gguf")))));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        test::write_text(path("c.jsonl"), "{\"text\": \"The quick brown fox jumps over the lazy dog.\", \"domain\": \"en\"}\n"
                                          "{\"text\": \"int main() { return 0; }\", \"domain\": \"code\"}\n"
                                          "{\"text\": \"Another sentence about experts and routers.\"}\n");
        auto c = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} --trace {} -t 2", s(path("m.gguf")),
                                                            s(path("c.jsonl")), s(path("s.json")), s(path("t.trace")))));
        ASSERT_EQ(c.exit_code, 0) << c.output;
        c = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} --coact -t 2", s(path("m.gguf")),
                                                       s(path("c.jsonl")), s(path("sc.json")))));
        ASSERT_EQ(c.exit_code, 0) << c.output;
        test::write_text(path("k.json"), R"({"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})");
    }
    static void TearDownTestSuite() {
        delete dir_;
        dir_ = nullptr;
    }
    static fs::path path(const std::string & name) { return *dir_ / name; }
    // A scratch copy of a shared input, so a test may mangle it.
    fs::path copy(const std::string & name, const std::string & as) {
        fs::copy_file(path(name), local_ / as, fs::copy_options::overwrite_existing);
        return local_ / as;
    }
    fs::path local(const std::string & name) { return local_ / name; }

    static test::TempDir * dir_;
    test::TempDir local_;
};
test::TempDir * Hostile::dir_ = nullptr;

// A GGUF whose metadata `edit` changed: ggml writes the new header, the tensor data
// follows unchanged (tensor offsets are relative to the data section).
void rewrite_gguf(const fs::path & src, const fs::path & dst, const std::function<void(gguf_context *)> & edit) {
    gguf_init_params p{true, nullptr};
    gguf_context * g = gguf_init_from_file(src.c_str(), p);
    ASSERT_NE(g, nullptr);
    const size_t data_offset = gguf_get_data_offset(g);
    edit(g);
    ASSERT_TRUE(gguf_write_to_file(g, dst.c_str(), true));
    gguf_free(g);
    const std::string data = test::read_bytes(src).substr(data_offset);
    test::write_text(dst, test::read_bytes(dst) + data);
}

// Offset of the first byte after `needle` in `bytes`.
size_t after(const std::string & bytes, const std::string & needle) {
    const size_t at = bytes.find(needle);
    EXPECT_NE(at, std::string::npos) << needle;
    return at + needle.size();
}

// A raw (uncompressed) trace of `n` tokens, 2 layers, 8 experts, top-3, in blocks of 4.
void write_small_trace(const fs::path & p, int n, std::vector<std::string> domains = {"all"}) {
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 8;
    h.top_m = 3;
    h.domains = std::move(domains);
    h.meta = {{"n_expert_used", 2}};
    TraceWriter w(p, h, 4);
    for (int t = 0; t < n; ++t) {
        const uint16_t ids[6] = {uint16_t(t % 8), uint16_t((t + 1) % 8), uint16_t((t + 2) % 8), 1, 2, 3};
        const float logits[6] = {3, 2, 1, 3, 2, 1};
        TraceTokenMeta m;
        m.pos = t;
        w.append(m, ids, logits);
    }
}

// The same trace in version 1's layout (no checksums), which readers still accept: the
// checks a file without checksums depends on are tested on such files.
void rewrite_as_version1(const fs::path & p) {
    std::string b = test::read_bytes(p);
    uint32_t meta_len = 0, n_layer = 0;
    std::memcpy(&meta_len, b.data() + 20, 4);
    std::memcpy(&n_layer, b.data() + 8, 4);
    const uint32_t one = 1;
    std::memcpy(b.data() + 4, &one, 4);
    const size_t sections = n_layer + 1, fixed = 16 + 8 * sections;
    std::string out = b.substr(0, 24 + meta_len);
    for (size_t pos = 24 + meta_len + 8; pos < b.size();) {  // past version 3's header checksum
        uint64_t stored = 0;
        for (size_t i = 0; i < sections; ++i) {
            uint64_t size = 0;
            std::memcpy(&size, b.data() + pos + 16 + 8 * i, 8);
            stored += size;
        }
        out += b.substr(pos, fixed);
        out += b.substr(pos + fixed + 8 * sections + 8, stored);
        pos += fixed + 8 * sections + 8 + stored;
    }
    test::write_text(p, out);
}

// Where block 0's layer-0 section of a file of write_small_trace (as version 1) starts.
uint64_t first_layer_section(const fs::path & p) {
    const std::string b = test::read_bytes(p);
    uint32_t meta_len = 0;
    std::memcpy(&meta_len, b.data() + 20, 4);
    return 24 + meta_len + 16 + 8 * 3 + 4 * 16;
}

} // namespace

// ---------------------------------------------------------------- data loss

TEST_F(Hostile, CollectRefusesToWriteOverItsInputs) {
    const fs::path m = copy("m.gguf", "m.gguf"), c = copy("c.jsonl", "c.jsonl");
    const std::string base = fmt::format("collect -m {} -f {} ", s(m), s(c));
    expect_refused(base + "-o " + s(local("x.json")) + " --trace " + s(m), {"refusing to overwrite the input", "m.gguf"},
                   {m, c}, {local("x.json")});
    expect_refused(base + "-o " + s(m), {"refusing to overwrite the input"}, {m, c});
    expect_refused(base + "-o " + s(c), {"refusing to overwrite the input"}, {m, c});
    expect_refused(base + "-o " + s(local("x.json")) + " --trace " + s(c), {"refusing to overwrite the input"}, {m, c},
                   {local("x.json")});
    expect_refused(base + "-o " + s(local("X")) + " --trace " + s(local("X")), {"is given for two outputs"}, {m, c},
                   {local("X")});
    // A hard link and a symbolic link are the same file.
    fs::create_hard_link(m, local("hard.gguf"));
    fs::create_symlink(c, local("soft.jsonl"));
    expect_refused(base + "-o " + s(local("x.json")) + " --trace " + s(local("hard.gguf")),
                   {"refusing to overwrite the input"}, {m, c}, {local("x.json")});
    expect_refused(base + "-o " + s(local("soft.jsonl")), {"refusing to overwrite the input"}, {m, c});
}

// Binary data or invalid UTF-8 given as a text: refused naming the file, not passed to
// llama.cpp's tokenizer (which fails without a name, or reads on); thread counts far above
// the machine's CPUs refused by every command that takes -t (issue 47).
TEST_F(Hostile, BinaryTextAndHugeThreadCountsAreRefusedByName) {
    test::write_text(local("binary.txt"), std::string("GGUF\0\x03\0\0\xff\xfe binary", 18));
    test::write_text(local("latin1.txt"), "caf\xe9 au lait, na\xefve\n");
    for (const char * text : {"binary.txt", "latin1.txt"}) {
        expect_refused(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")), s(local(text)), s(local("x.json"))),
                       {s(local(text)) + ": is not UTF-8 text"}, {local(text)}, {local("x.json")});
        expect_refused(fmt::format("eval -m {} -f {} --base-out {}", s(path("m.gguf")), s(local(text)), s(local("b.mpkl"))),
                       {s(local(text)) + ": is not UTF-8 text"}, {local(text)}, {local("b.mpkl")});
    }
    for (const std::string & command :
         {fmt::format("collect -m {} -f {} -o {} -t 10000", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
          fmt::format("eval -m {} -f {} --base-out {} -t 10000", s(path("m.gguf")), s(path("c.jsonl")), s(local("b.mpkl"))),
          fmt::format("replay --trace {} --policy lru --cache 4 -t 10000", s(path("t.trace"))),
          fmt::format("corpus -m {} --source a={} -o {} -t 10000", s(path("m.gguf")), s(path("c.jsonl")), s(local("out"))),
          fmt::format("run -m {} --corpus a={} -k 4 -o {} -t 10000", s(path("m.gguf")), s(path("c.jsonl")), s(local("run")))}) {
        const auto r = test::run_command(moeprune_cmd(command));
        EXPECT_NE(r.exit_code, 0) << command;  // CLI11's code for a refused flag
        EXPECT_NE(r.output.find("--threads: 10000: threads are 0 (one per CPU) to"), std::string::npos) << r.output;
        for (const char * out : {"x.json", "b.mpkl", "out", "run"}) {
            EXPECT_FALSE(fs::exists(local(out))) << command;
        }
    }
}

TEST_F(Hostile, ReplaySelectAndKeepRefuseToWriteOverTheirInputs) {
    const fs::path t = copy("t.trace", "t.trace"), k = copy("k.json", "k.json"), st = copy("s.json", "s.json");
    expect_refused(fmt::format("replay --trace {} --policy lru --cache 4 --json {}", s(t), s(t)),
                   {"refusing to overwrite the input"}, {t});
    expect_refused(fmt::format("replay --trace {} --keep {} --policy lru --cache 4 --json {}", s(t), s(k), s(k)),
                   {"refusing to overwrite the input"}, {t, k});
    expect_refused(fmt::format("replay --trace {} --policy lru --cache 4 --json {} --csv {}", s(t), s(local("o")),
                               s(local("o"))),
                   {"is given for two outputs"}, {t}, {local("o")});
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq --json {}", s(st), s(st)),
                   {"refusing to overwrite the input"}, {st});
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq --trace {} -o {} --json {}", s(st), s(t),
                               s(local("maps")), s(local("maps") / "freq-k4.json")),
                   {"is given for two outputs"}, {st, t}, {local("maps") / "freq-k4.json"});
    expect_refused(fmt::format("keep check {} -o {}", s(k), s(k)), {"refusing to overwrite the input"}, {k});
    fs::create_directories(local("npy"));
    fs::create_symlink(t, local("npy") / "ids.npy");
    expect_refused(fmt::format("trace export {} --npy {}", s(t), s(local("npy"))), {"refusing to overwrite the input"}, {t});
}

// ---------------------------------------------------------------- crashes and hangs

TEST_F(Hostile, TraceIdsOutOfRangeAreRejectedNamingBlockAndLayer) {
    const fs::path t = local("t.trace");
    write_small_trace(t, 10);
    rewrite_as_version1(t);
    std::string bytes = test::read_bytes(t);
    const uint64_t at = first_layer_section(t) + 12 * 2;  // block 0, layer 0, token 2 (12-byte records), first id
    bytes[at] = char(0x8c);
    bytes[at + 1] = 0;
    test::write_text(t, bytes);
    for (const std::string & args :
         {fmt::format("replay --trace {} --policy lru,belady,near-pick-ema --cache 4", s(t)),
          fmt::format("replay --trace {} --policy lfu,sieve --cache 4 --prefill-union 4", s(t)),
          fmt::format("trace info {}", s(t)), fmt::format("trace export {} --npy {}", s(t), s(local("npy")))}) {
        expect_refused(args, {"t.trace: corrupt trace: block 0, layer 0, token 2 names expert 140", "8 experts"}, {t});
    }
    EXPECT_FALSE(fs::exists(local("npy") / "ids.npy"));

    test::write_q4rt(local("q.trace"), 2, 8, 1, 5, 5, [](uint64_t tok, std::vector<uint16_t> & ids, std::vector<float> & z) {
        ids = {uint16_t(tok == 3 ? 9 : 1), 2};
        z = {1, 1};
    });
    expect_refused(fmt::format("replay --trace {} --k 1 --policy lru --cache 1", s(local("q.trace"))),
                   {"q.trace: corrupt trace: layer 0, token 3 names expert 9"});
}

TEST_F(Hostile, TraceSelectRefusesAnotherModelsTraceAndAnEmptyOne) {
    const fs::path st = copy("s.json", "s.json");
    write_small_trace(local("other.trace"), 10);  // 8 experts but 2 layers of top-3 from another "model"
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 16;
    h.top_m = 3;
    h.domains = {"all"};
    {
        TraceWriter w(local("sixteen.trace"), h, 4);
        const uint16_t ids[6] = {1, 2, 3, 1, 2, 3};
        const float z[6] = {3, 2, 1, 3, 2, 1};
        w.append({}, ids, z);
    }
    h.n_expert = 8;
    { TraceWriter w(local("empty.trace"), h, 4); }
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq --trace {} -o {}", s(st), s(local("sixteen.trace")),
                               s(local("maps"))),
                   {"sixteen.trace: records 2 layers x 16 experts", "another model"}, {st}, {local("maps") / "freq-k4.json"});
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq --trace {} -o {}", s(st), s(local("empty.trace")),
                               s(local("maps"))),
                   {"empty.trace: holds no tokens"}, {st}, {local("maps") / "freq-k4.json"});
    // replay --model of another expert count
    const auto r = test::run_command(moeprune_cmd(fmt::format("synth --arch qwen3moe --layers 2 --experts 16 --used 2 -o {}",
                                                              s(local("m16.gguf")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_refused(fmt::format("replay --trace {} --model {} --policy lru --cache-mib 1", s(path("t.trace")),
                               s(local("m16.gguf"))),
                   {"m16.gguf: has 16 experts per layer but the trace has 8"});
}

TEST_F(Hostile, TraceBlockSizesThatWrapOrClaimTooMuchAreRejected) {
    const fs::path t = local("t.trace");
    write_small_trace(t, 4);
    rewrite_as_version1(t);
    const std::string good = test::read_bytes(t);
    uint32_t meta_len = 0;
    std::memcpy(&meta_len, good.data() + 20, 4);
    const size_t block = 24 + meta_len;
    const auto with = [&](uint32_t n_tokens, uint32_t codec, std::vector<uint64_t> sizes) {
        std::string b = good.substr(0, block + 16 + 8 * 3);
        std::memcpy(b.data() + block + 4, &n_tokens, 4);
        std::memcpy(b.data() + block + 8, &codec, 4);
        for (size_t i = 0; i < 3; ++i) {
            std::memcpy(b.data() + block + 16 + 8 * i, &sizes[i], 8);
        }
        b += std::string(620 - std::min<size_t>(620, b.size()), 'z');
        test::write_text(t, b);
    };
    const uint64_t big = uint64_t(1) << 63;
    for (uint32_t codec : {0u, 1u}) {
        with(4, codec, {big, big - 40, 0});
        for (const std::string & args : {fmt::format("trace info {}", s(t)), fmt::format("replay --trace {} --policy lru --cache 2", s(t))}) {
            expect_refused(args, {"t.trace: corrupt trace: block 0", "claims 4 tokens"});
        }
    }
    with(50'000'000, 1, {100, 100, 100});  // a small zstd block claiming 50 M tokens
    expect_refused(fmt::format("trace export {} --npy {}", s(t), s(local("npy"))), {"claims 50000000 tokens"});
    with(0xFFFFFFFFu, 0, {64, 24, 24});
    expect_refused(fmt::format("trace info {}", s(t)), {"claims 4294967295 tokens"});
}

TEST_F(Hostile, MergeOfCoactInOneLayerIsRefusedInBothOrders) {
    json x = json::parse(test::read_bytes(path("sc.json")));
    x["layers"][1].erase("coact");
    test::write_text(local("x.json"), x.dump());
    expect_refused(fmt::format("merge {} {} -o {}", s(path("sc.json")), s(local("x.json")), s(local("o.json"))),
                   {"x.json: layer 1 lacks \"coact\""}, {local("x.json")}, {local("o.json")});
    expect_refused(fmt::format("merge {} {} -o {}", s(local("x.json")), s(path("sc.json")), s(local("o.json"))),
                   {"x.json: layer 1 lacks \"coact\""}, {local("x.json")}, {local("o.json")});
}

TEST_F(Hostile, DeeplyNestedJsonIsRefusedOnRead) {
    const std::string deep = std::string(60000, '[') + std::string(60000, ']');
    test::write_text(local("k1.json"), R"({"format": "moeprune-keep", "version": )" + deep +
                                           R"(, "n_expert": 8, "k": 4, "layers": {"0": [0,1,2,3]}})");
    expect_refused("keep check " + s(local("k1.json")), {"k1.json: JSON nested deeper than"});
    json st = json::parse(test::read_bytes(path("s.json")));
    const std::string text = st.dump();
    const std::string nested = text.substr(0, text.size() - 1) + R"(, "extra": )" + deep + "}";
    test::write_text(local("s.json"), nested);
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq", s(local("s.json"))), {"s.json: JSON nested deeper than"});
    test::write_text(local("k2.json"), R"({"0": [0, 1e400]})");
    expect_refused("keep check " + s(local("k2.json")), {"k2.json: not usable JSON", "1e400"});
    test::write_text(local("k3.json"), R"({"format": "moeprune-keep", "version": 1, "n_expert": 8, "k": 2, "metric": 5, "layers": {"0": [0, 1]}})");
    expect_refused("keep check " + s(local("k3.json")), {"k3.json: \"metric\" must be a string"});
}

TEST_F(Hostile, SplitShardsWithWrongTypesOrDuplicatesAreRefused) {
    auto r = test::run_command(moeprune_cmd(fmt::format("synth --arch qwen3moe --layers 3 --experts 8 --used 2 --split 3 -o {}",
                                                        s(local("sp.gguf")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const fs::path first = local("sp-00001-of-00003.gguf"), second = local("sp-00002-of-00003.gguf"),
                   third = local("sp-00003-of-00003.gguf");
    const std::string third_bytes = test::read_bytes(third);
    // split.no stored as i16 instead of u16 (same size, another type).
    std::string b = third_bytes;
    const size_t type_at = after(b, "split.no");
    ASSERT_EQ(b[type_at], char(GGUF_TYPE_UINT16));
    b[type_at] = char(GGUF_TYPE_INT16);
    test::write_text(third, b);
    expect_refused("inspect " + s(first), {"sp-00003-of-00003.gguf: split.no does not say shard 3"});
    expect_refused(fmt::format("slice -m {} --keep {} -o {}", s(first), s(path("k.json")), s(local("o.gguf"))),
                   {"split.no does not say shard 3"}, {first}, {local("o.gguf")});
    // Shard 3 a renumbered copy of shard 2.
    b = test::read_bytes(second);
    b[after(b, "split.no") + 4] = 2;
    test::write_text(third, b);
    expect_refused("inspect " + s(first), {"sp-00003-of-00003.gguf: holds tensor", "which shard 2 holds too"});
    expect_refused(fmt::format("slice -m {} --keep {} -o {}", s(first), s(path("k.json")), s(local("o.gguf"))),
                   {"which shard 2 holds too"}, {}, {local("o.gguf")});
}

TEST_F(Hostile, ModelsLlamaCppWouldAbortOnAreReportedBroken) {
    const auto broken = [&](const std::string & name, const std::function<void(gguf_context *)> & edit,
                            const std::string & says) {
        const fs::path p = local(name);
        rewrite_gguf(path("m.gguf"), p, edit);
        const auto r = test::run_command(moeprune_cmd("inspect " + s(p)));
        EXPECT_EQ(r.exit_code, 2) << name << "\n" << r.output;
        EXPECT_NE(r.output.find(says), std::string::npos) << name << "\n" << r.output;
        expect_refused(fmt::format("collect -m {} -f {} -o {}", s(p), s(path("c.jsonl")), s(local("x.json"))),
                       {name + ": is inconsistent", says}, {p}, {local("x.json")});
    };
    broken("blocks0.gguf", [](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.block_count", 0); },
           "block_count is 0 but the tensors cover blocks 0..1");
    broken("blocks1000.gguf", [](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.block_count", 1000); },
           "block_count is 1000 but the tensors cover blocks 0..1");
    broken("groups3.gguf", [](gguf_context * g) {
        gguf_set_val_u32(g, "qwen3moe.expert_group_count", 3);
        gguf_set_val_u32(g, "qwen3moe.expert_group_used_count", 1);
    }, "expert_group_count is 3, which does not divide the 8 experts");
    broken("groups16.gguf", [](gguf_context * g) {
        gguf_set_val_u32(g, "qwen3moe.expert_group_count", 16);
        gguf_set_val_u32(g, "qwen3moe.expert_group_used_count", 1);
    }, "expert_group_count is 16");
    broken("count16.gguf", [](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_count", 16); },
           "expert axis has 8 experts but qwen3moe.expert_count says 16");
    // slice names the model, not the keep map, when the model contradicts itself.
    expect_refused(fmt::format("slice -m {} --keep {} -o {}", s(local("count16.gguf")), s(path("k.json")),
                               s(local("o.gguf"))),
                   {"count16.gguf: is inconsistent", "expert_count says 16"}, {}, {local("o.gguf")});
    broken("used0.gguf", [](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_used_count", 0); },
           "expert_used_count is 0");
    broken("usedneg.gguf", [](gguf_context * g) { gguf_set_val_i32(g, "qwen3moe.expert_used_count", -1); },
           "expert_used_count is -1");

    // Tensor data cut off: the file holds less than its tensors.
    const fs::path cut = copy("m.gguf", "cut.gguf");
    fs::resize_file(cut, fs::file_size(cut) / 2);
    const auto r = test::run_command(moeprune_cmd("inspect " + s(cut)));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("cut.gguf: is truncated"), std::string::npos) << r.output;
    expect_refused(fmt::format("slice -m {} --keep {} -o {}", s(cut), s(path("k.json")), s(local("o.gguf"))),
                   {"cut.gguf: is inconsistent", "cut.gguf: is truncated"}, {cut}, {local("o.gguf")});

    expect_refused("synth --layers 10000 -o " + s(local("big.gguf")), {"--layers must be from 1 to 512"}, {},
                   {local("big.gguf")});
    expect_refused(fmt::format("collect -m {} -f {} -o {} --rpc nonsense -ngl 1", s(path("m.gguf")), s(path("c.jsonl")),
                               s(local("x.json"))),
                   {"--rpc: \"nonsense\" is not HOST:PORT"}, {}, {local("x.json")});
}

TEST_F(Hostile, DimensionsWhoseElementCountOverflowsAreRefused) {
    // The last tensor of the file gets a first dimension of 2^62: its element or byte
    // count wraps to 0 inside ggml, which then accepts the file as consistent.
    std::string name;
    {
        gguf_init_params p{true, nullptr};
        gguf_context * g = gguf_init_from_file(path("m.gguf").c_str(), p);
        ASSERT_NE(g, nullptr);
        name = gguf_get_tensor_name(g, gguf_get_n_tensors(g) - 1);
        gguf_free(g);
    }
    std::string b = test::read_bytes(path("m.gguf"));
    const size_t at = after(b, name);
    const int64_t huge = int64_t(1) << 62;
    std::memcpy(b.data() + at + 4, &huge, 8);
    test::write_text(local("dim.gguf"), b);
    expect_refused("inspect " + s(local("dim.gguf")), {"dim.gguf: tensor " + name, "overflows"}, {local("dim.gguf")});
    expect_refused(fmt::format("slice -m {} --keep {} -o {}", s(local("dim.gguf")), s(path("k.json")), s(local("o.gguf"))),
                   {"dim.gguf: tensor " + name, "overflows"}, {local("dim.gguf")}, {local("o.gguf")});
}

TEST_F(Hostile, CountsBeyondWhatTheFileCanHoldAreRefusedBeforeAllocating) {
    // Statistics: one layer of 2^33 experts in a few hundred bytes.
    json st = json::parse(test::read_bytes(path("s.json")));
    st["n_expert"] = uint64_t(1) << 33;
    st["n_layer"] = 1;
    test::write_text(local("s.json"), st.dump());
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq", s(local("s.json"))),
                   {"s.json: n_layer 1 x n_expert 8589934592 cannot be the shape of a file of"});
    // Next-layer prefetch over 65536 experts would count 2^32 pairs per worker.
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 65536;
    h.top_m = 2;
    h.domains = {"all"};
    h.meta = {{"n_expert_used", 2}};
    {
        TraceWriter w(local("wide.trace"), h, 4);
        const uint16_t ids[4] = {1, 2, 60000, 3};
        const float z[4] = {2, 1, 2, 1};
        for (int t = 0; t < 4; ++t) {
            w.append({}, ids, z);
        }
    }
    expect_refused(fmt::format("replay --trace {} --policy lru --cache 4 --prefetch next-layer", s(local("wide.trace"))),
                   {"wide.trace: has 65536 experts per layer; --prefetch counts expert pairs"});
    // The endless zero device as any input.
    expect_refused("keep check /dev/zero", {"/dev/zero: not a regular file"});
    expect_refused("select --stats /dev/zero -k 4 --metric freq", {"/dev/zero: not a regular file"});
    expect_refused(fmt::format("collect -m {} -f /dev/zero -o {}", s(path("m.gguf")), s(local("x.json"))),
                   {"/dev/zero: not a regular file"}, {}, {local("x.json")});
}

TEST_F(Hostile, FifosAreRefusedInsteadOfBlocking) {
    const fs::path fifo = local("fifo");
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    expect_refused("keep check " + s(fifo), {"fifo: not a regular file"});
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq", s(fifo)), {"fifo: not a regular file"});
    expect_refused(fmt::format("trace info {}", s(fifo)), {"fifo: not a regular file"});
    expect_refused(fmt::format("replay --trace {} --keep {} --policy lru --cache 4", s(path("t.trace")), s(fifo)),
                   {"fifo: not a regular file"});
    expect_refused(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")), s(fifo), s(local("x.json"))),
                   {"fifo: not a regular file"}, {}, {local("x.json")});
}

// ---------------------------------------------------------------- silent wrong answers

TEST_F(Hostile, ATraceClaimingAnImpossibleTopKIsNamedAsSuch) {
    TraceHeader h;
    h.n_layer = 1;
    h.n_expert = 8;
    h.top_m = 2;
    h.domains = {"all"};
    h.meta = {{"n_expert_used", uint64_t(1) << 40}};
    {
        TraceWriter w(local("k40.trace"), h, 4);
        const uint16_t ids[2] = {1, 2};
        const float z[2] = {2, 1};
        w.append({}, ids, z);
        w.append({}, ids, z);
    }
    expect_refused(fmt::format("replay --trace {} --policy lru --cache 4", s(local("k40.trace"))),
                   {"k40.trace: meta.n_expert_used is 1099511627776, not from 1 to the top 2"});
}

TEST_F(Hostile, MoreDomainsThanATraceCanNumberAreRefused) {
    std::string corpus;
    for (int d = 0; d < 65536; ++d) {
        corpus += fmt::format("{{\"text\": \"x\", \"domain\": \"d{}\"}}\n", d);
    }
    test::write_text(local("many.jsonl"), corpus);
    expect_refused(fmt::format("collect -m {} -f {} -o {} --trace {}", s(path("m.gguf")), s(local("many.jsonl")),
                               s(local("x.json")), s(local("x.trace"))),
                   {"many.jsonl: has 65536 domains; a trace stores domain ids in 16 bits"}, {},
                   {local("x.json"), local("x.trace")});
    TraceHeader h;
    h.n_layer = 1;
    h.n_expert = 4;
    h.top_m = 1;
    h.domains.assign(65537, "d");
    EXPECT_THROW(TraceWriter(local("w.trace"), h), std::exception);
}

TEST_F(Hostile, KeepMapsWithAmbiguousLayersOrImpossibleCountsAreRefused) {
    test::write_text(local("k1.json"), R"({"0": [0, 1], "00": [2, 3]})");
    expect_refused("keep check " + s(local("k1.json")), {"k1.json: layer key \"00\" is not a layer number"});
    test::write_text(local("k2.json"), R"({"0": [0, 1], "0": [2, 3]})");
    expect_refused("keep check " + s(local("k2.json")), {"k2.json: key \"0\" appears twice"});
    for (const std::string & n : {"18446744073709551615", "-8"}) {
        test::write_text(local("k3.json"), R"({"format": "moeprune-keep", "version": 1, "n_expert": )" + n +
                                               R"(, "k": 2, "layers": {"0": [0, 1]}})");
        expect_refused("keep check " + s(local("k3.json")), {"k3.json: \"n_expert\" is " + n});
    }
    // replay accepts only the trace's layers, as slice does.
    test::write_text(local("k4.json"), R"({"0": [0, 1, 2, 3], "1": [0, 1, 2, 3], "999999": [0, 1, 2, 3]})");
    expect_refused(fmt::format("replay --trace {} --keep {} --policy lru --cache 2", s(path("t.trace")), s(local("k4.json"))),
                   {"k4.json: names layer 999999, which is not one of the trace's MoE layers"});
}

TEST_F(Hostile, MergeRefusesWhatSelectRejectsWrappedCountsAndTheSameFileTwice) {
    json zero = json::parse(test::read_bytes(path("s.json")));
    zero["n_tokens"] = 0;
    test::write_text(local("zero.json"), zero.dump());
    expect_refused(fmt::format("merge {} {} -o {}", s(path("s.json")), s(local("zero.json")), s(local("o.json"))),
                   {"zero.json: fails the tokens check"}, {}, {local("o.json")});
    json neg = json::parse(test::read_bytes(path("s.json")));
    neg["layers"][0]["reap_sum"][0] = -1.0;
    test::write_text(local("neg.json"), neg.dump());
    expect_refused(fmt::format("merge {} {} -o {}", s(path("s.json")), s(local("neg.json")), s(local("o.json"))),
                   {"neg.json: fails the sign check"}, {}, {local("o.json")});
    expect_refused(fmt::format("merge {} {} -o {}", s(path("s.json")), s(path("s.json")), s(local("o.json"))),
                   {"s.json: is given twice (also as", "its tokens would count twice"}, {}, {local("o.json")});
    fs::copy_file(path("s.json"), local("again.json"));
    expect_refused(fmt::format("merge {} {} -o {}", s(path("s.json")), s(local("again.json")), s(local("o.json"))),
                   {"again.json: has the same bytes as"}, {}, {local("o.json")});

    // u64 counts that would wrap: 2^64 - 1 + x.
    SaliencyStats a = SaliencyStats::empty(1, 2, 1);
    a.n_tokens = UINT64_MAX;
    a.layers[0].count = {UINT64_MAX, 0};
    SaliencyStats b = SaliencyStats::empty(1, 2, 1);
    b.n_tokens = 25;
    b.layers[0].count = {25, 0};
    EXPECT_THROW(merge_stats(a, b, "a", "b"), std::exception);
}

TEST_F(Hostile, SliceRefusesDroppingEveryLayerAndAModelAsTheImatrix) {
    test::FakeMoe spec;
    spec.n_layer = 2;
    spec.n_nextn = 2;
    test::write_fake_moe(local("allmtp.gguf"), spec);
    test::write_text(local("k.json"), R"({"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]})");
    expect_refused(fmt::format("slice -m {} --keep {} -o {} --mtp drop", s(local("allmtp.gguf")), s(local("k.json")),
                               s(local("o.gguf"))),
                   {"every MoE layer is an MTP (nextn) layer"}, {local("allmtp.gguf")}, {local("o.gguf")});
    expect_refused(fmt::format("slice -m {} --keep {} -o {} --imatrix {} --imatrix-out {}", s(path("m.gguf")),
                               s(path("k.json")), s(local("o.gguf")), s(path("m.gguf")), s(local("i.gguf"))),
                   {"m.gguf: entry", "is not an imatrix entry"}, {path("m.gguf")}, {local("o.gguf"), local("i.gguf")});
}

TEST_F(Hostile, NumericFlagsOutsideTheirRangeAreRefusedAtParseTime) {
    const std::string t = s(path("t.trace")), st = s(path("s.json"));
    const std::string replay = fmt::format("replay --trace {} --policy lru --cache 4 ", t);
    const std::vector<std::pair<std::string, std::string>> cases = {
        {replay + "--compute-ms -5", "--compute-ms must be a finite number >= 0"},
        {replay + "--compute-ms nan", "--compute-ms must be a finite number >= 0"},
        {replay + "--read-latency-us -1", "--read-latency-us must be a finite number >= 0"},
        {replay + "--sync-us -1e9", "--sync-us must be a finite number >= 0"},
        {fmt::format("replay --trace {} --policy lru --cache-mib inf --expert-mb 1", t), "--cache-mib must be positive and finite"},
        {fmt::format("replay --trace {} --policy lru --cache-mib 8 --expert-mb 1e-300", t), "--expert-mb must be a finite size"},
        {replay + "-t -3", "--threads: -3: threads are 0 (one per CPU) to"},
        {replay + "--prefetch-n -3", "-t and --prefetch-n must be >= 0"},
        {replay + "--warmup -1", "--warmup"},
        {fmt::format("select --stats {} -k 4 --metric reap-lcb --lcb-z nan", st), "--lcb-z must be a number from 0 to 10"},
        {fmt::format("slice -m {} --keep {} -o {} --split-max-size -1", s(path("m.gguf")), s(path("k.json")),
                     s(local("o.gguf"))), "--split-max-size \"-1\" is not a size"},
        {fmt::format("collect -m {} -f {} -o {} --chunks 0", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
         "--chunks >= 1"},
        {fmt::format("collect -m {} -f {} -o {} -t -3", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
         "--threads: -3: threads are 0 (one per CPU) to"},
        {fmt::format("collect -m {} -f {} -o {} --save-every -3", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
         "-t, -ngl and --save-every must be >= 0"},
        {fmt::format("collect -m {} -f {} -o {} --trace {} --trace-top 1", s(path("m.gguf")), s(path("c.jsonl")),
                     s(local("x.json")), s(local("x.trace"))), "--trace-top 1 is below the 2 experts"},
        {"synth --ff 0 -o " + s(local("f.gguf")), "--ff must be at least 1"},
        {"synth --experts 1 --used 1 -o " + s(local("f.gguf")), "--experts must be from 2 to 1024 (got 1)"},
    };
    for (const auto & [args, says] : cases) {
        const auto r = test::run_command(moeprune_cmd(args));
        EXPECT_NE(r.exit_code, 0) << args << "\n" << r.output;
        EXPECT_NE(r.output.find(says), std::string::npos) << args << "\nexpected: " << says << "\ngot: " << r.output;
    }
    EXPECT_FALSE(fs::exists(local("x.json")));
    EXPECT_FALSE(fs::exists(local("o.gguf")));
}

TEST_F(Hostile, CorpusExtensionsRolesAndNulBytes) {
    // Upper-case .JSONL is JSONL: the statistics carry the file's domains.
    fs::copy_file(path("c.jsonl"), local("c.JSONL"));
    const auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")),
                                                              s(local("c.JSONL")), s(local("up.json")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(read_stats(local("up.json")).domains.size(), 2u);

    test::write_text(local("roles.jsonl"), R"({"messages": [{"role": "wizard", "content": "hi"}]})" "\n");
    expect_refused(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")), s(local("roles.jsonl")), s(local("x.json"))),
                   {"roles.jsonl:1: message role \"wizard\" is not one of"}, {}, {local("x.json")});
    test::write_text(local("forge.jsonl"), R"({"messages": [{"role": "user<|im_end|>", "content": "hi"}]})" "\n");
    expect_refused(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")), s(local("forge.jsonl")), s(local("x.json"))),
                   {"forge.jsonl:1: message role"}, {}, {local("x.json")});
    test::write_text(local("nul.jsonl"), std::string(R"({"text": "hi"})") + '\0' + "\n");
    expect_refused(fmt::format("collect -m {} -f {} -o {}", s(path("m.gguf")), s(local("nul.jsonl")), s(local("x.json"))),
                   {"nul.jsonl:1: holds a NUL byte at column 15"}, {}, {local("x.json")});
}

TEST(SetUp, FetchFailureShowsNpmsOwnErrorAndWhatToCheck) {
    test::TempDir dir;
    fs::create_directories(dir / "bin");
    test::write_text(dir / "bin" / "npm", "#!/bin/sh\necho 'npm error code ECONNREFUSED (from the fake npm)' >&2\nexit 1\n");
    fs::permissions(dir / "bin" / "npm", fs::perms::owner_all);
    const auto r = test::run_command(fmt::format("PATH={}:$PATH bash {}/scripts/fetch-llama.sh {}", s(dir / "bin"),
                                                 MOEPRUNE_SOURCE_DIR, s(dir / "llama")));
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ECONNREFUSED (from the fake npm)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("proxy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("-DMOEPRUNE_LLAMA_DIR"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "llama"));
}

// ---------------------------------------------------------------- round 2 (issue 33)

namespace {

// Runs `args` under a file-size limit of `kib` KiB (a disk that fills up).
test::CommandResult run_limited(const std::string & args, int kib) {
    return test::run_command(fmt::format("sh -c 'ulimit -f {}; exec {}'", kib, moeprune_cmd(args)));
}

std::string set_bytes(const fs::path & dir) {
    return test::read_bytes(dir / "calib.jsonl") + "|" + test::read_bytes(dir / "eval.jsonl") + "|" +
           test::read_bytes(dir / "corpus.json");
}

// A folder of `n` text files, each its own group, distinct enough not to be near duplicates.
void write_text_files(const fs::path & dir, int n, const std::string & tag = "file") {
    fs::create_directories(dir);
    for (int i = 0; i < n; ++i) {
        std::string text;
        for (int w = 0; w < 40; ++w) {
            text += fmt::format("{}{} {}{} value{} ", tag, i, tag, w, (i * 7919 + w * 104729 + tag.size() * 31) % 100003);
        }
        test::write_text(dir / fmt::format("doc{:02}.txt", i), text + "\n");
    }
}

// The compact base file's parts: fixed header, JSON header and the sections of records.
struct Mpkl {
    uint32_t top = 0;
    json header;
    std::string records;  // every record, checksums left out
};

Mpkl read_mpkl(const fs::path & p) {
    const std::string b = test::read_bytes(p);
    Mpkl m;
    uint32_t hlen = 0;
    std::memcpy(&m.top, b.data() + 8, 4);
    std::memcpy(&hlen, b.data() + 12, 4);
    m.header = json::parse(b.substr(16, hlen));
    const size_t rec = 12 + 8 * size_t(m.top), section = 1024 * rec;
    for (size_t at = 16 + hlen + 8; at < b.size();) {
        const size_t n = std::min(section, b.size() - at - 8);
        m.records += b.substr(at, n);
        at += n + 8;
    }
    return m;
}

// Writes `m` with every checksum made anew, as a forger (or a careless tool) would.
void write_mpkl(const fs::path & p, const Mpkl & m, uint32_t version = 2) {
    const std::string h = m.header.dump();
    std::string out = "MPKL";
    const auto u32 = [&](uint32_t v) { out.append(reinterpret_cast<const char *>(&v), 4); };
    const auto u64 = [&](std::string & to, uint64_t v) { to.append(reinterpret_cast<const char *>(&v), 8); };
    u32(version);
    u32(m.top);
    u32(uint32_t(h.size()));
    out += h;
    u64(out, XXH3_64bits(out.data(), out.size()));
    const size_t section = 1024 * (12 + 8 * size_t(m.top));
    for (size_t at = 0; at < m.records.size(); at += section) {
        const std::string s = m.records.substr(at, section);
        out += s;
        u64(out, XXH3_64bits(s.data(), s.size()));
    }
    test::write_text(p, out);
}

void put_f32(std::string & b, size_t at, float v) { std::memcpy(b.data() + at, &v, 4); }

} // namespace

TEST_F(Hostile, CorpusOutputsTakeTheirNamesTogetherOrTheOldSetStays) {
    write_text_files(local("src"), 12);
    const std::string base = fmt::format("corpus -m {} --source en={} -o {}", s(path("m.gguf")), s(local("src")), s(local("out")));
    const auto first = test::run_command(moeprune_cmd(base + " --seed 1"));
    ASSERT_EQ(first.exit_code, 0) << first.output;
    const std::string old_set = set_bytes(local("out"));
    int failed = 0;
    for (int kib = 1; kib <= 40; ++kib) {
        const auto r = run_limited(base + " --seed 2", kib);
        if (r.exit_code == 0) {
            break;  // the limit no longer bites
        }
        ++failed;
        EXPECT_EQ(set_bytes(local("out")), old_set) << "a failed write at " << kib << " KiB changed the old set:\n" << r.output;
        for (const auto & e : fs::directory_iterator(local("out"))) {
            EXPECT_EQ(e.path().filename().string().find(".partial."), std::string::npos) << e.path();
        }
    }
    EXPECT_GT(failed, 1) << "no limit made corpus fail: the test tests nothing";
    EXPECT_NE(set_bytes(local("out")), old_set) << "the unlimited run with another seed wrote the same set";
}

TEST_F(Hostile, CorpusRefusesAFifoAsItsModel) {
    ASSERT_EQ(::mkfifo(s(local("m.fifo")).c_str(), 0600), 0);
    write_text_files(local("src"), 3);
    expect_refused(fmt::format("corpus -m {} --source en={} -o {}", s(local("m.fifo")), s(local("src")), s(local("out"))),
                   {"m.fifo: not a regular file"}, {}, {local("out") / "corpus.json"});
}

TEST_F(Hostile, EvalBaseFilesAreChecksummedAndEveryRecordChecked) {
    const fs::path base = local("base.mpkl");
    const std::string eval = fmt::format("eval -m {} -f {} -c 32 --top 4 ", s(path("m.gguf")), s(path("c.jsonl")));
    const auto r = test::run_command(moeprune_cmd(eval + "--base-out " + s(base)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string good = test::read_bytes(base);
    uint32_t version = 0;
    std::memcpy(&version, good.data() + 4, 4);
    EXPECT_EQ(version, 2u) << "docs/formats.md says version 2";
    const auto ok = test::run_command(moeprune_cmd(eval + "--keep " + s(path("k.json")) + " --base " + s(base)));
    ASSERT_EQ(ok.exit_code, 0) << ok.output;

    const Mpkl m = read_mpkl(base);
    const size_t rec = 12 + 8 * size_t(m.top);
    ASSERT_GE(m.records.size(), 2 * rec);
    const fs::path bad = local("bad.mpkl");
    const auto refused = [&](const std::string & says) {
        expect_refused(eval + "--keep " + s(path("k.json")) + " --base " + s(bad), {"bad.mpkl", says}, {bad});
    };
    // One flipped bit is a checksum mismatch.
    std::string flipped = good;
    flipped[flipped.size() - 20] = char(flipped[flipped.size() - 20] ^ 0x10);
    test::write_text(bad, flipped);
    refused("checksum mismatch in records");
    // Forged records with valid checksums are still impossible distributions.
    const auto forged = [&](const std::function<void(std::string &)> & edit, const std::string & says) {
        Mpkl f = m;
        edit(f.records);
        write_mpkl(bad, f);
        refused(says);
    };
    forged([&](std::string & b) { put_f32(b, rec + 4, std::nanf("")); }, "record 1: ln p(target) is nan");
    forged([&](std::string & b) { put_f32(b, 4, 5.0f); }, "record 0: ln p(target) is 5");
    forged([&](std::string & b) { put_f32(b, 12 + 4 * m.top, 0.0f); }, "record 0: ");  // top mass above 1
    forged([&](std::string & b) { put_f32(b, 8, std::nanf("")); }, "record 0: ln tail mass is nan");
    forged([&](std::string & b) { std::memcpy(b.data() + 16, b.data() + 12, 4); }, "record 0: names one id twice");
    forged([&](std::string & b) { const int32_t id = 1 << 30; std::memcpy(b.data() + 12, &id, 4); }, "outside the");
    // Headers: a field missing, or disagreeing with the body.
    const auto header = [&](const std::function<void(json &)> & edit, const std::string & says) {
        Mpkl f = m;
        edit(f.header);
        write_mpkl(bad, f);
        refused(says);
    };
    header([](json & h) { h.erase("corpus"); }, "header: \"corpus\" is missing");
    header([](json & h) { h["top"] = 5; }, "header: \"top\" is 5");
    header([](json & h) { h["format"] = "x"; }, "header: \"format\"");
    header([](json & h) { h["n_scored"] = h["n_scored"].get<uint64_t>() + 1; }, "truncated?");
    Mpkl v1 = m;
    write_mpkl(bad, v1, 1);
    refused("eval base version 1 is not supported");
}

TEST_F(Hostile, EvalBaseAndMergeIdentifyModelsByContent) {
    const fs::path base = local("base.mpkl");
    const auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} -c 32 --top 4 --base-out {}", s(path("m.gguf")),
                                                              s(path("c.jsonl")), s(base))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // The same model under another name is the same model.
    fs::copy_file(path("m.gguf"), local("renamed.gguf"));
    const auto same = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} -c 32 --keep {} --base {}",
                                                                 s(local("renamed.gguf")), s(path("c.jsonl")),
                                                                 s(path("k.json")), s(base))));
    EXPECT_EQ(same.exit_code, 0) << same.output;
    // Another model of the same shape under the same name is not.
    fs::create_directories(local("other"));
    const fs::path other = local("other") / "m.gguf";
    const auto o = test::run_command(moeprune_cmd(
        fmt::format("synth --arch qwen3moe --layers 2 --experts 8 --used 2 --seed 99 -o {}", s(other))));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    ASSERT_EQ(fs::file_size(other), fs::file_size(path("m.gguf")));
    expect_refused(fmt::format("eval -m {} -f {} -c 32 --keep {} --base {}", s(other), s(path("c.jsonl")), s(path("k.json")), s(base)),
                   {"base.mpkl: was recorded on another model"}, {base});
    // merge: statistics of two models of one shape are not one model's.
    const auto c = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -t 2", s(other), s(path("c.jsonl")),
                                                              s(local("so.json")))));
    ASSERT_EQ(c.exit_code, 0) << c.output;
    expect_refused(fmt::format("merge {} {} -o {}", s(path("s.json")), s(local("so.json")), s(local("merged.json"))),
                   {"come from different models"}, {path("s.json"), local("so.json")}, {local("merged.json")});
    json old = json::parse(test::read_bytes(path("s.json")));
    old["model"].erase("digest");
    test::write_text(local("old.json"), old.dump());
    expect_refused(fmt::format("merge {} {} -o {}", s(local("old.json")), s(path("s.json")), s(local("merged.json"))),
                   {"old.json: model.digest: missing"}, {local("old.json")}, {local("merged.json")});
}

TEST_F(Hostile, TraceHeaderAndMetadataAreChecksummed) {
    const fs::path t = local("t.trace");
    write_small_trace(t, 10);
    const std::string good = test::read_bytes(t);
    std::string b = good;
    const uint32_t n_expert = 200;
    std::memcpy(b.data() + 12, &n_expert, 4);
    test::write_text(t, b);
    for (const std::string & args : {fmt::format("trace verify {}", s(t)), fmt::format("replay --trace {} --policy lru --cache 100", s(t))}) {
        expect_refused(args, {"t.trace: trace header checksum mismatch"}, {t});
    }
    b = good;
    b[after(b, "n_expert_used\":") ] = '3';
    test::write_text(t, b);
    expect_refused(fmt::format("trace info {}", s(t)), {"t.trace: trace header checksum mismatch"}, {t});
}

TEST_F(Hostile, CorpusRefusesEmptySidesAndReportsWhatItSkipped) {
    write_text_files(local("a"), 6);
    const std::string m = s(path("m.gguf"));
    const auto manifest = [&](const std::string & name, const std::string & body) {
        test::write_text(local(name), body);
        return local(name);
    };
    // A source listed twice: deduplication empties the second, whose weight then leaves nothing.
    const fs::path twice = manifest("twice.toml", "[[source]]\nname = \"one\"\npath = \"a\"\ndomain = \"en\"\n"
                                                  "[[source]]\nname = \"two\"\npath = \"a\"\ndomain = \"en\"\n");
    expect_refused(fmt::format("corpus -m {} --manifest {} -o {}", m, s(twice), s(local("o1"))),
                   {"side would be empty", "source \"two\"", "duplicate"}, {twice}, {local("o1") / "corpus.json"});
    // One group: it cannot be on both sides.
    test::write_text(local("single.txt"), "one file, one group, nothing to hold out for eval\n");
    expect_refused(fmt::format("corpus -m {} --source en={} -o {}", m, s(local("single.txt")), s(local("o2"))),
                   {"eval side would be empty", "one group"}, {}, {local("o2") / "corpus.json"});
    // A budget of one token leaves the eval side nothing.
    const fs::path tiny = manifest("tiny.toml", "[corpus]\ntokens = 1\n[[source]]\nname = \"a\"\npath = \"a\"\ndomain = \"en\"\n");
    expect_refused(fmt::format("corpus -m {} --manifest {} -o {}", m, s(tiny), s(local("o3"))),
                   {"eval side would be empty"}, {tiny}, {local("o3") / "corpus.json"});
    // Only empty files.
    fs::create_directories(local("empty"));
    test::write_text(local("empty") / "x.txt", "  \n");
    test::write_text(local("empty") / "y.txt", "\n");
    expect_refused(fmt::format("corpus -m {} --source en={} -o {}", m, s(local("empty")), s(local("o4"))),
                   {"side would be empty"}, {}, {local("o4") / "corpus.json"});
    // An eval-only source that repeats a calib-only one.
    const fs::path split = manifest("split.toml", "[[source]]\nname = \"c\"\npath = \"a\"\ndomain = \"en\"\nsplit = \"calib\"\n"
                                                  "[[source]]\nname = \"e\"\npath = \"a\"\ndomain = \"en\"\nsplit = \"eval\"\n");
    expect_refused(fmt::format("corpus -m {} --manifest {} -o {}", m, s(split), s(local("o5"))),
                   {"eval side would be empty", "source \"e\""}, {split}, {local("o5") / "corpus.json"});
    // --eval-share 0 asks for no eval side: that one is written.
    const auto none = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --source en={} -o {} --eval-share 0", m,
                                                                 s(local("a")), s(local("o6")))));
    EXPECT_EQ(none.exit_code, 0) << none.output;
    // A file of a directory source that is not text is named, not only counted.
    test::write_text(local("a") / "image.bin", std::string("\x89PNG\r\n\x1a\n\0\0\0", 11));
    const auto skipped = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --source en={} -o {}", m, s(local("a")),
                                                                    s(local("o7")))));
    ASSERT_EQ(skipped.exit_code, 0) << skipped.output;
    EXPECT_NE(skipped.output.find("skipped 1 file(s) that are not UTF-8 text: " + s(local("a") / "image.bin")), std::string::npos)
        << skipped.output;
    // -o naming a file is refused by name.
    test::write_text(local("afile"), "x");
    expect_refused(fmt::format("corpus -m {} --source en={} -o {}", m, s(local("a")), s(local("afile"))),
                   {"afile: exists and is not a folder"}, {local("afile")});
    expect_refused(fmt::format("select --stats {} -k 4 --metric freq -o {}", s(path("s.json")), s(local("afile"))),
                   {"afile: exists and is not a folder"}, {local("afile")});
}

TEST_F(Hostile, CorpusStratifiesGroupsPerSourceAndKeysThemRelativeToTheSource) {
    write_text_files(local("here") / "code", 24);
    write_text_files(local("here") / "chat", 24, "talk");
    test::write_text(local("here") / "corpus.toml",
                     "[corpus]\neval_share = 0.1\n[[source]]\nname = \"code\"\npath = \"code\"\ndomain = \"code\"\n"
                     "[[source]]\nname = \"chat\"\npath = \"chat\"\ndomain = \"chat\"\n");
    for (int seed = 0; seed < 8; ++seed) {
        const fs::path out = local(fmt::format("o{}", seed));
        const auto r = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --manifest {} -o {} --seed {} --allow-shortfall",
                                                                  s(path("m.gguf")), s(local("here") / "corpus.toml"),
                                                                  s(out), seed)));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        const json report = json::parse(test::read_bytes(out / "corpus.json"));
        for (const json & src : report["sources"]) {
            // round(0.1 x 24) = 2 groups held out, whatever the seed.
            EXPECT_EQ(src["eval"]["groups_available"].get<int>(), 2) << src["name"] << " seed " << seed;
            EXPECT_EQ(src["calib"]["groups_available"].get<int>(), 22) << src["name"] << " seed " << seed;
        }
    }
    // The same corpus moved elsewhere splits the same.
    fs::copy(local("here"), local("there"), fs::copy_options::recursive);
    for (const char * where : {"here", "there"}) {
        const auto r = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --manifest {} -o {} --seed 3 --allow-shortfall",
                                                                  s(path("m.gguf")), s(local(where) / "corpus.toml"),
                                                                  s(local(where) / "out"))));
        ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    EXPECT_EQ(test::read_bytes(local("here") / "out" / "eval.jsonl"), test::read_bytes(local("there") / "out" / "eval.jsonl"));
    EXPECT_EQ(test::read_bytes(local("here") / "out" / "calib.jsonl"), test::read_bytes(local("there") / "out" / "calib.jsonl"));
}

// Measurements plan reads, made once on the fixture's model: a keep map, its eval, a
// replay of the collect trace with and without cache-aware routing.
class HostilePlan : public Hostile {
protected:
    static void SetUpTestSuite() {
        Hostile::SetUpTestSuite();
        const auto run = [&](const std::string & args) {
            const auto r = test::run_command(moeprune_cmd(args));
            ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
        };
        run(fmt::format("select --stats {} -k 4 --metric freq -o {}", s(path("s.json")), s(path("maps"))));
        run(fmt::format("eval -m {} -f {} -c 32 --keep {} --json {}", s(path("m.gguf")), s(path("c.jsonl")),
                        s(path("maps") / "freq-k4.json"), s(path("e.json"))));
        run(fmt::format("replay --trace {} --model {} --policy lru --cache 4 --lambda 0,0.5 --json {}", s(path("t.trace")),
                        s(path("m.gguf")), s(path("r.json"))));
        replay_ = json::parse(test::read_bytes(path("r.json")));
        eval_ = json::parse(test::read_bytes(path("e.json")));
    }
    std::string plan(const std::string & more) {
        return fmt::format("plan -m {} --replay {} --eval {} {}", s(path("m.gguf")), s(path("r.json")), s(path("e.json")), more);
    }
    // plan refuses a changed copy of the replay (or the eval) result, naming `says`.
    void refuses(bool replay, const std::function<void(json &)> & edit, const std::string & says) {
        json changed = replay ? replay_ : eval_;
        edit(changed);
        const fs::path bad = local(replay ? "bad-r.json" : "bad-e.json");
        test::write_text(bad, changed.dump());
        expect_refused(fmt::format("plan -m {} --replay {} --eval {} --json {}", s(path("m.gguf")),
                                   s(replay ? bad : path("r.json")), s(replay ? path("e.json") : bad), s(local("p.json"))),
                       {bad.filename().string() + ": " + says}, {bad}, {local("p.json")});
    }
    void refuses_replay(const std::function<void(json &)> & edit, const std::string & says) { refuses(true, edit, says); }
    void refuses_eval(const std::function<void(json &)> & edit, const std::string & says) { refuses(false, edit, says); }
    static inline json replay_, eval_;
};

TEST_F(HostilePlan, RefusesAnotherModelsMeasurements) {
    const fs::path other = local("other.gguf");
    const auto o = test::run_command(moeprune_cmd(
        fmt::format("synth --arch qwen3moe --layers 2 --experts 8 --used 2 --seed 99 -o {}", s(other))));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    expect_refused(fmt::format("plan -m {} --replay {}", s(other), s(path("r.json"))),
                   {"r.json: inputs.trace_meta.model.digest", "another model"}, {path("r.json")});
    expect_refused(fmt::format("plan -m {} --eval {}", s(other), s(path("e.json"))),
                   {"e.json: base.digest", "another model"}, {path("e.json")});
    // Planned by hand, the inputs must still agree with each other.
    const auto e2 = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} -c 32 --keep {} --json {}", s(other),
                                                               s(path("c.jsonl")), s(path("maps") / "freq-k4.json"),
                                                               s(local("e-other.json")))));
    ASSERT_EQ(e2.exit_code, 0) << e2.output;
    expect_refused(fmt::format("plan --expert-mb 1 --layers 2 --experts 8 --used 2 --replay {} --eval {}", s(path("r.json")),
                               s(local("e-other.json"))),
                   {"r.json: inputs.trace_meta.model.digest", "another model than", "e-other.json: base"});
    // A 16-expert model's eval for an 8-expert plan.
    json e16 = eval_;
    e16["base"]["n_expert"] = 16;
    test::write_text(local("e16.json"), e16.dump());
    expect_refused(fmt::format("plan -m {} --eval {}", s(path("m.gguf")), s(local("e16.json"))),
                   {"e16.json: base.n_expert: is 16"});
}

TEST_F(HostilePlan, RefusesImpossibleRecordsByFileRecordAndField) {
    refuses_replay([](json & r) { r["records"][0]["misses_per_token"] = -1; }, "records[0].misses_per_token: is -1");
    refuses_replay([](json & r) { r["records"][0]["cache"] = -4; }, "records[0].cache: is -4");
    refuses_replay([](json & r) { r["records"][0]["cache"] = uint64_t(1) << 40; }, "records[0].cache: is 1099511627776");
    refuses_replay([](json & r) { r["records"][0]["slots"] = {-1}; }, "records[0].slots[0]: is -1");
    refuses_replay([](json & r) { r["records"][0]["policy"] = "nonsense"; }, "records[0].policy: is \"nonsense\"");
    refuses_replay([](json & r) { r["records"][0]["lambda"] = -2; }, "records[0].lambda: is -2");
    refuses_replay([](json & r) { r["records"][0]["read_rounds_per_token"] = nullptr, r["records"][0]["misses_per_token"] = "x"; },
                   "records[0].misses_per_token: is \"x\"");
    refuses_replay([](json & r) { r.erase("records"); }, "records: is missing");
    refuses_replay([](json & r) { r["inputs"]["n_expert"] = 200; }, "inputs.n_expert: is 200");
    refuses_replay([](json & r) { r["inputs"]["n_expert_after_keep"] = 99; }, "inputs.n_expert_after_keep: is 99");
    const auto keep_candidate = [](json & e) -> json & {
        for (json & c : e["candidates"]) {
            if (c["kind"] == "keep") {
                return c;
            }
        }
        throw std::runtime_error("no keep candidate");
    };
    refuses_eval([&](json & e) { keep_candidate(e)["all"]["kld_mean"] = -1; }, "candidates[0].all.kld_mean: is -1");
    refuses_eval([&](json & e) { keep_candidate(e)["source"] = "", keep_candidate(e)["name"] = "freq-k99"; }, "candidates[0].name: names K 99");
    refuses_eval([](json & e) { e.erase("candidates"); }, "candidates: is missing");
    refuses_eval([](json & e) { e["base"].erase("digest"); }, "base.digest: is missing");
}

TEST_F(HostilePlan, RefusesImpossibleSettings) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {plan("--misses-per-token nan"), "--misses-per-token nan must be a finite count"},
        {plan("--max-kld nan"), "--max-kld nan must be a finite KLD"},
        {plan("--speed-share nan"), "--speed-share nan must be a share in (0, 1]"},
        {plan("--misses-per-token 1 --cache-experts 0"), "--cache-experts 0: a per-layer cache holds 1 to 8 experts"},
        {plan("--misses-per-token 1 --cache-experts 9"), "--cache-experts 9: a per-layer cache holds 1 to 8 experts"},
        {plan("--ram 20000000000T"), "--ram \"20000000000T\" is 2^64 bytes or more"},
        {plan("--ram 0"), "--ram 0 leaves no RAM for the model"},
        {plan("--ram ''"), "--ram \"\" is not a size"},
        {"plan --expert-mb 1 --layers 2147483647 --experts 2147483647 --used 2", "at most 100000 layers of 65536 experts"},
        {fmt::format("eval -m {} -f {} --worst -1", s(path("m.gguf")), s(path("c.jsonl"))), "--worst -1: the number of worst"},
    };
    for (const auto & [args, says] : cases) {
        expect_refused(args, {says}, {path("r.json"), path("e.json")});
    }
}

TEST_F(HostilePlan, ReroutedOptionsGetOnlyTheClosedLoopsKld) {
    const auto open = test::run_command(moeprune_cmd(plan("--json " + s(local("p.json")))));
    ASSERT_EQ(open.exit_code, 0) << open.output;
    int rerouted = 0;
    const json p = json::parse(test::read_bytes(local("p.json")));
    for (const json & o : p["options"]) {
        if (o["lambda"].get<double>() > 0) {
            ++rerouted;
            EXPECT_TRUE(o["kld_mean"].is_null()) << o.dump() << ": λ > 0 given the open-loop KLD of its keep map";
            EXPECT_EQ(o["kld_loop"], "closed");
            EXPECT_NE(o.value("kld_note", "").find("unmeasured"), std::string::npos) << o.dump();
        }
    }
    EXPECT_GT(rerouted, 0);
    // With the closed loop of the same (model, policy, cache, λ) measured, that is its KLD.
    const auto closed = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} -c 32 --cache-policy lru --cache 4 "
                                                                   "--lambda 0.5 --json {}", s(path("m.gguf")),
                                                                   s(path("c.jsonl")), s(local("ec.json")))));
    ASSERT_EQ(closed.exit_code, 0) << closed.output;
    double closed_kld = -1;
    const json ec = json::parse(test::read_bytes(local("ec.json")));
    for (const json & c : ec["candidates"]) {
        if (c["kind"] == "closed-loop") {
            closed_kld = c["all"]["kld_mean"].get<double>();
        }
    }
    ASSERT_GE(closed_kld, 0);
    const auto both = test::run_command(moeprune_cmd(fmt::format("plan -m {} --replay {} --eval {},{} --json {}", s(path("m.gguf")),
                                                                 s(path("r.json")), s(path("e.json")), s(local("ec.json")),
                                                                 s(local("p2.json")))));
    ASSERT_EQ(both.exit_code, 0) << both.output;
    int measured = 0;
    const json p2 = json::parse(test::read_bytes(local("p2.json")));
    for (const json & o : p2["options"]) {
        if (o["lambda"].get<double>() == 0.5 && o["criterion"] == "none" && o["policy"] == "lru" && o["cache_experts"] == 4) {
            ++measured;
            EXPECT_DOUBLE_EQ(o["kld_mean"].get<double>(), closed_kld) << o.dump();
            EXPECT_EQ(o["kld_measured"], true);
        }
    }
    EXPECT_EQ(measured, 1);
}

// The commands plan prints run what it recommends, or none is printed: a first word the
// shell would take for an assignment is quoted, a keep map plan never read is a named
// placeholder, a relative keep map is made absolute, a --llama-bin without the tool is said.
TEST_F(HostilePlan, PrintedCommandsRunWhatTheyNameFromAnyFolder) {
    fs::create_directory(local("a=b"));
    auto r = test::run_command(fmt::format("cd {} && {}", s(local_.path()),
                                           moeprune_cmd(fmt::format("plan -m {} -k 4 --llama-bin a=b", s(path("m.gguf"))))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("'a=b/llama-completion' -m"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("a=b has no llama-completion"), std::string::npos) << r.output;
    // Without --eval no keep map was read: the slice line names a placeholder and says so.
    EXPECT_NE(r.output.find("--keep KEEP-MAP-K4.json"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("KEEP-MAP-K4.json stands for a keep map of K 4"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("any-k4.json"), std::string::npos) << r.output;

    // eval.json's keep map named relative to the folder eval ran in.
    const auto e = test::run_command(fmt::format(
        "cd {} && {}", s(dir_->path()), moeprune_cmd(fmt::format("eval -m m.gguf -f c.jsonl -c 32 --keep maps/freq-k4.json --json {}",
                                                        s(local("e-rel.json"))))));
    ASSERT_EQ(e.exit_code, 0) << e.output;
    r = test::run_command(fmt::format("cd {} && {}", s(dir_->path()),
                                      moeprune_cmd(fmt::format("plan -m m.gguf --eval {} -k 4 --ram 1G --reserve 0 --json {}",
                                                               s(local("e-rel.json")), s(local("p.json"))))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json p = json::parse(test::read_bytes(local("p.json")));
    const std::vector<std::string> slice = p["commands"]["slice"].get<std::vector<std::string>>();
    ASSERT_FALSE(slice.empty()) << p["commands"].dump();
    EXPECT_EQ(slice[5], s(path("maps") / "freq-k4.json")) << p["commands"].dump();
}

// A recommended expert cache runs in no llama.cpp release: plan prints no llama.cpp
// command as if it ran it, and says why.
TEST_F(HostilePlan, ARecommendedExpertCacheGetsNoLlamaCppCommands) {
    // 500 MB experts: K 8 resident does not fit in 5.37 GB, K 4 does, and an LRU of 4 slots
    // on K 8 (KLD 0) is within --speed-share of it when compute dominates.
    const std::string by_hand = fmt::format("plan --expert-mb 500 --layers 2 --experts 8 --used 2 --other-gb 1 -k 4,8 "
                                            "--ram 6G --reserve 1G --eval {} --replay {} --compute-ms 1000 "
                                            "--speed-share 0.8",
                                            s(path("e.json")), s(path("r.json")));
    auto r = test::run_command(moeprune_cmd(by_hand + " --runs-on any --json " + s(local("p.json"))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json p = json::parse(test::read_bytes(local("p.json")));
    ASSERT_TRUE(p["recommended"].is_number()) << r.output;
    EXPECT_EQ(p["options"][p["recommended"].get<size_t>()]["runs_on"], "expert-cache runtime") << r.output;
    EXPECT_TRUE(p["commands"].is_null()) << p["commands"].dump();
    EXPECT_NE(r.output.find("no command runs it: no llama.cpp release runs an expert cache"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("llama-completion"), std::string::npos) << r.output;
    // Among what llama.cpp runs, the same plan has its commands.
    r = test::run_command(moeprune_cmd(by_hand + " --json " + s(local("p2.json"))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json p2 = json::parse(test::read_bytes(local("p2.json")));
    EXPECT_EQ(p2["options"][p2["recommended"].get<size_t>()]["runs_on"], "llama.cpp");
    EXPECT_TRUE(p2["commands"].is_object());
}

// --min-accuracy on tasks too few to tell a map from the base: the plan says the filter
// reads noise.
TEST_F(HostilePlan, MinAccuracyWithinTheBasesNoiseIsSaidToBeNoise) {
    std::string tasks;
    static const char * words[] = {"the fox", "a dog", "experts", "routers", "int main"};
    for (int t = 0; t < 8; ++t) {
        tasks += fmt::format("{} {}\n{}\n", words[t % 5], words[(t + 2) % 5], t % 4);
        for (int e = 0; e < 4; ++e) {
            tasks += fmt::format("{} {}\n", words[(t + e) % 5], words[(t + 3 * e) % 5]);
        }
    }
    test::write_text(local("tasks.txt"), tasks);
    const auto e = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} -c 64 --keep {} --hellaswag {} --json {}",
                                                              s(path("m.gguf")), s(path("c.jsonl")),
                                                              s(path("maps") / "freq-k4.json"), s(local("tasks.txt")),
                                                              s(local("et.json")))));
    ASSERT_EQ(e.exit_code, 0) << e.output;
    const auto r = test::run_command(moeprune_cmd(fmt::format("plan -m {} --eval {} -k 4 --min-accuracy 0.9", s(path("m.gguf")),
                                                              s(local("et.json")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("over 8 tasks, so differences under"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("accuracy cannot tell these options apart"), std::string::npos) << r.output;
}

// Bytes that are not UTF-8 in a path: refused naming the argument, before anything is made.
TEST_F(Hostile, PathsThatAreNotUtf8AreRefusedBeforeAnythingIsMade) {
    const std::string bad = s(local("r_")) + "\xff";
    auto r = test::run_command(moeprune_cmd(fmt::format("plan -m {} -k 4 --ram 1G --json '{}'", s(path("m.gguf")), bad)));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--json " + s(local("r_")) + "\\xff: is not UTF-8"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(bad));
    test::write_text(local("c.toml"), "[[source]]\npath = \"" + s(path("c.jsonl")) + "\"\ndomain = \"en\"\n");
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} -k 4 -o '{}'", s(path("m.gguf")), s(local("c.toml")), bad)));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("is not UTF-8"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(bad)) << "no run folder made";
    // A shortlist needs a measure and a budget: refused, not ignored.
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} -k 4 --measure-shortlist 2 -o {}", s(path("m.gguf")),
                                                   s(local("c.toml")), s(local("run")))));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--measure-shortlist 2: the shortlist is measured under --ram after the measure stage"),
              std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(local("run")));
    // A --ram under the weights that are not experts is refused before any stage, measured
    // reserve or not.
    r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} -k 4 --ram 1M --measure 25% -o {}", s(path("m.gguf")),
                                                   s(local("c.toml")), s(local("run")))));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--ram 1M leaves 0.001 GB, less than the"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(local("run")));
}

// One JSONL file of independent documents without an id: group = "document" splits it,
// and the refusal with the default group says so. Task settings out of bounds are refused,
// and a domain left without tasks says why.
TEST_F(Hostile, CorpusSplitsOneJsonlFileByDocumentAndSaysWhyTasksAreMissing) {
    std::string jsonl;
    for (int d = 0; d < 40; ++d) {
        std::string text;
        for (int w = 0; w < 60; ++w) {
            text += fmt::format("word{} ", (d * 7 + w * 13) % 97) + (w % 10 == 9 ? "end.\n" : "");
        }
        jsonl += json({{"text", text}}).dump() + "\n";
    }
    test::write_text(local("docs.jsonl"), jsonl);
    const std::string m = s(path("m.gguf"));
    expect_refused(fmt::format("corpus -m {} --source prose={} -o {}", m, s(local("docs.jsonl")), s(local("o1"))),
                   {"eval side would be empty", "one group", "group = \"document\" puts each JSONL document in a group"},
                   {local("docs.jsonl")}, {local("o1") / "corpus.json"});
    test::write_text(local("doc.toml"), fmt::format("[corpus]\ntasks_per_domain = 4\n[[source]]\npath = \"{}\"\ndomain = "
                                                    "\"prose\"\ngroup = \"document\"\n",
                                                    s(local("docs.jsonl"))));
    auto r = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --manifest {} -o {}", m, s(local("doc.toml")), s(local("o2")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_GT(test::read_bytes(local("o2") / "calib.jsonl").size(), 0u);
    EXPECT_GT(test::read_bytes(local("o2") / "eval.jsonl").size(), 0u);

    test::write_text(local("huge.toml"), fmt::format("[corpus]\ntask_context = 999999999\n[[source]]\npath = \"{}\"\n"
                                                     "domain = \"prose\"\ngroup = \"document\"\n",
                                                     s(local("docs.jsonl"))));
    expect_refused(fmt::format("corpus -m {} --manifest {} -o {}", m, s(local("huge.toml")), s(local("o3"))),
                   {"huge.toml", "\"task_context\" is 999999999 tokens: at most 65536"}, {local("huge.toml")},
                   {local("o3") / "corpus.json"});

    // Endings of one token: too few distinct ones, said in tasks.json.
    r = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --manifest {} --task-context 1 --task-ending 1 -o {}", m,
                                                   s(local("doc.toml")), s(local("o4")))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json tasks = json::parse(test::read_bytes(local("o4") / "tasks.json"));
    for (const json & d : tasks["domains"]) {
        EXPECT_TRUE(d["tasks"].get<int>() > 0 || !d.value("skipped", std::string()).empty()) << d.dump();
    }
}
