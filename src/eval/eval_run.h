#pragma once
// Eval's internals shared by the files of its phases: windows, prompts, the models a run
// loads, and EvalRun, one run phase by phase. Private to eval (its interface: eval/eval.h).
#include "eval/eval.h"
#include "route/tap.h"
#include "route/mask.h"
#include "eval/scoring.h"
#include "eval/tasks.h"
#include "core/atomic_file.h"
#include "core/file_io.h"
#include "core/progress.h"
#include "engine/media.h"
#include "engine/mtp.h"
#include "engine/session.h"
#include "formats/base_logits.h"
#include "formats/corpus.h"
#include "formats/keep_map.h"
#include "formats/trace.h"
#include "model/inspect.h"
#include "model/model_file.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeprune::eval_impl {

namespace fs = std::filesystem;
using nlohmann::json;

// A stretch of one document decoded from a clean context; positions [first, last]
// predict the token after them.
// A document with media is one window: its prompt up to the text after its last media
// span is decoded first without outputs (`media`), and `tokens` are that text, from
// position `pos0`.
struct Window {
    size_t doc = 0;
    int domain = -1;
    std::vector<llama_token> tokens;
    int first = 0, last = -1;
    uint64_t first_record = 0;  // index of its first scored token over the whole run
    int n_scored() const { return last - first + 1; }
    std::shared_ptr<const MediaPrompt> media;
    const MediaEncoder * encoder = nullptr;
    size_t prefix_rows = 0;
    int32_t pos0 = 0;
};

// A chat prompt for the behaviour checks.
struct Prompt {
    std::vector<llama_token> tokens;
    std::string text, domain, where;
    bool opens_think = false;
};

// How one candidate's context is set up for a decode and checked after it.
struct Decoder {
    llama_context * ctx = nullptr;
    std::function<void(int)> before;     // per call, with its token count: a closed loop starts a "window"
    std::function<void()> after;         // per call: rethrows what the callbacks caught
    bool all_outputs = false;            // a routing tap needs every token in every layer
    MtpHead * head = nullptr;            // drafts over the continuation, when the candidate has one
};

// One context runs every closed-loop configuration in turn: its callback goes to the tap
// of the configuration being decoded.
struct TapSlot {
    RouterTap * tap = nullptr;
    static bool callback(ggml_tensor * t, bool ask, void * ud) {
        RouterTap * tap = static_cast<TapSlot *>(ud)->tap;
        return tap ? RouterTap::callback(t, ask, tap) : !ask;
    }
};

// A closed-loop candidate: its configuration, the keep map it runs on (or none) and its tap.
struct ClosedLoopRun {
    ClosedLoopConfig config;
    int map = -1;  // index into the keep maps, -1: the full model
    std::unique_ptr<RouterTap> tap;
};

// A loaded model, the context its windows decode in, and its MTP head's when it drafts.
struct Model {
    ModelPtr model{nullptr, llama_model_free};
    ContextPtr ctx{nullptr, llama_free};
    std::unique_ptr<MtpHead> head;
};

// The text of one token.
std::string piece(const llama_vocab * v, llama_token t);

// A context for one model's passes, with its graph callback.
ContextPtr make_context(llama_model * model, const EvalOptions & opt, int threads, ggml_backend_sched_eval_callback cb,
                        void * cb_data);

// Decodes tokens [0, n) at positions pos0.. of sequence 0; outputs are [first, last].
void decode_tokens(llama_context * ctx, const llama_token * tokens, int n, int pos0, int first, int last,
                   const std::function<void()> & rethrow);
// A window from a clean context, with outputs at its scored positions (or all of them).
void decode_window(llama_context * ctx, const Window & w, const std::function<void()> & rethrow = {},
                   bool all_outputs = false);
void draft_window(MtpHead * head, const Window & w, const std::function<void()> & rethrow = {});

void closed_loop_figures(const EvalOptions & opt, const TraceInMemory & base_trace,
                         const std::vector<std::pair<fs::path, KeepMap>> & maps, std::vector<ClosedLoopRun> & runs,
                         int n_layer, int threads, EvalReport & rep, size_t first_closed);

// One eval run, phase by phase (run_eval calls them in order). Contexts' callbacks point
// at the mask and the tap slots, the slots at the taps, and taps at the mask, the keep maps
// and their configurations: a run stays where it is made, and its members are declared in
// the order they come to life (and go in reverse).
class EvalRun {
public:
    explicit EvalRun(const EvalOptions & given) : given(given), opt(given), closed_loop(!opt.cache_policies.empty()) {}
    EvalRun(const EvalRun &) = delete;
    EvalRun & operator=(const EvalRun &) = delete;

    void check_options();
    void read_model();
    void read_keep_maps();
    void load_base();
    void make_windows();
    void refuse_unsupported_media();
    void read_prompts();
    void check_base_file();
    void open_candidates();
    void choose_reference();
    void plan_closed_loop();
    void open_base_context();
    void name_candidates();
    void open_outputs();
    void score_windows();
    void check_behaviour();
    void read_tasks();
    void score_tasks();
    void read_task_domains();
    void finish_passes();
    void score_statistics();
    void describe_run();
    void write_outputs();
    EvalReport take_report() { return std::move(rep); }

private:
    void observe_base(size_t wi, const Window & w);
    void reference_pass(size_t wi, const Window & w, Progress & progress);
    void candidate_passes(size_t wi, const Window & w, Progress & progress);
    void score_window(const Model & m, EvalCandidate & cand, size_t wi, const Window & w);
    std::unique_ptr<MtpHead> head_for(llama_model * model, llama_context * ctx, ggml_backend_sched_eval_callback cb,
                                      void * cb_data) const;
    const Model * reference_model() const;

    const EvalOptions & given;
    EvalOptions opt;  // with J resolved once the model's k is known
    std::vector<fs::path> keeps;
    const bool closed_loop;
    GgufModel gguf;
    InspectReport info;
    MaskFacts facts;
    bool run_mtp = false;   // the model has an MTP head and --mtp drop was not given
    std::optional<double> base_tokens_per_step;  // of the base's greedy continuations, with its head
    MaskFacts mask_layers;  // what keep maps cover and the mask plans: facts' layers, and the MTP head's
    std::vector<std::pair<fs::path, KeepMap>> maps;
    std::optional<BaseLogitsReader> base_file;
    Corpus corpus;
    int threads = 0;
    Model base;
    const llama_vocab * vocab = nullptr;
    int n_vocab = 0;
    std::string base_vocab;
    std::unique_ptr<MediaEncoder> media;  // --mmproj: encodes the corpus' media for every model's passes
    size_t media_documents_left_out = 0;  // text_only
    json mmproj_identity;                 // the projector's file and digest when the corpus has media; null otherwise
    std::vector<Window> windows;
    uint64_t n_scored = 0;
    std::vector<Prompt> prompts;
    std::vector<ChoiceTask> choice_tasks;   // --hellaswag
    std::vector<WinograndeTask> winogrande_tasks;
    std::vector<MultipleChoiceTask> multiple_choice_tasks;   // the selected ones, in the order scored
    size_t tasks_in_file = 0;
    std::vector<size_t> task_selection;     // llama-perplexity's, of --tasks
    std::vector<size_t> task_lines;
    std::vector<std::string> domain_order, task_domain;   // --task-domains: the domains, and each selected task's   // per selected task: the line of its context, or its number in a binary file
    json settings, base_identity;
    uint32_t top = 0;
    std::optional<RouterMask> mask;  // made from the model's facts, before the contexts that call it
    Model masked;
    std::vector<Model> files;
    int against = -1;
    int trace_top = 0;
    std::vector<double> expert_bytes;
    std::optional<RouterTap> observer;
    TapSlot observer_slot, closed_slot;
    std::vector<ClosedLoopRun> runs;
    Model closed;
    bool base_live = false;
    EvalReport rep;
    size_t first_closed = 0;
    std::optional<TraceInMemory> base_trace;   // the base pass's routing, replayed open-loop from memory
    std::optional<AtomicOutput> trace_file;    // --trace-out
    std::optional<TraceWriter> trace;
    std::optional<AtomicOutput> base_out;
    std::optional<File> base_out_file;
    std::optional<BaseLogitsWriter> base_writer;
    std::vector<BaseRow> rows;
    std::vector<BaseRecord> records;
    // Per scored token: the base's own draft accepted there (-1: none), and its domain.
    std::vector<int8_t> base_accept;
    std::vector<int> base_accept_domain;
    double base_tail_mass = 0;  // summed over the records of --base: how tight their lower bound is
};

} // namespace moeprune::eval_impl
