// moeprune eval: keep maps masked inside the base model equal the sliced models, the
// numbers agree with llama-perplexity's, the compact base is small and a lower bound,
// and bad inputs are refused by name with nothing written.
#include "eval/eval.h"
#include "slice/slice_support.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <sstream>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;
using test::synth;
using test::read_json;

// Keeps the first k experts of every layer in `layers`.
KeepMap first_k(int64_t n_expert, int64_t k, const std::vector<int> & layers) {
    KeepMap km;
    km.n_expert = n_expert;
    km.k = k;
    for (int l : layers) {
        for (int32_t e = 0; e < k; ++e) {
            km.layers[l].push_back(e);
        }
    }
    return km;
}

const json & candidate(const json & report, const std::string & name) {
    for (const json & c : report["candidates"]) {
        if (c["name"] == name) {
            return c;
        }
    }
    throw std::runtime_error("no candidate " + name + " in " + report.dump());
}

} // namespace

// The done-when of issue 11, as exact as the arithmetic allows: the keep map masked inside
// the original model equals the sliced model, for three gating functions. Not bit for bit:
// the router's softmax over 8 experts with 4 at -inf runs another ggml code path than the
// one over 4 (SIMD expf and a float lane sum against scalar expf and a double sum), so the
// gate weights differ in the last bit on most tokens. The output matrix quantizes its input
// to 8 bits, which hides that on almost every token and, where a value sits on a rounding
// boundary, turns it into one quantum (a per-token KLD near 1e-5, measured on qwen2moe). A
// wrong mask costs the whole cut (the last check: > 1e-3 on average).
class MaskedEqualsSliced : public ::testing::TestWithParam<std::string> {};

TEST_P(MaskedEqualsSliced, PerTokenKldAndTopOne) {
    const std::string arch = GetParam();
    test::TempDir dir;
    synth(fmt::format("--arch {} --layers 3 --experts 8 --used 2", arch), dir / "m.gguf");
    test::write_text(dir / "text.txt", test::mixed_text());
    // dots1's first block is dense: its MoE layers are 1 and 2.
    const std::vector<int> layers = arch == "dots1" ? std::vector<int>{1, 2} : std::vector<int>{0, 1, 2};
    KeepMap km = first_k(8, 4, layers);
    km.layers[layers.back()] = {1, 3, 5, 6};  // not only a prefix: ids are renumbered by slice
    test::write_keep(dir / "k4.json", km);
    auto r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", (dir / "m.gguf").string(),
                                                        (dir / "k4.json").string(), (dir / "sliced.gguf").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format(
        "eval -m {} -f {} --keep {} --candidate {} --against {} -c 128 -t 2 --json {} --per-token {}",
        (dir / "m.gguf").string(), (dir / "text.txt").string(), (dir / "k4.json").string(), (dir / "sliced.gguf").string(),
        (dir / "sliced.gguf").string(), (dir / "r.json").string(), (dir / "pt.jsonl").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto rows = test::per_token_rows(dir / "pt.jsonl");
    ASSERT_EQ(rows.at("k4").size(), rows.at("sliced").size());
    ASSERT_GT(rows.at("k4").size(), 500u);
    double worst = 0, sum = 0;
    size_t differing = 0, other_top1 = 0;
    for (const json & t : rows.at("k4")) {
        const double kld = t["kld"].get<double>();
        worst = std::max(worst, kld);
        sum += kld;
        differing += kld > 1e-9;
        other_top1 += !t["same_top1"].get<bool>();
    }
    const size_t n = rows.at("k4").size();
    EXPECT_LE(sum / double(n), 1e-7) << arch;
    EXPECT_LE(worst, 1e-4) << arch;
    EXPECT_LE(differing, n / 100) << arch;
    EXPECT_LE(other_top1, n / 100) << arch;
    // The mask changed something: against the base, the same map costs far more.
    r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 128 -t 2 --json {}",
                                                   (dir / "m.gguf").string(), (dir / "text.txt").string(),
                                                   (dir / "k4.json").string(), (dir / "b.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_GT(candidate(read_json(dir / "b.json"), "k4")["all"]["kld_mean"].get<double>(), 1e-3) << arch;
}

INSTANTIATE_TEST_SUITE_P(Gating, MaskedEqualsSliced, ::testing::Values("qwen3moe", "qwen2moe", "dots1"));

TEST(Eval, AgreesWithLlamaPerplexityAndItsBaseFileIsUnderOnePercent) {
    test::TempDir dir;
    synth("--arch qwen3moe --layers 3 --experts 8 --used 2", dir / "m.gguf");
    test::write_keep(dir / "k4.json", first_k(8, 4, {0, 1, 2}));
    auto r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", (dir / "m.gguf").string(),
                                                        (dir / "k4.json").string(), (dir / "sliced.gguf").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const test::Kld llama = test::kl_divergence(dir / "m.gguf", dir / "sliced.gguf", dir.path());
    ASSERT_GT(llama.mean, 0) << llama.log;
    // Same text, window, batch and scoring as the helper's llama-perplexity run.
    r = test::run_command(moeprune_cmd(fmt::format(
        "eval -m {} -f {} --candidate {} --keep {} -c 128 -b 128 -t 2 --score second-half --no-parse-special "
        "--base-out {} --json {}",
        (dir / "m.gguf").string(), (dir / "kld-text.txt").string(), (dir / "sliced.gguf").string(),
        (dir / "k4.json").string(), (dir / "base.mpkl").string(), (dir / "r.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json rep = read_json(dir / "r.json");
    for (const char * name : {"sliced", "k4"}) {
        const json & all = candidate(rep, name)["all"];
        const double ours = all["kld_mean"].get<double>();
        EXPECT_TRUE(std::fabs(ours - llama.mean) <= std::max(0.01 * llama.mean, 1e-5)) << name << " " << ours << " vs " << llama.mean;
        EXPECT_NEAR(100 * all["same_top1"].get<double>(), llama.same_top_p, 0.5) << name;
    }
    const uint64_t ours = fs::file_size(dir / "base.mpkl"), theirs = fs::file_size(dir / "m.kld");
    EXPECT_LE(double(ours), 0.01 * double(theirs)) << ours << " vs " << theirs;

    // The compact base prices a candidate later, as a lower bound of the exact KLD,
    // with the same top-1 agreement and likelihoods.
    r = test::run_command(moeprune_cmd(fmt::format(
        "eval -m {} -f {} --candidate {} -c 128 -b 128 -t 2 --score second-half --no-parse-special --base {} "
        "--per-token {} --json {}",
        (dir / "m.gguf").string(), (dir / "kld-text.txt").string(), (dir / "sliced.gguf").string(),
        (dir / "base.mpkl").string(), (dir / "compact.jsonl").string(), (dir / "c.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = test::run_command(moeprune_cmd(fmt::format(
        "eval -m {} -f {} --candidate {} -c 128 -b 128 -t 2 --score second-half --no-parse-special --per-token {}",
        (dir / "m.gguf").string(), (dir / "kld-text.txt").string(), (dir / "sliced.gguf").string(),
        (dir / "exact.jsonl").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto compact = test::per_token_rows(dir / "compact.jsonl").at("sliced"), exact = test::per_token_rows(dir / "exact.jsonl").at("sliced");
    ASSERT_EQ(compact.size(), exact.size());
    for (size_t i = 0; i < exact.size(); ++i) {
        EXPECT_LE(compact[i]["kld"].get<double>(), exact[i]["kld"].get<double>() + 1e-9) << i;
        EXPECT_EQ(compact[i]["same_top1"], exact[i]["same_top1"]) << i;
        EXPECT_NEAR(compact[i]["nll_base"].get<double>(), exact[i]["nll_base"].get<double>(), 1e-4) << i;
        EXPECT_NEAR(compact[i]["nll"].get<double>(), exact[i]["nll"].get<double>(), 1e-6) << i;
    }
    EXPECT_GT(read_json(dir / "c.json")["base"]["tail_mass_mean"].get<double>(), 0.0);
}

TEST(Eval, DeadExpertsCostNothingAndLiveOnesMoreAsKShrinks) {
    test::TempDir dir;
    const auto s = test::run_command(moeprune_cmd(fmt::format(
        "synth --arch qwen3moe --layers 3 --experts 12 --used 2 --dead 2 --json -o {}", (dir / "m.gguf").string())));
    ASSERT_EQ(s.exit_code, 0) << s.output;
    const json planted = json::parse(s.output.substr(s.output.find('{')));
    test::write_text(dir / "text.txt", test::mixed_text());
    KeepMap dead;
    dead.n_expert = 12;
    dead.k = 10;
    for (int l = 0; l < 3; ++l) {
        const auto d = planted["dead"][std::to_string(l)].get<std::vector<int>>();
        for (int32_t e = 0; e < 12; ++e) {
            if (std::find(d.begin(), d.end(), e) == d.end()) {
                dead.layers[l].push_back(e);
            }
        }
    }
    test::write_keep(dir / "dead.json", dead);
    // Live maps: keep the dead experts' complements' first K, so live experts go.
    std::vector<std::string> maps = {(dir / "dead.json").string()};
    for (int k : {8, 5, 2}) {
        KeepMap km = dead;
        km.k = k;
        for (auto & [l, ids] : km.layers) {
            ids.resize(size_t(k));
        }
        test::write_keep(dir / fmt::format("live{}.json", k), km);
        maps.push_back((dir / fmt::format("live{}.json", k)).string());
    }
    const auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 128 -t 2 --json {}",
                                                              (dir / "m.gguf").string(), (dir / "text.txt").string(),
                                                              fmt::join(maps, ","), (dir / "r.json").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json rep = read_json(dir / "r.json");
    const double d = candidate(rep, "dead")["all"]["kld_mean"].get<double>();
    const double k8 = candidate(rep, "live8")["all"]["kld_mean"].get<double>();
    const double k5 = candidate(rep, "live5")["all"]["kld_mean"].get<double>();
    const double k2 = candidate(rep, "live2")["all"]["kld_mean"].get<double>();
    EXPECT_LE(d, 1e-5);
    EXPECT_GT(k8, d);
    EXPECT_GT(k5, k8);
    EXPECT_GT(k2, k5);
    EXPECT_DOUBLE_EQ(candidate(rep, "dead")["all"]["same_top1"].get<double>(), 1.0);
}

TEST(Eval, BadInputsAreRefusedByNameWithNothingWritten) {
    test::TempDir dir;
    synth("--arch qwen3moe --layers 2 --experts 8 --used 2", dir / "m.gguf");
    synth("--arch qwen3moe --layers 2 --experts 8 --used 2 --seed 7 --vocab " MOEPRUNE_LLAMA_DIR
          "/models/ggml-vocab-gpt-2.gguf",
          dir / "gpt2.gguf");
    synth("--arch qwen3moe --layers 2 --experts 16 --used 2", dir / "m16.gguf");
    test::write_text(dir / "text.txt", test::mixed_text());
    test::write_text(dir / "other.txt", test::mixed_text() + " and something else entirely.");
    test::write_keep(dir / "k4.json", first_k(8, 4, {0, 1}));
    test::write_keep(dir / "k16.json", first_k(16, 4, {0, 1}));
    test::write_keep(dir / "k1.json", first_k(8, 1, {0, 1}));
    const std::string m = (dir / "m.gguf").string(), text = (dir / "text.txt").string();
    const std::string outs = fmt::format("--json {} --per-token {}", (dir / "r.json").string(), (dir / "t.jsonl").string());
    // HellaSwag files (6 lines a task): one line short, a label out of range, a task whose
    // four endings do not fit 4 x -c 8 tokens.
    const std::string task = "The river ran\n1\nfast\nslow\nnorth\ndry\n";
    test::write_text(dir / "short.txt", task + "A second task\n2\na\nb\nc\n");
    test::write_text(dir / "label.txt", task + "A second task\n4\na\nb\nc\nd\n");
    test::write_text(dir / "long.txt", task + std::string(400, 'x') + "\n0\na\nb\nc\nd\n");
    // corpus' domains of two tasks, for another file than long.txt.
    test::write_text(dir / "domains.json",
                     R"({"format": "moeprune-tasks", "version": 1, "file": "tasks.txt", "xxh64": "0123456789abcdef",
                         "eval": "eval.jsonl", "settings": {"seed": 0, "context_tokens": 64, "ending_tokens": 24,
                         "tasks_per_domain": 100}, "tasks": 2, "domains": [{"domain": "prose", "tasks": 2,
                         "documents": 3, "overlapping": 0}], "task_domains": ["prose", "prose"]})");
    // WinoGrande CSVs (a header line is skipped, as llama-perplexity skips it): an answer
    // out of range, a sentence without the blank.
    const std::string wino = "index,sentence,option1,option2,answer\n0,The cup fell so _ broke.,cup,table,1\n";
    test::write_text(dir / "wino.csv", wino + "1,The dog ran so _ won.,dog,cat,3\n2,A _ b.,x,y,1\n");
    test::write_text(dir / "blank.csv", "0,A _ b.,x,y,1\n1,No blank here.,a,b,1\n2,A _ c.,x,y,2\n");
    // A binary multiple-choice file cut short inside its one task.
    std::string mc;
    const auto u32 = [&](uint32_t v) { mc.append(reinterpret_cast<const char *>(&v), 4); };
    u32(1);
    u32(8);
    u32(9);
    mc += "Question?";
    u32(2);
    u32(3);
    mc += "yes";
    test::write_text(dir / "cut.bin", mc);
    // One task with the given answers and labels (its second answer list, llama-perplexity's
    // "multiple correct", empty): one answer, a label other than 0 or 1, no right answer.
    const auto mc_task = [](const std::vector<std::string> & answers, const std::vector<int32_t> & labels) {
        std::string b;
        const auto put = [&](uint32_t v) { b.append(reinterpret_cast<const char *>(&v), 4); };
        put(1);
        put(8);
        put(9);
        b += "Question?";
        put(uint32_t(answers.size()));
        for (const std::string & a : answers) {
            put(uint32_t(a.size()));
            b += a;
        }
        for (const int32_t l : labels) {
            put(uint32_t(l));
        }
        put(0);
        return b;
    };
    test::write_text(dir / "one.bin", mc_task({"yes"}, {1}));
    test::write_text(dir / "seven.bin", mc_task({"yes", "no"}, {7, 0}));
    test::write_text(dir / "none.bin", mc_task({"yes", "no"}, {0, 0}));
    // A HellaSwag file with CRLF line ends.
    std::string crlf = task + "A second task\n2\na\nb\nc\nd\n";
    for (size_t at = crlf.find('\n'); at != std::string::npos; at = crlf.find('\n', at + 2)) {
        crlf.insert(at, "\r");
    }
    test::write_text(dir / "crlf.txt", crlf);
    auto r = test::run_command(moeprune_cmd(fmt::format("eval -m {} -f {} --keep {} -c 128 --base-out {}", m, text,
                                                        (dir / "k4.json").string(), (dir / "b.mpkl").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<std::pair<std::string, std::string>> cases = {
        {fmt::format("eval -m {} -f {} --candidate {} -c 128 {}", m, text, (dir / "gpt2.gguf").string(), outs),
         "gpt2.gguf: has another vocabulary"},
        {fmt::format("eval -m {} -f {} --keep {} -c 128 --base {} {}", m, (dir / "other.txt").string(),
                     (dir / "k4.json").string(), (dir / "b.mpkl").string(), outs),
         "b.mpkl: was recorded on other text"},
        {fmt::format("eval -m {} -f {} --keep {} -c 128 --base {} {}", (dir / "m16.gguf").string(), text,
                     (dir / "k16.json").string(), (dir / "b.mpkl").string(), outs),
         "b.mpkl: was recorded on another model"},
        {fmt::format("eval -m {} -f {} --keep {} -c 64 --base {} {}", m, text, (dir / "k4.json").string(),
                     (dir / "b.mpkl").string(), outs),
         "b.mpkl: was recorded with other settings"},
        {fmt::format("eval -m {} -f {} --keep {} -c 128 {}", m, text, (dir / "k16.json").string(), outs),
         "k16.json: made for a model with 16 experts, this model has 8"},
        {fmt::format("eval -m {} -f {} --keep {} -c 128 {}", m, text, (dir / "k1.json").string(), outs),
         "k1.json: keeps 1 experts per layer, fewer than the 2"},
        {fmt::format("eval -m {} -f {} --keep {} -c 128 --json {}", m, text, (dir / "k4.json").string(),
                     (dir / "k4.json").string()),
         "refusing to overwrite the input"},
        {fmt::format("eval -m {} -f {} --hellaswag {} -c 128 {}", m, text, (dir / "short.txt").string(), outs),
         "short.txt: has 11 lines, not a multiple of 6"},
        {fmt::format("eval -m {} -f {} --hellaswag {} -c 128 {}", m, text, (dir / "label.txt").string(), outs),
         "label.txt: line 8 (task 2): the label is \"4\", not an ending's index 0 to 3"},
        {fmt::format("eval -m {} -f {} --hellaswag {} -c 8 {}", m, text, (dir / "long.txt").string(), outs),
         "long.txt line 7 (task 2): needs"},
        {fmt::format("eval -m {} -f {} --hellaswag {} --tasks -1 -c 128 {}", m, text, (dir / "long.txt").string(), outs),
         "--tasks -1: the number of tasks to score must be at least 1"},
        {fmt::format("eval -m {} -f {} --hellaswag {} --task-domains {} -c 128 {}", m, text, (dir / "long.txt").string(),
                     (dir / "domains.json").string(), outs),
         "domains.json: describes 2 tasks of a file with xxh64 0123456789abcdef, not"},
        {fmt::format("eval -m {} -f {} --keep {} --task-domains {} -c 128 {}", m, text, (dir / "k4.json").string(),
                     (dir / "domains.json").string(), outs),
         "--task-domains describes a HellaSwag file made by corpus: give it with --hellaswag"},
        {fmt::format("eval -m {} -f {} --winogrande {} -c 128 {}", m, text, (dir / "wino.csv").string(), outs),
         "wino.csv: line 3 has the answer \"3\", not 1 or 2"},
        {fmt::format("eval -m {} -f {} --winogrande {} -c 128 {}", m, text, (dir / "blank.csv").string(), outs),
         "blank.csv: line 2 has no _ in its sentence"},
        {fmt::format("eval -m {} -f {} --multiple-choice {} -c 128 {}", m, text, (dir / "cut.bin").string(), outs),
         "cut.bin: task 1 (at byte"},
        {fmt::format("eval -m {} -f {} --multiple-choice {} -c 128 {}", m, text, (dir / "one.bin").string(), outs),
         "one.bin: task 1 has one answer: a choice needs two or more"},
        {fmt::format("eval -m {} -f {} --multiple-choice {} -c 128 {}", m, text, (dir / "seven.bin").string(), outs),
         "seven.bin: task 1: answer 0 is labelled 7: a label is 1 (right) or 0 (wrong)"},
        {fmt::format("eval -m {} -f {} --multiple-choice {} -c 128 {}", m, text, (dir / "none.bin").string(), outs),
         "none.bin: task 1 has no right answer (no answer labelled 1)"},
        {fmt::format("eval -m {} -f {} --hellaswag {} -c 128 {}", m, text, (dir / "crlf.txt").string(), outs),
         "crlf.txt: line 2 (task 1): the label ends in a carriage return (\\r): the file has CRLF line ends"},
    };
    const std::string keep_bytes = test::read_bytes(dir / "k4.json");
    for (const auto & [args, says] : cases) {
        r = test::run_command(moeprune_cmd(args));
        EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
        EXPECT_NE(r.output.find(says), std::string::npos) << args << "\nexpected: " << says << "\ngot: " << r.output;
        EXPECT_FALSE(fs::exists(dir / "r.json")) << args;
        EXPECT_FALSE(fs::exists(dir / "t.jsonl")) << args;
    }
    EXPECT_EQ(test::read_bytes(dir / "k4.json"), keep_bytes);
}

TEST(Eval, StatisticsFollowLlamaPerplexitysDefinitions) {
    std::vector<TokenScore> t(4);
    const double kld[4] = {0.4, 0.1, 0.3, 0.2};
    for (int i = 0; i < 4; ++i) {
        t[size_t(i)].kld = kld[i];
        t[size_t(i)].same_top1 = i != 2;
        t[size_t(i)].nll = 2.0 + 0.1 * i;
        t[size_t(i)].nll_base = 2.0;
    }
    std::vector<const TokenScore *> p;
    for (const auto & x : t) {
        p.push_back(&x);
    }
    const EvalStats s = eval_stats(p);
    EXPECT_EQ(s.tokens, 4u);
    EXPECT_NEAR(s.kld_mean, 0.25, 1e-12);
    // sqrt((E[x²] - E[x]²) / (n - 1)) = sqrt((0.075 - 0.0625) / 3)
    EXPECT_NEAR(s.kld_stderr, std::sqrt(0.0125 / 3), 1e-12);
    EXPECT_NEAR(s.kld_median, 0.25, 1e-12);           // mean of the two middle values
    EXPECT_NEAR(s.kld_p90, 0.3 + 0.7 * 0.1, 1e-12);   // at 0.9 * (n - 1) = 2.7
    EXPECT_NEAR(s.kld_max, 0.4, 1e-12);
    EXPECT_NEAR(s.same_top1, 0.75, 1e-12);
    EXPECT_NEAR(s.ln_ppl_ratio, 0.15, 1e-12);
    double dp2 = 0;
    for (int i = 0; i < 4; ++i) {
        const double dp = std::exp(-(2.0 + 0.1 * i)) - std::exp(-2.0);
        dp2 += dp * dp;
    }
    EXPECT_NEAR(s.dp_rms, std::sqrt(dp2 / 4), 1e-12);
    EXPECT_NEAR(s.ppl / s.ppl_base, std::exp(0.15), 1e-9);
}
