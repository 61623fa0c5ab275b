// Choice tasks from the held-out side: does the model still pick a passage's real
// continuation over continuations of other held-out documents of its domain? Written in
// llama.cpp's HellaSwag format (tasks.txt), so `llama-perplexity --hellaswag` scores the
// same file, with each task's domain in tasks.json. docs/corpus.md, "Choice tasks".
#include "corpus/phases.h"

#include "core/digest.h"

#include <xxhash.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace moeprune::corpus_build {

namespace {

constexpr int kEndings = 4;         // HellaSwag's
constexpr int kDistractorTries = 32;

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// A line of the HellaSwag file: whitespace runs (newlines included) as one space, trimmed.
std::string one_line(std::string_view s) {
    std::string out;
    bool gap = false;
    for (const char c : s) {
        if (is_space(c)) {
            gap = !out.empty();
        } else {
            if (gap) {
                out += ' ';
                gap = false;
            }
            out += c;
        }
    }
    return out;
}

// A held-out unit as the tasks see it: its text, where each of its tokens begins, where a
// task may cut it (context before, true ending after) and where a distractor may start.
struct Passage {
    size_t doc = 0;
    std::string text;
    std::vector<size_t> at;          // byte offset of each token, then the text's size
    std::vector<size_t> splits, starts;
    size_t tokens() const { return at.size() - 1; }
};

// Token offsets from the pieces, where the pieces spell the text (a tokenizer that adds a
// leading space, as SentencePiece does, spells it with one more byte in front). None when
// they do not: such text makes no tasks rather than misplaced ones.
std::optional<std::vector<size_t>> token_offsets(const llama_vocab * vocab, const std::string & text) {
    const int n = -llama_tokenize(vocab, text.data(), int32_t(text.size()), nullptr, 0, false, false);
    std::vector<llama_token> ids(size_t(std::max(n, 0)));
    if (n <= 0 || llama_tokenize(vocab, text.data(), int32_t(text.size()), ids.data(), n, false, false) != n) {
        return std::nullopt;
    }
    std::string spelled;
    std::vector<size_t> at;
    char buf[256];
    for (const llama_token id : ids) {
        at.push_back(spelled.size());
        const int len = llama_token_to_piece(vocab, id, buf, sizeof buf, 0, false);
        if (len < 0) {
            return std::nullopt;
        }
        spelled.append(buf, size_t(len));
    }
    size_t shift = 0;
    if (spelled.size() == text.size() + 1 && spelled[0] == ' ' && spelled.compare(1, std::string::npos, text) == 0) {
        shift = 1;
    } else if (spelled != text) {
        return std::nullopt;
    }
    for (size_t & a : at) {
        a = a > shift ? a - shift : 0;
    }
    at.push_back(text.size());
    return at;
}

// Where a token starts a word: after whitespace, at whitespace it carries, or at a
// character that is not ASCII (Chinese and Japanese have no spaces between words).
bool word_start(const Passage & p, size_t i) {
    const size_t a = p.at[i];
    if (a >= p.text.size() || (uint8_t(p.text[a]) & 0xC0) == 0x80) {
        return false;
    }
    return a == 0 || is_space(p.text[a]) || is_space(p.text[a - 1]) || (uint8_t(p.text[a]) & 0x80);
}

// Where a token starts a sentence or a line: the text before it ends a sentence (. ! ? or
// a full-width stop) and whitespace follows, or a newline lies between them.
bool sentence_start(const Passage & p, size_t i) {
    if (!word_start(p, i)) {
        return false;
    }
    size_t j = p.at[i];
    bool newline = false;
    while (j < p.text.size() && is_space(p.text[j])) {   // the token's own leading whitespace
        newline = newline || p.text[j] == '\n';
        ++j;
    }
    size_t k = p.at[i];
    while (k > 0 && is_space(p.text[k - 1])) {
        newline = newline || p.text[k - 1] == '\n';
        --k;
    }
    if (k == 0 || newline) {
        return true;
    }
    const std::string_view before(p.text.data(), k);
    const bool spaced = k < j;
    return (spaced && (before.back() == '.' || before.back() == '!' || before.back() == '?')) ||
           before.ends_with("\u3002") || before.ends_with("\uFF01") || before.ends_with("\uFF1F");
}

// From token `from`, about `n` tokens, ending before a word where that loses at most half.
std::string span(const Passage & p, size_t from, size_t n) {
    size_t end = std::min(p.tokens(), from + n);
    if (end < p.tokens()) {
        size_t e = end;
        while (e > from + n / 2 && !word_start(p, e)) {
            --e;
        }
        if (word_start(p, e) && e > from) {
            end = e;
        }
    }
    return one_line(std::string_view(p.text).substr(p.at[from], p.at[end] - p.at[from]));
}

// A text unit cuts at each sentence or line start with a full context before it and a
// full ending after, and its distractors start at its sentence or line starts (at word
// starts where it has none but its beginning). A conversation cuts once, before its last
// answer, which is also where its distractors start: the answer to another question.
std::optional<Passage> passage_of(const Unit & u, const llama_vocab * vocab, size_t context, size_t ending) {
    Passage p;
    p.doc = u.doc;
    size_t answer_at = std::string::npos;
    if (u.messages.empty()) {
        p.text = u.text;
    } else {
        const auto last = std::find_if(u.messages.rbegin(), u.messages.rend(), [](const CorpusMessage & m) {
            return m.role == "assistant" && !one_line(m.content).empty();
        });
        if (last == u.messages.rend() || std::any_of(u.messages.begin(), u.messages.end(),
                                                     [](const CorpusMessage & m) { return !m.media.empty(); })) {
            return std::nullopt;
        }
        for (auto m = u.messages.begin(); m != last.base() - 1; ++m) {
            p.text += one_line(m->content) + "\n";
        }
        if (one_line(p.text).empty()) {
            return std::nullopt;
        }
        answer_at = p.text.size();
        p.text += last->content;
    }
    const auto at = token_offsets(vocab, p.text);
    if (!at) {
        return std::nullopt;
    }
    p.at = *at;
    const size_t n = p.tokens();
    if (answer_at != std::string::npos) {
        const auto first = std::lower_bound(p.at.begin(), p.at.end() - 1, answer_at);
        if (first == p.at.end() - 1 || *first != answer_at) {
            return std::nullopt;
        }
        p.splits = p.starts = {size_t(first - p.at.begin())};
        return p;
    }
    // Text without a sentence or line start after its beginning (one long line) is cut and
    // drawn from at word starts instead.
    bool sentences = false;
    for (size_t i = 1; i < n && !sentences; ++i) {
        sentences = sentence_start(p, i);
    }
    for (size_t i = 0; i + ending <= n; ++i) {
        if (i == 0 || (sentences ? sentence_start(p, i) : word_start(p, i))) {
            p.starts.push_back(i);
            if (i >= context) {
                p.splits.push_back(i);
            }
        }
    }
    return p;
}

struct Task {
    std::string context;
    size_t gold = 0;
    std::array<std::string, kEndings> endings;
};

// The held-out passages of each domain, domains in the order eval.jsonl first shows them.
struct DomainPassages {
    std::vector<std::string> order;
    std::map<std::string, std::vector<Passage>> passages;
    std::map<std::string, std::set<size_t>> documents;
};

DomainPassages passages_by_domain(const CorpusBuild & b, const llama_vocab * vocab, size_t context, size_t ending) {
    DomainPassages out;
    for (const Unit * u : b.sequence[kEval]) {
        const std::string & domain = b.specs[b.docs[u->doc].d.source].domain;
        if (!out.passages.contains(domain)) {
            out.order.push_back(domain);
            out.passages[domain];
        }
        out.documents[domain].insert(u->doc);
        if (std::optional<Passage> p = passage_of(*u, vocab, context, ending)) {
            out.passages[domain].push_back(std::move(*p));
        }
    }
    return out;
}

using Draw = std::function<size_t(size_t)>;   // a seeded draw in [0, n)

// A cut of a passage where a task's ending starts, and whether its window overlaps one
// chosen before it.
struct TaskCut {
    size_t passage, split;
    bool overlapping;
};

// Why a domain's passages can give no task, or "" when they can; `cuts` lists every
// candidate cut as (passage, token).
std::string no_tasks_because(const std::vector<Passage> & ps, const std::vector<std::pair<size_t, size_t>> & cuts,
                             size_t context, size_t ending) {
    std::set<size_t> docs_with_starts;
    for (const Passage & p : ps) {
        if (!p.starts.empty()) {
            docs_with_starts.insert(p.doc);
        }
    }
    if (cuts.empty()) {
        return fmt::format("no held-out text of {} tokens or more before a sentence or line start with {} after it, "
                           "and no conversation ending in an answer",
                           context, ending);
    }
    if (docs_with_starts.size() < 2) {
        return "its held-out text is one document: the wrong endings must come from other documents";
    }
    return "";
}

// Up to `n` cuts in a seeded order: windows apart first; where the text is too short for
// that, windows that overlap.
std::vector<TaskCut> choose_cuts(std::vector<std::pair<size_t, size_t>> cuts, size_t window, size_t n, const Draw & draw) {
    for (size_t i = cuts.size(); i > 1; --i) {   // Fisher-Yates, portable
        std::swap(cuts[i - 1], cuts[draw(i)]);
    }
    std::vector<TaskCut> chosen;
    std::vector<bool> taken(cuts.size(), false);
    const auto overlaps = [&](const std::pair<size_t, size_t> & c) {
        return std::any_of(chosen.begin(), chosen.end(), [&](const TaskCut & o) {
            return o.passage == c.first && o.split < c.second + window && c.second < o.split + window;
        });
    };
    for (const bool overlapping : {false, true}) {
        for (size_t i = 0; i < cuts.size() && chosen.size() < n; ++i) {
            if (!taken[i] && (overlapping || !overlaps(cuts[i]))) {
                taken[i] = true;
                chosen.push_back({cuts[i].first, cuts[i].second, overlapping});
            }
        }
    }
    return chosen;
}

// The context before a cut, from a word start: the first within `context` tokens of the
// cut, or, where a word is longer than that, the one the cut's first token belongs to.
std::string context_before(const Passage & p, size_t split, size_t context) {
    const size_t earliest = split > context ? split - context : 0;
    size_t from = earliest;
    while (from < split && !word_start(p, from)) {
        ++from;
    }
    if (from == split) {
        for (from = earliest; from > 0 && !word_start(p, from); --from) {
        }
    }
    return one_line(std::string_view(p.text).substr(p.at[from], p.at[split] - p.at[from]));
}

enum class TaskDrop { None, EmptyContext, TooFewEndings };

// The task at a cut: its context, its true ending and wrong ones from other documents of
// the domain, the true one at a drawn position.
TaskDrop task_at(const std::vector<Passage> & ps, const TaskCut & cut, size_t context, size_t ending, const Draw & draw,
                 Task & t) {
    const Passage & p = ps[cut.passage];
    t.context = context_before(p, cut.split, context);
    const std::string truth = span(p, cut.split, ending);
    std::vector<std::string> wrong;
    for (int tries = 0; wrong.size() + 1 < kEndings && tries < kDistractorTries; ++tries) {
        const Passage & o = ps[draw(ps.size())];
        if (o.doc == p.doc || o.starts.empty()) {
            continue;
        }
        std::string e = span(o, o.starts[draw(o.starts.size())], ending);
        if (!e.empty() && e != truth && std::find(wrong.begin(), wrong.end(), e) == wrong.end()) {
            wrong.push_back(std::move(e));
        }
    }
    if (t.context.empty()) {
        return TaskDrop::EmptyContext;
    }
    if (truth.empty() || wrong.size() + 1 < kEndings) {
        return TaskDrop::TooFewEndings;   // too few distinct endings in the other documents
    }
    t.gold = draw(kEndings);
    for (size_t e = 0, w = 0; e < kEndings; ++e) {
        t.endings[e] = e == t.gold ? truth : wrong[w++];
    }
    return TaskDrop::None;
}

// One domain's tasks appended to tasks.txt; its row says how many, or why none.
TaskSetDomain make_domain_tasks(CorpusBuild & b, const std::string & domain, const std::vector<Passage> & ps,
                                size_t documents) {
    const CorpusSpec & spec = b.spec;
    const size_t context = size_t(spec.task_context), ending = size_t(spec.task_ending);
    TaskSetDomain row{domain, 0, documents, 0, ""};
    std::mt19937_64 rng(spec.seed ^ XXH64(domain.data(), domain.size(), 0));
    const Draw draw = [&](size_t n) { return size_t(rng() % n); };
    std::vector<std::pair<size_t, size_t>> cuts;
    for (size_t i = 0; i < ps.size(); ++i) {
        for (const size_t s : ps[i].splits) {
            cuts.emplace_back(i, s);
        }
    }
    row.skipped = no_tasks_because(ps, cuts, context, ending);
    if (!row.skipped.empty()) {
        return row;
    }
    const std::vector<TaskCut> chosen = choose_cuts(std::move(cuts), ending + context, size_t(spec.tasks_per_domain), draw);
    size_t empty_context = 0, too_few_endings = 0;
    for (const TaskCut & cut : chosen) {
        Task t;
        const TaskDrop drop = task_at(ps, cut, context, ending, draw, t);
        empty_context += drop == TaskDrop::EmptyContext;
        too_few_endings += drop == TaskDrop::TooFewEndings;
        if (drop != TaskDrop::None) {
            continue;
        }
        b.tasks_text += t.context + "\n" + std::to_string(t.gold) + "\n";
        for (const std::string & e : t.endings) {
            b.tasks_text += e + "\n";
        }
        b.tasks.task_domains.push_back(domain);
        ++row.tasks;
        row.overlapping += cut.overlapping;
    }
    if (row.tasks == 0) {
        row.skipped = fmt::format("each of its {} cuts was dropped: {} had no text before them on their line, {} found "
                                  "fewer than {} distinct endings of {} tokens in other documents (a longer task_ending "
                                  "tells endings apart)",
                                  chosen.size(), empty_context, too_few_endings, kEndings, ending);
    }
    return row;
}

} // namespace

void make_tasks(CorpusBuild & b, const llama_model * model) {
    const CorpusSpec & spec = b.spec;
    TaskSet & set = b.tasks;
    set = {};
    set.file = b.tasks_path.string();
    set.eval = b.eval_path.string();
    set.seed = spec.seed;
    set.context_tokens = spec.task_context;
    set.ending_tokens = spec.task_ending;
    set.tasks_per_domain = spec.tasks_per_domain;
    b.tasks_text.clear();
    if (spec.tasks_per_domain == 0) {
        return;
    }
    DomainPassages d = passages_by_domain(b, llama_model_get_vocab(model), size_t(spec.task_context),
                                          size_t(spec.task_ending));
    for (const std::string & domain : d.order) {
        set.domains.push_back(make_domain_tasks(b, domain, d.passages[domain], d.documents[domain].size()));
    }
    set.file_digest = xxh64_hex(b.tasks_text);
}

} // namespace moeprune::corpus_build
