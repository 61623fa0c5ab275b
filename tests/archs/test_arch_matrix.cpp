// Issue 15's matrix: every MoE architecture synth builds goes through the whole pipeline
// (llama.cpp loads it split and unsplit; collect's invariants; slicing; identity slice
// bit for bit; planted dead experts sliced away at no cost; eval's masking against the
// sliced model). Each case records what it verified in build/arch-results/CASE.json,
// from which scripts/arch-table.py writes docs/architectures.md.
#include "formats/keep_map.h"
#include "model/model_file.h"
#include "model/inspect.h"
#include "slice/slice_support.h"
#include "support/test_support.h"
#include "synth/architectures.h"
#include "synth/synth.h"

#include "llama.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

struct Case {
    std::string name;  // ctest and result-file name
    std::string arch;
    bool groups = false;
};

std::vector<Case> all_cases() {
    std::vector<Case> cases;
    for (const auto & t : arch_table()) {
        cases.push_back({t.name, t.name, false});
        if (t.groups) {
            cases.push_back({t.name + "-groups", t.name, true});
        }
    }
    return cases;
}

std::string test_name(const std::string & case_name) {
    std::string s = case_name;
    for (char & c : s) {
        if (!std::isalnum(static_cast<unsigned char>(c))) {
            c = '_';
        }
    }
    return s;
}

// The columns of docs/architectures.md, in order: key and title. Every result file
// carries them, and scripts/arch-table.py takes them from there.
const std::vector<std::pair<std::string, std::string>> kColumns = {
    {"synth_loads", "synth loads (split and unsplit)"},
    {"collect_invariants", "collect invariants"},
    {"slice_loads", "slice loads and runs"},
    {"identity_bit_exact", "identity slice bit-exact"},
    {"planted_dead_kld", "planted-dead slice KLD <= 1e-5"},
    {"eval_masking_equals_sliced", "eval masking = sliced"},
    {"mtp", "MTP (nextn layer sliced, loads)"},
    {"mtp_runs", "MTP runs (collected, masked = sliced drafts)"},
    {"groups", "groups"},
};

// What a case verified: column -> "pass", "fail", or "n/a: why".
class Record {
public:
    // Written at every step, so a case that crashes (llama.cpp aborts rather than
    // throws) still shows in the table, as unfinished, with what it got through.
    Record(const Case & c, json settings) : case_(c) {
        j_ = {{"case", c.name},       {"arch", c.arch},        {"settings", std::move(settings)},
              {"columns", json::object()}, {"column_titles", kColumns}, {"finished", false}};
        save();
    }
    ~Record() {
        j_["finished"] = true;
        save();
    }
    void set(const std::string & column, const std::string & value) {
        if (std::none_of(kColumns.begin(), kColumns.end(), [&](const auto & k) { return k.first == column; })) {
            throw std::logic_error("no column " + column + " in kColumns");
        }
        j_["columns"][column] = value;
        save();
    }
    void pass_if(const std::string & column, bool ok) { set(column, ok ? "pass" : "fail"); }
    void note(const std::string & key, json value) {
        j_["notes"][key] = std::move(value);
        save();
    }

private:
    void save() const {
        const fs::path dir = fs::path(MOEPRUNE_ARCH_RESULTS_DIR);
        fs::create_directories(dir);
        std::ofstream(dir / (case_.name + ".json")) << j_.dump(1) << "\n";
    }

    Case case_;
    json j_;
};

std::vector<llama_token> tokens_of(const llama_model * model, const std::string & text, size_t max_tokens) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> toks(text.size() + 16);
    const int n = llama_tokenize(vocab, text.data(), int32_t(text.size()), toks.data(), int32_t(toks.size()), true, false);
    toks.resize(size_t(std::max(0, std::min<int>(n, int(max_tokens)))));
    return toks;
}

// Every position's logits for the first tokens of the test text, from llama.cpp itself.
std::vector<float> logits_of(const fs::path & model_path, size_t n_tokens = 96) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        ADD_FAILURE() << "llama.cpp cannot load " << model_path;
        return {};
    }
    const std::vector<llama_token> toks = tokens_of(model, test::mixed_text(), n_tokens);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_threads = cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init(int32_t(toks.size()), 0, 1);
    for (size_t i = 0; i < toks.size(); ++i) {
        batch.token[i] = toks[i];
        batch.pos[i] = int32_t(i);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;
    }
    batch.n_tokens = int32_t(toks.size());
    std::vector<float> out;
    if (llama_decode(ctx, batch) == 0) {
        const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        for (size_t i = 0; i < toks.size(); ++i) {
            const float * row = llama_get_logits_ith(ctx, int32_t(i));
            out.insert(out.end(), row, row + n_vocab);
        }
    } else {
        ADD_FAILURE() << "llama_decode failed on " << model_path;
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return out;
}

int64_t vocab_size(const fs::path & model) {
    const GgufModel m = GgufModel::open(model);
    const int64_t id = gguf_find_key(m.meta(), "tokenizer.ggml.tokens");
    return id < 0 ? 0 : int64_t(gguf_get_arr_n(m.meta(), id));
}

// Mean over positions of KL(p || q), p and q the softmax of two logit rows of width n_vocab.
double mean_kld(const std::vector<float> & p_logits, const std::vector<float> & q_logits, size_t n_vocab) {
    const size_t n = p_logits.size() / n_vocab;
    double total = 0;
    for (size_t t = 0; t < n; ++t) {
        const float * a = &p_logits[t * n_vocab];
        const float * b = &q_logits[t * n_vocab];
        const double ma = *std::max_element(a, a + n_vocab), mb = *std::max_element(b, b + n_vocab);
        double za = 0, zb = 0;
        for (size_t i = 0; i < n_vocab; ++i) {
            za += std::exp(double(a[i]) - ma);
            zb += std::exp(double(b[i]) - mb);
        }
        double kl = 0;
        for (size_t i = 0; i < n_vocab; ++i) {
            const double lp = double(a[i]) - ma - std::log(za), lq = double(b[i]) - mb - std::log(zb);
            kl += std::exp(lp) * (lp - lq);
        }
        total += kl;
    }
    return n ? total / double(n) : -1;
}

bool perplexity_runs(const fs::path & model, const fs::path & text, std::string * log) {
    return test::llama_perplexity(model, text, "-c 128 -b 128 --chunks 2 -t 1", log).has_value();
}

KeepMap keep_map(const InspectReport & rep, const std::function<std::vector<int32_t>(int)> & kept) {
    KeepMap km;
    km.n_expert = rep.n_expert;
    for (const auto & L : rep.layers) {
        km.layers[int(L.layer)] = kept(int(L.layer));
    }
    km.k = int64_t(km.layers.begin()->second.size());
    return km;
}

class ArchMatrix : public ::testing::TestWithParam<Case> {};

} // namespace

TEST_P(ArchMatrix, Verify) {
    const Case & c = GetParam();
    const ArchTraits & traits = *find_arch(c.arch);
    test::TempDir dir;
    const fs::path text = dir / "text.txt";
    test::write_text(text, test::mixed_text());
    if (!traits.refused.empty()) {
        // Refused by name, with the reason, and nothing written.
        Record rec(c, json::object());
        const auto r = test::run_command(
            moeprune_cmd(fmt::format("synth --arch {} -o {}", c.arch, (dir / "m.gguf").string())));
        const bool refused = r.exit_code != 0 && r.output.find(traits.refused) != std::string::npos &&
                             !fs::exists(dir / "m.gguf");
        EXPECT_TRUE(refused) << r.output;
        for (const auto & [column, title] : kColumns) {
            rec.set(column, refused ? "n/a: refused by synth: " + traits.refused : "fail");
        }
        return;
    }

    SynthOptions o = test::synth_options();
    o.arch = c.arch;
    o.mtp = traits.mtp;
    o.n_layer = std::max(traits.min_layers, 3) + int(o.mtp);
    o.n_expert = 8;
    o.n_expert_used = 2;
    o.n_embd = std::max(64, traits.head_dim);
    o.groups = c.groups ? 2 : 0;
    const bool planting = traits.planting_refused.empty() && !c.groups;
    o.dead = planting ? 2 : 0;
    o.output = dir / "m.gguf";
    Record rec(c, {{"layers", o.n_layer}, {"experts", o.n_expert}, {"used", o.n_expert_used}, {"embd", o.n_embd},
                   {"mtp", o.mtp}, {"groups", o.groups}, {"dead", o.dead}});
    rec.set("mtp", o.mtp ? "fail"
                         : "n/a: " + (traits.no_mtp_reason.empty() ? "llama.cpp builds no nextn layer for " + c.arch
                                                                     : "synth cannot build it: " + traits.no_mtp_reason));
    rec.set("mtp_runs", o.mtp ? "fail" : "n/a");
    rec.set("groups", c.groups ? "fail" : "n/a");

    const SynthResult synth = synthesize(o);
    SynthOptions split = o;
    split.split = 2;
    split.output = dir / "s.gguf";
    const SynthResult synth_split = synthesize(split);
    std::string log;
    const bool loads = perplexity_runs(o.output, text, &log);
    EXPECT_TRUE(loads) << log;
    const bool loads_split = perplexity_runs(synth_split.files.front(), text, &log);
    EXPECT_TRUE(loads_split) << log;
    rec.pass_if("synth_loads", loads && loads_split);
    ASSERT_TRUE(loads);

    const InspectReport rep = inspect_model(GgufModel::open(o.output), {});
    EXPECT_TRUE(rep.problems.empty()) << fmt::format("{}", fmt::join(rep.problems, "; "));
    ASSERT_FALSE(rep.layers.empty());
    std::vector<int> moe_layers;
    for (const auto & L : rep.layers) {
        moe_layers.push_back(int(L.layer));
    }
    rec.note("moe_layers", moe_layers);
    rec.note("nextn_layers", rep.n_nextn);

    // collect: its invariants are fatal when broken, so a finished run holds them.
    const fs::path stats = dir / "stats.json";
    auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -c 128 -t 1", o.output.string(),
                                                        text.string(), stats.string())));
    bool collected = r.exit_code == 0;
    json sj;
    if (collected) {
        sj = json::parse(test::read_bytes(stats));
        collected = sj["settings"]["invariants"]["ok"].get<bool>();
        rec.note("gating", sj["settings"]["gating"]);
        rec.note("expert_output_node", sj["settings"]["expert_output_node"]);
        const uint64_t repeats = sj["settings"]["repeated_routings_ignored"].get<uint64_t>();
        rec.note("repeated_routings_ignored", repeats);
        // grovemoe routes each layer twice (experts, then adjugate experts) from one router.
        EXPECT_EQ(repeats > 0, c.arch == "grovemoe") << repeats;
    }
    EXPECT_TRUE(collected) << r.output;
    rec.pass_if("collect_invariants", collected);
    // The MTP head ran over every token: its layer is recorded with k picks per token.
    bool mtp_collected = false;
    if (o.mtp && collected) {
        const auto & layers = sj["model"]["moe_layers"];
        mtp_collected = !layers.empty() && layers.back() == o.n_layer - 1 && sj["model"]["mtp_layers"] == json({o.n_layer - 1});
        uint64_t picks = 0;
        for (uint64_t n : sj["layers"].back()["count"]) {
            picks += n;
        }
        mtp_collected = mtp_collected && picks == sj["n_tokens"].get<uint64_t>() * uint64_t(o.n_expert_used);
        EXPECT_TRUE(mtp_collected) << sj["model"];
    }

    // Slicing away live experts: llama.cpp loads and runs the smaller model.
    const int per_group = o.groups ? o.n_expert / o.groups : 0;
    const json planted = synth.planted;
    const auto dead_in = [&](int layer) {
        std::set<int32_t> d;
        if (planted["dead"].contains(std::to_string(layer))) {
            for (int id : planted["dead"][std::to_string(layer)]) {
                d.insert(id);
            }
        }
        return d;
    };
    // Drops two live experts per layer (with groups, half of each group), so the cut
    // changes what the model computes; planted dead experts stay.
    const KeepMap cut = keep_map(rep, [&](int layer) {
        std::vector<int32_t> keep;
        const auto dead = dead_in(layer);
        int live_dropped = 0;
        for (int32_t e = 0; e < o.n_expert; ++e) {
            const bool drop = o.groups ? e % per_group < per_group / 2 : (!dead.count(e) && live_dropped < 2);
            if (drop && !o.groups) {
                ++live_dropped;
            }
            if (!drop) {
                keep.push_back(e);
            }
        }
        return keep;
    });
    test::write_keep(dir / "cut.json", cut);
    r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", o.output.string(),
                                                   (dir / "cut.json").string(), (dir / "cut.gguf").string())));
    bool sliced = r.exit_code == 0;
    EXPECT_TRUE(sliced) << r.output;
    if (sliced) {
        sliced = perplexity_runs(dir / "cut.gguf", text, &log);
        EXPECT_TRUE(sliced) << log;
    }
    if (sliced) {
        const InspectReport cut_rep = inspect_model(GgufModel::open(dir / "cut.gguf"), {});
        EXPECT_EQ(cut_rep.n_expert, cut.k);
        sliced = cut_rep.n_expert == cut.k;
        if (c.groups) {
            EXPECT_EQ(cut_rep.expert_group_count, o.groups) << "the sliced model keeps its groups";
            rec.pass_if("groups", sliced && cut_rep.expert_group_count == o.groups);
        }
    }
    rec.pass_if("slice_loads", sliced);
    if (o.mtp) {
        // slice refuses a keep map that leaves the nextn layer out; this one covered it.
        const bool covered = std::count(moe_layers.begin(), moe_layers.end(), o.n_layer - 1) == 1;
        EXPECT_TRUE(covered) << "the nextn layer " << o.n_layer - 1 << " has no per-expert tensors";
        // llama-perplexity skips nextn tensors; loading them checks the sliced shapes.
        llama_backend_init();
        llama_model_params mp = llama_model_default_params();
        mp.load_mtp = true;
        llama_model * with_mtp = sliced ? llama_model_load_from_file((dir / "cut.gguf").c_str(), mp) : nullptr;
        const bool mtp_loads = with_mtp && llama_model_n_layer_nextn(with_mtp) == 1;
        if (with_mtp) {
            llama_model_free(with_mtp);
        }
        EXPECT_TRUE(mtp_loads);
        rec.pass_if("mtp", covered && mtp_loads);
    }

    // The identity keep map: the same logits, bit for bit.
    const KeepMap identity = keep_map(rep, [&](int) {
        std::vector<int32_t> all(size_t(o.n_expert));
        std::iota(all.begin(), all.end(), 0);
        return all;
    });
    test::write_keep(dir / "identity.json", identity);
    r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", o.output.string(),
                                                   (dir / "identity.json").string(), (dir / "identity.gguf").string())));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<float> base = logits_of(o.output);
    const int64_t rep_vocab = vocab_size(o.output);
    const std::vector<float> same = logits_of(dir / "identity.gguf");
    ASSERT_FALSE(base.empty());
    const bool bit_exact = base.size() == same.size() && std::memcmp(base.data(), same.data(), base.size() * 4) == 0;
    double cut_kld = 0;
    if (sliced) {
        // The cut removed live experts: visible, so masking equal to it below means something.
        cut_kld = mean_kld(base, logits_of(dir / "cut.gguf"), size_t(rep_vocab));
        rec.note("cut_kld", cut_kld);
        EXPECT_GT(cut_kld, 0.0);
    }
    EXPECT_TRUE(bit_exact);
    rec.pass_if("identity_bit_exact", bit_exact);

    // Planted dead experts: never chosen, and slicing exactly them away costs nothing.
    if (!planting) {
        rec.set("planted_dead_kld", "n/a: " + (c.groups ? std::string("planting is not combined with --groups")
                                                        : traits.planting_refused));
    } else {
        bool never_chosen = collected;
        if (collected) {
            const auto & layers = sj["model"]["moe_layers"];
            for (size_t i = 0; i < layers.size(); ++i) {
                for (int id : dead_in(layers[i].get<int>())) {
                    const uint64_t n = sj["layers"][i]["count"][size_t(id)].get<uint64_t>();
                    EXPECT_EQ(n, 0u) << "dead expert " << id << " chosen in layer " << layers[i];
                    never_chosen = never_chosen && n == 0;
                }
            }
        }
        const KeepMap live = keep_map(rep, [&](int layer) {
            std::vector<int32_t> keep;
            const auto dead = dead_in(layer);
            for (int32_t e = 0; e < o.n_expert; ++e) {
                if (!dead.count(e)) {
                    keep.push_back(e);
                }
            }
            return keep;
        });
        test::write_keep(dir / "live.json", live);
        r = test::run_command(moeprune_cmd(fmt::format("slice -m {} --keep {} -o {}", o.output.string(),
                                                       (dir / "live.json").string(), (dir / "live.gguf").string())));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        const std::vector<float> without_dead = logits_of(dir / "live.gguf");
        ASSERT_EQ(without_dead.size(), base.size());
        const double kld = mean_kld(base, without_dead, size_t(rep_vocab));
        rec.note("planted_dead_kld", kld);
        EXPECT_LE(kld, 1e-5);
        rec.pass_if("planted_dead_kld", never_chosen && kld <= 1e-5);
    }

    // eval: the keep map masked inside the original equals the sliced model.
    if (sliced) {
        r = test::run_command(moeprune_cmd(fmt::format(
            "eval -m {} -f {} --keep {} --candidate {} --against {} -c 128 -t 1 --json {} --per-token {}",
            o.output.string(), text.string(), (dir / "cut.json").string(), (dir / "cut.gguf").string(),
            (dir / "cut.gguf").string(), (dir / "r.json").string(), (dir / "pt.jsonl").string())));
        const auto refusal = r.output.find("masking cannot reproduce the sliced model here");
        if (r.exit_code != 0 && refusal != std::string::npos) {
            // eval refuses by name what masking cannot express; the reason goes in the table.
            const auto open = r.output.find('(', refusal), close = r.output.find(')', open);
            rec.set("eval_masking_equals_sliced", "n/a: eval refuses: " + r.output.substr(open + 1, close - open - 1));
        } else if (r.exit_code != 0) {
            rec.set("eval_masking_equals_sliced", "fail");
            ADD_FAILURE() << r.output;
        } else {
            double worst = 0, sum = 0;
            size_t rows = 0, other_top1 = 0;
            std::istringstream in(test::read_bytes(dir / "pt.jsonl"));
            for (std::string line; std::getline(in, line);) {
                const json j = json::parse(line);
                if (j["candidate"] == "cut") {
                    worst = std::max(worst, j["kld"].get<double>());
                    sum += j["kld"].get<double>();
                    other_top1 += !j["same_top1"].get<bool>();
                    ++rows;
                }
            }
            const double mean = rows ? sum / double(rows) : 1.0;
            rec.note("eval_masked_vs_sliced_worst_kld", worst);
            rec.note("eval_masked_vs_sliced_mean_kld", mean);
            EXPECT_GT(rows, 100u);
            // Masking computes the same experts in another graph (softmax over 8 with two at
            // -inf against 6: another ggml code path), so the gate weights differ in the last
            // bit; the q8_0 output matrix quantizes its input, which hides that on most tokens
            // and makes one quantum of it on a few (per-token KLDs up to about 1e-5 on these
            // near-uniform random models, where that also moves a near-tied top-1 now and
            // then). The mean must also be far below what the cut itself costs.
            const double mean_bound = std::min(1e-6, cut_kld / 100);
            const bool top1 = other_top1 <= rows / 100;
            EXPECT_LE(mean, mean_bound);
            EXPECT_LE(worst, 1e-4);
            EXPECT_TRUE(top1) << other_top1 << " of " << rows << " tokens with another top-1";
            rec.pass_if("eval_masking_equals_sliced", rows > 100 && mean <= mean_bound && worst <= 1e-4 && top1);
            if (o.mtp) {
                // The nextn layer masked in the MTP context drafts as the sliced head does.
                const json ej = json::parse(test::read_bytes(dir / "r.json"));
                const json & masked = ej["candidates"][0]["all"];
                const bool drafted = masked.value("mtp_tokens", uint64_t(0)) > 100;
                const double mtp_kld = masked.value("mtp_kld_mean", 1.0);
                rec.note("eval_masked_vs_sliced_mtp_kld", mtp_kld);
                EXPECT_TRUE(drafted) << masked;
                EXPECT_LE(mtp_kld, 1e-6);
                rec.pass_if("mtp_runs", mtp_collected && drafted && mtp_kld <= 1e-6);
            }
        }
    } else {
        rec.set("eval_masking_equals_sliced", "fail");
    }
}

INSTANTIATE_TEST_SUITE_P(Archs, ArchMatrix, ::testing::ValuesIn(all_cases()),
                         [](const auto & info) { return test_name(info.param.name); });

// The ctest list in tests/CMakeLists.txt names every case, so each architecture has its label.
TEST(ArchMatrixList, CTestRegistersEveryCase) {
    std::set<std::string> registered;
    std::istringstream in(MOEPRUNE_ARCH_CASES);
    for (std::string name; std::getline(in, name, ',');) {
        registered.insert(name);
    }
    std::set<std::string> cases;
    for (const Case & c : all_cases()) {
        cases.insert(c.name);
    }
    EXPECT_EQ(registered, cases);
}
