// Task accuracy, the phase after the behaviour checks: the base, every keep map masked in
// it and every candidate file answer the same choice tasks, each in a context made as
// llama-perplexity makes one for them (eval/tasks.h).
#include "eval/eval_run.h"
#include "core/progress.h"

#include <fmt/format.h>

namespace moeprune::eval_impl {

// The task file read and its tasks chosen before any model loads: a bad file costs nothing.
void EvalRun::read_tasks() {
    if (opt.hellaswag.empty()) {
        return;
    }
    choice_tasks = read_hellaswag(opt.hellaswag);
    task_selection = llama_task_selection(choice_tasks.size(), size_t(opt.tasks));
}

void EvalRun::score_tasks() {
    if (choice_tasks.empty()) {
        return;
    }
    const std::string origin = opt.hellaswag.string();
    Progress progress("tasks", 1 + maps.size() + files.size(), "models");
    const auto answers = [&](llama_model * model, ggml_backend_sched_eval_callback cb, void * cb_data,
                             const std::function<void()> & rethrow) {
        const ContextPtr ctx = new_context(model, choice_context(opt.ctx, opt.ubatch, threads, cb, cb_data));
        std::vector<size_t> chosen = score_hellaswag(ctx.get(), choice_tasks, task_selection, origin, rethrow);
        progress.advance(1);
        return chosen;
    };
    const std::vector<size_t> base_chosen = answers(base.model.get(), nullptr, nullptr, {});
    const auto figures = [&](const std::vector<size_t> & chosen) {
        return task_figures(choice_tasks, task_selection, chosen, base_chosen);
    };
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
    json selected_lines = json::array();   // each task by the line of its context, in the order scored
    for (size_t i : task_selection) {
        selected_lines.push_back(choice_tasks[i].line);
    }
    rep.tasks = {{"format", "hellaswag"},
                 {"file", origin},
                 {"tasks_in_file", choice_tasks.size()},
                 {"tasks", task_selection.size()},
                 {"selected", selected_lines},
                 {"base", to_json(figures(base_chosen))}};
}

} // namespace moeprune::eval_impl
