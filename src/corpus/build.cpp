#include "corpus/build.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "model/model_file.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "corpus/dedupe.h"
#include "corpus/sources.h"
#include "engine/media.h"
#include "engine/session.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <random>
#include <unordered_map>
#include <unordered_set>

namespace moeprune {

using nlohmann::json;

namespace {

constexpr int kCalib = 0, kEval = 1;
constexpr const char * kSideName[2] = {"calib", "eval"};
constexpr size_t kExamples = 5;
constexpr double kPrefixes[] = {0.10, 0.25, 0.50, 1.00};

struct Doc {
    SourceDocument d;
    bool dropped = false;
    size_t boiler_skip = 0;  // bytes of the body that are reported boilerplate
    int side = kCalib;
};

// The part of a document boilerplate lives in: a text, or a conversation's first message.
std::string & body(SourceDocument & d) {
    return d.messages.empty() ? d.text : d.messages.front().content;
}

// What deduplication and the leak check compare. A document with media is its media
// files' digests and the answers: the user's words beside a file are mostly a prompt
// every document of a media source shares.
std::string content_text(const SourceDocument & d) {
    if (d.messages.empty()) {
        return d.text;
    }
    std::string s = d.media_key.empty() ? "" : d.media_key + "\n";
    for (const CorpusMessage & m : d.messages) {
        if (!d.media_key.empty() && m.role == "user") {
            continue;
        }
        s += m.content;
        s += '\n';
    }
    return s;
}

std::string label(const std::vector<SourceFile> & files, const SourceDocument & d) {
    const std::string f = files[d.file].path.string();
    return d.line ? fmt::format("{}:{}", f, d.line) : f;
}

// A unit of output: one document or one piece of one, with its exact token count.
struct Unit {
    size_t doc;
    std::string text;
    std::vector<CorpusMessage> messages;
    uint64_t tokens = 0;
    bool truncated = false;
    bool piece = false;
};

// Snaps a byte offset of UTF-8 text back to the start of a code point.
size_t char_start(const std::string & s, size_t at) {
    while (at > 0 && at < s.size() && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) {
        --at;
    }
    return at;
}

class Tokenizer {
public:
    Tokenizer(const llama_model * model, uint32_t limit, const MediaEncoder * media)
        : model_(model), vocab_(llama_model_get_vocab(model)), limit_(limit), media_(media) {}

    uint64_t count(const std::string & text, const std::string & where) const {
        return tokenize(vocab_, text, true, where).size();
    }

    // Whether a prompt already holds the model's chat template: it has control tokens.
    bool templated(const std::string & prompt) const {
        std::vector<llama_token> t(prompt.size() + 8);
        const int n = llama_tokenize(vocab_, prompt.data(), int32_t(prompt.size()), t.data(), int32_t(t.size()), false, true);
        for (int i = 0; i < n; ++i) {
            if (llama_vocab_get_attr(vocab_, t[size_t(i)]) & LLAMA_TOKEN_ATTR_CONTROL) {
                return true;
            }
        }
        return false;
    }

    // With media, the rows collect decodes: libmtmd's text tokens and media embeddings.
    uint64_t count_chat(const std::vector<CorpusMessage> & msgs, const std::string & where) const {
        CorpusDocument c;
        c.messages = msgs;
        const std::string text = render_chat(model_, c, false, where);
        const std::vector<CorpusMedia> media = media_of(msgs);
        if (media.empty()) {
            return count(text, where);
        }
        if (!media_) {
            fail_file(where, fmt::format("has an {} ({}): give the model's projector with --mmproj FILE, so its tokens "
                                         "are counted as libmtmd counts them", modality_name(media[0].modality),
                                         media[0].path.string()));
        }
        std::lock_guard<std::mutex> lock(media_mutex_);  // one libmtmd context for the tokenizing threads
        return media_->tokenize(text, media, true, where).tokens.size();
    }

    // The units one document becomes under the limit.
    std::vector<Unit> units(size_t index, const SourceDocument & src, Truncate rule, const std::string & where) const {
        SourceDocument d = src;
        if (d.prompt_response && templated(d.messages[0].content)) {
            d.text = d.messages[0].content + d.messages[1].content;  // used as it is: never wrapped twice
            d.messages.clear();
        }
        const bool chat = !d.messages.empty() || src.prompt_response;
        if (rule == Truncate::Auto) {
            rule = chat ? Truncate::Left : Truncate::Pieces;
        }
        Unit u{index, d.text, d.messages, 0, false, false};
        u.tokens = d.messages.empty() ? count(d.text, where) : count_chat(d.messages, where);
        if (u.tokens <= limit_) {
            return {std::move(u)};
        }
        if (!d.media_key.empty()) {
            fail_file(where, fmt::format("takes {} tokens with its media as libmtmd counts them, over doc_tokens {}: a "
                                         "document with media is never cut, so raise doc_tokens", u.tokens, limit_));
        }
        if (!d.messages.empty()) {
            return rule == Truncate::Left ? std::vector<Unit>{chat_tail(index, d.messages, where)}
                                          : chat_pieces(index, d.messages, where);
        }
        return rule == Truncate::Left ? std::vector<Unit>{text_tail(index, d.text, u.tokens, where)}
                                      : text_pieces(index, d.text, u.tokens, where);
    }

private:
    // The longest end of `text` (starting at a line, word or character boundary) within the limit.
    Unit text_tail(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const {
        double keep = 0.95 * double(limit_) / double(tokens);
        for (;;) {
            size_t at = char_start(text, text.size() - size_t(keep * double(text.size())));
            const size_t line = text.find('\n', at);
            if (line != std::string::npos && line + 1 < text.size() && line - at < 200) {
                at = line + 1;
            }
            Unit u{index, text.substr(at), {}, 0, true, false};
            u.tokens = count(u.text, where);
            if (u.tokens <= limit_ || u.text.size() <= 1) {
                return u;
            }
            keep *= 0.85;
        }
    }

    // Consecutive pieces within the limit, cut at line ends where possible.
    std::vector<Unit> text_pieces(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const {
        std::vector<Unit> out;
        const double bytes_per_token = double(text.size()) / double(tokens);
        size_t pos = 0;
        while (pos < text.size()) {
            double want = 0.95 * double(limit_) * bytes_per_token;
            for (;;) {
                size_t end = std::min(text.size(), pos + std::max<size_t>(1, size_t(want)));
                if (end < text.size()) {
                    const size_t line = text.rfind('\n', end - 1);
                    const size_t space = text.find_last_of(" \t", end - 1);
                    if (line != std::string::npos && line > pos && line + 1 - pos > (end - pos) / 2) {
                        end = line + 1;
                    } else if (space != std::string::npos && space > pos && space + 1 - pos > (end - pos) / 2) {
                        end = space + 1;
                    } else {
                        end = std::max(pos + 1, char_start(text, end));
                    }
                }
                Unit u{index, text.substr(pos, end - pos), {}, 0, false, true};
                u.tokens = count(u.text, where);
                if (u.tokens <= limit_ || end - pos <= 4) {
                    pos = end;
                    if (u.text.find_first_not_of(" \t\r\n") != std::string::npos) {
                        out.push_back(std::move(u));
                    }
                    break;
                }
                want *= 0.85;
            }
        }
        return out;
    }

    // Drops the fewest leading messages that brings the conversation within the limit; a
    // last message still too long keeps its end.
    Unit chat_tail(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const {
        size_t lo = std::min<size_t>(1, msgs.size() - 1), hi = msgs.size() - 1;  // drops that many, in [lo, hi]
        while (lo < hi) {
            const size_t mid = (lo + hi) / 2;
            if (count_chat({msgs.begin() + long(mid), msgs.end()}, where) <= limit_) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Unit u{index, {}, {msgs.begin() + long(lo), msgs.end()}, 0, true, false};
        u.tokens = count_chat(u.messages, where);
        double keep = 0.9;
        while (u.tokens > limit_ && u.messages.back().content.size() > 1) {
            std::string & c = u.messages.back().content;
            c = c.substr(char_start(c, c.size() - size_t(keep * double(c.size()))));
            u.tokens = count_chat(u.messages, where);
            keep = 0.85;
        }
        return u;
    }

    std::vector<Unit> chat_pieces(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const {
        std::vector<Unit> out;
        size_t start = 0;
        while (start < msgs.size()) {
            size_t end = start + 1;
            while (end < msgs.size() && count_chat({msgs.begin() + long(start), msgs.begin() + long(end + 1)}, where) <= limit_) {
                ++end;
            }
            std::vector<CorpusMessage> part(msgs.begin() + long(start), msgs.begin() + long(end));
            Unit u = count_chat(part, where) <= limit_ ? Unit{index, {}, part, count_chat(part, where), false, true}
                                                       : chat_tail(index, part, where);
            u.piece = true;
            out.push_back(std::move(u));
            start = end;
        }
        return out;
    }

    const llama_model * model_;
    const llama_vocab * vocab_;
    uint64_t limit_;
    const MediaEncoder * media_;
    mutable std::mutex media_mutex_;
};

double group_draw(uint64_t seed, const std::string & group) {
    return double(XXH64(group.data(), group.size(), seed) >> 11) * 0x1.0p-53;
}

// The side of every group of the sources split by group, stratified per source: its
// groups in a seeded random order, the first round(eval_share x groups) to eval, at least
// one when it has two groups or more and an eval share, never all of them. A group an
// earlier source already placed (sources may share group keys) keeps its side and counts.
std::unordered_map<std::string, int> split_groups(const std::vector<SourceSpec> & specs, const std::vector<Doc> & docs,
                                                  const CorpusSpec & spec) {
    std::unordered_map<std::string, int> side;
    for (size_t s = 0; s < specs.size(); ++s) {
        if (specs[s].split != SplitSide::Both) {
            continue;
        }
        std::vector<std::string> mine;
        std::unordered_set<std::string> seen;
        for (const Doc & d : docs) {
            if (!d.dropped && d.d.source == s && seen.insert(d.d.group).second) {
                mine.push_back(d.d.group);
            }
        }
        const size_t n = mine.size();
        const bool wants_eval = spec.eval_share > 0 || specs[s].eval_tokens.value_or(0) > 0;
        size_t want = size_t(std::llround(spec.eval_share * double(n)));
        if (wants_eval && n >= 2) {
            want = std::clamp<size_t>(want, 1, n - 1);
        }
        std::vector<std::string> open;
        for (const std::string & g : mine) {
            if (auto it = side.find(g); it != side.end()) {
                want -= want > 0 && it->second == kEval ? 1 : 0;
            } else {
                open.push_back(g);
            }
        }
        std::sort(open.begin(), open.end(), [&](const std::string & a, const std::string & b) {
            const double da = group_draw(spec.seed, a), db = group_draw(spec.seed, b);
            return da != db ? da < db : a < b;
        });
        for (size_t i = 0; i < open.size(); ++i) {
            side[open[i]] = i < want ? kEval : kCalib;
        }
    }
    return side;
}

// A side nothing was written to is an error unless the sources ask for it to be empty
// (no source can give eval documents when the eval share is 0 and none is split "eval";
// every source split "eval" leaves calib empty): collect or eval would read an empty file.
void refuse_empty_sides(const std::vector<SourceSpec> & specs, const CorpusSpec & spec,
                        const std::vector<std::array<uint64_t, 2>> & taken_tokens, const std::vector<uint64_t> & read_docs,
                        const std::vector<uint64_t> & exact_dropped, const std::vector<uint64_t> & near_dropped,
                        const std::vector<uint64_t> & boiler_only,
                        const std::vector<std::array<std::set<std::string>, 2>> & groups,
                        const std::vector<std::array<uint64_t, 2>> & budget) {
    for (int side : {kCalib, kEval}) {
        bool asked = false;
        uint64_t tokens = 0;
        for (size_t s = 0; s < specs.size(); ++s) {
            const SourceSpec & src = specs[s];
            asked = asked || (side == kCalib ? src.split != SplitSide::Eval
                                             : src.split == SplitSide::Eval ||
                                                   (src.split == SplitSide::Both && (spec.eval_share > 0 || src.eval_tokens.value_or(0) > 0)));
            tokens += taken_tokens[s][size_t(side)];
        }
        if (!asked || tokens > 0) {
            continue;
        }
        std::string msg = fmt::format("the {} side would be empty:", kSideName[side]);
        for (size_t s = 0; s < specs.size(); ++s) {
            const SourceSpec & src = specs[s];
            if (side == kCalib ? src.split == SplitSide::Eval : src.split == SplitSide::Calib) {
                continue;
            }
            const uint64_t kept = read_docs[s] - exact_dropped[s] - near_dropped[s] - boiler_only[s];
            msg += fmt::format("\n  source \"{}\": {} documents read, {} exact and {} near duplicates dropped, {} only "
                               "boilerplate; {} groups on this side, a budget of {} tokens",
                               src.name, read_docs[s], exact_dropped[s], near_dropped[s], boiler_only[s],
                               groups[s][size_t(side)].size(),
                               budget[s][size_t(side)] == std::numeric_limits<uint64_t>::max() ? std::string("all")
                                                                                              : std::to_string(budget[s][size_t(side)]));
            if (kept == 0 && read_docs[s] > 0) {
                msg += " (every document is a duplicate of another source's or only boilerplate)";
            } else if (side == kEval && groups[s][kCalib].size() + groups[s][kEval].size() == 1) {
                msg += " (one group: it cannot be on both sides)";
            }
        }
        throw Error(msg + (side == kEval ? "\n(--eval-share 0 asks for no eval side)" : ""));
    }
}

json doc_ref(const std::vector<SourceFile> & files, const std::vector<SourceSpec> & specs, const SourceDocument & d) {
    return {{"source", specs[d.source].name}, {"at", label(files, d)}};
}

namespace fs = std::filesystem;

// The budget of a source that takes everything it has.
constexpr uint64_t kAll = std::numeric_limits<uint64_t>::max();

// What the phases of build_corpus share; each group of members is filled by the phases its comment names.
struct CorpusBuild {
    CorpusBuild(const CorpusOptions & options, std::vector<SourceSpec> sources)
        : opt(options), spec(options.spec), specs(std::move(sources)), paths(specs.size()),
          empty_skipped(specs.size(), 0), read_docs(specs.size(), 0), binary_skipped(specs.size()),
          not_media_skipped(specs.size()),
          exact_dropped(specs.size(), 0), near_dropped(specs.size(), 0), boiler_only(specs.size(), 0),
          order(specs.size()), groups(specs.size()), budget(specs.size(), {0, 0}), taken(specs.size()),
          next_doc(specs.size(), {0, 0}), taken_tokens(specs.size(), {0, 0}), spare(specs.size()) {}

    const CorpusOptions & opt;
    const CorpusSpec & spec;
    const std::vector<SourceSpec> specs;

    // prepare_files
    std::vector<std::vector<fs::path>> paths;
    uint64_t total_bytes = 0;
    fs::path calib_path, eval_path, report_path;
    std::string model_identity;

    // read_sources
    std::vector<std::pair<uint32_t, fs::path>> jobs;
    std::vector<SourceFile> files;  // in the order of the reading jobs
    std::vector<Doc> docs;
    std::vector<uint64_t> empty_skipped, read_docs;
    std::vector<std::vector<std::string>> binary_skipped;
    std::vector<std::vector<std::string>> not_media_skipped;

    // drop_exact_duplicates, mark_boilerplate, drop_near_duplicates
    std::vector<uint64_t> exact_dropped, near_dropped, boiler_only;
    json dedupe_examples = json::array();
    json boilerplate = json::array();

    // split_sides
    std::vector<std::array<std::vector<size_t>, 2>> order;
    std::vector<std::array<std::set<std::string>, 2>> groups;

    // plan_budgets, take_budgets, check_shortfalls
    std::vector<std::array<uint64_t, 2>> budget;
    std::vector<std::array<std::vector<Unit>, 2>> taken;
    std::vector<std::array<size_t, 2>> next_doc;
    std::vector<std::array<uint64_t, 2>> taken_tokens;
    std::vector<std::array<std::vector<Unit>, 2>> spare;  // pieces past the budget
    uint64_t tokenized_bytes = 0;
    std::vector<std::string> shortfalls;

    // interleave
    std::array<std::vector<const Unit *>, 2> sequence;
    std::array<uint64_t, 2> side_tokens{0, 0};

    // report_domains
    json domain_report = json::array();
    json prefix_report = json::object();

    // stage_jsonl, commit_outputs
    std::array<json, 2> output_report;
    std::vector<std::unique_ptr<AtomicOutput>> staged;
};

// The sources with their key roots, and the settings checked before anything is read.
std::vector<SourceSpec> checked_sources(const CorpusSpec & spec, bool has_projector) {
    std::vector<SourceSpec> specs = spec.sources;
    for (SourceSpec & s : specs) {
        s.key_root = source_key_root(s, spec.base_dir);
    }
    if (specs.empty()) {
        throw Error("no sources: give --manifest or --source DOMAIN=PATH");
    }
    std::set<std::string> names;
    for (const SourceSpec & s : specs) {
        if (!names.insert(s.name).second) {
            throw Error(fmt::format("two sources are named \"{}\"", s.name));
        }
    }
    for (const SourceSpec & s : specs) {
        if (s.media != Modality::Text && !has_projector) {
            throw Error(fmt::format("source \"{}\" is {} files: give the model's projector with --mmproj FILE, so "
                                    "their tokens are counted as libmtmd counts them", s.name, modality_name(s.media)));
        }
    }
    if (!(spec.near_dup > 0 && spec.near_dup <= 1) || !(spec.eval_share >= 0 && spec.eval_share < 1)) {
        throw Error("--near-dup must be in (0, 1] and --eval-share in [0, 1)");
    }
    return specs;
}

// Inputs, and the check that no output is one of them.
void prepare_files(CorpusBuild & b) {
    const CorpusOptions & opt = b.opt;
    std::vector<fs::path> inputs{opt.model};
    if (!opt.mmproj.empty()) {
        inputs.push_back(opt.mmproj);
    }
    if (!b.spec.manifest.empty()) {
        inputs.push_back(b.spec.manifest);
    }
    for (size_t s = 0; s < b.specs.size(); ++s) {
        b.paths[s] = expand_source_path(b.specs[s], b.spec.base_dir);
        for (const fs::path & p : b.paths[s]) {
            inputs.push_back(p);
            std::error_code ec;
            b.total_bytes += fs::file_size(p, ec);
        }
    }
    b.calib_path = opt.out_dir / "calib.jsonl";
    b.eval_path = opt.out_dir / "eval.jsonl";
    b.report_path = opt.out_dir / "corpus.json";
    std::vector<fs::path> outputs{b.calib_path, b.eval_path, b.report_path};
    if (!opt.report.empty()) {
        outputs.push_back(opt.report);
    }
    refuse_output_clashes(outputs, inputs);
    create_output_dir(opt.out_dir);
    // A FIFO or device is refused by name here: llama.cpp would block reading it.
    b.model_identity = model_digest(GgufModel::open(opt.model).shard_paths());
}

// The files of a source that were skipped for not being `what`: the first five, then how many more.
void print_skipped(const SourceSpec & src, const std::vector<std::string> & skipped, const std::string & what) {
    if (skipped.empty()) {
        return;
    }
    const size_t shown = std::min<size_t>(skipped.size(), 5);
    std::fprintf(stderr, "moeprune corpus: source \"%s\": skipped %zu file(s) that are not %s: %s%s\n", src.name.c_str(),
                 skipped.size(), what.c_str(), fmt::format("{}", fmt::join(skipped.begin(), skipped.begin() + long(shown), ", ")).c_str(),
                 skipped.size() > shown ? fmt::format(" and {} more (corpus.json lists them)", skipped.size() - shown).c_str() : "");
}

// Read every file, in parallel, keeping the sources' order.
void read_sources(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::pair<uint32_t, fs::path>> & jobs = b.jobs;
    for (size_t s = 0; s < specs.size(); ++s) {
        for (const fs::path & p : b.paths[s]) {
            jobs.emplace_back(uint32_t(s), p);
        }
    }
    std::vector<SourceFiles> read(jobs.size());
    {
        Progress progress("reading", b.total_bytes, "MiB", 1.0 / 1048576);
        std::mutex m;
        run_parallel(jobs.size(), b.opt.threads, [&](size_t i) {
            const SourceSpec & src = specs[jobs[i].first];
            const bool named = fs::path(src.path) == jobs[i].second || b.spec.base_dir / src.path == jobs[i].second;
            read_source_file(src, jobs[i].first, jobs[i].second, !named, read[i]);
            std::lock_guard<std::mutex> lock(m);
            progress.advance(read[i].files[0].bytes);
        });
        progress.finish();
    }
    for (size_t i = 0; i < read.size(); ++i) {
        const uint32_t offset = uint32_t(b.files.size());
        b.files.push_back(read[i].files[0]);
        b.empty_skipped[jobs[i].first] += read[i].empty_skipped;
        for (std::string & skipped : read[i].binary_skipped) {
            b.binary_skipped[jobs[i].first].push_back(std::move(skipped));
        }
        for (std::string & skipped : read[i].not_media_skipped) {
            b.not_media_skipped[jobs[i].first].push_back(std::move(skipped));
        }
        for (SourceDocument & d : read[i].documents) {
            d.file += offset;
            ++b.read_docs[d.source];
            b.docs.push_back({std::move(d), false, 0, kCalib});
        }
        read[i] = {};
    }

    for (size_t s = 0; s < specs.size(); ++s) {
        print_skipped(specs[s], b.binary_skipped[s], "UTF-8 text");
        print_skipped(specs[s], b.not_media_skipped[s], fmt::format("{} files", modality_name(specs[s].media)));
    }
}

// Exact duplicates, across sources, the first kept.
void drop_exact_duplicates(CorpusBuild & b) {
    std::vector<Doc> & docs = b.docs;
    std::vector<std::string> digests(docs.size());
    run_parallel(docs.size(), b.opt.threads,
                 [&](size_t i) { digests[i] = normalized_digest(content_text(docs[i].d)); });
    std::unordered_map<std::string, size_t> first;
    for (size_t i = 0; i < docs.size(); ++i) {
        auto [it, fresh] = first.emplace(digests[i], i);
        if (!fresh) {
            docs[i].dropped = true;
            ++b.exact_dropped[docs[i].d.source];
            if (b.dedupe_examples.size() < kExamples) {
                b.dedupe_examples.push_back({{"kind", "exact"},
                                             {"kept", doc_ref(b.files, b.specs, docs[it->second].d)},
                                             {"dropped", doc_ref(b.files, b.specs, docs[i].d)}});
            }
        }
    }
}

// Boilerplate, per source; never compared, and with --strip-boilerplate kept once.
void mark_boilerplate(CorpusBuild & b) {
    std::vector<Doc> & docs = b.docs;
    const bool strip = b.spec.strip_boilerplate;
    for (size_t s = 0; s < b.specs.size(); ++s) {
        std::vector<size_t> ids;
        std::vector<std::string_view> bodies;
        for (size_t i = 0; i < docs.size(); ++i) {
            if (docs[i].d.source == s && !docs[i].dropped && docs[i].d.media_key.empty()) {
                ids.push_back(i);
                bodies.push_back(body(docs[i].d));
            }
        }
        // Shared by one document in a hundred at least: a prefix a few near copies share
        // is theirs, not boilerplate.
        const size_t min_documents = std::max<size_t>(3, (bodies.size() + 99) / 100);
        for (const Boilerplate & found : find_boilerplate(bodies, 256, min_documents)) {
            const std::string & prefix = found.prefix;
            uint64_t bytes = 0;
            for (const size_t m : found.members) {
                Doc & d = docs[ids[m]];
                bytes += content_text(d.d).size();
                d.boiler_skip = prefix.size();
            }
            b.boilerplate.push_back({{"source", b.specs[s].name},
                                     {"chars", prefix.size()},
                                     {"documents", found.members.size()},
                                     {"share_of_their_bytes",
                                      double(prefix.size() * found.members.size()) / double(bytes)},
                                     {"begins", prefix.substr(0, char_start(prefix, std::min<size_t>(80, prefix.size())))},
                                     {"stripped", strip}});
            if (strip) {
                for (size_t k = 1; k < found.members.size(); ++k) {
                    Doc & d = docs[ids[found.members[k]]];
                    body(d.d).erase(0, prefix.size());
                    d.boiler_skip = 0;
                    if (content_text(d.d).find_first_not_of(" \t\r\n") == std::string::npos) {
                        d.dropped = true;
                        ++b.boiler_only[s];
                    }
                }
            }
        }
    }
}

// Near duplicates: each document against those kept before it, decided on exact Jaccard.
void drop_near_duplicates(CorpusBuild & b, LshIndex & lsh) {
    std::vector<Doc> & docs = b.docs;
    const auto similarity_text = [&](const Doc & d) {
        const std::string c = content_text(d.d);
        return d.boiler_skip < c.size() ? c.substr(d.boiler_skip) : std::string();
    };
    std::vector<Signature> sigs(docs.size());
    std::vector<uint8_t> has_units(docs.size(), 0);
    run_parallel(docs.size(), b.opt.threads, [&](size_t i) {
        if (!docs[i].dropped) {
            const std::vector<uint64_t> sh = shingle_set(similarity_text(docs[i]));
            has_units[i] = !sh.empty();
            sigs[i] = minhash(sh);
        }
    });
    for (size_t i = 0; i < docs.size(); ++i) {
        if (docs[i].dropped || !has_units[i]) {
            continue;
        }
        const std::vector<uint32_t> cands = lsh.candidates(sigs[i]);
        bool dup = false;
        if (!cands.empty()) {
            const std::vector<uint64_t> mine = shingle_set(similarity_text(docs[i]));
            for (const uint32_t c : cands) {
                const double j = jaccard(mine, shingle_set(similarity_text(docs[c])));
                if (j >= b.spec.near_dup) {
                    dup = true;
                    docs[i].dropped = true;
                    ++b.near_dropped[docs[i].d.source];
                    if (b.dedupe_examples.size() < 2 * kExamples) {
                        b.dedupe_examples.push_back({{"kind", "near"},
                                                     {"jaccard", j},
                                                     {"kept", doc_ref(b.files, b.specs, docs[c].d)},
                                                     {"dropped", doc_ref(b.files, b.specs, docs[i].d)}});
                    }
                    break;
                }
            }
        }
        if (!dup) {
            lsh.add(uint32_t(i), sigs[i]);
        }
    }
}

// Sides by group; each source's documents of a side in a seeded random order.
void split_sides(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::unordered_map<std::string, int> group_side = split_groups(specs, b.docs, b.spec);
    for (size_t i = 0; i < b.docs.size(); ++i) {
        Doc & d = b.docs[i];
        if (d.dropped) {
            continue;
        }
        const SourceSpec & s = specs[d.d.source];
        d.side = s.split == SplitSide::Calib ? kCalib : s.split == SplitSide::Eval ? kEval : group_side.at(d.d.group);
        b.order[d.d.source][size_t(d.side)].push_back(i);
        b.groups[d.d.source][size_t(d.side)].insert(d.d.group);
    }
    for (size_t s = 0; s < specs.size(); ++s) {
        for (int side : {kCalib, kEval}) {
            std::mt19937_64 rng(XXH64(specs[s].name.data(), specs[s].name.size(), b.spec.seed * 2 + uint64_t(side)));
            std::shuffle(b.order[s][size_t(side)].begin(), b.order[s][size_t(side)].end(), rng);
        }
    }
}

// Budgets: fixed ones first; weighted sources share the corpus budget, or without one
// take as much as every weighted source can give in proportion (kAll until take_budgets).
void plan_budgets(CorpusBuild & b) {
    const CorpusSpec & spec = b.spec;
    uint64_t fixed = 0;
    double weight_sum = 0;
    for (const SourceSpec & s : b.specs) {
        if (s.split != SplitSide::Eval) {
            fixed += s.tokens.value_or(0);
            weight_sum += s.tokens ? 0 : *s.weight;
        }
    }
    if (spec.tokens && weight_sum > 0 && *spec.tokens <= fixed) {
        throw Error(fmt::format("the corpus budget of {} tokens leaves nothing for the weighted sources after the {} "
                                "tokens the others ask for", *spec.tokens, fixed));
    }
    for (size_t s = 0; s < b.specs.size(); ++s) {
        const SourceSpec & src = b.specs[s];
        if (src.split == SplitSide::Eval) {
            b.budget[s][kEval] = src.eval_tokens ? *src.eval_tokens : src.tokens ? *src.tokens : kAll;
            continue;
        }
        if (src.tokens) {
            b.budget[s][kCalib] = *src.tokens;
        } else if (spec.tokens) {
            b.budget[s][kCalib] = uint64_t(std::llround(double(*spec.tokens - fixed) * *src.weight / weight_sum));
        } else {
            b.budget[s][kCalib] = kAll;
        }
    }
}

// Taking units from one source and side in order, tokenizing in parallel batches.
void take_units(CorpusBuild & b, const Tokenizer & tokenizer, size_t s, int side, uint64_t budget, Progress & progress) {
    std::vector<Unit> & out = b.taken[s][size_t(side)];
    const std::vector<size_t> & ids = b.order[s][size_t(side)];
    std::vector<Unit> & pending = b.spare[s][size_t(side)];
    uint64_t & taken_tokens = b.taken_tokens[s][size_t(side)];
    size_t & next_doc = b.next_doc[s][size_t(side)];
    const size_t batch = 64;
    while (taken_tokens < budget) {
        if (pending.empty()) {
            const size_t from = next_doc;
            if (from >= ids.size()) {
                return;
            }
            const size_t n = std::min(batch, ids.size() - from);
            std::vector<std::vector<Unit>> made(n);
            run_parallel(n, b.opt.threads, [&](size_t k) {
                const Doc & d = b.docs[ids[from + k]];
                made[k] = tokenizer.units(ids[from + k], d.d, b.specs[s].truncate, label(b.files, d.d));
            });
            next_doc = from + n;
            for (size_t k = 0; k < n; ++k) {
                b.tokenized_bytes += content_text(b.docs[ids[from + k]].d).size();
                for (Unit & u : made[k]) {
                    pending.push_back(std::move(u));
                }
            }
            std::reverse(pending.begin(), pending.end());
        }
        while (!pending.empty() && taken_tokens < budget) {
            taken_tokens += pending.back().tokens;
            progress.advance(pending.back().tokens);
            out.push_back(std::move(pending.back()));
            pending.pop_back();
        }
    }
}

// Every source's budgets taken: the open budgets of weighted sources settled first, then
// each source's calib and eval side.
void take_budgets(CorpusBuild & b, const Tokenizer & tokenizer) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::array<uint64_t, 2>> & budget = b.budget;
    const double eval_ratio = b.spec.eval_share / (1.0 - b.spec.eval_share);
    const auto eval_budget_for = [&](const SourceSpec & s, uint64_t calib) -> uint64_t {
        return s.eval_tokens ? *s.eval_tokens : uint64_t(std::llround(double(calib) * eval_ratio));
    };
    uint64_t planned = 0;
    bool weighted_open = false;
    for (size_t s = 0; s < specs.size(); ++s) {
        weighted_open = weighted_open || budget[s][kCalib] == kAll;
        planned += budget[s][kCalib] == kAll ? 0 : budget[s][kCalib];
    }
    Progress progress("tokenizing", std::max<uint64_t>(planned, 1), "tokens");
    if (weighted_open) {
        // Everything the weighted sources have, then the largest budget all can meet.
        double scale = std::numeric_limits<double>::infinity();
        for (size_t s = 0; s < specs.size(); ++s) {
            if (budget[s][kCalib] == kAll) {
                take_units(b, tokenizer, s, kCalib, kAll, progress);
                scale = std::min(scale, double(b.taken_tokens[s][kCalib]) / *specs[s].weight);
            }
        }
        for (size_t s = 0; s < specs.size(); ++s) {
            if (budget[s][kCalib] == kAll) {
                budget[s][kCalib] = uint64_t(std::floor(scale * *specs[s].weight));
                // Give back what is past the budget, whole units, in the order taken.
                std::vector<Unit> & out = b.taken[s][kCalib];
                uint64_t sum = 0;
                size_t keep = 0;
                while (keep < out.size() && sum < budget[s][kCalib]) {
                    sum += out[keep++].tokens;
                }
                out.resize(keep);
                b.taken_tokens[s][kCalib] = sum;
            }
        }
    }
    for (size_t s = 0; s < specs.size(); ++s) {
        if (specs[s].split == SplitSide::Both) {
            budget[s][kEval] = eval_budget_for(specs[s], budget[s][kCalib]);
        }
        for (int side : {kCalib, kEval}) {
            take_units(b, tokenizer, s, side, budget[s][size_t(side)], progress);
        }
    }
    progress.finish();
}

// Shortfalls: a budget a source could not meet.
//
// An eval budget derived from the eval share is a cap: how many groups fall on the
// eval side is chance. Calib budgets and eval budgets asked for by number are demands.
void check_shortfalls(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::vector<std::vector<fs::path>> & paths = b.paths;
    bool demand_missed = false;
    for (size_t s = 0; s < specs.size(); ++s) {
        for (int side : {kCalib, kEval}) {
            const uint64_t budget = b.budget[s][size_t(side)];
            const uint64_t taken = b.taken_tokens[s][size_t(side)];
            if (budget != kAll && taken < budget) {
                demand_missed = demand_missed || side == kCalib || specs[s].eval_tokens || specs[s].split == SplitSide::Eval;
                b.shortfalls.push_back(fmt::format(
                    "source \"{}\" ({}) has {} {} tokens, short of its budget of {}: {} documents in {} groups fell on "
                    "that side after deduplication and the split by group \"{}\"",
                    specs[s].name, paths[s].size() == 1 ? paths[s][0].string() : specs[s].path, taken, kSideName[side],
                    budget, b.order[s][size_t(side)].size(), b.groups[s][size_t(side)].size(), specs[s].group.written));
            }
        }
    }
    if (demand_missed && !b.opt.allow_shortfall) {
        std::string msg = "budgets cannot be met (--allow-shortfall builds the corpus anyway and reports them):";
        for (const std::string & m : b.shortfalls) {
            msg += "\n  " + m;
        }
        throw Error(msg);
    }
    for (const std::string & m : b.shortfalls) {
        std::fprintf(stderr, "moeprune corpus: shortfall: %s\n", m.c_str());
    }
}

// Interleave: the source furthest behind its share of the side's tokens goes next, so
// every prefix holds each source (and so each domain) at its share.
void interleave(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    const std::vector<std::array<std::vector<Unit>, 2>> & taken = b.taken;
    const std::vector<std::array<uint64_t, 2>> & taken_tokens = b.taken_tokens;
    for (int side : {kCalib, kEval}) {
        std::vector<size_t> pos(specs.size(), 0);
        std::vector<uint64_t> emitted(specs.size(), 0);
        for (size_t s = 0; s < specs.size(); ++s) {
            b.side_tokens[size_t(side)] += taken_tokens[s][size_t(side)];
        }
        for (;;) {
            long best = -1;
            double best_progress = 0;
            for (size_t s = 0; s < specs.size(); ++s) {
                const std::vector<Unit> & units = taken[s][size_t(side)];
                if (pos[s] >= units.size()) {
                    continue;
                }
                const double p = (double(emitted[s]) + 0.5 * double(units[pos[s]].tokens)) / double(taken_tokens[s][size_t(side)]);
                if (best < 0 || p < best_progress) {
                    best = long(s);
                    best_progress = p;
                }
            }
            if (best < 0) {
                break;
            }
            const Unit & u = taken[size_t(best)][size_t(side)][pos[size_t(best)]++];
            emitted[size_t(best)] += u.tokens;
            b.sequence[size_t(side)].push_back(&u);
        }
    }
}

// Domains: target shares from budgets, reached shares, and shares of every prefix.
void report_domains(CorpusBuild & b) {
    const std::vector<SourceSpec> & specs = b.specs;
    std::vector<std::string> domains;
    for (const SourceSpec & s : specs) {
        if (std::find(domains.begin(), domains.end(), s.domain) == domains.end()) {
            domains.push_back(s.domain);
        }
    }
    const auto domain_of = [&](size_t s) { return size_t(std::find(domains.begin(), domains.end(), specs[s].domain) - domains.begin()); };
    for (int side : {kCalib, kEval}) {
        std::vector<double> target(domains.size(), 0), reached(domains.size(), 0);
        double target_sum = 0;
        for (size_t s = 0; s < specs.size(); ++s) {
            const uint64_t budget = b.budget[s][size_t(side)];
            const double t = budget == kAll ? double(b.taken_tokens[s][size_t(side)]) : double(budget);
            target[domain_of(s)] += t;
            target_sum += t;
            reached[domain_of(s)] += double(b.taken_tokens[s][size_t(side)]);
        }
        json rows = json::array();
        const uint64_t total = b.side_tokens[size_t(side)];
        for (const double f : kPrefixes) {
            const double cutoff = f * double(total);
            std::vector<double> got(domains.size(), 0);
            double seen = 0;
            for (const Unit * u : b.sequence[size_t(side)]) {
                if (seen >= cutoff) {
                    break;
                }
                const double part = std::min(double(u->tokens), cutoff - seen);
                got[domain_of(b.docs[u->doc].d.source)] += part;
                seen += part;
            }
            json shares = json::object();
            double worst = 0;
            for (size_t d = 0; d < domains.size(); ++d) {
                const double share = seen > 0 ? got[d] / seen : 0;
                shares[domains[d]] = share;
                if (target_sum > 0) {
                    worst = std::max(worst, std::abs(share - target[d] / target_sum));
                }
            }
            rows.push_back({{"prefix", f}, {"tokens", uint64_t(seen)}, {"shares", shares}, {"max_abs_error_vs_target", worst}});
        }
        b.prefix_report[kSideName[side]] = rows;
        for (size_t d = 0; d < domains.size(); ++d) {
            if (side == kCalib) {
                b.domain_report.push_back({{"domain", domains[d]}});
            }
            b.domain_report[d][kSideName[side]] = {{"tokens", uint64_t(reached[d])},
                                                   {"target_share", target_sum > 0 ? target[d] / target_sum : 0},
                                                   {"share", total > 0 ? reached[d] / double(total) : 0}};
        }
    }
}

// Leak check of what is written.
json check_leaks(const CorpusBuild & b) {
    std::array<std::vector<LeakDocument>, 2> leak_docs;
    for (int side : {kCalib, kEval}) {
        for (const Unit * u : b.sequence[size_t(side)]) {
            const Doc & d = b.docs[u->doc];
            SourceDocument view;
            view.text = u->text;
            view.messages = u->messages;
            view.media_key = d.d.media_key;
            const std::string text = content_text(view);
            const size_t skip = d.boiler_skip && !u->truncated && !u->piece ? d.boiler_skip : 0;
            leak_docs[size_t(side)].push_back({text, d.d.group, label(b.files, d.d), std::min(skip, text.size())});
        }
    }
    return leak_check(leak_docs[kCalib], leak_docs[kEval], b.spec.near_dup, b.opt.threads);
}

// A message as the corpus format reads it: a string, or text and media parts in order,
// media by absolute path (the output may live far from its sources).
json content_json(const CorpusMessage & m) {
    if (m.media.empty()) {
        return m.content;
    }
    json parts = json::array();
    size_t at = 0;
    const std::string marker = kMediaMarker;
    for (const CorpusMedia & media : m.media) {
        const size_t next = m.content.find(marker, at);
        if (next > at) {
            parts.push_back({{"type", "text"}, {"text", m.content.substr(at, next - at)}});
        }
        parts.push_back({{"type", modality_name(media.modality)}, {"path", fs::absolute(media.path).string()}});
        at = next + marker.size();
    }
    if (at < m.content.size()) {
        parts.push_back({{"type", "text"}, {"text", m.content.substr(at)}});
    }
    return parts;
}

// The JSONL collect and eval read, written whole under temporary names: every output
// takes its final name only once all are written, so a failed write leaves the old set.
void stage_jsonl(CorpusBuild & b) {
    for (int side : {kCalib, kEval}) {
        std::string bytes;
        for (const Unit * u : b.sequence[size_t(side)]) {
            const SourceDocument & d = b.docs[u->doc].d;
            json line;
            if (u->messages.empty()) {
                line["text"] = u->text;
            } else {
                json msgs = json::array();
                for (const CorpusMessage & m : u->messages) {
                    msgs.push_back({{"role", m.role}, {"content", content_json(m)}});
                }
                line["messages"] = std::move(msgs);
            }
            line["domain"] = b.specs[d.source].domain;
            line["group"] = d.group;
            line["source"] = b.specs[d.source].name;
            bytes += line.dump();
            bytes += '\n';
        }
        const fs::path & path = side == kCalib ? b.calib_path : b.eval_path;
        b.output_report[size_t(side)] = {{"path", path.string()},
                                         {"documents", b.sequence[size_t(side)].size()},
                                         {"tokens", b.side_tokens[size_t(side)]},
                                         {"bytes", bytes.size()},
                                         {"digest", fmt::format("{:016x}", XXH64(bytes.data(), bytes.size(), 0))}};
        b.staged.push_back(std::make_unique<AtomicOutput>(path));
        write_temp_file(*b.staged.back(), bytes);
    }
}

// One source's row of the report: its files, what was dropped, and what each side took.
json source_report(const CorpusBuild & b, size_t s) {
    const SourceSpec & src = b.specs[s];
    const std::vector<SourceFile> & files = b.files;
    json f = json::array();
    for (size_t i = 0; i < files.size(); ++i) {
        if (b.jobs[i].first == s) {  // files are in the order of the reading jobs
            f.push_back({{"path", files[i].path.string()}, {"bytes", files[i].bytes}, {"digest", files[i].digest}});
        }
    }
    json row = {{"name", src.name},
                {"path", src.path},
                {"domain", src.domain},
                {"group", src.group.written},
                {"split", to_string(src.split)},
                {"media", modality_name(src.media)},
                {"files", f},
                {"documents_read", b.read_docs[s]},
                {"empty_skipped", b.empty_skipped[s]},
                {"binary_skipped", b.binary_skipped[s]},
                {"not_media_skipped", b.not_media_skipped[s]},
                {"exact_duplicates", b.exact_dropped[s]},
                {"near_duplicates", b.near_dropped[s]},
                {"boilerplate_only", b.boiler_only[s]}};
    if (src.tokens) {
        row["tokens"] = *src.tokens;
    } else {
        row["weight"] = *src.weight;
    }
    for (int side : {kCalib, kEval}) {
        const std::vector<Unit> & taken = b.taken[s][size_t(side)];
        uint64_t pieces = 0, truncated = 0;
        std::set<size_t> whole;
        for (const Unit & u : taken) {
            pieces += u.piece;
            truncated += u.truncated;
            whole.insert(u.doc);
        }
        const uint64_t budget = b.budget[s][size_t(side)];
        const uint64_t tokens = b.taken_tokens[s][size_t(side)];
        row[kSideName[side]] = {{"budget", budget == kAll ? json(nullptr) : json(budget)},
                                {"tokens", tokens},
                                {"shortfall", budget != kAll && tokens < budget ? budget - tokens : 0},
                                {"documents", whole.size()},
                                {"units", taken.size()},
                                {"pieces", pieces},
                                {"truncated", truncated},
                                {"documents_available", b.order[s][size_t(side)].size()},
                                {"groups_available", b.groups[s][size_t(side)].size()}};
    }
    return row;
}

// The report (corpus.json): inputs, settings, and what every phase did.
json corpus_report(const CorpusBuild & b, const llama_model * model, const LshIndex & lsh, const json & leaks,
                   const json & seconds) {
    const CorpusOptions & opt = b.opt;
    const CorpusSpec & spec = b.spec;
    json sources = json::array();
    for (size_t s = 0; s < b.specs.size(); ++s) {
        sources.push_back(source_report(b, s));
    }
    uint64_t exact_total = 0, near_total = 0;
    for (size_t s = 0; s < b.specs.size(); ++s) {
        exact_total += b.exact_dropped[s];
        near_total += b.near_dropped[s];
    }
    std::error_code ec;
    return {
        {"format", "moeprune-corpus"},
        {"version", 1},
        {"inputs",
         {{"model", {{"path", opt.model.string()}, {"bytes", fs::file_size(opt.model, ec)},
                     {"digest", b.model_identity}, {"vocab", vocab_digest(llama_model_get_vocab(model))}}},
          {"manifest", spec.manifest.empty() ? json(nullptr) : json(spec.manifest.string())},
          {"mmproj", opt.mmproj.empty() ? json(nullptr) : json(opt.mmproj.string())},
          {"bytes", b.total_bytes}}},
        {"settings",
         {{"seed", spec.seed},
          {"near_dup", spec.near_dup},
          {"eval_share", spec.eval_share},
          {"tokens", spec.tokens ? json(*spec.tokens) : json(nullptr)},
          {"doc_tokens", spec.doc_tokens},
          {"strip_boilerplate", spec.strip_boilerplate},
          {"allow_shortfall", opt.allow_shortfall},
          {"tokens_counted_as", "llama.cpp tokenizer with BOS where the model adds one, special tokens parsed; "
                                "conversations rendered with the model's chat template"},
          {"minhash", {{"shingle_units", kShingleUnits}, {"signature", kSignatureSize}, {"lsh_rows", lsh.rows()}, {"lsh_bands", lsh.bands()}}}}},
        {"sources", sources},
        {"domains", b.domain_report},
        {"dedupe", {{"exact", exact_total}, {"near", near_total}, {"examples", b.dedupe_examples}}},
        {"boilerplate", b.boilerplate},
        {"leak_check", leaks},
        {"prefix_shares", b.prefix_report},
        {"shortfalls", b.shortfalls},
        {"tokenized_bytes", b.tokenized_bytes},
        {"seconds", seconds},
        {"outputs", {{"calib", b.output_report[kCalib]}, {"eval", b.output_report[kEval]}}}};
}

// The report staged beside the JSONL (and its copy, if asked for), then every output renamed together.
void commit_outputs(CorpusBuild & b, const json & report) {
    const std::string text = report.dump(2) + "\n";
    b.staged.push_back(std::make_unique<AtomicOutput>(b.report_path));
    write_temp_file(*b.staged.back(), text);
    if (!b.opt.report.empty()) {
        b.staged.push_back(std::make_unique<AtomicOutput>(b.opt.report));
        write_temp_file(*b.staged.back(), text);
    }
    for (const auto & out : b.staged) {
        out->commit();
    }
}

} // namespace

json leak_check(const std::vector<LeakDocument> & calib, const std::vector<LeakDocument> & eval, double near_dup, int threads) {
    json examples = json::array();
    const auto example = [&](const char * kind, const LeakDocument & c, const LeakDocument & e, json extra) {
        if (examples.size() < 3 * kExamples) {
            json x = {{"kind", kind}, {"calib", c.label}, {"eval", e.label}};
            x.update(extra);
            examples.push_back(std::move(x));
        }
    };
    // Calib's side, computed once.
    std::vector<std::string> digests(calib.size());
    std::vector<Signature> sigs(calib.size());
    std::vector<std::vector<Ngram>> grams(calib.size());
    run_parallel(calib.size(), threads, [&](size_t i) {
        const std::string_view compared = std::string_view(calib[i].text).substr(calib[i].skip);
        digests[i] = normalized_digest(calib[i].text);
        sigs[i] = minhash(shingle_set(compared));
        grams[i] = sampled_ngrams(compared);
    });
    std::unordered_map<std::string, size_t> digest_at;
    std::unordered_map<uint64_t, std::pair<size_t, uint32_t>> gram_at;
    std::unordered_map<std::string, size_t> group_at;
    LshIndex lsh(near_dup);
    for (size_t i = 0; i < calib.size(); ++i) {
        digest_at.emplace(digests[i], i);
        lsh.add(uint32_t(i), sigs[i]);
        for (const Ngram & g : grams[i]) {
            gram_at.emplace(g.hash, std::pair{i, g.offset});
        }
        grams[i].clear();
        grams[i].shrink_to_fit();
        group_at.emplace(calib[i].group, i);
    }
    uint64_t exact = 0, near = 0, ngram_docs = 0, shared_ngrams = 0;
    std::set<std::string> shared_groups;
    std::vector<json> per_eval(eval.size());
    struct Hit {
        int exact = -1, near = -1, gram = -1;
        double jaccard = 0;
        uint32_t gram_count = 0, eval_offset = 0, calib_offset = 0;
    };
    std::vector<Hit> hits(eval.size());
    run_parallel(eval.size(), threads, [&](size_t i) {
        Hit & h = hits[i];
        const LeakDocument & e = eval[i];
        if (auto it = digest_at.find(normalized_digest(e.text)); it != digest_at.end()) {
            h.exact = int(it->second);
            return;
        }
        const std::string_view compared = std::string_view(e.text).substr(e.skip);
        const std::vector<uint64_t> shingles = shingle_set(compared);
        for (const uint32_t c : lsh.candidates(minhash(shingles))) {
            const double j = jaccard(shingles, shingle_set(std::string_view(calib[c].text).substr(calib[c].skip)));
            if (j >= near_dup && j > h.jaccard) {
                h.near = int(c);
                h.jaccard = j;
            }
        }
        for (const Ngram & g : sampled_ngrams(compared)) {
            if (auto it = gram_at.find(g.hash); it != gram_at.end()) {
                if (h.gram < 0) {
                    h.gram = int(it->second.first);
                    h.calib_offset = it->second.second;
                    h.eval_offset = uint32_t(g.offset + e.skip);
                }
                ++h.gram_count;
            }
        }
    });
    const auto snippet = [](const std::string & text, size_t at) {
        return text.substr(at, char_start(text, std::min(text.size(), at + 80)) - at);
    };
    for (size_t i = 0; i < eval.size(); ++i) {
        const Hit & h = hits[i];
        if (h.exact >= 0) {
            ++exact;
            example("exact", calib[size_t(h.exact)], eval[i], json::object());
        }
        if (h.near >= 0) {
            ++near;
            example("near", calib[size_t(h.near)], eval[i], {{"jaccard", h.jaccard}});
        }
        if (h.gram >= 0) {
            ++ngram_docs;
            shared_ngrams += h.gram_count;
            example("ngram", calib[size_t(h.gram)], eval[i], {{"text", snippet(eval[i].text, h.eval_offset)}});
        }
        if (auto it = group_at.find(eval[i].group); it != group_at.end() && shared_groups.insert(eval[i].group).second) {
            example("group", calib[it->second], eval[i], {{"group", eval[i].group}});
        }
    }
    return {{"exact", exact},
            {"near", near},
            {"shared_ngrams", ngram_docs},
            {"shared_ngram_hashes", shared_ngrams},
            {"shared_groups", shared_groups.size()},
            {"ngram_units", kLeakNgramUnits},
            {"ngram_sample", kLeakNgramSample},
            {"clean", exact + near + ngram_docs + shared_groups.size() == 0},
            {"examples", examples}};
}

json build_corpus(const CorpusOptions & opt) {
    CorpusBuild b(opt, checked_sources(opt.spec, !opt.mmproj.empty()));
    prepare_files(b);

    // The tokenizer first: a model that cannot load should fail before minutes of reading.
    const ModelPtr model = load_vocabulary(opt.model);
    std::unique_ptr<MediaEncoder> media;
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, model.get(), std::max(1, opt.threads), false);
    }
    const Tokenizer tokenizer(model.get(), opt.spec.doc_tokens, media.get());

    json seconds = json::object();
    auto last = std::chrono::steady_clock::now();
    const auto lap = [&](const char * stage) {
        const auto now = std::chrono::steady_clock::now();
        seconds[stage] = std::chrono::duration<double>(now - last).count();
        last = now;
    };

    read_sources(b);
    lap("read");

    drop_exact_duplicates(b);
    mark_boilerplate(b);
    LshIndex lsh(opt.spec.near_dup);
    drop_near_duplicates(b, lsh);
    lap("dedupe");

    split_sides(b);
    plan_budgets(b);
    take_budgets(b, tokenizer);
    lap("tokenize");

    check_shortfalls(b);
    refuse_empty_sides(b.specs, b.spec, b.taken_tokens, b.read_docs, b.exact_dropped, b.near_dropped, b.boiler_only,
                       b.groups, b.budget);

    interleave(b);
    report_domains(b);
    const json leaks = check_leaks(b);
    lap("leak_check");

    stage_jsonl(b);
    lap("write");

    const json report = corpus_report(b, model.get(), lsh, leaks, seconds);
    commit_outputs(b, report);
    return report;
}

} // namespace moeprune
