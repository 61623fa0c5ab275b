#include "core/errors.h"
#include "formats/sliced_trace.h"
#include "formats/trace.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "ggml.h"

#include <fmt/format.h>

#include <cstring>
#include <fstream>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kLayers = 3, kExperts = 40, kTopM = 5;

// Deterministic candidates: logits are multiples of 0.25, exact in f16.
void token_record(uint64_t t, std::vector<uint16_t> & ids, std::vector<float> & logits) {
    ids.resize(kLayers * kTopM);
    logits.resize(kLayers * kTopM);
    for (uint32_t l = 0; l < kLayers; ++l) {
        for (uint32_t i = 0; i < kTopM; ++i) {
            ids[l * kTopM + i] = uint16_t((t * 7 + l * 3 + i * 11) % kExperts);
            logits[l * kTopM + i] = float(int((t + l) % 16) - int(i)) * 0.25f;
        }
    }
}

TraceTokenMeta token_meta(uint64_t t) {
    TraceTokenMeta m;
    m.token = int32_t(1000 + t);
    m.pos = int32_t(t % 50);
    m.seq = int32_t(t / 50);
    m.domain = uint16_t(t % 2);
    m.phase = t % 50 < 40 ? TracePhase::Prefill : TracePhase::Decode;
    return m;
}

void write_trace(const fs::path & path, uint64_t n_tokens, int zstd_level, uint32_t block = 16) {
    TraceHeader h;
    h.n_layer = kLayers;
    h.n_expert = kExperts;
    h.top_m = kTopM;
    h.domains = {"chat", "code"};
    h.meta = {{"model", "synthetic"}};
    TraceWriter w(path, h, block, zstd_level);
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    for (uint64_t t = 0; t < n_tokens; ++t) {
        token_record(t, ids, logits);
        w.append(token_meta(t), ids.data(), logits.data());
    }
    w.close();
}

void expect_trace_contents(const TraceReader & r, uint64_t n_tokens, bool with_meta) {
    ASSERT_EQ(r.n_tokens(), n_tokens);
    std::vector<uint16_t> ids, want_ids;
    std::vector<float> logits, want_logits;
    for (uint32_t l = 0; l < kLayers; ++l) {
        r.read_layer(l, ids, logits);
        ASSERT_EQ(ids.size(), n_tokens * kTopM);
        for (uint64_t t = 0; t < n_tokens; ++t) {
            token_record(t, want_ids, want_logits);
            for (uint32_t i = 0; i < kTopM; ++i) {
                ASSERT_EQ(ids[t * kTopM + i], want_ids[l * kTopM + i]) << "token " << t << " layer " << l;
                ASSERT_EQ(logits[t * kTopM + i], want_logits[l * kTopM + i]) << "token " << t << " layer " << l;
            }
        }
    }
    if (with_meta) {
        const auto meta = r.token_meta();
        for (uint64_t t = 0; t < n_tokens; ++t) {
            const auto want = token_meta(t);
            ASSERT_EQ(meta[t].token, want.token);
            ASSERT_EQ(meta[t].pos, want.pos);
            ASSERT_EQ(meta[t].seq, want.seq);
            ASSERT_EQ(meta[t].domain, want.domain);
            ASSERT_EQ(meta[t].phase, want.phase);
        }
    }
}

// An f32 -> f16 conversion of our own, for values that are exact in f16, so the
void write_q4rt(const fs::path & path, uint64_t n_tokens, uint32_t header_count, size_t extra_tail_bytes = 0) {
    test::write_q4rt(path, kLayers, kExperts, kTopM, n_tokens, header_count, token_record, extra_tail_bytes);
}

} // namespace

TEST(Trace, RoundTripsUncompressed) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 100, 0);
    const auto r = TraceReader::open(dir / "t.trace");
    EXPECT_EQ(r.format(), "moeprune-trace v3");
    EXPECT_TRUE(r.has_checksums());
    EXPECT_EQ(r.header().domains, (std::vector<std::string>{"chat", "code"}));
    EXPECT_EQ(r.header().meta["model"], "synthetic");
    EXPECT_FALSE(r.truncated_tail());
    expect_trace_contents(r, 100, true);
}

TEST(Trace, RoundTripsZstdAndIsSmaller) {
    test::TempDir dir;
    write_trace(dir / "raw.trace", 400, 0);
    write_trace(dir / "z.trace", 400, 3);
    expect_trace_contents(TraceReader::open(dir / "z.trace"), 400, true);
    EXPECT_LT(fs::file_size(dir / "z.trace"), fs::file_size(dir / "raw.trace"));
}

TEST(Trace, UncompressedSizeStaysNearTheQ4rtLayout) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 256, 0, 256);
    const double per_token = double(fs::file_size(dir / "t.trace")) / 256.0;
    const double q4rt = kLayers * kTopM * 4.0;
    EXPECT_LE(per_token, q4rt + 16 + 2);  // 16 bytes of token metadata, block headers amortized
}

TEST(Trace, KilledWriterLosesOnlyTheLastBlock) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 100, 0, 16);  // 6 full blocks of 16 and one of 4
    const auto full = fs::file_size(dir / "t.trace");
    // Cut inside the last full block: what a writer killed mid-write leaves.
    fs::resize_file(dir / "t.trace", full - 300);
    const auto r = TraceReader::open(dir / "t.trace");
    EXPECT_TRUE(r.truncated_tail());
    EXPECT_EQ(r.n_tokens(), 96u);
    expect_trace_contents(r, 96, true);
}

TEST(Trace, CorruptBlockIsAnErrorNamingTheFile) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 40, 0, 16);
    std::string bytes = test::read_bytes(dir / "t.trace");
    const size_t second = bytes.find("MPBK", bytes.find("MPBK") + 4);
    ASSERT_NE(second, std::string::npos);
    bytes[second] = 'X';
    test::write_text(dir / "bad.trace", bytes);
    try {
        TraceReader::open(dir / "bad.trace");
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("bad.trace"), std::string::npos);
        EXPECT_NE(std::string(e.what()).find("after 16 tokens"), std::string::npos) << e.what();
    }
}

TEST(Trace, RejectsWhatIsNotATrace) {
    test::TempDir dir;
    test::write_text(dir / "x.trace", "hello, this is not a trace file at all");
    EXPECT_THROW(TraceReader::open(dir / "x.trace"), Error);
    test::write_text(dir / "short.trace", "Q4RT");
    EXPECT_THROW(TraceReader::open(dir / "short.trace"), Error);
    EXPECT_THROW(TraceReader::open(dir / "missing.trace"), Error);
}

TEST(Trace, ReadsQ4rtV1Exactly) {
    test::TempDir dir;
    write_q4rt(dir / "seed.bin", 37, 37);
    const auto r = TraceReader::open(dir / "seed.bin");
    EXPECT_EQ(r.format(), "Q4RT v1");
    EXPECT_EQ(r.header().n_layer, kLayers);
    EXPECT_EQ(r.header().n_expert, kExperts);
    EXPECT_EQ(r.header().top_m, kTopM);
    expect_trace_contents(r, 37, false);
}

TEST(Trace, Q4rtWithZeroHeaderCountDerivesItFromTheSize) {
    test::TempDir dir;
    write_q4rt(dir / "killed.bin", 29, 0, 40);  // a killed run: count never written, torn last record
    const auto r = TraceReader::open(dir / "killed.bin");
    EXPECT_EQ(r.n_tokens(), 29u);
    EXPECT_TRUE(r.truncated_tail());
    expect_trace_contents(r, 29, false);
}

TEST(Trace, Q4rtClaimingMoreTokensThanItHoldsIsAnError) {
    test::TempDir dir;
    write_q4rt(dir / "short.bin", 10, 50);
    try {
        TraceReader::open(dir / "short.bin");
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("only 10 complete tokens"), std::string::npos) << e.what();
    }
}

TEST(Trace, ExportsNumpyArrays) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 20, 0);
    export_trace_npy(TraceReader::open(dir / "t.trace"), dir / "npy");
    const std::string ids = test::read_bytes(dir / "npy" / "ids.npy");
    ASSERT_GT(ids.size(), 10u);
    EXPECT_EQ(ids.substr(0, 6), "\x93NUMPY");
    const uint16_t header_len = uint16_t(uint8_t(ids[8]) | (uint8_t(ids[9]) << 8));
    EXPECT_EQ((10 + header_len) % 64, 0);
    EXPECT_NE(ids.find("'shape': (20, 3, 5)"), std::string::npos);
    EXPECT_EQ(ids.size(), 10u + header_len + 20 * 3 * 5 * 2);
    // token 4, layer 2, candidate 1 in C order
    uint16_t id;
    std::memcpy(&id, ids.data() + 10 + header_len + ((4 * 3 + 2) * 5 + 1) * 2, 2);
    EXPECT_EQ(id, uint16_t((4 * 7 + 2 * 3 + 1 * 11) % kExperts));
    const std::string tok = test::read_bytes(dir / "npy" / "token.npy");
    EXPECT_NE(tok.find("'shape': (20,)"), std::string::npos);
    for (const char * f : {"logits.npy", "pos.npy", "seq.npy", "domain.npy", "phase.npy"}) {
        EXPECT_TRUE(fs::exists(dir / "npy" / f)) << f;
    }
}

TEST(Trace, InfoCountsPhasesSequencesAndDomains) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 100, 0);
    const auto j = trace_info_json(TraceReader::open(dir / "t.trace"));
    EXPECT_EQ(j["n_tokens"], 100);
    EXPECT_EQ(j["phases"]["prefill"], 80);
    EXPECT_EQ(j["phases"]["decode"], 20);
    EXPECT_EQ(j["n_sequences"], 2);
    EXPECT_EQ(j["domains"]["chat"], 50);
    EXPECT_EQ(j["domains"]["code"], 50);
}

namespace {

// Where the bytes of a raw trace written by write_trace (block of 16) lie.
struct RawLayout {
    uint64_t header = 0, block = 0, block_header = 0, meta = 0, layer = 0;
    uint64_t section(uint32_t block_index, uint32_t layer_index) const {
        return header + block_index * block + block_header + meta + layer_index * layer;
    }
};

RawLayout raw_layout(const fs::path & path) {
    const std::string bytes = test::read_bytes(path);
    uint32_t meta_len;
    std::memcpy(&meta_len, bytes.data() + 20, 4);
    RawLayout l;
    l.header = 24 + meta_len + 8;  // version 3: the header checksum follows the JSON
    l.block_header = 16 + 16 * (kLayers + 1) + 8;
    l.meta = 16 * 16;
    l.layer = 16 * kTopM * 4;
    l.block = l.block_header + l.meta + kLayers * l.layer;
    return l;
}

void flip_byte(const fs::path & path, uint64_t offset) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(offset));
    char c;
    f.get(c);
    f.seekp(std::streamoff(offset));
    f.put(char(c ^ 0x10));
}

} // namespace

TEST(Trace, ChecksumsNameTheDamagedBlockAndLayer) {
    test::TempDir dir;
    for (const int level : {0, 3}) {
        const fs::path path = dir / fmt::format("t{}.trace", level);
        write_trace(path, 100, level);
        ASSERT_TRUE(TraceReader::open(path).verify().empty());
        uint64_t target;
        if (level == 0) {
            // A logit byte: the ids stay valid, so only the checksum can tell.
            target = raw_layout(path).section(2, 1) + 3 * kTopM * 4 + 2 * kTopM + 1;
        } else {
            // The middle of the file, inside some section's compressed bytes.
            target = fs::file_size(path) / 2;
        }
        flip_byte(path, target);
        std::vector<std::string> problems;
        try {
            problems = TraceReader::open(path).verify();
        } catch (const Error & e) {
            problems = {e.what()};  // the flip landed in a block header: named when opening
        }
        ASSERT_EQ(problems.size(), 1u) << "level " << level;
        EXPECT_NE(problems[0].find("corrupt trace: block "), std::string::npos) << problems[0];
        EXPECT_NE(problems[0].find(path.string()), std::string::npos) << problems[0];
        if (level == 0) {
            EXPECT_NE(problems[0].find("block 2 at offset"), std::string::npos) << problems[0];
            EXPECT_NE(problems[0].find("layer 1"), std::string::npos) << problems[0];
            const TraceReader r = TraceReader::open(path);
            std::vector<uint16_t> ids;
            std::vector<float> logits;
            r.read_layer(0, ids, logits);  // the other layers read as before
            EXPECT_THROW(r.read_layer(1, ids, logits), Error);
        }
    }
    const auto bad = test::run_command(test::bin("moeprune").string() + " trace verify " + (dir / "t0.trace").string());
    EXPECT_EQ(bad.exit_code, 1);
    EXPECT_NE(bad.output.find("layer 1"), std::string::npos) << bad.output;
    write_trace(dir / "whole.trace", 100, 3);
    const auto good = test::run_command(test::bin("moeprune").string() + " trace verify " + (dir / "whole.trace").string());
    EXPECT_EQ(good.exit_code, 0) << good.output;
    EXPECT_NE(good.output.find("every checksum matches"), std::string::npos) << good.output;
}

TEST(Trace, ADamagedBlockHeaderIsNamedWhenOpening) {
    test::TempDir dir;
    write_trace(dir / "t.trace", 100, 0);
    const RawLayout l = raw_layout(dir / "t.trace");
    // A byte of block 3's section sizes, in range either way: only the header checksum tells.
    flip_byte(dir / "t.trace", l.header + 3 * l.block + 16 + 8 * 2 + 7);
    try {
        TraceReader::open(dir / "t.trace");
        FAIL() << "a damaged block header must be refused";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("block 3 at offset"), std::string::npos) << e.what();
    }
}

TEST(Trace, Version1TracesStillRead) {
    // A version 1 file, written by hand: no checksums after the section sizes.
    test::TempDir dir;
    std::string f = "MPTR";
    const auto u32 = [&](uint32_t v) { f.append(reinterpret_cast<const char *>(&v), 4); };
    const auto u64 = [&](uint64_t v) { f.append(reinterpret_cast<const char *>(&v), 8); };
    const std::string meta = R"({"domains":["chat"],"meta":{}})";
    u32(1), u32(kLayers), u32(kExperts), u32(kTopM), u32(uint32_t(meta.size()));
    f += meta;
    const uint32_t n = 4;
    f += "MPBK";
    u32(n), u32(0), u32(kLayers + 1);
    u64(16 * n);
    for (uint32_t l = 0; l < kLayers; ++l) {
        u64(uint64_t(n) * kTopM * 4);
    }
    for (uint32_t t = 0; t < n; ++t) {
        f += std::string(16, '\0');
    }
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    for (uint32_t l = 0; l < kLayers; ++l) {
        for (uint32_t t = 0; t < n; ++t) {
            token_record(t, ids, logits);
            for (uint32_t i = 0; i < kTopM; ++i) {
                f.append(reinterpret_cast<const char *>(&ids[l * kTopM + i]), 2);
            }
            for (uint32_t i = 0; i < kTopM; ++i) {
                const ggml_fp16_t h = ggml_fp32_to_fp16(logits[l * kTopM + i]);
                f.append(reinterpret_cast<const char *>(&h), 2);
            }
        }
    }
    test::write_text(dir / "v1.trace", f);
    const TraceReader r = TraceReader::open(dir / "v1.trace");
    EXPECT_EQ(r.format(), "moeprune-trace v1");
    EXPECT_FALSE(r.has_checksums());
    expect_trace_contents(r, n, false);
    EXPECT_TRUE(r.verify().empty());
}

// Issue 16's done-when: one flipped byte anywhere in any block, header or section, of an
// uncompressed or compressed trace is caught: by verify, naming the block, or when opening.
TEST(Trace, AByteFlippedInEveryBlockIsCaught) {
    test::TempDir dir;
    std::mt19937_64 rng(16);
    for (const int level : {0, 3}) {
        const fs::path whole = dir / fmt::format("whole{}.trace", level);
        write_trace(whole, 100, level);  // 7 blocks of 16 tokens, the last one short
        const std::string bytes = test::read_bytes(whole);
        // Block b spans [start_b, start_{b+1}): found by where a flip is reported, so the
        // test picks offsets spread over the whole data region instead.
        const uint64_t data_start = raw_layout(whole).header;
        const uint64_t span = bytes.size() - data_start;
        std::set<std::string> blocks_named;
        for (int i = 0; i < 64; ++i) {
            const uint64_t at = data_start + (uint64_t(i) * span) / 64 + rng() % (span / 64);
            const fs::path path = dir / "flipped.trace";
            test::write_text(path, bytes);
            flip_byte(path, at);
            std::vector<std::string> problems;
            try {
                problems = TraceReader::open(path).verify();
            } catch (const Error & e) {
                problems = {e.what()};
            }
            ASSERT_FALSE(problems.empty()) << "level " << level << ": a flip at offset " << at << " went unnoticed";
            const size_t b = problems[0].find("block ");
            if (b != std::string::npos) {
                blocks_named.insert(problems[0].substr(b, problems[0].find(' ', b + 6) - b));
            }
        }
        EXPECT_EQ(blocks_named.size(), 7u) << "level " << level << ": every block was hit and named";
    }
}

TEST(TraceInMemory, GivesBackWhatTheFileReaderGivesBackOfTheSameTokens) {
    test::TempDir dir;
    TraceHeader h;
    h.n_layer = kLayers;
    h.n_expert = kExperts;
    h.top_m = kTopM;
    h.domains = {"chat", "code"};
    TraceWriter w(dir / "t.mptrace", h, 16, 3);
    TraceInMemory mem(h);
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> any(-20.0f, 20.0f);
    for (uint64_t t = 0; t < 100; ++t) {
        token_record(t, ids, logits);
        for (float & z : logits) {
            z = any(rng);  // not exact in f16: both must round the same way
        }
        w.append(token_meta(t), ids.data(), logits.data());
        mem.append(token_meta(t), ids.data(), logits.data());
    }
    w.close();
    const TraceReader file = TraceReader::open(dir / "t.mptrace");
    ASSERT_EQ(mem.n_tokens(), file.n_tokens());
    const std::vector<TraceTokenMeta> a = mem.token_meta(), b = file.token_meta();
    ASSERT_EQ(a.size(), b.size());
    for (size_t t = 0; t < a.size(); ++t) {
        EXPECT_EQ(a[t].token, b[t].token);
        EXPECT_EQ(a[t].pos, b[t].pos);
        EXPECT_EQ(a[t].seq, b[t].seq);
        EXPECT_EQ(a[t].domain, b[t].domain);
        EXPECT_EQ(a[t].phase, b[t].phase);
    }
    for (uint32_t l = 0; l < kLayers; ++l) {
        std::vector<uint16_t> mem_ids, file_ids;
        std::vector<float> mem_logits, file_logits;
        const auto collect = [](std::vector<uint16_t> & ids_out, std::vector<float> & logits_out) {
            return [&](uint64_t first, uint32_t n, const uint16_t * i, const float * z) {
                EXPECT_EQ(first * kTopM, ids_out.size());
                ids_out.insert(ids_out.end(), i, i + n * kTopM);
                logits_out.insert(logits_out.end(), z, z + n * kTopM);
            };
        };
        mem.for_each_layer_chunk(l, collect(mem_ids, mem_logits));
        file.for_each_layer_chunk(l, collect(file_ids, file_logits));
        EXPECT_EQ(mem_ids, file_ids) << "layer " << l;
        ASSERT_EQ(mem_logits.size(), file_logits.size());
        EXPECT_EQ(0, std::memcmp(mem_logits.data(), file_logits.data(), mem_logits.size() * sizeof(float)))
            << "layer " << l << ": logits differ from the file's bit for bit";
    }
    std::vector<uint16_t> bad(kLayers * kTopM, kExperts);
    EXPECT_THROW(mem.append(token_meta(0), bad.data(), logits.data()), Error);
}

TEST(TraceInMemory, ARefusedTokenLeavesTheTraceAsItWas) {
    TraceHeader h;
    h.n_layer = kLayers;
    h.n_expert = kExperts;
    h.top_m = kTopM;
    h.domains = {"chat", "code"};
    TraceInMemory mem(h);
    std::vector<uint16_t> ids;
    std::vector<float> logits;
    token_record(0, ids, logits);
    mem.append(token_meta(0), ids.data(), logits.data());
    token_record(1, ids, logits);
    ids.back() = uint16_t(kExperts);  // the last layer names an expert past n_expert
    EXPECT_THROW(mem.append(token_meta(1), ids.data(), logits.data()), Error);
    ASSERT_EQ(mem.n_tokens(), 1u);
    for (uint32_t l = 0; l < kLayers; ++l) {
        uint64_t seen = 0;
        mem.for_each_layer_chunk(l, [&](uint64_t, uint32_t n, const uint16_t *, const float *) { seen += n; });
        EXPECT_EQ(seen, 1u) << "layer " << l;
    }
}

// A trace read as the sliced model routes it: each token's kept candidates, best first,
// renumbered by their rank among the layer's kept experts, the best k of them.
TEST(SlicedTrace, KeepsTheBestKeptCandidatesRenumberedAsTheSlicedModelNumbersThem) {
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 6;
    h.top_m = 4;
    TraceInMemory mem(h);
    // Layer 0 then layer 1, candidates best first.
    const std::vector<uint16_t> ids = {5, 0, 2, 3, /* layer 1 */ 1, 4, 0, 2};
    const std::vector<float> logits = {4, 3, 2, 1, 8, 7, 6, 5};
    mem.append(TraceTokenMeta{.token = 9}, ids.data(), logits.data());
    KeepMap keep;
    keep.n_expert = 6;
    keep.k = 3;
    keep.layers = {{0, {0, 3, 5}}, {1, {0, 2, 4}}};
    const SlicedTrace sliced(mem, keep, 2, "keep.json");
    EXPECT_EQ(sliced.header().n_expert, 3u);
    EXPECT_EQ(sliced.header().top_m, 2u);
    std::vector<std::vector<uint16_t>> got(2);
    std::vector<std::vector<float>> got_logits(2);
    for (uint32_t l = 0; l < 2; ++l) {
        sliced.for_each_layer_chunk(l, [&](uint64_t, uint32_t n, const uint16_t * i, const float * z) {
            got[l].assign(i, i + n * 2);
            got_logits[l].assign(z, z + n * 2);
        });
    }
    EXPECT_EQ(got[0], (std::vector<uint16_t>{2, 0})) << "experts 5 and 0 are the 3rd and 1st kept";
    EXPECT_EQ(got_logits[0], (std::vector<float>{4, 3}));
    EXPECT_EQ(got[1], (std::vector<uint16_t>{2, 0})) << "expert 1 is dropped; 4 and 0 come next";
    EXPECT_EQ(got_logits[1], (std::vector<float>{7, 6}));

    // Fewer kept candidates than the model routes to: refused by the keep map's name.
    keep.layers = {{0, {1, 4, 5}}, {1, {0, 2, 4}}};
    const SlicedTrace short_of(mem, keep, 2, "keep.json");
    try {
        short_of.for_each_layer_chunk(0, [](uint64_t, uint32_t, const uint16_t *, const float *) {});
        FAIL() << "one kept candidate where two are routed to";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("keep.json: keeps 1 of token 0's top 4 candidates in trace layer 0"),
                  std::string::npos) << e.what();
    }
}
