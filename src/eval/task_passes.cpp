// Task accuracy, the phase after the behaviour checks: the base, every keep map masked in
// it and every candidate file answer the same tasks, each in a context made as
// llama-perplexity makes one for them (eval/tasks.h).
#include "eval/eval_run.h"
#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/progress.h"
#include "formats/task_set.h"

#include <fmt/format.h>

namespace moeprune::eval_impl {

namespace {

constexpr size_t kHellaswagDefaultTasks = 400;   // llama-perplexity's --hellaswag-tasks

} // namespace

// The task file read and its tasks chosen before any model loads: a bad file costs nothing.
void EvalRun::read_tasks() {
    if (!opt.hellaswag.empty()) {
        choice_tasks = read_hellaswag(opt.hellaswag);
        tasks_in_file = choice_tasks.size();
        task_selection = llama_task_selection(choice_tasks.size(), opt.tasks > 0 ? size_t(opt.tasks) : kHellaswagDefaultTasks);
        for (size_t i : task_selection) {
            task_lines.push_back(choice_tasks[i].line);
        }
        if (!opt.task_domains.empty()) {
            read_task_domains();
        }
    } else if (!opt.winogrande.empty()) {
        winogrande_tasks = read_winogrande(opt.winogrande);
        tasks_in_file = winogrande_tasks.size();
        task_selection = llama_winogrande_selection(winogrande_tasks.size(), size_t(opt.tasks));
        for (size_t i : task_selection) {
            task_lines.push_back(winogrande_tasks[i].line);
        }
    } else if (!opt.multiple_choice.empty()) {
        multiple_choice_tasks = read_multiple_choice(opt.multiple_choice, size_t(opt.tasks), tasks_in_file);
        for (size_t i = 0; i < multiple_choice_tasks.size(); ++i) {
            task_selection.push_back(i);
            task_lines.push_back(multiple_choice_tasks[i].index);
        }
    }
}

// corpus' tasks.json beside the HellaSwag file it describes: each selected task's domain.
void EvalRun::read_task_domains() {
    const TaskSet set = read_task_set(opt.task_domains);
    const std::string digest = xxh64_hex(read_text_file(opt.hellaswag));
    if (set.file_digest != digest || set.task_domains.size() != choice_tasks.size()) {
        fail_file(opt.task_domains.string(),
                  fmt::format("describes {} tasks of a file with xxh64 {}, not {} ({} tasks, xxh64 {})",
                              set.task_domains.size(), set.file_digest, opt.hellaswag.string(), choice_tasks.size(), digest));
    }
    for (const TaskSetDomain & d : set.domains) {
        if (d.tasks > 0) {
            domain_order.push_back(d.domain);
        }
    }
    for (const size_t i : task_selection) {
        task_domain.push_back(set.task_domains[i]);
    }
}

void EvalRun::score_tasks() {
    if (task_selection.empty()) {
        return;
    }
    const std::string format = !choice_tasks.empty() ? "hellaswag" : !winogrande_tasks.empty() ? "winogrande" : "multiple-choice";
    const std::string origin = (format == "hellaswag" ? opt.hellaswag : format == "winogrande" ? opt.winogrande
                                                                                               : opt.multiple_choice)
                                   .string();
    Progress progress("tasks", 1 + maps.size() + files.size(), "models");
    const auto answers = [&](llama_model * model, ggml_backend_sched_eval_callback cb, void * cb_data,
                             const std::function<void()> & rethrow) {
        const ContextPtr ctx = new_context(model, choice_context(opt.ctx, opt.parallel, opt.ubatch, threads, cb, cb_data));
        std::vector<size_t> chosen =
            format == "hellaswag"    ? score_hellaswag(ctx.get(), choice_tasks, task_selection, origin, rethrow)
            : format == "winogrande" ? score_winogrande(ctx.get(), winogrande_tasks, task_selection, origin, rethrow)
                                     : score_multiple_choice(ctx.get(), multiple_choice_tasks, origin, rethrow);
        progress.advance(1);
        return chosen;
    };
    const auto right = [&](size_t task, size_t choice) {
        const size_t i = task_selection[task];
        return format == "hellaswag"    ? choice == choice_tasks[i].gold
               : format == "winogrande" ? choice == winogrande_tasks[i].gold
                                        : multiple_choice_tasks[i].labels[choice] == 1;
    };
    const std::vector<size_t> base_chosen = answers(base.model.get(), nullptr, nullptr, {});
    const auto figures = [&](const std::vector<size_t> & chosen) {
        return task_figures(right, chosen, base_chosen, domain_order, task_domain);
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
    rep.tasks = {{"format", format},
                 {"file", origin},
                 {"tasks_in_file", tasks_in_file},
                 {"tasks", task_selection.size()},
                 {"selected", task_lines},
                 {"domains", opt.task_domains.empty() ? json(nullptr) : json(opt.task_domains.string())},
                 {"base", to_json(figures(base_chosen))}};
}

} // namespace moeprune::eval_impl
