#pragma once
// Choice tasks scored as llama-perplexity scores them (tools/perplexity/perplexity.cpp of
// the pinned release), so that a keep map's or a candidate's accuracy here is the one
// `llama-perplexity --hellaswag` gives its sliced file, task for task. docs/eval.md,
// "Task accuracy".
#include "engine/session.h"

#include "llama.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace moeprune {

// One HellaSwag task as llama.cpp's file holds it: the context, the gold ending's index
// and four endings, six lines in all.
struct ChoiceTask {
    std::string context;
    size_t gold = 0;
    std::vector<std::string> endings;
    size_t line = 0;   // of its context in the file, from 1
};

// Refused with the file and line named: a line count that is not a multiple of 6, a label
// that is not 0 to 3.
std::vector<ChoiceTask> read_hellaswag(const std::filesystem::path & path);

// llama-perplexity's choice of min(n, count) tasks: drawn one at a time from those left,
// by std::mt19937 seeded 1 (--hellaswag-tasks; its default is 400). Indices, in the order
// scored.
std::vector<size_t> llama_task_selection(size_t count, size_t n);

// One WinoGrande task as llama.cpp's CSV holds it (index, sentence with a "_" where the
// choice goes, choice 1, choice 2, answer 1 or 2), split at the "_".
struct WinograndeTask {
    std::string first, second;
    std::string choices[2];
    size_t gold = 0;   // 0 or 1
    size_t line = 0;   // from 1
};

// As llama-perplexity reads the CSV: its -f drops the file's final newline and its loop
// stops at the end of the text, so the last line is never read. A first line that is not
// a task (a header) is skipped as llama-perplexity skips it; any other line that is not a
// task is refused with the file and line named (llama-perplexity skips those too, and
// scores fewer tasks than the file seems to hold).
std::vector<WinograndeTask> read_winogrande(const std::filesystem::path & path);

// llama-perplexity's --winogrande-tasks N (and --multiple-choice-tasks N, drawn alike): all,
// in file order, when N is 0 or not below the count; else N drawn by std::mt19937 seeded 1
// in its float arithmetic.
std::vector<size_t> llama_winogrande_selection(size_t count, size_t n);

// The choice (0 or 1) each selected task's higher mean log-probability of the words after
// the choice picks, as llama-perplexity scores it (its two tasks per decode and its use of
// the first sequence's last logits where it does not skip the choice word included).
std::vector<size_t> score_winogrande(llama_context * ctx, const std::vector<WinograndeTask> & tasks,
                                     const std::vector<size_t> & selection, const std::string & origin,
                                     const std::function<void()> & rethrow);

// llama-perplexity's context for choice tasks: `parallel` sequences (its -np, at least 4)
// on one cache of parallel x `ctx` tokens, a unified cache, batches of at most 2048.
ContextSettings choice_context(int ctx, int parallel, int ubatch, int threads, ggml_backend_sched_eval_callback callback,
                               void * callback_data);

// The ending each selected task's highest mean log-probability picks (acc_norm), from a
// context made by choice_context. `origin` names the file in errors (a task longer than
// the context); `rethrow` runs after each decode (what the graph callback caught).
std::vector<size_t> score_hellaswag(llama_context * ctx, const std::vector<ChoiceTask> & tasks,
                                    const std::vector<size_t> & selection, const std::string & origin,
                                    const std::function<void()> & rethrow);

// One task of llama.cpp's binary multiple-choice file (ARC, MMLU, TruthfulQA as
// llama-perplexity --multiple-choice reads them): a question, its answers and their labels
// (1: right); the second set of answers (several right) is read and not scored, as there.
struct MultipleChoiceTask {
    std::string question;
    std::vector<std::string> answers;
    std::vector<int32_t> labels;
    size_t index = 0;   // in the file, from 1
};

// The tasks llama-perplexity scores for --multiple-choice-tasks `n`: every task in file
// order when n is 0 or not below the count, else n drawn by std::mt19937 seeded 1 (in its
// float arithmetic), each read at its position from the file's table. `count` gets the
// number of tasks the file holds. A file cut short, a task with more than 100 answers, an
// empty question or answer: refused, naming the file and the task.
std::vector<MultipleChoiceTask> read_multiple_choice(const std::filesystem::path & path, size_t n, size_t & count);

// The answer with the highest mean log-probability per task (acc_norm, in llama-perplexity's
// float arithmetic), as many tasks per decode as fit the context and the sequences.
std::vector<size_t> score_multiple_choice(llama_context * ctx, const std::vector<MultipleChoiceTask> & tasks,
                                          const std::string & origin, const std::function<void()> & rethrow);

struct TaskDomainFigures;

// Accuracy of a candidate against the base's answers on the same tasks.
struct TaskFigures {
    uint64_t tasks = 0, correct = 0;
    double accuracy = 0, stderr_ = 0;     // binomial: sqrt(p (1 - p) / n)
    uint64_t kept_base_correct = 0;       // tasks both answer right
    uint64_t new_correct = 0;             // tasks it answers right and the base does not
    std::string answers;                  // the ending chosen per task, in the order scored ("0312...")
    // With the tasks' domains (corpus' tasks.json): the same figures over each domain's
    // tasks, in the domains' order; their answers are left empty.
    std::vector<TaskDomainFigures> domains;
};
struct TaskDomainFigures {
    std::string domain;
    TaskFigures figures;
};
// `chosen` and `base_chosen` per selected task; `right(task, choice)` says whether a
// choice of the task-th selected task is right.
TaskFigures task_figures(const std::function<bool(size_t, size_t)> & right, const std::vector<size_t> & chosen,
                         const std::vector<size_t> & base_chosen);
// The same, and per domain: `domain_of[i]` is the i-th selected task's, `domains` their order.
TaskFigures task_figures(const std::function<bool(size_t, size_t)> & right, const std::vector<size_t> & chosen,
                         const std::vector<size_t> & base_chosen, const std::vector<std::string> & domains,
                         const std::vector<std::string> & domain_of);
nlohmann::json to_json(const TaskFigures & f);

} // namespace moeprune
