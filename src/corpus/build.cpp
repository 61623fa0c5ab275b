// build_corpus: the phases of corpus building in order, each stage of them timed.
#include "corpus/build.h"
#include "corpus/phases.h"
#include "engine/media.h"
#include "engine/session.h"

#include <algorithm>
#include <chrono>
#include <memory>

namespace moeprune {

using namespace corpus_build;

CorpusReport build_corpus(const CorpusOptions & opt) {
    CorpusBuild b(opt, checked_sources(opt.spec, !opt.mmproj.empty()));
    prepare_files(b);

    // The tokenizer first: a model that cannot load should fail before minutes of reading.
    const ModelPtr model = load_vocabulary(opt.model);
    std::unique_ptr<MediaEncoder> media;
    if (!opt.mmproj.empty()) {
        media = std::make_unique<MediaEncoder>(opt.mmproj, model.get(), std::max(1, opt.threads), false);
    }
    const Tokenizer tokenizer(model.get(), opt.spec.doc_tokens, media.get());

    auto last = std::chrono::steady_clock::now();
    const auto lap = [&](double & seconds) {
        const auto now = std::chrono::steady_clock::now();
        seconds = std::chrono::duration<double>(now - last).count();
        last = now;
    };

    read_sources(b);
    lap(b.report.seconds.read);

    drop_exact_duplicates(b);
    mark_boilerplate(b);
    LshIndex lsh(opt.spec.near_dup);
    drop_near_duplicates(b, lsh);
    lap(b.report.seconds.dedupe);

    split_sides(b);
    plan_budgets(b);
    take_budgets(b, tokenizer);
    lap(b.report.seconds.tokenize);

    check_shortfalls(b);
    refuse_empty_sides(b);

    interleave(b);
    report_domains(b);
    b.report.leak_check = check_leaks(b);
    lap(b.report.seconds.leak_check);

    make_tasks(b, model.get());
    stage_jsonl(b);
    lap(b.report.seconds.write);

    finish_report(b, model.get(), lsh);
    commit_outputs(b);
    return std::move(b.report);
}

} // namespace moeprune
