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

nlohmann::json to_json(const TaskFigures & f) {
    return {{"tasks", f.tasks},
            {"correct", f.correct},
            {"accuracy", f.accuracy},
            {"stderr", f.stderr_},
            {"kept_base_correct", f.kept_base_correct},
            {"new_correct", f.new_correct},
            {"answers", f.answers}};
}

TaskFigures task_figures(const std::vector<ChoiceTask> & tasks, const std::vector<size_t> & selection,
                         const std::vector<size_t> & chosen, const std::vector<size_t> & base_chosen) {
    TaskFigures f;
    f.tasks = chosen.size();
    for (size_t i = 0; i < chosen.size(); ++i) {
        const bool right = chosen[i] == tasks[selection[i]].gold, base_right = base_chosen[i] == tasks[selection[i]].gold;
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
