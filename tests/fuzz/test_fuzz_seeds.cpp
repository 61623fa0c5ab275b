// The fuzz targets' committed seeds (fuzz/corpus/READER/) stay meaningful: every file
// named valid* is read without error by its reader (fuzz/readers.h), every other file is
// refused with a moeprune::Error, as libFuzzer starts from them. `make fuzz-seeds`
// rewrites them with the DISABLED_Write test below.
#include "readers.h"

#include "core/errors.h"
#include "formats/keep_map.h"
#include "formats/verify_summary.h"
#include "run/run.h"
#include "slice/slice_support.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>

using namespace moeprune;
namespace fs = std::filesystem;

namespace {

using test::moeprune_cmd;

fs::path seeds_dir() { return fs::path(MOEPRUNE_SOURCE_DIR) / "fuzz" / "corpus"; }

void run_ok(const std::string & args) {
    const auto r = test::run_command(moeprune_cmd(args));
    ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
}

} // namespace

TEST(FuzzSeeds, EveryCommittedSeedIsReadAsItsNameSays) {
    test::TempDir dir;
    for (const fuzz::Reader & r : fuzz::readers()) {
        SCOPED_TRACE(r.name);
        const fs::path seeds = seeds_dir() / r.name;
        ASSERT_TRUE(fs::is_directory(seeds)) << seeds;
        int valid = 0, invalid = 0;
        for (const auto & e : fs::directory_iterator(seeds)) {
            const std::string name = e.path().filename().string();
            SCOPED_TRACE(name);
            const fs::path input = dir / ("input" + r.extension);
            fs::copy_file(e.path(), input, fs::copy_options::overwrite_existing);
            if (name.rfind("valid", 0) == 0) {
                ++valid;
                EXPECT_NO_THROW(r.read(input));
            } else {
                ++invalid;
                EXPECT_THROW(r.read(input), Error);
            }
        }
        EXPECT_GE(valid, 1);
        EXPECT_GE(invalid, 1);
    }
}

// Writes the seeds into $MOEPRUNE_FUZZ_SEEDS (make fuzz-seeds): small files of every
// shape each reader accepts, from moeprune's own writers on a tiny synthesized model,
// plus one refused variant of each.
TEST(FuzzSeeds, DISABLED_Write) {
    const char * out_env = std::getenv("MOEPRUNE_FUZZ_SEEDS");
    ASSERT_NE(out_env, nullptr) << "set MOEPRUNE_FUZZ_SEEDS to the seed folder (fuzz/corpus)";
    const fs::path out = out_env;
    test::TempDir dir;
    const auto put = [&](const std::string & reader, const std::string & name, const fs::path & from) {
        fs::create_directories(out / reader);
        fs::copy_file(from, out / reader / name, fs::copy_options::overwrite_existing);
    };
    const auto put_text = [&](const std::string & reader, const std::string & name, const std::string & text) {
        test::write_text(dir / "text.tmp", text);
        put(reader, name, dir / "text.tmp");
    };

    // A model, statistics, a trace and a recorded base from the real commands.
    run_ok(fmt::format("synth --layers 2 --experts 4 --used 2 --embd 32 --ff 32 -o {}", (dir / "m.gguf").string()));
    test::write_text(dir / "text.jsonl",
                     "{\"text\": \"The expert cache keeps experts.\", \"domain\": \"en\"}\n"
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"专家?\"}, {\"role\": \"assistant\", "
                     "\"content\": \"Yes.\"}], \"domain\": \"zh\"}\n");
    run_ok(fmt::format("collect -m {} -f {} -c 32 --trace-top 3 -o {} --trace {}", (dir / "m.gguf").string(),
                       (dir / "text.jsonl").string(), (dir / "stats.json").string(), (dir / "t.mptrace").string()));
    run_ok(fmt::format("eval -m {} -f {} -c 32 --top 4 --base-out {}", (dir / "m.gguf").string(),
                       (dir / "text.jsonl").string(), (dir / "base.mpkl").string()));
    put("stats", "valid.json", dir / "stats.json");
    put("trace", "valid.mptrace", dir / "t.mptrace");
    put("base_logits", "valid.mpkl", dir / "base.mpkl");
    put("base_logits_resealed", "valid.mpkl", dir / "base.mpkl");
    put("trace_resealed", "valid.mptrace", dir / "t.mptrace");
    put("corpus_jsonl", "valid.jsonl", dir / "text.jsonl");
    // corpus.json from moeprune corpus over the same text, and the same with a leak its check calls clean.
    run_ok(fmt::format("corpus -m {} --source en={} --eval-share 0 -o {}", (dir / "m.gguf").string(),
                       (dir / "text.jsonl").string(), (dir / "corpus").string()));
    put("corpus_report", "valid.json", dir / "corpus" / "corpus.json");
    {
        nlohmann::json r = nlohmann::json::parse(test::read_bytes(dir / "corpus" / "corpus.json"));
        r["leak_check"]["exact"] = 1;
        put_text("corpus_report", "invalid-clean-beside-a-leak.json", r.dump(1));
    }
    // measure needs a memory cgroup (root here); its report, and one without a storage probe.
    run_ok(fmt::format("measure -m {} -f {} --warmup 1 --tokens 4 --ram 100% --probe-mib 1 --json {}",
                       (dir / "m.gguf").string(), (dir / "text.jsonl").string(), (dir / "measure.json").string()));
    put("measure_report", "valid.json", dir / "measure.json");
    {
        nlohmann::json m = nlohmann::json::parse(test::read_bytes(dir / "measure.json"));
        m["probe"] = nullptr;
        put_text("measure_report", "invalid-no-probe.json", m.dump(1));
    }
    // A projector, and the same cut short (a model where a projector belongs: below).
    run_ok(fmt::format("synth --arch qwen3vlmoe --layers 2 --experts 4 --used 2 --embd 32 --ff 32 --image-experts 2 "
                       "--mmproj {} -o {}", (dir / "p.gguf").string(), (dir / "vl.gguf").string()));
    put("projector", "valid.gguf", dir / "p.gguf");
    const std::string projector = test::read_bytes(dir / "p.gguf");
    put_text("projector", "invalid-cut.gguf", projector.substr(0, projector.size() - 100));
    // Forged reports: each figure in range, but impossible with the others or unsafe to print.
    using Forgery = std::function<void(nlohmann::json &)>;
    for (const auto & [name, forge] : std::vector<std::pair<std::string, Forgery>>{
             {"invalid-huge-speed.json", [](auto & m) { m["runs"][0]["decode"]["tokens_per_second"] = 1e308; }},
             {"invalid-speed-not-its-time.json",
              [](auto & m) { m["runs"][0]["decode"]["tokens_per_second"] = 3 * m["runs"][0]["decode"]["tokens_per_second"].template get<double>(); }},
             {"invalid-limit-below-resident.json", [](auto & m) { m["runs"][0]["limit_bytes"] = 1; }},
             {"invalid-compute.json", [](auto & m) { m["resident"]["decode"]["ms_per_token"]["mean"] = 1e308; }},
             {"invalid-storage.json", [](auto & m) { m["probe"]["effective_gbps"] = 1e-300; }},
             {"invalid-version.json", [](auto & m) { m["version"] = 2; }},
             {"invalid-busy.json", [](auto & m) { m["busy"] = "the resident run took 344 ms per token"; }},
             {"invalid-ram-escape.json", [](auto & m) { m["runs"][0]["ram"] = "\x1b[2J50%"; }},
             {"invalid-process-bytes.json", [](auto & m) { m["process_bytes"] = 1e308; }},
             {"invalid-other-geometry.json", [](auto & m) { m["model"]["routed_layer_expert_bytes"] = {8e9, 8e9}; }},
         }) {
        nlohmann::json m = nlohmann::json::parse(test::read_bytes(dir / "measure.json"));
        forge(m);
        put_text("measure_report", name, m.dump(1));
    }
    // The reports run, plan and report read back: select's, eval's (a keep map and a
    // closed loop), replay's and plan's, and one with an impossible figure.
    run_ok(fmt::format("select --stats {} --trace {} -k 3 --metric freq -o {} --json {}", (dir / "stats.json").string(),
                       (dir / "t.mptrace").string(), (dir / "keep").string(), (dir / "select.json").string()));
    run_ok(fmt::format("eval -m {} -f {} -c 32 --base {} --keep {} --cache-policy lru --cache 3 --lambda 0.5 --json {}",
                       (dir / "m.gguf").string(), (dir / "text.jsonl").string(), (dir / "base.mpkl").string(),
                       (dir / "keep" / "freq-k3.json").string(), (dir / "eval.json").string()));
    run_ok(fmt::format("replay --trace {} --policy lru,belady --cache 2,3 --json {}", (dir / "t.mptrace").string(),
                       (dir / "replay.json").string()));
    put("stage_report", "valid-select.json", dir / "select.json");
    put("stage_report", "valid-eval.json", dir / "eval.json");
    put("stage_report", "valid-replay.json", dir / "replay.json");
    run_ok(fmt::format("plan -m {} --eval {} --replay {} --ram 1G --reserve 100M --json {}", (dir / "m.gguf").string(),
                       (dir / "eval.json").string(), (dir / "replay.json").string(), (dir / "plan.json").string()));
    put("stage_report", "valid-plan.json", dir / "plan.json");
    put("stage_report", "valid-measure.json", dir / "measure.json");
    {
        VerifySummary v;
        v.plan = (dir / "plan.json").string();
        v.option = nlohmann::json::parse(test::read_bytes(dir / "plan.json"))["options"][0];
        v.model = (dir / "m.gguf").string();
        v.ram = "100%";
        v.predicted_tok_per_s = 120;
        v.measured_tok_per_s = 100;
        v.measured_major_faults_per_token = 2;
        v.measure = (dir / "measure.json").string();
        put_text("stage_report", "valid-verify.json", to_json(v).dump(1));
    }
    {
        nlohmann::json r = nlohmann::json::parse(test::read_bytes(dir / "replay.json"));
        r["records"][0]["misses_per_token"] = -1;
        put_text("stage_report", "invalid-negative-misses.json", r.dump(1));
    }
    {
        std::string s = test::read_bytes(dir / "stats.json");
        put_text("stats", "invalid-truncated.json", s.substr(0, s.size() / 2));
        std::string t = test::read_bytes(dir / "t.mptrace");
        t[t.size() / 2] = char(t[t.size() / 2] ^ 0x40);
        put_text("trace", "invalid-flipped.mptrace", t);
        std::string b = test::read_bytes(dir / "base.mpkl");
        put_text("base_logits", "invalid-truncated.mpkl", b.substr(0, b.size() - 3));
        put_text("trace_resealed", "invalid-flipped.mptrace", t);
        // Resealed, a record's NaN passes the checksums and meets the record checks.
        std::string nan_record = b;
        const float nan = std::nanf("");
        uint32_t hlen = 0;
        std::memcpy(&hlen, b.data() + 12, 4);
        std::memcpy(nan_record.data() + 16 + hlen + 8 + 4, &nan, 4);
        put_text("base_logits", "invalid-nan.mpkl", nan_record);
        put_text("base_logits_resealed", "invalid-nan.mpkl", nan_record);
    }
    test::write_q4rt(dir / "q.bin", 2, 8, 3, 5, 5, [](uint64_t t, std::vector<uint16_t> & ids, std::vector<float> & z) {
        ids.resize(2 * 3);
        z.resize(2 * 3);
        for (size_t i = 0; i < ids.size(); ++i) {
            ids[i] = uint16_t((t + i) % 8);
            z[i] = 1.0f - 0.25f * float(i % 3);
        }
    });
    put("trace", "valid-q4rt.bin", dir / "q.bin");

    KeepMap km;
    km.n_expert = 8;
    km.k = 4;
    km.layers = {{0, {0, 2, 4, 6}}, {1, {1, 3, 5, 7}}};
    write_keep_map(dir / "k.json", km);
    put("keep_map", "valid.json", dir / "k.json");
    put_text("keep_map", "invalid-unsorted.json",
             "{\"format\": \"moeprune-keep\", \"version\": 1, \"n_expert\": 8, \"k\": 2, \"layers\": {\"0\": [3, 1]}}");

    put_text("corpus_jsonl", "invalid-role.jsonl", "{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}\n");
    put_text("corpus_source", "valid.jsonl",
             "{\"prompt\": \"Q: why?\", \"response\": \"A: because.\", \"session\": 1}\n"
             "{\"text\": \"plain\", \"session\": 3, \"turn\": 1}\n"
             "{\"messages\": [{\"role\": \"user\", \"content\": \"专家?\"}], \"session\": \"a\"}\n");
    put_text("corpus_source", "invalid-no-group.jsonl", "{\"text\": \"plain\"}\n");

    put_text("corpus_manifest", "valid.toml",
             "[corpus]\nseed = 7\neval_share = 0.1\ntokens = 4096\n\n[[source]]\nname = \"docs\"\npath = \"docs/*.md\"\n"
             "domain = \"en\"\ngroup = \"path:-2\"\nweight = 2.0\n\n[[source]]\nname = \"chat\"\npath = \"chat.jsonl\"\n"
             "domain = \"zh\"\ngroup = \"field:session\"\nsplit = \"calib\"\n");
    put_text("corpus_manifest", "invalid-key.toml", "[corpus]\nseeds = 7\n");

    RunConfig rc;
    rc.model = "model.gguf";
    rc.corpus = {"corpus.toml"};
    rc.ks = {96, 64};
    rc.ram = "24G";
    rc.max_kld = 0.05;
    test::write_text(dir / "run.toml", run_config_toml(rc));
    put("run_config", "valid.toml", dir / "run.toml");
    put_text("run_config", "invalid-type.toml", "model = 3\n");

    test::FakeMoe plain;
    plain.n_expert = 4;
    plain.n_used = 2;
    plain.n_embd = 8;
    plain.n_ff = 8;
    test::write_fake_moe(dir / "plain.gguf", plain);
    put("gguf", "valid-moe.gguf", dir / "plain.gguf");
    put("projector", "invalid-a-model.gguf", dir / "plain.gguf");
    test::FakeMoe groups = plain;
    groups.arch = "deepseek2";
    groups.n_expert = 8;
    groups.n_group = 2;
    groups.n_layer = 3;
    groups.n_nextn = 1;
    test::write_fake_moe(dir / "groups.gguf", groups);
    put("gguf", "valid-groups-nextn.gguf", dir / "groups.gguf");
    {
        std::string g = test::read_bytes(dir / "plain.gguf");
        put_text("gguf", "invalid-truncated.gguf", g.substr(0, 200));
    }
}
