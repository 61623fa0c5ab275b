#include "eval/tasks.h"

#include "core/errors.h"
#include "core/atomic_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

namespace moeprune {

namespace {

constexpr size_t kEndings = 4, kLinesPerTask = 2 + kEndings;

// A task tokenized as llama-perplexity tokenizes it: context, a space and each ending,
// with the model's BOS; the tokens all four sequences share are decoded once.
struct TokenizedTask {
    std::vector<llama_token> seq[kEndings];
    size_t common_prefix = 0, required = 0;
};

TokenizedTask tokenize_task(const llama_vocab * vocab, const ChoiceTask & t, const std::string & where) {
    TokenizedTask out;
    for (size_t s = 0; s < kEndings; ++s) {
        out.seq[s] = tokenize(vocab, t.context + " " + t.endings[s], false, where);
    }
    const size_t shortest = std::min({out.seq[0].size(), out.seq[1].size(), out.seq[2].size(), out.seq[3].size()});
    while (out.common_prefix < shortest && out.seq[0][out.common_prefix] == out.seq[1][out.common_prefix] &&
           out.seq[0][out.common_prefix] == out.seq[2][out.common_prefix] &&
           out.seq[0][out.common_prefix] == out.seq[3][out.common_prefix]) {
        ++out.common_prefix;
    }
    out.required = out.common_prefix;
    for (size_t s = 0; s < kEndings; ++s) {
        if (out.seq[s].size() == out.common_prefix) {
            fail_file(where, fmt::format("has ending {} adding no token to what the endings share: it has nothing to score", s));
        }
        out.required += out.seq[s].size() - out.common_prefix;
    }
    return out;
}

// The batch decoded in pieces of the context's n_batch, as llama-perplexity decodes it,
// every output's logits copied in order.
void decode_in_batches(llama_context * ctx, llama_batch & batch, std::vector<float> & logits, int n_vocab,
                       const std::function<void()> & rethrow) {
    const int n_batch = int(llama_n_batch(ctx));
    size_t outputs = 0;
    for (int i = 0; i < batch.n_tokens; i += n_batch) {
        const int n = std::min(n_batch, batch.n_tokens - i);
        llama_batch view = {n, batch.token + i, nullptr, batch.pos + i, batch.n_seq_id + i, batch.seq_id + i, batch.logits + i};
        const int rc = llama_decode(ctx, view);
        if (rethrow) {
            rethrow();
        }
        if (rc != 0) {
            throw Error(fmt::format("llama_decode failed ({}) on a choice task of {} tokens", rc, batch.n_tokens));
        }
        int n_out = 0;
        for (int k = 0; k < n; ++k) {
            n_out += view.logits[k] != 0;
        }
        std::memcpy(logits.data() + outputs * size_t(n_vocab), llama_get_logits(ctx), size_t(n_out) * size_t(n_vocab) * sizeof(float));
        outputs += size_t(n_out);
    }
}

// llama-perplexity's log-probability of `tok`, in its float arithmetic.
float token_logprob(const float * logits, int n_vocab, llama_token tok) {
    float max_logit = logits[0];
    for (int j = 1; j < n_vocab; ++j) {
        max_logit = std::max(max_logit, logits[j]);
    }
    float sum_p = 0.f;
    for (int j = 0; j < n_vocab; ++j) {
        sum_p += expf(logits[j] - max_logit);
    }
    return logits[tok] - max_logit - std::log(sum_p);
}

// Its probability of `tok` after the shared prefix: a float softmax summed in double.
float first_token_prob(const float * logits, int n_vocab, llama_token tok) {
    float max_logit = logits[0];
    for (int j = 0; j < n_vocab; ++j) {
        max_logit = std::max(max_logit, logits[j]);
    }
    double sum_exp = 0.0;
    for (int j = 0; j < n_vocab; ++j) {
        sum_exp += expf(logits[j] - max_logit);
    }
    return float(expf(logits[tok] - max_logit) / sum_exp);
}

} // namespace

std::vector<ChoiceTask> read_hellaswag(const std::filesystem::path & path) {
    std::string text = read_text_file(path);
    if (!text.empty() && text.back() == '\n') {
        text.pop_back();   // as llama.cpp's -f reads a prompt file
    }
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

ContextSettings choice_context(int ctx, int ubatch, int threads, ggml_backend_sched_eval_callback callback,
                               void * callback_data) {
    const int total = int(kEndings) * ctx;
    ContextSettings s{total, std::min(2048, total), std::min(ubatch, total), threads, callback, callback_data};
    s.seq_max = int(kEndings);
    return s;
}

std::vector<size_t> score_hellaswag(llama_context * ctx, const std::vector<ChoiceTask> & tasks,
                                    const std::vector<size_t> & selection, const std::string & origin,
                                    const std::function<void()> & rethrow) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_ctx = int(llama_n_ctx(ctx));
    std::vector<TokenizedTask> tokenized;
    for (size_t i : selection) {
        const std::string where = fmt::format("{} line {} (task {})", origin, tasks[i].line, i + 1);
        tokenized.push_back(tokenize_task(vocab, tasks[i], where));
        if (tokenized.back().required > size_t(n_ctx)) {
            fail_file(where, fmt::format("needs {} tokens for its four endings, more than the context's {} (4 x -c)",
                                         tokenized.back().required, n_ctx));
        }
    }
    llama_batch batch = llama_batch_init(n_ctx, 0, int32_t(kEndings));
    std::vector<float> logits;
    std::vector<size_t> chosen;
    try {
        for (const TokenizedTask & t : tokenized) {
            batch.n_tokens = 0;
            const auto add = [&](llama_token tok, int pos, std::initializer_list<int> seqs, bool output) {
                const int k = batch.n_tokens++;
                batch.token[k] = tok;
                batch.pos[k] = pos;
                batch.n_seq_id[k] = int32_t(seqs.size());
                std::copy(seqs.begin(), seqs.end(), batch.seq_id[k]);
                batch.logits[k] = output;
            };
            for (size_t i = 0; i < t.common_prefix; ++i) {
                add(t.seq[0][i], int(i), {0, 1, 2, 3}, false);
            }
            batch.logits[batch.n_tokens - 1] = true;
            size_t n_out = 1;
            for (size_t s = 0; s < kEndings; ++s) {
                for (size_t i = t.common_prefix; i < t.seq[s].size(); ++i) {
                    const bool output = i + 1 < t.seq[s].size();
                    add(t.seq[s][i], int(i), {int(s)}, output);
                    n_out += output;
                }
            }
            logits.resize(n_out * size_t(n_vocab));
            llama_memory_clear(llama_get_memory(ctx), true);
            decode_in_batches(ctx, batch, logits, n_vocab, rethrow);
            size_t at = 1;
            double best = 0;
            size_t best_ending = 0;
            for (size_t s = 0; s < kEndings; ++s) {
                double logprob = std::log(first_token_prob(logits.data(), n_vocab, t.seq[s][t.common_prefix]));
                size_t count = 1;
                for (size_t j = t.common_prefix; j + 1 < t.seq[s].size(); ++j, ++at, ++count) {
                    logprob += token_logprob(logits.data() + at * size_t(n_vocab), n_vocab, t.seq[s][j + 1]);
                }
                logprob /= double(count);
                if (s == 0 || logprob > best) {
                    best = logprob;
                    best_ending = s;
                }
            }
            chosen.push_back(best_ending);
        }
    } catch (...) {
        llama_batch_free(batch);
        throw;
    }
    llama_batch_free(batch);
    return chosen;
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
    std::string text = read_text_file(path);
    if (!text.empty() && text.back() == '\n') {
        text.pop_back();
    }
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
    llama_batch batch = llama_batch_init(int32_t(n_ctx), 0, 2);
    std::vector<float> logits;
    std::vector<size_t> chosen;
    try {
        for (size_t i0 = 0; i0 < tokenized.size();) {
            // As many tasks as fit the context and the sequences, two sequences each.
            batch.n_tokens = 0;
            size_t i1 = i0, n_cur = 0, n_out = 0;
            std::vector<size_t> first_output;
            while (i1 < tokenized.size() && n_cur + tokenized[i1].required <= n_ctx && 2 * (i1 - i0) + 2 <= max_seq) {
                const TokenizedWinogrande & t = tokenized[i1];
                const int s0 = int(2 * (i1 - i0));
                const auto add = [&](llama_token tok, size_t pos, std::initializer_list<int> seqs, bool output) {
                    const int k = batch.n_tokens++;
                    batch.token[k] = tok;
                    batch.pos[k] = int(pos);
                    batch.n_seq_id[k] = int32_t(seqs.size());
                    std::copy(seqs.begin(), seqs.end(), batch.seq_id[k]);
                    batch.logits[k] = output;
                };
                for (size_t i = 0; i < t.common_prefix; ++i) {
                    add(t.seq[0][i], i, {s0, s0 + 1}, i + 1 == t.common_prefix);
                }
                first_output.push_back(n_out);
                n_out += 1;
                for (size_t s = 0; s < 2; ++s) {
                    for (size_t i = t.common_prefix; i < t.seq[s].size(); ++i) {
                        add(t.seq[s][i], i, {s0 + int(s)}, true);
                        n_out += 1;
                    }
                }
                n_cur += t.required;
                ++i1;
            }
            logits.resize(n_out * size_t(n_vocab));
            llama_memory_clear(llama_get_memory(ctx), true);
            decode_in_batches(ctx, batch, logits, n_vocab, rethrow);
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
    } catch (...) {
        llama_batch_free(batch);
        throw;
    }
    llama_batch_free(batch);
    return chosen;
}

nlohmann::json to_json(const TaskFigures & f) {
    return {{"tasks", f.tasks},
            {"correct", f.correct},
            {"accuracy", f.accuracy},
            {"stderr", f.stderr_},
            {"kept_base_correct", f.kept_base_correct},
            {"new_correct", f.new_correct},
            {"answers", f.answers}};
}

TaskFigures task_figures(const std::vector<size_t> & gold, const std::vector<size_t> & chosen,
                         const std::vector<size_t> & base_chosen) {
    TaskFigures f;
    f.tasks = chosen.size();
    for (size_t i = 0; i < chosen.size(); ++i) {
        const bool right = chosen[i] == gold[i], base_right = base_chosen[i] == gold[i];
        f.correct += right;
        f.kept_base_correct += right && base_right;
        f.new_correct += right && !base_right;
        f.answers += char('0' + chosen[i]);
    }
    if (f.tasks > 0) {
        f.accuracy = double(f.correct) / double(f.tasks);
        f.stderr_ = std::sqrt(f.accuracy * (1 - f.accuracy) / double(f.tasks));
    }
    return f;
}

} // namespace moeprune
