// Task accuracy, the phase after the behaviour checks: the base, every keep map masked in
// it and every candidate file answer the same tasks, each in a context made as
// llama-perplexity makes one for them (eval/tasks.h).
#include "eval/eval_run.h"
#include "core/progress.h"

#include <fmt/format.h>

namespace moeprune::eval_impl {

namespace {

constexpr size_t kHellaswagDefaultTasks = 400;   // llama-perplexity's --hellaswag-tasks

} // namespace

// The task file read and its tasks chosen before any model loads: a bad file costs nothing.
void EvalRun::read_tasks() {
    if (!opt.hellaswag.empty()) {
        choice_tasks = read_hellaswag(opt.hellaswag);
        task_selection = llama_task_selection(choice_tasks.size(), opt.tasks > 0 ? size_t(opt.tasks) : kHellaswagDefaultTasks);
        for (size_t i : task_selection) {
            task_gold.push_back(choice_tasks[i].gold);
            task_lines.push_back(choice_tasks[i].line);
        }
    } else if (!opt.winogrande.empty()) {
        winogrande_tasks = read_winogrande(opt.winogrande);
        task_selection = llama_winogrande_selection(winogrande_tasks.size(), size_t(opt.tasks));
        for (size_t i : task_selection) {
            task_gold.push_back(winogrande_tasks[i].gold);
            task_lines.push_back(winogrande_tasks[i].line);
        }
    }
}

void EvalRun::score_tasks() {
    if (task_selection.empty()) {
        return;
    }
    const bool hellaswag = !choice_tasks.empty();
    const std::string origin = (hellaswag ? opt.hellaswag : opt.winogrande).string();
    Progress progress("tasks", 1 + maps.size() + files.size(), "models");
    const auto answers = [&](llama_model * model, ggml_backend_sched_eval_callback cb, void * cb_data,
                             const std::function<void()> & rethrow) {
        const ContextPtr ctx = new_context(model, choice_context(opt.ctx, opt.ubatch, threads, cb, cb_data));
        std::vector<size_t> chosen =
            hellaswag ? score_hellaswag(ctx.get(), choice_tasks, task_selection, origin, rethrow)
                      : score_winogrande(ctx.get(), winogrande_tasks, task_selection, origin, rethrow);
        progress.advance(1);
        return chosen;
    };
    const std::vector<size_t> base_chosen = answers(base.model.get(), nullptr, nullptr, {});
    const auto figures = [&](const std::vector<size_t> & chosen) { return task_figures(task_gold, chosen, base_chosen); };
    for (size_t k = 0; k < maps.size(); ++k) {
        mask->set(maps[k].second, maps[k].first.string());
        rep.candidates[k].tasks =
            figures(answers(base.model.get(), &RouterMask::callback, &*mask, [&] { mask->rethrow_failure(); }));
    }
    mask->clear();
    for (size_t f = 0; f < files.size(); ++f) {
        rep.candidates[maps.size() + f].tasks = figures(answers(files[f].model.get(), nullptr, nullptr, {}));
    }
    progress.finish();
    rep.tasks = {{"format", hellaswag ? "hellaswag" : "winogrande"},
                 {"file", origin},
                 {"tasks_in_file", hellaswag ? choice_tasks.size() : winogrande_tasks.size()},
                 {"tasks", task_selection.size()},
                 {"selected", task_lines},
                 {"base", to_json(figures(base_chosen))}};
}

} // namespace moeprune::eval_impl
