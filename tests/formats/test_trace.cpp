#include "core/errors.h"
#include "formats/trace.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

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
    EXPECT_EQ(r.format(), "moeprune-trace v1");
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
