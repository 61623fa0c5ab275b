// MTP (nextn) heads end to end on a synthesized MTP model: collect records the nextn
// layer, select covers it, eval masks it exactly as slicing does and measures drafts that
// agree with a direct computation through llama.cpp's own MTP context.
#include "support/test_support.h"

#include "llama.h"
#include "llama-ext.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;
using test::read_json;

// The MTP head's top-1 draft and the trunk's top-1 at every position of `text`, computed
// as llama.cpp's drafter feeds the head: row k is token k with the trunk's h_nextn of k-1.
struct Drafts {
    std::vector<int> draft, trunk;
};
Drafts direct_drafts(const fs::path & model_path, const std::string & text) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    EXPECT_NE(model, nullptr);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> toks(text.size() + 8);
    toks.resize(size_t(llama_tokenize(vocab, text.data(), int32_t(text.size()), toks.data(), int32_t(toks.size()), true, true)));
    const int n = int(toks.size()), n_vocab = llama_vocab_n_tokens(vocab), n_embd = llama_model_n_embd_out(model);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256;
    cp.n_threads = cp.n_threads_batch = 1;
    llama_context * trunk = llama_init_from_model(model, cp);
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    llama_context * head = llama_init_from_model(model, cp);
    llama_set_embeddings_nextn(trunk, true, false);
    llama_set_embeddings_nextn(head, true, true);
    llama_batch b = llama_batch_init(n, 0, 1);
    llama_batch h = llama_batch_init(n, n_embd, 1);
    h.token = static_cast<llama_token *>(std::malloc(sizeof(llama_token) * size_t(n)));
    for (int i = 0; i < n; ++i) {
        b.token[i] = h.token[i] = toks[size_t(i)];
        b.pos[i] = h.pos[i] = i;
        b.n_seq_id[i] = h.n_seq_id[i] = 1;
        b.seq_id[i][0] = h.seq_id[i][0] = 0;
        b.logits[i] = h.logits[i] = 1;
    }
    b.n_tokens = h.n_tokens = n;
    EXPECT_EQ(llama_decode(trunk, b), 0);
    const float * hidden = llama_get_embeddings_nextn(trunk);
    std::memset(h.embd, 0, sizeof(float) * size_t(n_embd));
    std::memcpy(h.embd + n_embd, hidden, sizeof(float) * size_t(n_embd) * size_t(n - 1));
    EXPECT_EQ(llama_decode(head, h), 0);
    Drafts d;
    for (int i = 0; i < n; ++i) {
        const float * t = llama_get_logits_ith(trunk, i);
        const float * m = llama_get_logits_ith(head, i);
        d.trunk.push_back(int(std::max_element(t, t + n_vocab) - t));
        d.draft.push_back(int(std::max_element(m, m + n_vocab) - m));
    }
    llama_batch_free(b);
    llama_batch_free(h);
    llama_free(head);
    llama_free(trunk);
    llama_model_free(model);
    return d;
}

class MtpPipeline : public ::testing::Test {
protected:
    void SetUp() override {
        auto r = test::run_command(moeprune_cmd(fmt::format("synth --arch qwen35moe --mtp --layers 4 --experts 16 --used 4 "
                                                            "--dead 2 -o {} --json", (dir / "m.gguf").string())));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        planted = json::parse(r.output);
        // About 150 tokens, cut at a character boundary.
        size_t cut = 400;
        text = test::mixed_text();
        while (cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
            ++cut;
        }
        text.resize(std::min(cut, text.size()));
        test::write_text(dir / "c.jsonl", json{{"text", text}, {"domain", "mixed"}}.dump() + "\n");
    }
    test::TempDir dir;
    std::string text;
    json planted;  // what synth planted: dead experts per layer
};

TEST_F(MtpPipeline, CollectSelectAndEvalCoverTheNextnLayer) {
    const std::string m = (dir / "m.gguf").string(), c = (dir / "c.jsonl").string();
    auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -c 256 -t 1", m, c,
                                                        (dir / "s.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json stats = read_json(dir / "s.json");
    EXPECT_EQ(stats["model"]["moe_layers"], json({0, 1, 2, 3}));
    EXPECT_EQ(stats["model"]["mtp_layers"], json({3}));
    const uint64_t tokens = stats["n_tokens"].get<uint64_t>();
    uint64_t picks = 0;
    for (uint64_t n : stats["layers"][3]["count"]) {
        picks += n;
    }
    EXPECT_EQ(picks, tokens * 4) << "the nextn layer routes every token, k = 4 each";
    EXPECT_TRUE(stats["settings"]["invariants"]["ok"].get<bool>());
    // synth's planted dead experts of the nextn layer: never chosen, never kept.
    ASSERT_TRUE(planted["dead"].contains("3")) << planted;
    for (int e : planted["dead"]["3"]) {
        EXPECT_EQ(stats["layers"][3]["count"][size_t(e)].get<uint64_t>(), 0u) << "dead expert " << e;
    }

    r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -c 256 -t 1 --no-mtp", m, c,
                                                   (dir / "trunk.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(read_json(dir / "trunk.json")["model"]["moe_layers"], json({0, 1, 2}));
    // A checkpoint of the trunk alone, resumed with the head: the message names the setting.
    json checkpoint = read_json(dir / "trunk.json");
    checkpoint["settings"]["progress"] = {{"complete", false}};
    test::write_text(dir / "resumed.json.checkpoint", checkpoint.dump());
    r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -c 256 -t 1 --save-every 1 --resume", m, c,
                                                   (dir / "resumed.json").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("was collected without the MTP head's layers: resume with --no-mtp"), std::string::npos)
        << r.output;

    r = test::run_command(moeprune_cmd(fmt::format("select --stats {} -k 8 --metric reap -o {}", (dir / "s.json").string(),
                                                   (dir / "maps").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json map = read_json(dir / "maps" / "reap-k8.json");
    ASSERT_TRUE(map["layers"].contains("3"));
    for (int e : planted["dead"]["3"]) {
        const auto & kept = map["layers"]["3"];
        EXPECT_EQ(std::count(kept.begin(), kept.end(), e), 0) << "dead expert " << e << " kept in the nextn layer";
    }

    // Masked (the nextn layer masked in the MTP context) against sliced: the same drafts.
    const std::string map_path = (dir / "maps" / "reap-k8.json").string(), cut = (dir / "cut.gguf").string();
    r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", m, map_path, cut)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} --candidate {} --against {} -c 256 -t 1 "
                                                   "--json {} --per-token {}", m, c, map_path, cut, cut,
                                                   (dir / "e.json").string(), (dir / "t.jsonl").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json e = read_json(dir / "e.json");
    ASSERT_EQ(e["candidates"].size(), 2u);
    const json & masked = e["candidates"][0]["all"];
    EXPECT_GT(masked["mtp_tokens"].get<uint64_t>(), 0u) << masked;
    EXPECT_LE(masked["mtp_kld_mean"].get<double>(), 1e-6) << masked;
    EXPECT_EQ(masked["mtp_acceptance"], e["candidates"][1]["all"]["mtp_acceptance"]);
    const auto rows = test::per_token_rows(dir / "t.jsonl");
    const auto & a = rows.at("reap-k8"), & b = rows.at("cut");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i]["mtp_draft"], b[i]["mtp_draft"]) << "position " << a[i]["pos"];
    }

    // The identity map: the base's drafts exactly (draft KLD 0 against the base).
    json identity = map;
    for (auto & [layer, ids] : identity["layers"].items()) {
        ids = json::array();
        for (int x = 0; x < 16; ++x) {
            ids.push_back(x);
        }
    }
    identity["k"] = 16;
    test::write_text(dir / "identity.json", identity.dump());
    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 256 -t 1 --json {}", m, c,
                                                   (dir / "identity.json").string(), (dir / "i.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json ij = read_json(dir / "i.json");
    EXPECT_EQ(ij["candidates"][0]["all"]["mtp_kld_mean"].get<double>(), 0.0);
    EXPECT_EQ(ij["candidates"][0]["all"]["mtp_acceptance"], ij["base"]["mtp"]["acceptance"]);
}

// eval's drafts and acceptance, position by position, against llama.cpp's MTP context
// driven directly.
TEST_F(MtpPipeline, DraftsAndAcceptanceMatchADirectComputation) {
    const std::string m = (dir / "m.gguf").string();
    json all_kept = {{"format", "moeprune-keep"}, {"version", 1}, {"n_expert", 16}, {"k", 16}, {"metric", "all"},
                     {"layers", json::object()}};
    for (int l = 0; l < 4; ++l) {
        for (int x = 0; x < 16; ++x) {
            all_kept["layers"][std::to_string(l)].push_back(x);
        }
    }
    test::write_text(dir / "all.json", all_kept.dump());
    const auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 256 -t 1 --json {} --per-token {}",
                                                              m, (dir / "c.jsonl").string(), (dir / "all.json").string(),
                                                              (dir / "e.json").string(), (dir / "t.jsonl").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const Drafts d = direct_drafts(dir / "m.gguf", text);
    const auto rows = test::per_token_rows(dir / "t.jsonl").at("all");
    ASSERT_EQ(rows.size() + 1, d.draft.size());
    uint64_t accepted = 0;
    for (const json & row : rows) {
        const size_t pos = row["pos"].get<size_t>();
        EXPECT_EQ(row["mtp_draft"].get<int>(), d.draft[pos]) << "position " << pos;
        const bool acc = d.draft[pos] == d.trunk[pos];
        EXPECT_EQ(row["mtp_accept"].get<bool>(), acc) << "position " << pos;
        accepted += acc;
    }
    const json e = read_json(dir / "e.json");
    EXPECT_DOUBLE_EQ(e["base"]["mtp"]["acceptance"].get<double>(), double(accepted) / double(rows.size()));
}

// The accepted length per step of greedy continuations, for the base and for each keep map:
// the identity map's is the base's, every figure lies in [1, 2] (one draft token), and
// without the head there is none.
TEST_F(MtpPipeline, GreedyContinuationsReportTheAcceptedLengthPerStep) {
    const std::string m = (dir / "m.gguf").string(), c = (dir / "c.jsonl").string();
    json prompts = json::array();
    std::string lines;
    for (const char * q : {"Tell me about the sea.", "Name three colours.", "What is a ship?"}) {
        lines += json{{"messages", {{{"role", "user"}, {"content", q}}}}, {"domain", "chat"}}.dump() + "\n";
    }
    test::write_text(dir / "p.jsonl", lines);
    json identity = {{"format", "moeprune-keep"}, {"version", 1}, {"n_expert", 16}, {"k", 16}, {"metric", "all"},
                     {"layers", json::object()}};
    json half = identity;
    half["k"] = 8;
    half["metric"] = "half";
    for (int l = 0; l < 4; ++l) {
        for (int x = 0; x < 16; ++x) {
            identity["layers"][std::to_string(l)].push_back(x);
            if (x % 2 == 0) {
                half["layers"][std::to_string(l)].push_back(x);
            }
        }
    }
    test::write_text(dir / "all.json", identity.dump());
    test::write_text(dir / "half.json", half.dump());
    const std::string keep = (dir / "all.json").string() + "," + (dir / "half.json").string();
    auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} --prompts {} --generate 24 -c 256 -t 1 "
                                                        "--json {}", m, c, keep, (dir / "p.jsonl").string(),
                                                        (dir / "e.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("MTP draft:"), std::string::npos) << r.output;
    const json e = read_json(dir / "e.json");
    const double base = e["generation"]["base_mtp_tokens_per_step"].get<double>();
    EXPECT_EQ(e["base"]["mtp"]["tokens_per_step"].get<double>(), base);
    EXPECT_GE(base, 1.0);
    EXPECT_LE(base, 2.0);
    ASSERT_EQ(e["candidates"].size(), 2u);
    EXPECT_EQ(e["candidates"][0]["all"]["gen_mtp_tokens_per_step"].get<double>(), base);
    EXPECT_EQ(e["candidates"][0]["domains"]["chat"]["gen_mtp_tokens_per_step"].get<double>(), base);
    const double pruned = e["candidates"][1]["all"]["gen_mtp_tokens_per_step"].get<double>();
    EXPECT_GE(pruned, 1.0);
    EXPECT_LE(pruned, 2.0);

    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} --prompts {} --generate 24 -c 256 -t 1 "
                                                   "--mtp drop --json {}", m, c, keep, (dir / "p.jsonl").string(),
                                                   (dir / "e.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json dropped = read_json(dir / "e.json");
    EXPECT_FALSE(dropped["generation"].contains("base_mtp_tokens_per_step"));
    EXPECT_FALSE(dropped["candidates"][0]["all"].contains("gen_mtp_tokens_per_step"));
}

// plan prices each option with one draft token per step: the acceptance from eval (the
// greedy accepted length first), the trunk's and the head's misses from a replay of a trace
// with the nextn layer, and the same trunk figures as a replay of a trunk-only trace.
TEST_F(MtpPipeline, PlanPricesTheDraftFromMeasuredAcceptanceAndReplayedTraffic) {
    const std::string m = (dir / "m.gguf").string(), c = (dir / "c.jsonl").string();
    for (const auto & [name, flags] : {std::pair{"mtp", ""}, std::pair{"trunk", " --no-mtp"}}) {
        auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} --trace {} -c 256 -t 1{}", m, c,
                                                            (dir / (std::string(name) + ".json")).string(),
                                                            (dir / (std::string(name) + ".trace")).string(), flags)));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        r = test::run_command(moeprune_cmd(fmt::format("replay --model {} --trace {} --policy lru --cache 6 --json {}", m,
                                                       (dir / (std::string(name) + ".trace")).string(),
                                                       (dir / (std::string(name) + "-replay.json")).string())));
        ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    auto r = test::run_command(moeprune_cmd(fmt::format("select --stats {} -k 8 --metric reap -o {}",
                                                        (dir / "mtp.json").string(), (dir / "maps").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 256 -t 1 --json {}", m, c,
                                                   (dir / "maps" / "reap-k8.json").string(), (dir / "e.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // Random weights accept no draft: the figures the plan is checked on are set by hand,
    // the candidate's teacher-forced, the base's greedy one beside a teacher-forced one.
    json e = read_json(dir / "e.json");
    e["candidates"][0]["all"]["mtp_acceptance"] = 0.7;
    e["base"]["mtp"]["acceptance"] = 0.5;
    e["base"]["mtp"]["tokens_per_step"] = 1.6;
    test::write_text(dir / "e.json", e.dump());
    const fs::path plan_json = dir / "p.json";
    r = test::run_command(moeprune_cmd(fmt::format(
        "plan --model {} --replay {},{} --eval {} --compute-ms 10 --ssd 1 --read-latency-us 0 --sync-us 0 --json {}", m,
        (dir / "mtp-replay.json").string(), (dir / "trunk-replay.json").string(), (dir / "e.json").string(),
        plan_json.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tok/s MTP"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("with the MTP head drafting one token"), std::string::npos) << r.output;
    const json p = read_json(plan_json);
    const auto & g = p["inputs"]["geometry"];
    ASSERT_EQ(g["mtp_layers"], 1);
    ASSERT_EQ(g["moe_layers"], 3);
    const auto trunk_bytes = g["expert_bytes"].get<std::vector<double>>();
    const double mtp_bytes = g["mtp_expert_bytes"][0].get<double>();
    // 3 trunk layers and 1 MTP layer: a step computes 10 ms x (1 + 1/3).
    const double step_compute = 10e-3 * 4.0 / 3.0;
    const json * mtp_replayed = nullptr, * trunk_replayed = nullptr;
    int checked = 0;
    for (const json & o : p["options"]) {
        ASSERT_TRUE(o.contains("mtp_draft")) << o;
        const json & d = o["mtp_draft"];
        if (o["policy"] == "resident" && o["k"] == 8 && o["criterion"] == "reap") {
            EXPECT_NEAR(o["tok_per_s"].get<double>(), 100.0, 1e-9);
            EXPECT_DOUBLE_EQ(d["acceptance"].get<double>(), 0.7);
            EXPECT_NE(d["acceptance_source"].get<std::string>().find("teacher-forced"), std::string::npos) << d;
            EXPECT_DOUBLE_EQ(d["tokens_per_step"].get<double>(), 1.7);
            EXPECT_NEAR(d["tok_per_s"].get<double>(), 1.7 / step_compute, 1e-9);   // 127.5
            EXPECT_NEAR(d["speedup"].get<double>(), 1.275, 1e-12);
            ++checked;
        } else if (o["policy"] == "resident" && o["k"] == 16) {
            EXPECT_NEAR(d["acceptance"].get<double>(), 0.6, 1e-12) << "the greedy accepted length wins";
            EXPECT_NEAR(d["tok_per_s"].get<double>(), 1.6 / step_compute, 1e-9);   // 120
            ++checked;
        } else if (o["policy"] == "lru") {
            (o["source"].get<std::string>().find("mtp-replay") != std::string::npos ? mtp_replayed : trunk_replayed) = &o;
        }
    }
    EXPECT_EQ(checked, 2);
    ASSERT_TRUE(mtp_replayed && trunk_replayed);
    // The trunk's misses are its own whether the head's layer was replayed beside it.
    EXPECT_NEAR((*mtp_replayed)["misses_per_token"].get<double>(), (*trunk_replayed)["misses_per_token"].get<double>(), 1e-12);
    EXPECT_NEAR((*mtp_replayed)["tok_per_s"].get<double>(), (*trunk_replayed)["tok_per_s"].get<double>(), 1e-9);
    EXPECT_TRUE((*trunk_replayed)["mtp_draft"]["tok_per_s"].is_null());
    EXPECT_NE((*trunk_replayed)["mtp_draft"]["note"].get<std::string>().find("--no-mtp"), std::string::npos);
    // The step by hand: the trunk's reads of 2 positions and the head's of 1.6 tokens.
    const json rec = read_json(dir / "mtp-replay.json")["records"][0];
    const auto by_layer = rec["misses_per_token_by_layer"].get<std::vector<double>>();
    ASSERT_EQ(by_layer.size(), 4u);
    double trunk_read = 0;
    for (size_t l = 0; l < 3; ++l) {
        trunk_read += by_layer[l] * trunk_bytes[l];
    }
    EXPECT_GT(by_layer[3], 0.0);
    const double step = step_compute + (2 * trunk_read + 1.6 * by_layer[3] * mtp_bytes) / 1e9;
    EXPECT_NEAR((*mtp_replayed)["mtp_draft"]["tok_per_s"].get<double>(), 1.6 / step, 1e-6);
    EXPECT_NEAR((*mtp_replayed)["mtp_draft"]["mtp_read_bytes_per_token"].get<double>(), by_layer[3] * mtp_bytes, 1e-6);

    // A measured limit is llama.cpp decoding without a draft: no draft speed, and the table
    // shows it as unknown.
    const json measured = {
        {"format", "moeprune-measure"},
        {"version", 1},
        {"model", {{"digest", g["model_digest"]}, {"n_expert", 16}}},
        {"process_bytes", 1e7},
        {"resident_weight_bytes", 2e7},
        {"resident_need_bytes", 3e7},
        {"resident", {{"decode", {{"tokens_per_second", 100.0}, {"ms_per_token", {{"mean", 10.0}}}}}}},
        {"probe", {{"effective_gbps", 1.0}, {"fault_latency_us", 100.0}}},
        {"runs",
         {{{"ram", "150M"},
           {"limit_bytes", 150e6},
           {"decode", {{"tokens_per_second", 90.0}, {"ms_per_token", {{"mean", 1000.0 / 90}}}, {"major_faults_per_token", 1.0}}}}}}};
    test::write_text(dir / "measure.json", measured.dump());
    r = test::run_command(moeprune_cmd(fmt::format("plan --model {} --measured {} --eval {} --json {}", m,
                                                   (dir / "measure.json").string(), (dir / "e.json").string(),
                                                   plan_json.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    bool page_cache = false;
    const json measured_plan = read_json(plan_json);
    for (const json & o : measured_plan["options"]) {
        if (o["policy"] == "page-cache") {
            page_cache = true;
            EXPECT_TRUE(o["mtp_draft"]["tok_per_s"].is_null()) << o;
            EXPECT_TRUE(o["mtp_draft"]["acceptance"].is_null()) << o;
        }
    }
    EXPECT_TRUE(page_cache) << r.output;

    // --mtp-acceptance overrides what eval measured; a model without MTP layers refuses it.
    r = test::run_command(moeprune_cmd(fmt::format("plan --model {} -k 8 --compute-ms 10 --mtp-acceptance 0.25 --json {}", m,
                                                   plan_json.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NEAR(read_json(plan_json)["options"][0]["mtp_draft"]["tok_per_s"].get<double>(), 1.25 / step_compute, 1e-9);
    r = test::run_command(
        moeprune_cmd("plan --expert-mb 1 --layers 4 --experts 16 --used 4 -k 8 --compute-ms 10 --mtp-acceptance 0.7"));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("has no MTP (nextn) layers"), std::string::npos) << r.output;
}

// run on an MTP model: collect's trace has the nextn layer, so the plan prices the draft from
// replayed traffic and eval's acceptance, and the report sets each option beside its draft.
TEST_F(MtpPipeline, RunReportsEveryFrontOptionWithAndWithoutTheDraft) {
    static const char * words[] = {"sea", "ship", "harbour", "wind", "sail", "rope", "tide", "gull", "deck", "mast"};
    fs::create_directories(dir / "src" / "prose");
    fs::create_directories(dir / "src" / "code");
    for (int i = 0; i < 12; ++i) {
        std::string prose;
        for (int w = 0; w < 90; ++w) {
            prose += std::string(words[(w * 7 + i * 3 + w / 5) % 10]) + (w % 9 == 8 ? ".\n" : " ");
        }
        test::write_text(dir / "src" / "prose" / fmt::format("p{}.md", i), prose);
        test::write_text(dir / "src" / "code" / fmt::format("c{}.cpp", i),
                         fmt::format("int f{0}(int x) {{ return x * {0}; }}\nint g{0}(int y) {{ return y + {1}; }}\n", i, 7 * i));
    }
    test::write_text(dir / "corpus.toml", "[corpus]\nseed = 2\n[[source]]\npath = \"src/prose\"\ndomain = \"prose\"\n"
                                          "[[source]]\npath = \"src/code\"\ndomain = \"code\"\n");
    const fs::path out = dir / "run";
    const auto r = test::run_command(moeprune_cmd(fmt::format("run -m {} --corpus {} --criteria reap -k 8 --ram 0.2GB --reserve 0 "
                                                              "--compute-ms 5 -c 128 -t 2 -o {}",
                                                              (dir / "m.gguf").string(), (dir / "corpus.toml").string(),
                                                              out.string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("with the MTP head drafting one token"), std::string::npos) << r.output;
    const json plan = read_json(out / "plan" / "plan.json");
    size_t replayed = 0;
    for (const json & o : plan["options"]) {
        if (o["policy"] != "resident") {
            ++replayed;
            EXPECT_FALSE(o["mtp_draft"]["tok_per_s"].is_null()) << o;
            EXPECT_GT(o["mtp_draft"]["mtp_read_bytes_per_token"].get<double>(), 0.0) << o;
        }
    }
    EXPECT_GT(replayed, 0u);
    const std::string html = test::read_bytes(out / "report.html");
    EXPECT_NE(html.find("With and without the MTP draft"), std::string::npos);
    EXPECT_NE(html.find("(recommended)"), std::string::npos);
    const std::string csv = test::read_bytes(out / "report" / "plan.csv");
    EXPECT_NE(csv.substr(0, csv.find('\n')).find("mtp_acceptance,mtp_tok_per_s"), std::string::npos) << csv;
}

// A keep map without the nextn layer: refused by eval and slice, naming the layer and the
// two ways out; with --mtp drop eval runs the trunk only.
TEST_F(MtpPipeline, KeepMapsWithoutTheNextnLayerAreRefused) {
    json trunk_only = {{"format", "moeprune-keep"}, {"version", 1}, {"n_expert", 16}, {"k", 8}, {"metric", "hand"},
                       {"layers", json::object()}};
    for (int l = 0; l < 3; ++l) {
        for (int x = 0; x < 8; ++x) {
            trunk_only["layers"][std::to_string(l)].push_back(x);
        }
    }
    const fs::path map = dir / "trunk.json";
    test::write_text(map, trunk_only.dump());
    const std::string m = (dir / "m.gguf").string(), c = (dir / "c.jsonl").string();
    auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 256 -t 1 --json {}", m, c,
                                                        map.string(), (dir / "e.json").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(map.string() + ": leaves out the MTP (nextn) layer(s) 3"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("moeprune select"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--mtp drop"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "e.json"));
    r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", m, map.string(), (dir / "cut.gguf").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("layer 3 is an MTP (nextn) layer"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("moeprune select"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--mtp drop"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "cut.gguf"));

    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 256 -t 1 --mtp drop --json {}", m, c,
                                                   map.string(), (dir / "e.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json e = read_json(dir / "e.json");
    EXPECT_FALSE(e["base"].contains("mtp"));
    EXPECT_FALSE(e["candidates"][0]["all"].contains("mtp_tokens"));
}

} // namespace
