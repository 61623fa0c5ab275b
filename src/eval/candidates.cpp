// What an eval run compares: keep maps masked in the base model, other model files beside
// it, the reference they are compared with, and the report's candidates in pass order.
#include "eval/eval_run.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune::eval_impl {

namespace {

// Candidate names come from file names; a repeated one gets its position appended.
std::string unique_name(const std::string & stem, const std::vector<EvalCandidate> & taken) {
    std::string name = stem;
    for (int i = 2; std::any_of(taken.begin(), taken.end(), [&](const EvalCandidate & c) { return c.name == name; }); ++i) {
        name = fmt::format("{}#{}", stem, i);
    }
    return name;
}

} // namespace

ContextPtr make_context(llama_model * model, const EvalOptions & opt, int threads, ggml_backend_sched_eval_callback cb,
                        void * cb_data) {
    // A window is one llama_decode, so its logits stay readable while the candidates run.
    return new_context(model, {opt.ctx, std::max(opt.batch, opt.ctx), std::min(opt.ubatch, opt.ctx), threads, cb, cb_data});
}

// The candidates: keep maps masked in the base model, other files loaded beside it.
void EvalRun::open_candidates() {
    mask.emplace(mask_layers);
    if (!maps.empty()) {
        masked.ctx = make_context(base.model.get(), opt, threads, &RouterMask::callback, &*mask);
        masked.head = head_for(base.model.get(), masked.ctx.get(), &RouterMask::callback, &*mask);
        // A one-token pass shows how llama.cpp builds this model's router (and its MTP head's).
        Window probe;
        probe.tokens = {windows.front().tokens.front()};
        mask->start_probe();
        decode_window(masked.ctx.get(), probe, [&] { mask->rethrow_failure(); });
        if (masked.head) {
            draft_window(masked.head.get(), probe, [&] { mask->rethrow_failure(); });
        }
        mask->stop_probe();
        for (const auto & [path, km] : maps) {
            mask->set(km, path.string());  // refuses, by name, a map masking cannot reproduce
        }
        mask->clear();
    }
    for (const fs::path & c : opt.candidates) {
        Model m;
        m.model = load_model(c, opt.gpu_layers, run_mtp);
        const llama_vocab * cv = llama_model_get_vocab(m.model.get());
        if (llama_vocab_n_tokens(cv) != n_vocab || vocab_digest(cv) != base_vocab) {
            fail_file(c.string(), fmt::format("has another vocabulary than {} ({} tokens vs {}): KL needs the same tokens",
                                              opt.model.string(), llama_vocab_n_tokens(cv), n_vocab));
        }
        m.ctx = make_context(m.model.get(), opt, threads, nullptr, nullptr);
        m.head = head_for(m.model.get(), m.ctx.get(), nullptr, nullptr);
        files.push_back(std::move(m));
    }
}

// The reference every candidate is compared with: the base model, or one candidate file.
void EvalRun::choose_reference() {
    if (!opt.against.empty()) {
        const auto it = std::find(opt.candidates.begin(), opt.candidates.end(), opt.against);
        if (it == opt.candidates.end()) {
            throw Error(fmt::format("--against {} must be one of the --candidate files", opt.against.string()));
        }
        against = int(it - opt.candidates.begin());
    }
}

// The base decodes live unless --base or --against stands in for it; the closed loop
// observes its routing even then.
void EvalRun::open_base_context() {
    base_live = !base_file && against < 0;
    if (base_live || closed_loop) {
        base.ctx = make_context(base.model.get(), opt, threads, observer ? &TapSlot::callback : nullptr,
                                observer ? &observer_slot : nullptr);
        if (base_live) {
            base.head = head_for(base.model.get(), base.ctx.get(), nullptr, nullptr);
        }
    }
}

// A head for a model that has MTP layers, drafting from `m`'s context, when eval runs them.
std::unique_ptr<MtpHead> EvalRun::head_for(llama_model * model, llama_context * ctx, ggml_backend_sched_eval_callback cb,
                                           void * cb_data) const {
    if (!run_mtp || llama_model_n_layer_nextn(model) < 1) {
        return nullptr;
    }
    return std::make_unique<MtpHead>(model, ctx,
                                     ContextSettings{opt.ctx, std::max(opt.batch, opt.ctx), std::min(opt.ubatch, opt.ctx),
                                                     threads, cb, cb_data});
}

// The live reference whose drafts the candidates' are compared with, if any.
const Model * EvalRun::reference_model() const {
    if (base_file) {
        return nullptr;
    }
    return against >= 0 ? &files[size_t(against)] : &base;
}

// The report's candidates in the order of their passes (keep maps, files, closed-loop
// configurations), each with room for every scored token.
void EvalRun::name_candidates() {
    rep.domains = corpus.domains;
    for (const auto & [path, km] : maps) {
        EvalCandidate c;
        c.name = unique_name(path.stem().string(), rep.candidates);
        c.kind = "keep";
        c.source = path.string();
        rep.candidates.push_back(std::move(c));
    }
    for (const fs::path & path : opt.candidates) {
        EvalCandidate c;
        c.name = unique_name(path.stem().string(), rep.candidates);
        c.kind = "file";
        c.source = path.string();
        rep.candidates.push_back(std::move(c));
    }
    for (const ClosedLoopRun & run : runs) {
        EvalCandidate c;
        const ClosedLoopConfig & k = run.config;
        const std::string stem = fmt::format("{}{}-c{}-l{}", run.map >= 0 ? maps[size_t(run.map)].first.stem().string() + "+" : "",
                                             k.policy, k.cache, k.lambda);
        c.name = unique_name(stem, rep.candidates);
        c.kind = "closed-loop";
        c.source = run.map >= 0 ? maps[size_t(run.map)].first.string() : opt.model.string();
        c.config = {{"policy", k.policy},
                    {"cache", k.cache},
                    {"lambda", k.lambda},
                    {"j", k.j},
                    {"moce", opt.moce},
                    {"keep", run.map >= 0 ? json(maps[size_t(run.map)].first.string()) : json()}};
        rep.candidates.push_back(std::move(c));
    }
    for (EvalCandidate & c : rep.candidates) {
        c.tokens.resize(n_scored);
    }
    first_closed = maps.size() + opt.candidates.size();
}

} // namespace moeprune::eval_impl
