#include "engine/session.h"
#include "core/digest.h"
#include "core/errors.h"

#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>

namespace moeprune {

namespace {

// ggml's RPC client aborts on an endpoint it cannot parse, so the form is checked first.
void check_rpc_endpoint(const std::string & endpoint) {
    static const std::regex form(R"(^[A-Za-z0-9._\-]+:[0-9]{1,5}$|^\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}$)");
    const auto colon = endpoint.rfind(':');
    if (!std::regex_match(endpoint, form) || std::stoul(endpoint.substr(colon + 1)) > 65535 ||
        std::stoul(endpoint.substr(colon + 1)) == 0) {
        throw Error(fmt::format("--rpc: \"{}\" is not HOST:PORT (a port from 1 to 65535)", endpoint));
    }
}

} // namespace

void init_llama(const std::vector<std::string> & rpc) {
    for (const std::string & endpoint : rpc) {
        check_rpc_endpoint(endpoint);
    }
    llama_backend_init();
    for (const std::string & endpoint : rpc) {
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint.c_str());
        if (!reg) {
            throw Error(fmt::format("cannot reach the llama.cpp RPC server at {}", endpoint));
        }
        ggml_backend_register(reg);
    }
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            std::fputs(text, stderr);
        }
    }, nullptr);
}

ModelPtr load_model(const std::filesystem::path & path, int gpu_layers, bool mtp) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = gpu_layers;
    mp.load_mtp = mtp;
    mp.progress_callback = [](float, void *) { return true; };  // llama.cpp's default prints dots
    ModelPtr model(llama_model_load_from_file(path.c_str(), mp), llama_model_free);
    if (!model) {
        fail_file(path.string(), "llama.cpp could not load it");
    }
    return model;
}

ModelPtr load_vocabulary(const std::filesystem::path & path) {
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    mp.progress_callback = [](float, void *) { return true; };  // llama.cpp's default prints dots
    ModelPtr model(llama_model_load_from_file(path.c_str(), mp), llama_model_free);
    if (!model) {
        fail_file(path.string(), "llama.cpp could not load its vocabulary");
    }
    return model;
}

ContextPtr new_context(llama_model * model, const ContextSettings & s) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = uint32_t(s.ctx);
    cp.n_batch = uint32_t(s.batch);
    cp.n_ubatch = uint32_t(s.ubatch);
    cp.n_seq_max = uint32_t(s.seq_max);
    cp.kv_unified = cp.kv_unified || s.seq_max > 1;
    cp.n_threads = cp.n_threads_batch = s.threads;
    cp.cb_eval = s.callback;
    cp.cb_eval_user_data = s.callback_data;
    cp.ctx_type = s.type;
    ContextPtr ctx(llama_init_from_model(model, cp), llama_free);
    if (!ctx) {
        throw Error(fmt::format("llama.cpp could not create {}a context of {} tokens",
                                s.type == LLAMA_CONTEXT_TYPE_MTP ? "an MTP head's " : "", s.ctx));
    }
    return ctx;
}

std::string render_chat(const llama_model * model, const CorpusDocument & d, bool for_generation,
                        const std::string & where) {
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (!tmpl) {
        fail_file(where, "is a conversation, but the model has no chat template (tokenizer.chat_template)");
    }
    size_t n = d.messages.size();
    if (for_generation) {
        // Up to the last user turn: the model answers it.
        while (n > 0 && d.messages[n - 1].role != "user") {
            --n;
        }
        if (n == 0) {
            fail_file(where, "has no user turn to answer (--generate)");
        }
    }
    std::vector<llama_chat_message> msgs;
    for (size_t i = 0; i < n; ++i) {
        msgs.push_back({d.messages[i].role.c_str(), d.messages[i].content.c_str()});
    }
    std::string buf(4096, '\0');
    int32_t len = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), for_generation, buf.data(), int32_t(buf.size()));
    if (len > int32_t(buf.size())) {
        buf.resize(size_t(len));
        len = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), for_generation, buf.data(), int32_t(buf.size()));
    }
    if (len < 0) {
        fail_file(where, "the model's chat template could not be applied by llama.cpp");
    }
    buf.resize(size_t(len));
    return buf;
}

std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool parse_special,
                                  const std::string & where) {
    std::vector<llama_token> out(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), true, parse_special);
    if (n < 0) {
        out.resize(size_t(-n));
        n = llama_tokenize(vocab, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), true, parse_special);
    }
    if (n <= 0) {
        fail_file(where, "tokenizes to nothing");
    }
    out.resize(size_t(n));
    return out;
}

// The identity of a vocabulary: every token's text, type and the special ids, hashed.
std::string vocab_digest(const llama_vocab * v) {
    Xxh64 h;
    const int32_t head[6] = {int32_t(llama_vocab_type(v)), llama_vocab_n_tokens(v), llama_vocab_bos(v),
                             llama_vocab_eos(v), int32_t(llama_vocab_get_add_bos(v)), int32_t(llama_vocab_get_add_eos(v))};
    h.update(head, sizeof(head));
    for (int32_t i = 0; i < llama_vocab_n_tokens(v); ++i) {
        const char * text = llama_vocab_get_text(v, i);
        const int32_t attr = int32_t(llama_vocab_get_attr(v, i));
        h.update(text, std::strlen(text) + 1).update(&attr, sizeof(attr));
    }
    return h.named();
}

std::string document_text(const llama_model * model, const CorpusDocument & d, bool for_generation,
                          const std::string & where) {
    return d.messages.empty() ? d.text : render_chat(model, d, for_generation, where);
}

} // namespace moeprune
