#pragma once
// What every stage that runs a model through llama.cpp shares: backend set-up (with
// RPC servers), model loading, and turning corpus documents into tokens the way the
// model's own chat template and tokenizer do.
#include "formats/corpus.h"

#include "llama.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace moeprune {

using ModelPtr = std::unique_ptr<llama_model, decltype(&llama_model_free)>;
using ContextPtr = std::unique_ptr<llama_context, decltype(&llama_free)>;

// Checks every RPC endpoint's form (ggml's client aborts on one it cannot parse),
// initializes llama.cpp's backends, registers the RPC servers and keeps llama.cpp's
// log to errors only.
void init_llama(const std::vector<std::string> & rpc);

// With `mtp`, the nextn (MTP) layers too, which llama.cpp otherwise leaves unloaded.
ModelPtr load_model(const std::filesystem::path & path, int gpu_layers, bool mtp = false);

// The model's vocabulary alone, which is all a tokenizer needs: no tensor is read.
ModelPtr load_vocabulary(const std::filesystem::path & path);

// A context for a pass, of one sequence unless `seq_max` says more: its sizes, and the
// graph callback (an observer of router nodes) with its data.
struct ContextSettings {
    int ctx = 0, batch = 0, ubatch = 0, threads = 1;
    ggml_backend_sched_eval_callback callback = nullptr;
    void * callback_data = nullptr;
    llama_context_type type = LLAMA_CONTEXT_TYPE_DEFAULT;  // LLAMA_CONTEXT_TYPE_MTP: the nextn head's graph
    int seq_max = 1;              // sequences, on one cache of `ctx` tokens (llama.cpp's unified KV cache) when > 1
};
// Refused, naming the size asked for, when llama.cpp cannot make it.
ContextPtr new_context(llama_model * model, const ContextSettings & s);

// A conversation rendered with the model's chat template; with `for_generation`, up to
// the last user turn, followed by the assistant prompt. `where` names the document.
std::string render_chat(const llama_model * model, const CorpusDocument & d, bool for_generation, const std::string & where);

// Tokens of `text`, with the model's BOS where it adds one.
std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool parse_special,
                                  const std::string & where);

// The text of a document as the model reads it: plain, or rendered chat.
std::string document_text(const llama_model * model, const CorpusDocument & d, bool for_generation,
                          const std::string & where);

// The identity of a tokenizer: every token's text and attributes and the special ids,
// hashed ("xxh64:..."); two models tokenize alike when their digests agree.
std::string vocab_digest(const llama_vocab * v);

} // namespace moeprune
