#include "eval/tasks.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "engine/batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <sstream>

namespace moeprune {

namespace {

constexpr size_t kEndings = 4, kLinesPerTask = 2 + kEndings;

// A task file as llama.cpp's -f reads a prompt: whole, less one final newline.
std::string prompt_file(const std::filesystem::path & path) {
    std::string text = read_text_file(path);
    if (!text.empty() && text.back() == '\n') {
        text.pop_back();
    }
    return text;
}

// A task tokenized as llama-perplexity tokenizes it: the question (or context), a space
// and each answer, with the model's BOS; the tokens all answers share are decoded once.
struct TokenizedTask {
    std::vector<std::vector<llama_token>> seq;
    size_t common_prefix = 0, required = 0;
};

TokenizedTask tokenize_task(const llama_vocab * vocab, const std::string & question,
                            const std::vector<std::string> & answers, const std::string & where) {
    TokenizedTask out;
    for (const std::string & a : answers) {
        out.seq.push_back(tokenize(vocab, question + " " + a, false, where));
    }
    size_t shortest = out.seq[0].size();
    for (const auto & q : out.seq) {
        shortest = std::min(shortest, q.size());
    }
    const auto shared = [&](size_t k) {
        return std::all_of(out.seq.begin(), out.seq.end(), [&](const auto & q) { return q[k] == out.seq[0][k]; });
    };
    while (out.common_prefix < shortest && shared(out.common_prefix)) {
        ++out.common_prefix;
    }
    if (out.common_prefix == 0) {
        fail_file(where, "has answers that share no first token (the model adds no BOS): llama-perplexity reads another "
                         "task's logits for it");
    }
    out.required = out.common_prefix;
    for (size_t s = 0; s < out.seq.size(); ++s) {
        if (out.seq[s].size() == out.common_prefix) {
            fail_file(where, fmt::format("has answer {} adding no token to what the answers share: it has nothing to score",
                                         s));
        }
        out.required += out.seq[s].size() - out.common_prefix;
    }
    return out;
}

// A task batch decoded from a clean cache, in pieces of the context's n_batch as
// llama-perplexity decodes it, every output's logits copied in order.
void decode_tasks(llama_context * ctx, const DecodeBatch & batch, std::vector<float> & logits, int n_vocab,
                  const std::function<void()> & rethrow) {
    logits.resize(batch.outputs() * size_t(n_vocab));
    llama_memory_clear(llama_get_memory(ctx), true);
    size_t outputs = 0;
    batch.decode(ctx, [&] { return fmt::format("a batch of choice tasks of {} tokens", batch.size()); }, rethrow,
                 [&](int32_t, int32_t, int32_t n_out) {
                     std::memcpy(logits.data() + outputs * size_t(n_vocab), llama_get_logits(ctx),
                                 size_t(n_out) * size_t(n_vocab) * sizeof(float));
                     outputs += size_t(n_out);
                 });
}

float largest(const float * logits, int n_vocab) {
    return *std::max_element(logits, logits + n_vocab);
}

// llama-perplexity's log-probability of `tok`, in its float arithmetic.
float token_logprob(const float * logits, int n_vocab, llama_token tok) {
    const float max_logit = largest(logits, n_vocab);
    float sum_p = 0.f;
    for (int j = 0; j < n_vocab; ++j) {
        sum_p += expf(logits[j] - max_logit);
    }
    return logits[tok] - max_logit - std::log(sum_p);
}

// Its probability of `tok` after the shared prefix: a float softmax summed in double.
float first_token_prob(const float * logits, int n_vocab, llama_token tok) {
    const float max_logit = largest(logits, n_vocab);
    double sum_exp = 0.0;
    for (int j = 0; j < n_vocab; ++j) {
        sum_exp += expf(logits[j] - max_logit);
    }
    return float(expf(logits[tok] - max_logit) / sum_exp);
}

} // namespace

std::vector<ChoiceTask> read_hellaswag(const std::filesystem::path & path) {
    const std::string text = prompt_file(path);
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line, '\n');) {
        lines.push_back(line);
    }
    if (lines.empty() || lines.size() % kLinesPerTask != 0) {
        fail_file(path.string(), fmt::format("has {} lines, not a multiple of {}: a HellaSwag task is a context, a label "
                                             "and {} endings, a line each", lines.size(), kLinesPerTask, kEndings));
    }
    std::vector<ChoiceTask> tasks;
    for (size_t i = 0; i < lines.size(); i += kLinesPerTask) {
        ChoiceTask t;
        t.line = i + 1;
        t.context = lines[i];
        const std::string & label = lines[i + 1];
        if (label.size() != 1 || label[0] < '0' || size_t(label[0] - '0') >= kEndings) {
            if (!label.empty() && label.back() == '\r') {
                fail_file(path.string(), fmt::format("line {} (task {}): the label ends in a carriage return (\\r): the "
                                                     "file has CRLF line ends, and every context and ending would keep "
                                                     "its \\r; convert it to LF line ends (dos2unix, or tr -d '\\r')",
                                                     i + 2, i / kLinesPerTask + 1));
            }
            fail_file(path.string(), fmt::format("line {} (task {}): the label is \"{}\", not an ending's index 0 to {}",
                                                 i + 2, i / kLinesPerTask + 1, label, kEndings - 1));
        }
        t.gold = size_t(label[0] - '0');
        t.endings.assign(lines.begin() + std::ptrdiff_t(i + 2), lines.begin() + std::ptrdiff_t(i + kLinesPerTask));
        tasks.push_back(std::move(t));
    }
    return tasks;
}

std::vector<size_t> llama_task_selection(size_t count, size_t n) {
    std::vector<size_t> left(count);
    for (size_t i = 0; i < count; ++i) {
        left[i] = i;
    }
    std::mt19937 rng(1);
    std::vector<size_t> out;
    for (size_t i = 0; i < std::min(n, count); ++i) {
        std::uniform_int_distribution<size_t> dist(0, left.size() - 1);
        const size_t at = dist(rng);
        out.push_back(left[at]);
        left.erase(left.begin() + std::ptrdiff_t(at));
    }
    return out;
}

ContextSettings choice_context(int ctx, int parallel, int ubatch, int threads, ggml_backend_sched_eval_callback callback,
                               void * callback_data) {
    const int sequences = std::max(4, parallel);
    const int total = sequences * ctx;
    ContextSettings s{total, std::min(2048, total), std::min(ubatch, total), threads, callback, callback_data};
    s.seq_max = sequences;
    return s;
}

namespace {

// llama-perplexity's HellaSwag and multiple-choice scoring, which differ only in whether an
// answer's mean log-probability is summed in double (HellaSwag) or float: as many tasks per
// decode as fit the context and its sequences (at most 128), the shared prefix on every
// answer's sequence, outputs at its last token and at every answer token but the last.
template <class Sum>
std::vector<size_t> score_shared_prefix(llama_context * ctx, const std::vector<TokenizedTask> & tasks,
                                        const std::vector<std::string> & where, const std::function<void()> & rethrow) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const size_t n_ctx = llama_n_ctx(ctx), max_seq = std::min<size_t>(4 * 32, llama_n_seq_max(ctx));
    for (size_t i = 0; i < tasks.size(); ++i) {
        if (tasks[i].seq.size() > max_seq) {
            fail_file(where[i], fmt::format("has {} answers, more than the {} sequences of the context (llama-perplexity's "
                                            "-np; eval's --parallel)", tasks[i].seq.size(), max_seq));
        }
        if (tasks[i].required > n_ctx) {
            fail_file(where[i], fmt::format("needs {} tokens for its answers, more than the context's {} (--parallel x -c)",
                                            tasks[i].required, n_ctx));
        }
    }
    DecodeBatch batch(n_ctx, max_seq);
    std::vector<float> logits;
    std::vector<size_t> chosen;
    std::vector<int> seqs;
    for (size_t i0 = 0; i0 < tasks.size();) {
        batch.clear();
        size_t i1 = i0, n_cur = 0, s0 = 0;
        std::vector<size_t> first_output;
        while (i1 < tasks.size() && n_cur + tasks[i1].required <= n_ctx && s0 + tasks[i1].seq.size() <= max_seq) {
            const TokenizedTask & t = tasks[i1];
            seqs.resize(t.seq.size());
            for (size_t s = 0; s < t.seq.size(); ++s) {
                seqs[s] = int(s0 + s);
            }
            for (size_t i = 0; i < t.common_prefix; ++i) {
                batch.add(t.seq[0][i], i, seqs, false);
            }
            first_output.push_back(batch.outputs());
            batch.output_last();
            for (size_t s = 0; s < t.seq.size(); ++s) {
                for (size_t i = t.common_prefix; i < t.seq[s].size(); ++i) {
                    batch.add(t.seq[s][i], i, {int(s0 + s)}, i + 1 < t.seq[s].size());
                }
            }
            s0 += t.seq.size();
            n_cur += t.required;
            ++i1;
        }
        decode_tasks(ctx, batch, logits, n_vocab, rethrow);
        for (size_t i = i0; i < i1; ++i) {
            const TokenizedTask & t = tasks[i];
            const float * prefix = logits.data() + first_output[i - i0] * size_t(n_vocab);
            size_t at = first_output[i - i0] + 1;
            Sum best = 0;
            size_t best_answer = 0;
            for (size_t s = 0; s < t.seq.size(); ++s) {
                Sum logprob = std::log(first_token_prob(prefix, n_vocab, t.seq[s][t.common_prefix]));
                size_t count = 1;
                for (size_t j = t.common_prefix; j + 1 < t.seq[s].size(); ++j, ++at, ++count) {
                    logprob += token_logprob(logits.data() + at * size_t(n_vocab), n_vocab, t.seq[s][j + 1]);
                }
                logprob /= Sum(count);
                if (s == 0 || logprob > best) {
                    best = logprob;
                    best_answer = s;
                }
            }
            chosen.push_back(best_answer);
        }
        i0 = i1;
    }
    return chosen;
}

} // namespace

std::vector<size_t> score_hellaswag(llama_context * ctx, const std::vector<ChoiceTask> & tasks,
                                    const std::vector<size_t> & selection, const std::string & origin,
                                    const std::function<void()> & rethrow) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    std::vector<TokenizedTask> tokenized;
    std::vector<std::string> where;
    for (size_t i : selection) {
        where.push_back(fmt::format("{} line {} (task {})", origin, tasks[i].line, i + 1));
        tokenized.push_back(tokenize_task(vocab, tasks[i].context, tasks[i].endings, where.back()));
    }
    return score_shared_prefix<double>(ctx, tokenized, where, rethrow);
}

std::vector<size_t> score_multiple_choice(llama_context * ctx, const std::vector<MultipleChoiceTask> & tasks,
                                          const std::string & origin, const std::function<void()> & rethrow) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    std::vector<TokenizedTask> tokenized;
    std::vector<std::string> where;
    for (const MultipleChoiceTask & t : tasks) {
        where.push_back(fmt::format("{} (task {})", origin, t.index));
        tokenized.push_back(tokenize_task(vocab, t.question, t.answers, where.back()));
    }
    return score_shared_prefix<float>(ctx, tokenized, where, rethrow);
}

namespace {

// One line of the CSV as llama-perplexity splits it: the first four commas outside double
// quotes; a sentence that starts with a quote loses it and the character before the comma.
bool split_winogrande(const std::string & line, WinograndeTask & t, std::string & why) {
    size_t comma[4];
    int found = 0;
    bool quoted = false;
    for (size_t i = 0; i < line.size() && found < 4; ++i) {
        if (quoted) {
            quoted = line[i] != '"';
        } else if (line[i] == ',') {
            comma[found++] = i;
        } else if (line[i] == '"') {
            quoted = true;
        }
    }
    if (found != 4) {
        why = "has fewer than the 4 commas of index,sentence,choice1,choice2,answer";
        return false;
    }
    const std::string sentence = line[comma[0] + 1] == '"' ? line.substr(comma[0] + 2, comma[1] - comma[0] - 3)
                                                            : line.substr(comma[0] + 1, comma[1] - comma[0] - 1);
    const size_t blank = sentence.find('_');
    if (blank == std::string::npos) {
        why = "has no _ in its sentence for the choice to fill";
        return false;
    }
    std::istringstream answer(line.substr(comma[3] + 1));
    int gold = 0;
    answer >> gold;
    if (answer.fail() || gold < 1 || gold > 2) {
        why = fmt::format("has the answer \"{}\", not 1 or 2", line.substr(comma[3] + 1));
        return false;
    }
    t.first = sentence.substr(0, blank);
    t.second = sentence.substr(blank + 1);
    t.choices[0] = line.substr(comma[1] + 1, comma[2] - comma[1] - 1);
    t.choices[1] = line.substr(comma[2] + 1, comma[3] - comma[2] - 1);
    t.gold = size_t(gold - 1);
    return true;
}

struct TokenizedWinogrande {
    std::vector<llama_token> seq[2];
    size_t common_prefix = 0, required = 0, n_base[2] = {0, 0};
};

constexpr size_t kMinTrailing = 3;   // llama-perplexity's k_min_trailing_ctx

// Where llama-perplexity starts scoring each sentence: after the choice when both go on for
// more than three tokens past what they share, else right after what they share.
size_t scored_from(const TokenizedWinogrande & t, size_t s) {
    const bool skip_choice =
        t.seq[0].size() - t.common_prefix > kMinTrailing && t.seq[1].size() - t.common_prefix > kMinTrailing;
    return skip_choice ? t.n_base[s] : t.common_prefix;
}

} // namespace

std::vector<WinograndeTask> read_winogrande(const std::filesystem::path & path) {
    const std::string text = prompt_file(path);
    std::vector<WinograndeTask> tasks;
    std::istringstream in(text);
    size_t number = 0;
    for (std::string line; std::getline(in, line) && !in.eof();) {
        ++number;
        WinograndeTask t;
        t.line = number;
        std::string why;
        if (split_winogrande(line, t, why)) {
            tasks.push_back(std::move(t));
        } else if (number > 1) {
            fail_file(path.string(), fmt::format("line {} {}", number, why));
        }
    }
    if (tasks.empty()) {
        fail_file(path.string(), "holds no WinoGrande task that llama-perplexity reads (index,sentence with _,choice1,"
                                 "choice2,answer per line; it never reads the last line)");
    }
    return tasks;
}

std::vector<size_t> llama_winogrande_selection(size_t count, size_t n) {
    std::vector<size_t> out;
    if (n == 0 || n >= count) {
        for (size_t i = 0; i < count; ++i) {
            out.push_back(i);
        }
        return out;
    }
    std::mt19937 rng(1);
    std::vector<int> left(count);
    for (size_t i = 0; i < count; ++i) {
        left[i] = int(i);
    }
    const float scale = 1 / (1.f + float(rng.max()));
    for (size_t i = 0; i < n; ++i) {
        const int j = int(scale * float(rng()) * float(left.size()));
        out.push_back(size_t(left[size_t(j)]));
        left[size_t(j)] = left.back();
        left.pop_back();
    }
    return out;
}

std::vector<size_t> score_winogrande(llama_context * ctx, const std::vector<WinograndeTask> & tasks,
                                     const std::vector<size_t> & selection, const std::string & origin,
                                     const std::function<void()> & rethrow) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const size_t n_ctx = llama_n_ctx(ctx), max_seq = std::min<size_t>(256, llama_n_seq_max(ctx));
    std::vector<TokenizedWinogrande> tokenized;
    for (size_t i : selection) {
        const WinograndeTask & w = tasks[i];
        const std::string where = fmt::format("{} line {}", origin, w.line);
        TokenizedWinogrande t;
        for (size_t s = 0; s < 2; ++s) {
            t.seq[s] = tokenize(vocab, w.first + w.choices[s] + w.second, false, where);
            t.n_base[s] = tokenize(vocab, w.first + w.choices[s], false, where).size();
        }
        while (t.common_prefix < std::min(t.seq[0].size(), t.seq[1].size()) &&
               t.seq[0][t.common_prefix] == t.seq[1][t.common_prefix]) {
            ++t.common_prefix;
        }
        t.required = t.seq[0].size() + t.seq[1].size() - t.common_prefix;
        for (size_t s = 0; s < 2; ++s) {
            const size_t from = scored_from(t, s);
            if (from < t.common_prefix) {
                fail_file(where, "has a choice that tokenizes into what both sentences share: nothing tells them apart");
            }
            if (t.common_prefix == 0) {
                fail_file(where, "has sentences that share no first token (the model adds no BOS): llama-perplexity "
                                 "reads another task's logits for it");
            }
        }
        if (t.required > n_ctx) {
            fail_file(where, fmt::format("needs {} tokens for its two sentences, more than the context's {} (4 x -c)",
                                         t.required, n_ctx));
        }
        tokenized.push_back(std::move(t));
    }
    DecodeBatch batch(n_ctx, 2);
    std::vector<float> logits;
    std::vector<size_t> chosen;
    for (size_t i0 = 0; i0 < tokenized.size();) {
        // As many tasks as fit the context and the sequences, two sequences each.
        batch.clear();
        size_t i1 = i0, n_cur = 0;
        std::vector<size_t> first_output;
        while (i1 < tokenized.size() && n_cur + tokenized[i1].required <= n_ctx && 2 * (i1 - i0) + 2 <= max_seq) {
            const TokenizedWinogrande & t = tokenized[i1];
            const int s0 = int(2 * (i1 - i0));
            for (size_t i = 0; i < t.common_prefix; ++i) {
                batch.add(t.seq[0][i], i, {s0, s0 + 1}, false);
            }
            first_output.push_back(batch.outputs());
            batch.output_last();
            for (size_t s = 0; s < 2; ++s) {
                for (size_t i = t.common_prefix; i < t.seq[s].size(); ++i) {
                    batch.add(t.seq[s][i], i, {s0 + int(s)}, true);
                }
            }
            n_cur += t.required;
            ++i1;
        }
        decode_tasks(ctx, batch, logits, n_vocab, rethrow);
        for (size_t i = i0; i < i1; ++i) {
            const TokenizedWinogrande & t = tokenized[i];
            float score[2];
            for (size_t s = 0; s < 2; ++s) {
                const size_t from = scored_from(t, s);
                const size_t last = t.seq[s].size() - from > 1 ? 1 : 0;
                // The first sequence's outputs follow the prefix's; the second's follow
                // those, and where it does not skip the choice llama-perplexity starts
                // one output early (its FIXME), which is kept so the answers agree.
                size_t at = first_output[i - i0] + (s == 0 ? from - t.common_prefix
                                                            : t.seq[0].size() - t.common_prefix + from - t.common_prefix);
                float sum = 0;
                for (size_t j = from - 1; j < t.seq[s].size() - 1 - last; ++j) {
                    sum += token_logprob(logits.data() + at++ * size_t(n_vocab), n_vocab, t.seq[s][j + 1]);
                }
                // A sentence with nothing after the choice scores 0/0, and then loses, as there.
                score[s] = sum / float(t.seq[s].size() - from - last);
            }
            chosen.push_back(score[0] > score[1] ? 0 : 1);
        }
        i0 = i1;
    }
    return chosen;
}

namespace {

// llama.cpp's serialized strings and answer sets: little-endian uint32 counts, then bytes
// or int32 labels, as perplexity.cpp's deserialize reads them.
struct ByteReader {
    const std::string & bytes;
    size_t at = 0;
    bool u32(uint32_t & v) {
        if (bytes.size() - at < 4) {
            return false;
        }
        std::memcpy(&v, bytes.data() + at, 4);
        at += 4;
        return true;
    }
    bool string(std::string & s) {
        uint32_t n = 0;
        if (!u32(n) || bytes.size() - at < n) {
            return false;
        }
        s.assign(bytes.data() + at, n);
        at += n;
        return true;
    }
    bool answers(std::vector<std::string> & answers, std::vector<int32_t> & labels) {
        uint32_t n = 0;
        if (!u32(n) || n > 100) {   // llama-perplexity's own bound
            return false;
        }
        answers.resize(n);
        for (std::string & a : answers) {
            if (!string(a)) {
                return false;
            }
        }
        labels.resize(n);
        if (bytes.size() - at < 4 * size_t(n)) {
            return false;
        }
        if (n > 0) {   // an empty vector's data() may be null, which memcpy may not be given
            std::memcpy(labels.data(), bytes.data() + at, 4 * size_t(n));
        }
        at += 4 * size_t(n);
        return true;
    }
};

} // namespace

std::vector<MultipleChoiceTask> read_multiple_choice(const std::filesystem::path & path, size_t n, size_t & count) {
    const std::string bytes = prompt_file(path);   // a final newline dropped, binary or not, as there
    ByteReader in{bytes};
    uint32_t n_task = 0;
    if (!in.u32(n_task) || n_task == 0) {
        fail_file(path.string(), "holds no multiple-choice tasks (its first 4 bytes, the task count, are missing or 0)");
    }
    if ((bytes.size() - in.at) / 4 < n_task) {
        fail_file(path.string(), fmt::format("is cut short in its table of {} task positions", n_task));
    }
    std::vector<uint32_t> position(n_task);
    for (uint32_t & p : position) {
        in.u32(p);
    }
    count = n_task;
    // All: one after another from the end of the table; else each at its position.
    const std::vector<size_t> order = llama_winogrande_selection(n_task, n);
    const bool sequential = n == 0 || n >= n_task;
    std::vector<MultipleChoiceTask> tasks;
    for (size_t i : order) {
        MultipleChoiceTask t;
        t.index = i + 1;
        if (!sequential) {
            in.at = position[i];
        }
        std::vector<std::string> several;
        std::vector<int32_t> several_labels;
        if (in.at > bytes.size() || !in.string(t.question) || !in.answers(t.answers, t.labels) ||
            !in.answers(several, several_labels)) {
            fail_file(path.string(), fmt::format("task {} (at byte {}) is cut short or has more than 100 answers", i + 1,
                                                 sequential ? in.at : size_t(position[i])));
        }
        if (t.question.empty() || t.answers.empty() ||
            std::any_of(t.answers.begin(), t.answers.end(), [](const std::string & a) { return a.empty(); })) {
            fail_file(path.string(), fmt::format("task {} has an empty question or answer", i + 1));
        }
        if (t.answers.size() < 2) {
            fail_file(path.string(), fmt::format("task {} has one answer: a choice needs two or more", i + 1));
        }
        // llama-perplexity scores a label other than 0 or 1, or no right answer, as wrong
        // without a word: a task nobody can get right is a broken file.
        for (size_t a = 0; a < t.labels.size(); ++a) {
            if (t.labels[a] != 0 && t.labels[a] != 1) {
                fail_file(path.string(), fmt::format("task {}: answer {} is labelled {}: a label is 1 (right) or 0 (wrong)",
                                                     i + 1, a, t.labels[a]));
            }
        }
        if (std::find(t.labels.begin(), t.labels.end(), 1) == t.labels.end()) {
            fail_file(path.string(), fmt::format("task {} has no right answer (no answer labelled 1)", i + 1));
        }
        tasks.push_back(std::move(t));
    }
    return tasks;
}

nlohmann::json to_json(const TaskFigures & f) {
    nlohmann::json j = {{"tasks", f.tasks},
                        {"correct", f.correct},
                        {"accuracy", f.accuracy},
                        {"stderr", f.stderr_},
                        {"kept_base_correct", f.kept_base_correct},
                        {"new_correct", f.new_correct},
                        {"answers", f.answers}};
    if (!f.domains.empty()) {
        j["domains"] = nlohmann::json::array();
        for (const auto & [domain, d] : f.domains) {
            nlohmann::json row = to_json(d);
            row.erase("answers");
            row["domain"] = domain;
            j["domains"].push_back(std::move(row));
        }
    }
    return j;
}

TaskFigures task_figures(const std::function<bool(size_t, size_t)> & right, const std::vector<size_t> & chosen,
                         const std::vector<size_t> & base_chosen) {
    TaskFigures f;
    f.tasks = chosen.size();
    for (size_t i = 0; i < chosen.size(); ++i) {
        const bool ok = right(i, chosen[i]), base_ok = right(i, base_chosen[i]);
        f.correct += ok;
        f.kept_base_correct += ok && base_ok;
        f.new_correct += ok && !base_ok;
        f.answers += chosen[i] < 10 ? char('0' + chosen[i]) : char('a' + chosen[i] - 10);
    }
    if (f.tasks > 0) {
        f.accuracy = double(f.correct) / double(f.tasks);
        f.stderr_ = std::sqrt(f.accuracy * (1 - f.accuracy) / double(f.tasks));
    }
    return f;
}

TaskFigures task_figures(const std::function<bool(size_t, size_t)> & right, const std::vector<size_t> & chosen,
                         const std::vector<size_t> & base_chosen, const std::vector<std::string> & domains,
                         const std::vector<std::string> & domain_of) {
    TaskFigures f = task_figures(right, chosen, base_chosen);
    for (const std::string & domain : domains) {
        std::vector<size_t> at, mine, base;
        for (size_t i = 0; i < chosen.size(); ++i) {
            if (domain_of[i] == domain) {
                at.push_back(i);
                mine.push_back(chosen[i]);
                base.push_back(base_chosen[i]);
            }
        }
        if (!at.empty()) {
            TaskFigures d = task_figures([&](size_t i, size_t c) { return right(at[i], c); }, mine, base);
            d.answers.clear();
            f.domains.push_back({domain, std::move(d)});
        }
    }
    return f;
}

} // namespace moeprune
