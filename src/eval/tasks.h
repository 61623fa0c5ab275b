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

// llama-perplexity's context for choice tasks: four sequences on one cache of 4 x `ctx`
// tokens, as it sets n_parallel 4 and a unified cache.
ContextSettings choice_context(int ctx, int ubatch, int threads, ggml_backend_sched_eval_callback callback,
                               void * callback_data);

// The ending each selected task's highest mean log-probability picks (acc_norm), from a
// context made by choice_context. `origin` names the file in errors (a task longer than
// the context); `rethrow` runs after each decode (what the graph callback caught).
std::vector<size_t> score_hellaswag(llama_context * ctx, const std::vector<ChoiceTask> & tasks,
                                    const std::vector<size_t> & selection, const std::string & origin,
                                    const std::function<void()> & rethrow);

// Accuracy of a candidate against the base's answers on the same tasks.
struct TaskFigures {
    uint64_t tasks = 0, correct = 0;
    double accuracy = 0, stderr_ = 0;     // binomial: sqrt(p (1 - p) / n)
    uint64_t kept_base_correct = 0;       // tasks both answer right
    uint64_t new_correct = 0;             // tasks it answers right and the base does not
    std::string answers;                  // the ending chosen per task, in the order scored ("0312...")
};
// `chosen` and `base_chosen` per selected task, against its gold ending.
TaskFigures task_figures(const std::vector<ChoiceTask> & tasks, const std::vector<size_t> & selection,
                         const std::vector<size_t> & chosen, const std::vector<size_t> & base_chosen);
nlohmann::json to_json(const TaskFigures & f);

} // namespace moeprune
