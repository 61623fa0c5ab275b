// The moeprune binary end to end: exit codes, JSON outputs, errors that name the file.
#include "formats/stats.h"
#include "formats/trace.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

json json_of(const std::string & output) {
    const auto start = output.find('{');
    return json::parse(output.substr(start));
}

} // namespace

TEST(Cli, SynthThenInspectJson) {
    test::TempDir dir;
    const auto s = test::run_command(moeprune_cmd(fmt::format(
        "synth --arch qwen2moe --layers 3 --experts 12 --used 3 --type q8_0 --dead 2 --specialists --json -o {}",
        (dir / "m.gguf").string())));
    ASSERT_EQ(s.exit_code, 0) << s.output;
    const json planted = json_of(s.output);
    EXPECT_EQ(planted["dead"].size(), 3u);
    EXPECT_EQ(planted["dead"]["0"].size(), 2u);
    EXPECT_EQ(planted["specialists"]["2"].size(), 2u);

    const auto r = test::run_command(moeprune_cmd("inspect --json --at-k 6,9 " + (dir / "m.gguf").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json j = json_of(r.output);
    EXPECT_EQ(j["arch"], "qwen2moe");
    EXPECT_EQ(j["n_layer"], 3);
    EXPECT_EQ(j["n_expert"], 12);
    EXPECT_EQ(j["n_expert_used"], 3);
    EXPECT_EQ(j["shared_experts"]["has_tensors"], true);
    EXPECT_EQ(j["layers"][0]["tensors"][1]["type"], "q8_0");
    EXPECT_LT(j["size_at_k"]["6"].get<uint64_t>(), j["size_at_k"]["9"].get<uint64_t>());
}

TEST(Cli, BadInputsExitNonZeroNamingTheFile) {
    test::TempDir dir;
    auto r = test::run_command(moeprune_cmd("inspect " + (dir / "nope.gguf").string()));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("nope.gguf: no such file"), std::string::npos) << r.output;

    test::write_text(dir / "keep.json", R"({"0": [2, 1]})");
    r = test::run_command(moeprune_cmd("keep check " + (dir / "keep.json").string()));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("keep.json: layer 0: ids are not in ascending order"), std::string::npos) << r.output;

    r = test::run_command(moeprune_cmd("synth --arch gpt2 -o " + (dir / "x.gguf").string()));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("unsupported --arch gpt2"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "x.gguf"));
    // A MoE architecture whose graph never routes is refused with the reason.
    r = test::run_command(moeprune_cmd("synth --arch refact -o " + (dir / "x.gguf").string()));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("never routes through them"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "x.gguf"));
}

TEST(Cli, MergeWritesTheSumAndRefusesMismatches) {
    test::TempDir dir;
    // Valid statistics (merge refuses what select would): 3 tokens x top-2 per layer, softmax mass 1 per token.
    SaliencyStats a = SaliencyStats::empty(2, 4, 2);
    a.n_tokens = 3;
    a.layers[0].count = {1, 2, 3, 0};
    a.layers[1].count = {3, 3, 0, 0};
    a.layers[0].prob_sum = a.layers[1].prob_sum = {1, 1, 1, 0};
    a.model = {{"digest", "xxh3:0000000000000001"}};
    SaliencyStats b = a;
    b.layers[0].count = {0, 1, 0, 5};
    write_stats(dir / "a.json", a);
    write_stats(dir / "b.json", b);
    auto r = test::run_command(moeprune_cmd(fmt::format("merge {} {} -o {}", (dir / "a.json").string(),
                                                        (dir / "b.json").string(), (dir / "c.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const SaliencyStats c = read_stats(dir / "c.json");
    EXPECT_EQ(c.n_tokens, 6u);
    EXPECT_EQ(c.layers[0].count, (std::vector<uint64_t>{1, 3, 3, 5}));
    EXPECT_EQ(c.settings["merged_from"].size(), 2u);

    SaliencyStats other = a;
    other.model = {{"digest", "xxh3:0000000000000002"}, {"name", "other"}};
    write_stats(dir / "other.json", other);
    r = test::run_command(moeprune_cmd(fmt::format("merge {} {} -o {}", (dir / "a.json").string(),
                                                   (dir / "other.json").string(), (dir / "d.json").string())));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("different models"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "d.json"));

    r = test::run_command(moeprune_cmd(fmt::format("merge {} {} -o {}", (dir / "a.json").string(),
                                                   (dir / "b.json").string(), (dir / "a.json").string())));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("refusing to overwrite the input"), std::string::npos) << r.output;
}

TEST(Cli, TraceInfoAndExport) {
    test::TempDir dir;
    TraceHeader h;
    h.n_layer = 2;
    h.n_expert = 8;
    h.top_m = 3;
    h.domains = {"all"};
    {
        TraceWriter w(dir / "t.trace", h, 4);
        const uint16_t ids[6] = {1, 2, 3, 4, 5, 6};
        const float logits[6] = {3, 2, 1, 3, 2, 1};
        for (int t = 0; t < 10; ++t) {
            TraceTokenMeta m;
            m.pos = t;
            m.phase = t < 7 ? TracePhase::Prefill : TracePhase::Decode;
            w.append(m, ids, logits);
        }
    }
    auto r = test::run_command(moeprune_cmd("trace info --json " + (dir / "t.trace").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json j = json_of(r.output);
    EXPECT_EQ(j["n_tokens"], 10);
    EXPECT_EQ(j["phases"]["decode"], 3);
    r = test::run_command(moeprune_cmd(fmt::format("trace export {} --npy {}", (dir / "t.trace").string(),
                                                   (dir / "npy").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir / "npy" / "ids.npy"));
}
