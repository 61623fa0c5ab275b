// Hostile and careless input (issue 19): every case ends in a clear error that names
// the file and the problem, a non-zero exit, inputs byte-identical and no output under
// its final name; or, where the input is valid, in a correct answer.
#include "formats/stats.h"
#include "formats/trace.h"
#include "slice/slice_support.h"
#include "support/test_support.h"

#include "gguf.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <cstring>
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
    for (size_t pos = 24 + meta_len; pos < b.size();) {
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
        {replay + "-t -3", "-t and --prefetch-n must be >= 0"},
        {replay + "--warmup -1", "--warmup"},
        {fmt::format("select --stats {} -k 4 --metric reap-lcb --lcb-z nan", st), "--lcb-z must be a number from 0 to 10"},
        {fmt::format("slice -m {} --keep {} -o {} --split-max-size -1", s(path("m.gguf")), s(path("k.json")),
                     s(local("o.gguf"))), "size \"-1\" is not a number"},
        {fmt::format("collect -m {} -f {} -o {} --chunks 0", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
         "--chunks >= 1"},
        {fmt::format("collect -m {} -f {} -o {} -t -3", s(path("m.gguf")), s(path("c.jsonl")), s(local("x.json"))),
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
