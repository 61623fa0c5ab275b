// Images through llama.cpp's libmtmd: synth's projector is one libmtmd loads and encodes a
// real JPEG with, its image embeddings carry the planted coordinates, and collect over text
// and images records the image positions under the "image" domain, where the experts only
// images reach get all their hits.
#include "collect/collect.h"
#include "core/errors.h"
#include "formats/stats.h"
#include "formats/trace.h"
#include "support/test_support.h"
#include "synth/synth.h"

#include "gguf.h"
#include "llama.h"
#include "mtmd-helper.h"
#include "mtmd.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <functional>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>

using namespace moeprune;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using test::moeprune_cmd;

const fs::path test_image = fs::path(MOEPRUNE_LLAMA_DIR) / "tools" / "mtmd" / "test-1.jpeg";

// A qwen3vlmoe model (M-RoPE) with dead experts, text specialists and two experts per layer
// that only images reach (and, asked for, two that only audio reaches), and its projector.
struct VisionModel {
    test::TempDir dir;
    SynthResult synth;
    fs::path model, mmproj;
    explicit VisionModel(int audio_experts = 0) {
        SynthOptions o = test::synth_options();
        o.arch = "qwen3vlmoe";
        o.n_layer = 4;
        o.n_expert = 16;
        o.n_expert_used = 4;
        o.n_embd = 64;
        o.dead = 2;
        o.specialists = true;
        o.image_experts = 2;
        o.audio_experts = audio_experts;
        o.output = model = dir / "m.gguf";
        o.mmproj = mmproj = dir / "mmproj.gguf";
        synth = synthesize(o);
    }
    std::set<int> planted(const char * modality, int layer) const {
        return synth.planted[modality][std::to_string(layer)].get<std::set<int>>();
    }
    std::set<int> image_experts(int layer) const { return planted("image", layer); }
};

const VisionModel & vision_model() {
    static const VisionModel m;
    return m;
}

// Two conversations about the test image, and text of each specialist kind.
std::string media_corpus(const fs::path & dir, const std::string & image_name) {
    fs::copy_file(test_image, dir / image_name, fs::copy_options::overwrite_existing);
    std::string out;
    for (const char * question : {"What is in this picture?", "Describe the colours you see."}) {
        out += json{{"messages",
                     {{{"role", "user"},
                       {"content", {{{"type", "text"}, {"text", question}}, {{"type", "image"}, {"path", image_name}}}}},
                      {{"role", "assistant"}, {"content", "It shows a scene."}}}},
                    {"domain", "chat"}}
                   .dump() +
               "\n";
    }
    out += json{{"text", "int main() { std::vector<int> v{1, 2}; return v[0] == 1 ? 0 : 1; }"}, {"domain", "code"}}.dump() +
           "\n";
    out += json{{"text", "我们在笔记本电脑上运行大型语言模型，需要减少内存使用。"}, {"domain", "zh"}}.dump() + "\n";
    return out;
}

} // namespace

// libmtmd loads the projector synth wrote and encodes a real JPEG into (64/16)^2 = 16
// embeddings of the text model's input width; each carries coordinate 0's constant and the
// image coordinate exactly, and none of the text kinds' coordinates.
TEST(Media, LibmtmdEncodesAnImageWithSynthsProjector) {
    const VisionModel & vm = vision_model();
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    std::unique_ptr<llama_model, decltype(&llama_model_free)> model(llama_model_load_from_file(vm.model.c_str(), mp),
                                                                    llama_model_free);
    ASSERT_NE(model, nullptr);
    mtmd_context_params p = mtmd_context_params_default();
    p.use_gpu = false;
    p.print_timings = false;
    p.n_threads = 2;
    std::unique_ptr<mtmd_context, decltype(&mtmd_free)> ctx(mtmd_init_from_file(vm.mmproj.c_str(), model.get(), p), mtmd_free);
    ASSERT_NE(ctx, nullptr);
    EXPECT_TRUE(mtmd_support_vision(ctx.get()));
    EXPECT_TRUE(mtmd_decode_use_mrope(ctx.get())) << "qwen3vlmoe decodes images with M-RoPE positions";
    mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_file(ctx.get(), test_image.c_str(), false,
                                                                      mtmd_helper_init_opt_default());
    ASSERT_NE(w.bitmap, nullptr);
    std::unique_ptr<mtmd_input_chunks, decltype(&mtmd_input_chunks_free)> chunks(mtmd_input_chunks_init(),
                                                                                 mtmd_input_chunks_free);
    const std::string text = std::string("look: ") + mtmd_default_marker() + " now";
    const mtmd_input_text in{text.c_str(), text.size(), true, true};
    const mtmd_bitmap * bitmaps[] = {w.bitmap};
    ASSERT_EQ(mtmd_tokenize(ctx.get(), chunks.get(), &in, bitmaps, 1), 0);
    mtmd_bitmap_free(w.bitmap);
    const mtmd_input_chunk * image = nullptr;
    for (size_t i = 0; i < mtmd_input_chunks_size(chunks.get()); ++i) {
        const mtmd_input_chunk * c = mtmd_input_chunks_get(chunks.get(), i);
        if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE) image = c;
    }
    ASSERT_NE(image, nullptr);
    ASSERT_EQ(mtmd_input_chunk_get_n_tokens(image), 16u);
    ASSERT_EQ(mtmd_encode_chunk(ctx.get(), image), 0);
    const float * embd = mtmd_get_output_embd(ctx.get());
    const int n_embd = llama_model_n_embd_inp(model.get());
    const int image_coord = vm.synth.planted["image_coordinate"].get<int>();
    ASSERT_EQ(image_coord, 3) << "after the two text kinds' coordinates";
    for (int t = 0; t < 16; ++t) {
        const float * row = embd + size_t(t) * size_t(n_embd);
        EXPECT_FLOAT_EQ(row[0], 1.0f) << t;
        EXPECT_FLOAT_EQ(row[1], 0.0f) << t;
        EXPECT_FLOAT_EQ(row[2], 0.0f) << t;
        EXPECT_FLOAT_EQ(row[image_coord], 1.0f) << t;
        double other = 0;
        for (int c = image_coord + 1; c < n_embd; ++c) other += std::fabs(row[c]);
        EXPECT_GT(other, 0.0) << "the rest of the embedding depends on the image";
    }
}

// collect over conversations with the image and text: image rows are recorded under
// "image" (16 per image), the invariants hold over every row, the planted image experts get
// every hit from image rows and are chosen at every image row, dead experts at none, and
// the trace marks image rows (no token id, the image domain). Without the images, the same
// conversations give the image experts no hit at all.
TEST(Media, CollectRecordsImagePositionsUnderTheirModality) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    test::write_text(dir / "corpus.jsonl", media_corpus(dir.path(), "picture.jpeg"));
    CollectOptions o;
    o.model = vm.model;
    o.mmproj = vm.mmproj;
    o.corpus = dir / "corpus.jsonl";
    o.output = dir / "stats.json";
    o.trace = dir / "trace.bin";
    o.threads = 2;
    o.progress = false;
    const CollectResult r = collect(o);
    const SaliencyStats & s = r.stats;
    ASSERT_TRUE(s.domains.count("image"));
    const uint64_t image_rows = s.domains.at("image").n_tokens;
    EXPECT_EQ(image_rows, 32u) << "two images of 16 embeddings";
    for (size_t l = 0; l < s.layers.size(); ++l) {
        const int layer = int(l);  // qwen3vlmoe as synth makes it routes in every layer
        uint64_t picks = 0;
        for (uint64_t c : s.layers[l].count) picks += c;
        EXPECT_EQ(picks, s.n_tokens * 4) << "layer " << layer;
        for (int e : vm.image_experts(layer)) {
            EXPECT_EQ(s.layers[l].count[size_t(e)], image_rows) << "image expert " << e << " layer " << layer;
            EXPECT_EQ(s.domains.at("image").layers[l].count[size_t(e)], image_rows) << "image expert " << e;
        }
        for (int e : vm.synth.planted["dead"][std::to_string(layer)].get<std::vector<int>>()) {
            EXPECT_EQ(s.layers[l].count[size_t(e)], 0u) << "dead expert " << e << " layer " << layer;
        }
    }
    const TraceReader trace = TraceReader::open(o.trace);
    const auto & domains = trace.header().domains;
    const auto image_domain = uint16_t(std::find(domains.begin(), domains.end(), "image") - domains.begin());
    ASSERT_LT(image_domain, domains.size());
    uint64_t traced_image = 0;
    for (const TraceTokenMeta & m : trace.token_meta()) {
        if (m.domain == image_domain) {
            ++traced_image;
            EXPECT_EQ(m.token, -1) << "an image row has no token id";
        } else {
            EXPECT_GE(m.token, 0);
        }
    }
    EXPECT_EQ(traced_image, image_rows);

    // The same conversations with the image parts left out.
    const std::string corpus = media_corpus(dir.path(), "picture.jpeg");
    json doc = json::parse(corpus.substr(0, corpus.find('\n')));
    doc["messages"][0]["content"] = "What is in this picture?";
    test::write_text(dir / "text.jsonl", doc.dump() + "\n");
    o.corpus = dir / "text.jsonl";
    o.output = dir / "text-stats.json";
    o.trace.clear();
    const CollectResult t = collect(o);
    EXPECT_EQ(t.stats.domains.count("image"), 0u);
    for (size_t l = 0; l < t.stats.layers.size(); ++l) {
        for (int e : vm.image_experts(int(l))) {
            EXPECT_EQ(t.stats.layers[l].count[size_t(e)], 0u) << "image expert " << e << " chosen by text";
        }
    }
}

// The same documents with their image parts left out.
std::string text_only(const std::string & corpus) {
    std::string out;
    for (size_t at = 0, end; at < corpus.size(); at = end + 1) {
        end = corpus.find('\n', at);
        json doc = json::parse(corpus.substr(at, end - at));
        if (doc.contains("messages")) doc["messages"][0]["content"] = doc["messages"][0]["content"][0]["text"];
        out += doc.dump() + "\n";
    }
    return out;
}

// select names the experts most of whose hits come from image positions (exactly the
// planted ones) and domain-max keeps them all at a small K; calibrated on the same
// conversations without images, freq keeps none of them and select warns, naming them.
TEST(Media, SelectFindsImageExpertsAndWarnsWithoutImages) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    const std::string corpus = media_corpus(dir.path(), "picture.jpeg");
    test::write_text(dir / "corpus.jsonl", corpus);
    test::write_text(dir / "text.jsonl", text_only(corpus));
    const auto run_ok = [](const std::string & args) {
        const auto r = test::run_command(moeprune_cmd(args));
        EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
        return r.output;
    };
    run_ok(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(), vm.mmproj.string(),
                       (dir / "corpus.jsonl").string(), (dir / "stats.json").string()));
    const std::string collect_out = run_ok(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(),
                                                       vm.mmproj.string(), (dir / "text.jsonl").string(),
                                                       (dir / "text-stats.json").string()));
    EXPECT_NE(collect_out.find("WARNING: " + (dir / "text.jsonl").string() + " calibrates a multimodal model"),
              std::string::npos) << collect_out;

    run_ok(fmt::format("select --stats {} -k 6 --metric domain-max freq -o {} --json {}", (dir / "stats.json").string(),
                       (dir / "maps").string(), (dir / "select.json").string()));
    const json sel = json::parse(test::read_bytes(dir / "select.json"));
    const json dmax = json::parse(test::read_bytes(dir / "maps" / "domain-max-k6.json"));
    for (int layer = 0; layer < 4; ++layer) {
        const std::set<int> planted = vm.image_experts(layer);
        EXPECT_EQ(sel["media_experts"]["image"][std::to_string(layer)].get<std::set<int>>(), planted) << layer;
        const auto kept = dmax["layers"][std::to_string(layer)].get<std::set<int>>();
        for (int e : planted) EXPECT_TRUE(kept.count(e)) << "domain-max dropped image expert " << e << " layer " << layer;
    }
    for (const json & r : sel["results"]) {
        if (r["metric"] == "domain-max") EXPECT_EQ(r["media_experts_kept"]["image"]["kept"], 8);
    }
    EXPECT_TRUE(sel["warnings"].empty());

    const std::string out = run_ok(fmt::format("select --stats {} -k 6 --metric freq -o {} --json {}",
                                               (dir / "text-stats.json").string(), (dir / "text-maps").string(),
                                               (dir / "text-select.json").string()));
    const json freq = json::parse(test::read_bytes(dir / "text-maps" / "freq-k6.json"));
    for (int layer = 0; layer < 4; ++layer) {
        const auto kept = freq["layers"][std::to_string(layer)].get<std::set<int>>();
        for (int e : vm.image_experts(layer)) EXPECT_FALSE(kept.count(e)) << "image expert " << e << " layer " << layer;
    }
    const json text_sel = json::parse(test::read_bytes(dir / "text-select.json"));
    ASSERT_EQ(text_sel["warnings"].size(), 1u);
    const std::string w = text_sel["warnings"][0].get<std::string>();
    EXPECT_NE(w.find("collect was given the projector " + vm.mmproj.string()), std::string::npos) << w;
    EXPECT_NE(w.find(fmt::format("blk.0 e{}", *vm.image_experts(0).begin())), std::string::npos) << w;
    EXPECT_NE(out.find("moeprune select: WARNING"), std::string::npos) << "the warning goes to the error stream too";

    // A modality holding more rows than the whole is no statistics collect wrote.
    json bad = json::parse(test::read_bytes(dir / "stats.json"));
    bad["domains"]["image"]["n_tokens"] = bad["n_tokens"].get<uint64_t>() + 1;
    test::write_text(dir / "bad-stats.json", bad.dump());
    const auto r = test::run_command(moeprune_cmd(fmt::format("select --stats {} -k 6 --metric freq -o {}", (dir / "bad-stats.json").string(),
                                                              (dir / "bad-maps").string())));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find((dir / "bad-stats.json").string() + ": domain image holds"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "bad-maps"));
}

// eval scores the text after each conversation's image under the domain "image": a keep
// map masked in the model and the same map sliced out of it agree there as on text (mean
// KLD within 1e-6), and the identity map costs nothing. What eval does not take with media
// yet is refused by name.
TEST(Media, EvalScoresTextAfterImagesMaskedAsSliced) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    test::write_text(dir / "corpus.jsonl", media_corpus(dir.path(), "picture.jpeg"));
    const auto run = [](const std::string & args) { return test::run_command(moeprune_cmd(args)); };
    auto r = run(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(), vm.mmproj.string(),
                             (dir / "corpus.jsonl").string(), (dir / "stats.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run(fmt::format("select --stats {} -k 6 16 --metric domain-max -o {}", (dir / "stats.json").string(),
                        (dir / "maps").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // The map a text-only calibration gives at the same K, beside the image-aware ones.
    test::write_text(dir / "text.jsonl", text_only(media_corpus(dir.path(), "picture.jpeg")));
    r = run(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(), vm.mmproj.string(),
                        (dir / "text.jsonl").string(), (dir / "text-stats.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run(fmt::format("select --stats {} -k 6 --metric freq -o {}", (dir / "text-stats.json").string(),
                        (dir / "text-maps").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    fs::copy_file(dir / "text-maps" / "freq-k6.json", dir / "maps" / "text-only-freq-k6.json");
    r = run(fmt::format("slice -m {} --keep {} -o {}", vm.model.string(), (dir / "maps" / "domain-max-k6.json").string(),
                        (dir / "sliced.gguf").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string eval_args = fmt::format("eval -m {} --mmproj {} -f {} -t 2", vm.model.string(), vm.mmproj.string(),
                                              (dir / "corpus.jsonl").string());
    r = run(eval_args + fmt::format(" --keep-dir {} --json {}", (dir / "maps").string(), (dir / "eval.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json ev = json::parse(test::read_bytes(dir / "eval.json"));
    EXPECT_EQ(ev["inputs"]["mmproj"], vm.mmproj.string());
    std::map<std::string, json> by_name;
    for (const json & c : ev["candidates"]) by_name[c["name"].get<std::string>()] = c;
    ASSERT_TRUE(by_name.count("domain-max-k6") && by_name.count("domain-max-k16"));
    EXPECT_GT(by_name["domain-max-k6"]["domains"]["image"]["kld_mean"].get<double>(), 1e-4);
    EXPECT_EQ(by_name["domain-max-k16"]["domains"]["image"]["kld_mean"].get<double>(), 0.0) << "every expert kept";
    EXPECT_TRUE(by_name["domain-max-k6"]["domains"].contains("code")) << "text documents keep their domain";
    // Synth's image experts write what the text after an image reads, so losing them costs
    // there: the text-only map (none of them kept) is far worse on the image domain than
    // the image-aware map of the same size, which spends slots on them and loses text experts.
    ASSERT_TRUE(by_name.count("text-only-freq-k6"));
    const double text_only_kld = by_name["text-only-freq-k6"]["domains"]["image"]["kld_mean"].get<double>();
    const double image_aware_kld = by_name["domain-max-k6"]["domains"]["image"]["kld_mean"].get<double>();
    EXPECT_GT(text_only_kld, 5.0 * image_aware_kld) << "text-only " << text_only_kld << ", image-aware " << image_aware_kld;

    r = run(eval_args + fmt::format(" --keep {} --candidate {} --against {} --json {}",
                                    (dir / "maps" / "domain-max-k6.json").string(), (dir / "sliced.gguf").string(),
                                    (dir / "sliced.gguf").string(), (dir / "against.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json against = json::parse(test::read_bytes(dir / "against.json"));
    const json & image = against["candidates"][0]["domains"]["image"];
    EXPECT_LE(image["kld_mean"].get<double>(), 1e-6);
    EXPECT_EQ(image["same_top1"].get<double>(), 1.0);

    const auto refused = [&](const std::string & args, const std::string & expected) {
        const auto rr = run(args);
        EXPECT_NE(rr.exit_code, 0) << args;
        EXPECT_NE(rr.output.find(expected), std::string::npos) << rr.output;
    };
    const std::string keep = " --keep " + (dir / "maps" / "domain-max-k6.json").string();

    // A base recorded through one projector is not read through another: the media rows differ.
    r = run(eval_args + keep + " --base-out " + (dir / "base.mpkl").string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run(eval_args + keep + " --base " + (dir / "base.mpkl").string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    SynthOptions other = test::synth_options();
    other.arch = "qwen3vlmoe";
    other.seed = 7;
    other.output = dir / "other.gguf";
    other.mmproj = dir / "other-mmproj.gguf";
    synthesize(other);
    refused(fmt::format("eval -m {} --mmproj {} -f {} -t 2", vm.model.string(), other.mmproj.string(),
                        (dir / "corpus.jsonl").string()) + keep + " --base " + (dir / "base.mpkl").string(),
            "was recorded through another projector (\"" + vm.mmproj.string() + "\"), not " + other.mmproj.string());
    refused(fmt::format("eval -m {} -f {} -t 2", vm.model.string(), (dir / "corpus.jsonl").string()) + keep,
            "no projector was given to encode it (--mmproj FILE)");
    refused(eval_args + keep + " --generate 8", "give them with --prompts FILE");
    refused(eval_args + keep + " --score second-half", "use --score all");
    refused(eval_args + keep + " --cache-policy lru --cache 8 --lambda 0.5", "the closed loop (--cache-policy) routes text only");
}

// Media that cannot be read: a clear error naming the file, and nothing written.
TEST(Media, BadMediaAreRefusedByNameAndNothingIsWritten) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    const fs::path out = dir / "stats.json";
    const auto refused = [&](const std::string & corpus, const std::string & extra, const std::string & expected) {
        test::write_text(dir / "c.jsonl", corpus);
        const auto r = test::run_command(
            moeprune_cmd(fmt::format("collect -m {} -f {} -o {} -t 2 {}", vm.model.string(), (dir / "c.jsonl").string(),
                                     out.string(), extra)));
        EXPECT_NE(r.exit_code, 0) << corpus;
        EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
        EXPECT_FALSE(fs::exists(out));
    };
    const std::string mmproj = "--mmproj " + vm.mmproj.string();
    const auto with_image = [](const std::string & path, const std::string & type = "image") {
        return json{{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "see"}}, {{"type", type}, {"path", path}}}}}}}}
                   .dump() +
               "\n";
    };
    refused(with_image("missing.jpeg"), mmproj, (dir / "missing.jpeg").string() + " is not there");
    test::write_text(dir / "notes.jpeg", "not an image at all");
    refused(with_image("notes.jpeg"), mmproj, (dir / "notes.jpeg").string() + ": is not an image libmtmd can read");
    fs::copy_file(test_image, dir / "ok.jpeg");
    refused(with_image("ok.jpeg", "audio"), mmproj, "the projector " + vm.mmproj.string() + " encodes no audio");
    refused(with_image("ok.jpeg"), "", "no projector was given to encode it (--mmproj FILE)");
    refused(with_image("ok.jpeg", "video"), mmproj, "\"type\" text, image or audio");
    refused(with_image("ok.jpeg"), "--mmproj " + vm.model.string(), vm.model.string() + ": is not a projector: its general.architecture is 'qwen3vlmoe'");

    // A key libmtmd reads as a number, stored as a string: gguf's typed getter would abort
    // the process inside libmtmd's loader.
    gguf_context * g = gguf_init_from_file(vm.mmproj.c_str(), {/*no_alloc=*/true, nullptr});
    ASSERT_NE(g, nullptr);
    const size_t data_offset = gguf_get_data_offset(g);
    gguf_set_val_str(g, "clip.vision.image_size", "large");
    const fs::path bad = dir / "bad-mmproj.gguf";
    ASSERT_TRUE(gguf_write_to_file(g, bad.c_str(), /*only_meta=*/true));
    gguf_free(g);
    test::write_text(bad, test::read_bytes(bad) + test::read_bytes(vm.mmproj).substr(data_offset));
    refused(with_image("ok.jpeg"), "--mmproj " + bad.string(),
            bad.string() + ": llama.cpp's libmtmd aborts loading it as a projector, or encoding a small probe with it (Aborted): ");
}

// A copy of `src` with its metadata edited by `edit` and its tensor data as it was.
void rewrite_projector(const fs::path & src, const fs::path & dst, const std::function<void(gguf_context *)> & edit) {
    gguf_context * g = gguf_init_from_file(src.c_str(), {/*no_alloc=*/true, nullptr});
    ASSERT_NE(g, nullptr);
    const size_t data_offset = gguf_get_data_offset(g);
    edit(g);
    ASSERT_TRUE(gguf_write_to_file(g, dst.c_str(), /*only_meta=*/true));
    gguf_free(g);
    test::write_text(dst, test::read_bytes(dst) + test::read_bytes(src).substr(data_offset));
}

// Projectors libmtmd loads but would abort on at the first image (sizes an encode meets),
// or whose images would silently change (a cut file, NaN weights): refused by name before
// any image, by collect, eval and corpus alike (issue 47).
TEST(Media, ProjectorsThatCannotEncodeAreRefusedByName) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    fs::copy_file(test_image, dir / "ok.jpeg");
    test::write_text(dir / "c.jsonl",
                     json{{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "see"}},
                                                                         {{"type", "image"}, {"path", "ok.jpeg"}}}}}}}}.dump() + "\n");
    std::vector<std::pair<fs::path, std::string>> broken;
    for (const auto & [name, key, value] : {std::tuple{"size0.gguf", "clip.vision.image_size", 0u},
                                            {"size1.gguf", "clip.vision.image_size", 1u},
                                            {"patch1000.gguf", "clip.vision.patch_size", 1000u}}) {
        rewrite_projector(vm.mmproj, dir / name, [k = key, v = value](gguf_context * g) { gguf_set_val_u32(g, k, v); });
        broken.emplace_back(dir / name, "aborts loading it as a projector, or encoding a small probe with it");
    }
    const std::string bytes = test::read_bytes(vm.mmproj);
    test::write_text(dir / "cut.gguf", bytes.substr(0, bytes.size() - 100));
    broken.emplace_back(dir / "cut.gguf", "is truncated");
    {
        // Every f32 weight of the projector NaN.
        std::string nan = bytes;
        gguf_context * g = gguf_init_from_file(vm.mmproj.c_str(), {/*no_alloc=*/true, nullptr});
        ASSERT_NE(g, nullptr);
        for (int64_t t = 0; t < gguf_get_n_tensors(g); ++t) {
            if (gguf_get_tensor_type(g, t) == GGML_TYPE_F32) {
                const size_t at = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, t);
                for (size_t b = 0; b + 4 <= gguf_get_tensor_size(g, t); b += 4) {
                    const uint32_t q = 0x7fc00000;
                    std::memcpy(nan.data() + at + b, &q, 4);
                }
            }
        }
        gguf_free(g);
        test::write_text(dir / "nan.gguf", nan);
        broken.emplace_back(dir / "nan.gguf", "into embeddings that are not finite");
    }
    for (const auto & [mmproj, expected] : broken) {
        for (const std::string & command :
             {fmt::format("collect -m {} -f {} -o {} -t 2", vm.model.string(), (dir / "c.jsonl").string(), (dir / "s.json").string()),
              fmt::format("eval -m {} -f {} -c 64 -t 2 --base-out {}", vm.model.string(), (dir / "c.jsonl").string(), (dir / "e.mpkl").string())}) {
            const auto r = test::run_command(moeprune_cmd(command + " --mmproj " + mmproj.string()));
            EXPECT_NE(r.exit_code, 0) << command << "\n" << r.output;
            EXPECT_NE(r.output.find(mmproj.string() + ": "), std::string::npos) << r.output;
            EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
        }
        EXPECT_FALSE(fs::exists(dir / "s.json"));
        EXPECT_FALSE(fs::exists(dir / "e.mpkl"));
    }
}

// Media cut short are refused by file (decoders read what is there as the whole), media a
// corpus names are inputs no output may overwrite, and what a media folder holds besides
// files is named, not dropped silently (issue 47).
TEST(Media, CutMediaAndMediaAsOutputsAreRefusedByName) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    const std::string jpeg = test::read_bytes(test_image);
    const std::string mp3 = test::read_bytes(fs::path(MOEPRUNE_LLAMA_DIR) / "tools" / "mtmd" / "test-2.mp3");
    test::write_text(dir / "cut.jpeg", jpeg.substr(0, 2000));
    test::write_text(dir / "cut.mp3", mp3.substr(0, 500));
    std::string wav = "RIFF" + std::string("\x24\x00\x00\x00", 4) + "WAVEfmt " + std::string("\x10\0\0\0\x01\0\x01\0\x80\x3e\0\0\0\x7d\0\0\x02\0\x10\0", 20) +
                      "data" + std::string("\xf0\xff\xff\xff", 4);
    wav += std::string(100 - wav.size(), '\0');
    test::write_text(dir / "huge.wav", wav);
    fs::copy_file(test_image, dir / "ok.jpeg");
    test::CommandResult r0;
    const auto doc = [](const std::string & path, const std::string & type) {
        return json{{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "see"}}, {{"type", type}, {"path", path}}}}}}}}
                   .dump() + "\n";
    };
    for (const auto & [file, type, kind] : {std::tuple{"cut.jpeg", "image", "a JPEG image that ends early (2000 bytes)"},
                                            {"cut.mp3", "audio", "an MP3 file that ends early (500 bytes)"},
                                            {"huge.wav", "audio", "a WAV file that ends early (100 bytes)"}}) {
        test::write_text(dir / "c.jsonl", doc(file, type));
        const auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(),
                                                                  vm.mmproj.string(), (dir / "c.jsonl").string(), (dir / "s.json").string())));
        EXPECT_NE(r.exit_code, 0) << r.output;
        EXPECT_NE(r.output.find((dir / file).string() + ": is " + kind), std::string::npos) << r.output;
        EXPECT_FALSE(fs::exists(dir / "s.json"));
    }
    // Not media at all: the one error names the file, without libmtmd's decoder chatter.
    test::write_text(dir / "notes.jpeg", "not an image at all");
    test::write_text(dir / "c.jsonl", doc("notes.jpeg", "image"));
    r0 = test::run_command(moeprune_cmd(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(),
                                                    vm.mmproj.string(), (dir / "c.jsonl").string(), (dir / "s.json").string())));
    EXPECT_NE(r0.exit_code, 0);
    EXPECT_EQ(r0.output.find("ffprobe"), std::string::npos) << r0.output;
    EXPECT_EQ(r0.output.rfind("moeprune: error: " + (dir / "notes.jpeg").string() + ": is not an image libmtmd can read", 0), 0u)
        << "the error is not the first line: " << r0.output;
    // The whole image, with bytes after its end as other files carry, is read.
    test::write_text(dir / "tail.jpeg", jpeg + "trailing");
    test::write_text(dir / "c.jsonl", doc("tail.jpeg", "image"));
    auto r = test::run_command(moeprune_cmd(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(),
                                                        vm.mmproj.string(), (dir / "c.jsonl").string(), (dir / "s.json").string())));
    EXPECT_EQ(r.exit_code, 0) << r.output;

    // Outputs onto an image the corpus names: refused, the image as it was.
    test::write_text(dir / "c.jsonl", doc("ok.jpeg", "image"));
    const std::string image = (dir / "ok.jpeg").string();
    for (const std::string & outputs :
         {fmt::format("collect -m {} -f {} -o {}", vm.model.string(), (dir / "c.jsonl").string(), image),
          fmt::format("collect -m {} -f {} -o {} --trace {}", vm.model.string(), (dir / "c.jsonl").string(), (dir / "s2.json").string(), image),
          fmt::format("eval -m {} -f {} --base-out {}", vm.model.string(), (dir / "c.jsonl").string(), image),
          fmt::format("eval -m {} -f {} --base-out {} --json {}", vm.model.string(), (dir / "c.jsonl").string(), (dir / "b.mpkl").string(), image)}) {
        r = test::run_command(moeprune_cmd(outputs + " --mmproj " + vm.mmproj.string() + " -t 2"));
        EXPECT_NE(r.exit_code, 0) << outputs << "\n" << r.output;
        EXPECT_NE(r.output.find("refusing to overwrite the input"), std::string::npos) << r.output;
        EXPECT_EQ(test::read_bytes(dir / "ok.jpeg"), jpeg) << outputs;
    }

    // A media folder holding a link to /dev/zero and a FIFO: named, and left out.
    fs::create_directories(dir / "photos");
    fs::copy_file(test_image, dir / "photos" / "a.jpeg");
    fs::create_symlink("/dev/zero", dir / "photos" / "zero.jpg");
    ASSERT_EQ(::mkfifo((dir / "photos" / "pipe.jpg").c_str(), 0600), 0);
    test::write_text(dir / "corpus.toml", "[corpus]\nseed = 3\neval_share = 0.5\n[[source]]\npath = \"photos\"\ndomain = \"photos\"\nmedia = \"image\"\n");
    r = test::run_command(moeprune_cmd(fmt::format("corpus -m {} --mmproj {} --manifest {} -o {} --allow-shortfall", vm.model.string(),
                                                   vm.mmproj.string(), (dir / "corpus.toml").string(), (dir / "out").string())));
    for (const char * name : {"zero.jpg", "pipe.jpg"}) {
        EXPECT_NE(r.output.find("skipped " + (dir / "photos" / name).string() + ": not a regular file"), std::string::npos) << r.output;
    }
}

// A corpus manifest's media source: every image of a folder is one conversation (the
// source's prompt and the image, the caption beside it as the answer), budgeted in the
// rows libmtmd makes of it, split by group like text, and written with absolute paths
// that collect then reads, decoding exactly the tokens corpus counted.
TEST(Media, CorpusMediaSourceFlowsIntoCollect) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    fs::create_directories(dir / "photos");
    fs::create_directories(dir / "prose");
    const std::string jpeg = test::read_bytes(test_image);
    for (int i = 0; i < 6; ++i) {
        // Bytes after a JPEG's end marker are ignored by decoders: six distinct files of one image.
        test::write_text(dir / "photos" / fmt::format("p{}.jpeg", i), jpeg + std::string(size_t(i + 1), char('a' + i)));
        test::write_text(dir / "prose" / fmt::format("t{}.txt", i),
                         fmt::format("Document {} is about rivers, gardens and the weather in spring number {}.", i, i * 7));
    }
    test::write_text(dir / "photos" / "p0.txt", "A photograph of a scene.");
    test::write_text(dir / "photos" / "notes.md", "not an image");
    test::write_text(dir / "corpus.toml", "[corpus]\nseed = 3\neval_share = 0.34\n\n"
                                          "[[source]]\npath = \"photos\"\ndomain = \"photos\"\nmedia = \"image\"\n"
                                          "prompt = \"What do you see?\"\n\n"
                                          "[[source]]\npath = \"prose\"\ndomain = \"prose\"\ntokens = 40\n");
    const auto run = [](const std::string & args) { return test::run_command(moeprune_cmd(args)); };

    auto r = run(fmt::format("corpus -m {} --manifest {} -o {}", vm.model.string(), (dir / "corpus.toml").string(),
                             (dir / "bare").string()));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("source \"photos\" is image files: give the model's projector with --mmproj FILE"),
              std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "bare" / "calib.jsonl"));

    // Small sources miss their proportional budgets by a document; that is not under test.
    r = run(fmt::format("corpus -m {} --mmproj {} --manifest {} -o {} --allow-shortfall", vm.model.string(), vm.mmproj.string(),
                        (dir / "corpus.toml").string(), (dir / "out").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("skipped 1 file(s) that are not image files: " + (dir / "photos" / "notes.md").string()),
              std::string::npos) << r.output;
    const json report = json::parse(test::read_bytes(dir / "out" / "corpus.json"));
    EXPECT_EQ(report["inputs"]["mmproj"], vm.mmproj.string());
    std::map<std::string, int> side_of_image;
    bool captioned = false;
    for (const char * side : {"calib", "eval"}) {
        const std::string lines = test::read_bytes(dir / "out" / (std::string(side) + ".jsonl"));
        for (size_t at = 0, end; at < lines.size(); at = end + 1) {
            end = lines.find('\n', at);
            const json doc = json::parse(lines.substr(at, end - at));
            if (doc["domain"] != "photos") continue;
            const json & parts = doc["messages"][0]["content"];
            ASSERT_EQ(parts.size(), 2u) << doc.dump();
            EXPECT_EQ(parts[0]["type"], "image");
            const fs::path image = parts[0]["path"].get<std::string>();
            EXPECT_TRUE(image.is_absolute() && fs::exists(image)) << image;
            EXPECT_EQ(parts[1]["text"], "\nWhat do you see?");
            EXPECT_EQ(side_of_image.count(image.filename().string()), 0u) << "each image once";
            side_of_image[image.filename().string()] = std::string(side) == "calib" ? 0 : 1;
            if (image.filename() == "p0.jpeg") {
                ASSERT_EQ(doc["messages"].size(), 2u);
                EXPECT_EQ(doc["messages"][1]["content"], "A photograph of a scene.");
                captioned = true;
            }
        }
    }
    EXPECT_EQ(side_of_image.size(), 6u) << "every image, none dropped as a duplicate of another";
    EXPECT_TRUE(captioned);
    int on_eval = 0;
    for (const auto & [name, side] : side_of_image) on_eval += side;
    EXPECT_EQ(on_eval, 2) << "round(0.34 x 6) image groups held out";

    // collect decodes what corpus counted: 16 embeddings per image and the text around them.
    r = run(fmt::format("collect -m {} --mmproj {} -f {} -o {} -t 2", vm.model.string(), vm.mmproj.string(),
                        (dir / "out" / "calib.jsonl").string(), (dir / "stats.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json stats = json::parse(test::read_bytes(dir / "stats.json"));
    EXPECT_EQ(stats["n_tokens"].get<uint64_t>(), report["outputs"]["calib"]["tokens"].get<uint64_t>());
    EXPECT_EQ(stats["domains"]["image"]["n_tokens"].get<uint64_t>(), 16u * 4u) << "four calib images of 16 rows";
}

// run with --mmproj: a media source flows through corpus, collect, select and eval, and
// the report's quality section has a row per keep map with its KLD on text and on the
// text after images. Without images the same run warns in the report, naming what
// select warned about.
TEST(Media, RunCarriesImagesToTheReportsModalityRows) {
    const VisionModel & vm = vision_model();
    test::TempDir dir;
    fs::create_directories(dir / "photos");
    fs::create_directories(dir / "prose");
    const std::string jpeg = test::read_bytes(test_image);
    static const char * words[] = {"garden", "river", "stone", "cloud", "window", "bread", "music", "paper", "light"};
    for (int i = 0; i < 8; ++i) {
        test::write_text(dir / "photos" / fmt::format("p{}.jpeg", i), jpeg + std::string(size_t(i + 1), char('a' + i)));
        std::string text;
        for (int w = 0; w < 120; ++w) text += std::string(words[(w * 7 + i * 5 + w * w * i) % 9]) + " ";
        test::write_text(dir / "prose" / fmt::format("t{}.txt", i), text);
    }
    const std::string text_source = "[[source]]\npath = \"prose\"\ndomain = \"prose\"\n";
    test::write_text(dir / "corpus.toml", "[corpus]\nseed = 1\neval_share = 0.34\n\n[[source]]\npath = \"photos\"\n"
                                          "domain = \"photos\"\nmedia = \"image\"\n\n" + text_source);
    test::write_text(dir / "text.toml", "[corpus]\nseed = 1\neval_share = 0.34\n\n" + text_source);
    const auto run = [&](const std::string & manifest, const std::string & out) {
        return test::run_command(moeprune_cmd(fmt::format(
            "run -m {} --mmproj {} --corpus {} -k 6 --criteria domain-max,freq --ram 4GB --reserve 0 --compute-ms 5 "
            "--policies lru -c 256 -t 2 -o {}", vm.model.string(), vm.mmproj.string(), (dir / manifest).string(),
            (dir / out).string())));
    };
    auto r = run("corpus.toml", "media-run");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json report = json::parse(test::read_bytes(dir / "media-run" / "report.json"));
    EXPECT_TRUE(report["warnings"].empty()) << report["warnings"];
    std::map<std::string, std::map<std::string, json>> by_map;
    for (const json & row : report["modalities"]) by_map[row["map"].get<std::string>()][row["modality"].get<std::string>()] = row;
    ASSERT_EQ(by_map.size(), 2u);
    for (const auto & [map, rows] : by_map) {
        ASSERT_TRUE(rows.count("text") && rows.count("image")) << map;
        EXPECT_EQ(rows.at("image").at("tokens").get<int64_t>() > 0, true) << map;
        EXPECT_EQ(rows.at("text").at("tokens").get<int64_t>() > 0, true) << map;
    }
    const json eval = json::parse(test::read_bytes(dir / "media-run" / "eval" / "eval.json"));
    EXPECT_EQ(eval["inputs"]["mmproj"], vm.mmproj.string());
    for (const json & c : eval["candidates"]) {
        const std::string map = fs::path(c["source"].get<std::string>()).stem().string();
        EXPECT_EQ(c["modalities"]["image"]["kld_mean"], by_map[map]["image"]["kld_mean"]) << "the report's row is eval's";
    }
    const std::string html = test::read_bytes(dir / "media-run" / "report.html");
    EXPECT_NE(html.find("<th>keep map</th><th>text</th><th>image</th>"), std::string::npos);
    EXPECT_NE(test::read_bytes(dir / "media-run" / "report" / "modality.csv").find("domain-max-k6,domain-max,6,image,"),
              std::string::npos);

    r = run("text.toml", "text-run");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json text_report = json::parse(test::read_bytes(dir / "text-run" / "report.json"));
    ASSERT_EQ(text_report["warnings"].size(), 1u);
    EXPECT_NE(text_report["warnings"][0].get<std::string>().find("multimodal"), std::string::npos) << text_report["warnings"];
    EXPECT_TRUE(text_report["modalities"].is_null());
    const std::string text_html = test::read_bytes(dir / "text-run" / "report.html");
    EXPECT_NE(text_html.find("<p class=\"warning\"><b>WARNING:</b>"), std::string::npos);
    EXPECT_NE(text_html.find("no images or audio: every KLD here is on text"), std::string::npos);
}

// Audio takes the same path as images: libmtmd's Whisper encoder (qwen2a) in synth's
// projector turns test-2.mp3 into rows that only the planted audio experts are chosen by;
// collect counts them under the domain "audio", select names exactly those experts, and
// eval scores the text after the audio under "audio".
TEST(Media, AudioReachesOnlyThePlantedAudioExperts) {
    const VisionModel om(/*audio_experts=*/2);
    test::TempDir dir;
    fs::copy_file(fs::path(MOEPRUNE_LLAMA_DIR) / "tools" / "mtmd" / "test-2.mp3", dir / "speech.mp3");
    fs::copy_file(test_image, dir / "picture.jpeg");
    const auto conversation = [](const char * type, const char * path, const char * question) {
        return json{{"messages",
                     {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", question}}, {{"type", type}, {"path", path}}}}},
                      {{"role", "assistant"}, {"content", "It is about the weather."}}}}}
                   .dump() +
               "\n";
    };
    test::write_text(dir / "corpus.jsonl", conversation("audio", "speech.mp3", "What is said here?") +
                                               conversation("image", "picture.jpeg", "What is in this picture?") +
                                               json{{"text", "Plain text about rivers and gardens."}}.dump() + "\n");
    const auto run = [](const std::string & args) { return test::run_command(moeprune_cmd(args)); };
    auto r = run(fmt::format("collect -m {} --mmproj {} -f {} -o {} -c 1024 -t 2", om.model.string(), om.mmproj.string(),
                             (dir / "corpus.jsonl").string(), (dir / "stats.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json stats = json::parse(test::read_bytes(dir / "stats.json"));
    const uint64_t audio_rows = stats["domains"]["audio"]["n_tokens"].get<uint64_t>();
    EXPECT_EQ(audio_rows, 750u) << "one 30-second chunk: 3000 mel frames, halved by the convolution and the pooling";
    EXPECT_EQ(stats["domains"]["image"]["n_tokens"].get<uint64_t>(), 16u);
    for (int layer = 0; layer < 4; ++layer) {
        const json & l = stats["layers"][size_t(layer)];
        const json & audio_layer = stats["domains"]["audio"]["layers"][size_t(layer)];
        for (int e : om.planted("audio", layer)) {
            EXPECT_EQ(l["count"][size_t(e)].get<uint64_t>(), audio_rows) << "audio expert " << e << " layer " << layer;
            EXPECT_EQ(audio_layer["count"][size_t(e)].get<uint64_t>(), audio_rows);
        }
        for (int e : om.planted("image", layer)) {
            EXPECT_EQ(audio_layer["count"][size_t(e)].get<uint64_t>(), 0u) << "image expert " << e << " chosen by audio";
        }
    }
    r = run(fmt::format("select --stats {} -k 8 --metric domain-max -o {} --json {}", (dir / "stats.json").string(),
                        (dir / "maps").string(), (dir / "select.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json sel = json::parse(test::read_bytes(dir / "select.json"));
    const json dmax = json::parse(test::read_bytes(dir / "maps" / "domain-max-k8.json"));
    for (int layer = 0; layer < 4; ++layer) {
        EXPECT_EQ(sel["media_experts"]["audio"][std::to_string(layer)].get<std::set<int>>(), om.planted("audio", layer));
        const auto kept = dmax["layers"][std::to_string(layer)].get<std::set<int>>();
        for (int e : om.planted("audio", layer)) EXPECT_TRUE(kept.count(e)) << "audio expert " << e << " layer " << layer;
    }
    r = run(fmt::format("eval -m {} --mmproj {} -f {} -c 1024 -t 2 --keep {} --json {}", om.model.string(),
                        om.mmproj.string(), (dir / "corpus.jsonl").string(), (dir / "maps" / "domain-max-k8.json").string(),
                        (dir / "eval.json").string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json ev = json::parse(test::read_bytes(dir / "eval.json"));
    EXPECT_GT(ev["candidates"][0]["modalities"]["audio"]["tokens"].get<int64_t>(), 0);
    EXPECT_GT(ev["candidates"][0]["modalities"]["text"]["tokens"].get<int64_t>(), 0);
}
