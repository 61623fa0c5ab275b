#include "core/errors.h"
#include "formats/keep_map.h"
#include "support/test_support.h"

#include <gtest/gtest.h>

using namespace moeprune;

namespace {

KeepMap sample() {
    KeepMap km;
    km.n_expert = 16;
    km.k = 3;
    km.metric = "reap_mean";
    km.source = {{"model", "m.gguf"}};
    km.layers = {{0, {1, 5, 9}}, {1, {0, 2, 15}}, {2, {3, 4, 5}}};
    return km;
}

void expect_error(const std::string & text, const std::string & needle) {
    try {
        parse_keep_map(text, "keep.json");
        FAIL() << "accepted: " << text;
    } catch (const Error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("keep.json"), std::string::npos) << msg;
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
}

} // namespace

TEST(KeepMap, RoundTripsThroughFile) {
    test::TempDir dir;
    const KeepMap km = sample();
    write_keep_map(dir / "k.json", km);
    const KeepMap back = read_keep_map(dir / "k.json");
    EXPECT_EQ(back.n_expert, 16);
    EXPECT_EQ(back.k, 3);
    EXPECT_EQ(back.metric, "reap_mean");
    EXPECT_EQ(back.source, km.source);
    EXPECT_EQ(back.layers, km.layers);
    EXPECT_EQ(keep_map_digest(back), keep_map_digest(km));
}

TEST(KeepMap, ReadsSeedBareForm) {
    const KeepMap km = parse_keep_map(R"({"0": [1, 2], "1": [0, 7], "10": [3, 4]})", "bare.json");
    EXPECT_EQ(km.k, 2);
    EXPECT_EQ(km.n_expert, 0);
    ASSERT_EQ(km.layers.size(), 3u);
    EXPECT_EQ(km.layers.at(10), (std::vector<int32_t>{3, 4}));
}

TEST(KeepMap, DigestChangesWithContents) {
    KeepMap a = sample(), b = sample();
    b.layers[2] = {3, 4, 6};
    EXPECT_NE(keep_map_digest(a), keep_map_digest(b));
}

TEST(KeepMap, MalformedInputsNameTheProblem) {
    expect_error("not json", "not valid JSON");
    expect_error("[1,2]", "JSON object");
    expect_error(R"({"0": [3, 1]})", "ascending");
    expect_error(R"({"0": [1, 1]})", "twice");
    expect_error(R"({"0": [1, 2], "1": [1]})", "layer 1 keeps 1");
    expect_error(R"({"x": [1]})", "not a layer number");
    expect_error(R"({"0": [1.5]})", "not an integer");
    expect_error(R"({"0": [-1]})", "out of range");
    expect_error(R"({"format": "moeprune-keep", "version": 1, "n_expert": 4, "k": 2, "layers": {"0": [1, 4]}})",
                 "not below n_expert 4");
    expect_error(R"({"format": "moeprune-keep", "version": 2, "n_expert": 4, "k": 1, "layers": {"0": [1]}})",
                 "version");
    expect_error(R"({"format": "other"})", "expected \"moeprune-keep\"");
    expect_error(R"({"format": "moeprune-keep", "version": 1, "k": 1, "layers": {"0": [1]}})", "missing \"n_expert\"");
    expect_error("{}", "no layers");
}

TEST(KeepMap, ChecksAgainstTheModel) {
    const KeepMap km = sample();
    EXPECT_NO_THROW(validate_keep_map_for_model(km, "k.json", 16, {0, 1, 2}));
    EXPECT_THROW(validate_keep_map_for_model(km, "k.json", 16, {0, 1, 2, 3}), Error);  // layer 3 missing
    EXPECT_THROW(validate_keep_map_for_model(km, "k.json", 16, {0, 1}), Error);        // layer 2 is not MoE
    EXPECT_THROW(validate_keep_map_for_model(km, "k.json", 32, {0, 1, 2}), Error);     // other model
    try {
        validate_keep_map_for_model(km, "k.json", 16, {0, 1, 2, 3});
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("layer 3 is missing"), std::string::npos) << e.what();
    }
}

TEST(KeepMap, MissingFileIsAClearError) {
    try {
        read_keep_map("/nonexistent/keep.json");
        FAIL();
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("/nonexistent/keep.json"), std::string::npos);
    }
}

TEST(KeepMapName, SelectsNamesCarryCriterionAndK) {
    EXPECT_EQ(keep_map_file_name("reap-lcb", 8), "reap-lcb-k8.json");
    EXPECT_EQ(keep_map_label("domain-max", 224), "domain-max-k224");
    const KeepMapName a = parse_keep_map_name("maps/reap-lcb-k8.json");
    EXPECT_EQ(a.criterion, "reap-lcb");
    EXPECT_EQ(a.k, 8);
    const KeepMapName b = parse_keep_map_name(keep_map_file_name("freq", 256));
    EXPECT_EQ(b.criterion, "freq");
    EXPECT_EQ(b.k, 256);
}

TEST(KeepMapName, OtherNamesAreTheirStemWithoutK) {
    // The report once threw on these: stoll after the last "-k" of "my-keep".
    for (const std::string name : {"my-keep.json", "keep.json", "a-k.json", "x-k12y.json", "-k5.json"}) {
        const KeepMapName n = parse_keep_map_name(name);
        EXPECT_EQ(n.criterion, std::filesystem::path(name).stem().string()) << name;
        EXPECT_EQ(n.k, 0) << name;
    }
    // More digits than any int64_t holds is no K either.
    EXPECT_EQ(parse_keep_map_name("reap-k1234567890123456789012.json").k, 0);
}

TEST(KeepMap, RefusesFewerExpertsThanEachTokenUses) {
    const KeepMap km = sample();
    EXPECT_NO_THROW(require_top_k_room(km, "keep.json", 3));
    try {
        require_top_k_room(km, "keep.json", 4);
        FAIL() << "a map of 3 experts accepted for top-4 routing";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("keep.json"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("fewer than the 4 each token uses"), std::string::npos) << e.what();
    }
}
