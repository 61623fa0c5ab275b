#include "synth/vocabulary.h"
#include "core/errors.h"

#include "gguf.h"

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <regex>
#include <unordered_map>

namespace moeprune {

namespace fs = std::filesystem;

const std::vector<std::string> & specialist_kinds() {
    static const std::vector<std::string> kinds = {"cjk", "code"};
    return kinds;
}

namespace {

// The bytes of the UTF-8 character that starts with `lead`; 0 when no character starts so.
int utf8_length(uint8_t lead) {
    return lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3 : (lead >> 3) == 30 ? 4 : 0;
}

} // namespace

std::vector<uint32_t> utf8_codepoints(const std::string & s, bool * valid) {
    std::vector<uint32_t> out;
    *valid = true;
    for (size_t i = 0; i < s.size();) {
        const auto c = uint8_t(s[i]);
        const int len = utf8_length(c);
        if (len == 0 || i + len > s.size()) {
            *valid = false;
            return out;
        }
        uint32_t cp = len == 1 ? c : c & (0x7F >> len);
        for (int k = 1; k < len; ++k) {
            cp = (cp << 6) | (uint8_t(s[i + k]) & 0x3F);
        }
        out.push_back(cp);
        i += size_t(len);
    }
    return out;
}

int classify_token_text(const std::string & utf8) {
    bool valid = false;
    const auto cps = utf8_codepoints(utf8, &valid);
    if (!valid) {
        return -1;
    }
    for (uint32_t cp : cps) {
        if ((cp >= 0x3040 && cp <= 0x30FF) || (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x4E00 && cp <= 0x9FFF) ||
            (cp >= 0xAC00 && cp <= 0xD7AF)) {
            return 0;
        }
    }
    std::string t = utf8;
    t.erase(0, t.find_first_not_of(" \t\n"));
    if (t.empty()) {
        return -1;
    }
    static const std::regex code_re(
        R"(^(def|return|import|include|#include|function|const|let|var|class|struct|void|int|self|this|lambda|nullptr|std|elif|println|printf|namespace|template|typename)$|[{}();=<>\[\]]|::|->|==|!=|&&|\|\|)");
    return std::regex_search(t, code_re) ? 1 : -1;
}

std::string decode_byte_level(const std::string & piece) {
    static const std::map<uint32_t, uint8_t> decoder = [] {
        std::map<uint32_t, uint8_t> d;
        uint32_t extra = 0;
        for (uint32_t b = 0; b < 256; ++b) {
            const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
            d[printable ? b : 256 + extra++] = uint8_t(b);
        }
        return d;
    }();
    bool valid = false;
    std::string out;
    for (uint32_t cp : utf8_codepoints(piece, &valid)) {
        auto it = decoder.find(cp);
        if (it == decoder.end()) {
            return {};
        }
        out.push_back(char(it->second));
    }
    return valid ? out : std::string();
}

namespace {

// The pieces byte-level BPE passes through, merge by merge, to build `piece` from its bytes.
std::vector<std::string> bpe_steps(const std::string & piece, const std::unordered_map<std::string, size_t> & rank) {
    bool valid = false;
    utf8_codepoints(piece, &valid);
    if (!valid) {
        return {};
    }
    std::vector<std::string> symbols;
    for (size_t i = 0; i < piece.size();) {
        const size_t len = size_t(utf8_length(uint8_t(piece[i])));
        symbols.push_back(piece.substr(i, len));
        i += len;
    }
    std::vector<std::string> steps;
    while (symbols.size() > 1) {
        size_t best = symbols.size(), best_rank = SIZE_MAX;
        for (size_t i = 0; i + 1 < symbols.size(); ++i) {
            const auto it = rank.find(symbols[i] + " " + symbols[i + 1]);
            if (it != rank.end() && it->second < best_rank) {
                best = i;
                best_rank = it->second;
            }
        }
        if (best == symbols.size()) {
            break;
        }
        symbols[best] += symbols[best + 1];
        symbols.erase(symbols.begin() + std::ptrdiff_t(best) + 1);
        steps.push_back(symbols[best]);
    }
    return steps;
}

// The tokenizer's arrays as the cut reads them, and its lookups of merges and tokens.
struct TokenizerArrays {
    int64_t tokens_id = -1, types_id = -1, scores_id = -1, merges_id = -1;  // -1: scores or merges absent
    size_t n = 0;                                       // tokens
    const int32_t * types = nullptr;
    std::unordered_map<std::string, size_t> rank;       // merge "a b" -> its rank
    std::unordered_map<std::string, size_t> id_of;      // token text -> id
};

TokenizerArrays read_tokenizer_arrays(const gguf_context * src, const fs::path & path) {
    TokenizerArrays a;
    a.tokens_id = gguf_find_key(src, "tokenizer.ggml.tokens");
    a.types_id = gguf_find_key(src, "tokenizer.ggml.token_type");
    const auto is_array_of = [&](int64_t id, gguf_type type) {
        return id >= 0 && gguf_get_kv_type(src, id) == GGUF_TYPE_ARRAY && gguf_get_arr_type(src, id) == type;
    };
    if (!is_array_of(a.tokens_id, GGUF_TYPE_STRING) || !is_array_of(a.types_id, GGUF_TYPE_INT32)) {
        fail_file(path.string(), "has no tokenizer.ggml.tokens (strings) and token_type (int32) to cut with --vocab-first");
    }
    a.n = gguf_get_arr_n(src, a.tokens_id);
    if (gguf_get_arr_n(src, a.types_id) != a.n) {
        fail_file(path.string(), "has tokenizer.ggml.token_type of another length than its tokens");
    }
    // Every array read below by token id, or as strings, is checked first: a vocabulary is a user's file.
    a.scores_id = gguf_find_key(src, "tokenizer.ggml.scores");
    if (a.scores_id >= 0 && (!is_array_of(a.scores_id, GGUF_TYPE_FLOAT32) || gguf_get_arr_n(src, a.scores_id) != a.n)) {
        fail_file(path.string(), "has tokenizer.ggml.scores that is not one float32 per token");
    }
    a.types = static_cast<const int32_t *>(gguf_get_arr_data(src, a.types_id));
    a.merges_id = gguf_find_key(src, "tokenizer.ggml.merges");
    if (a.merges_id >= 0 && !is_array_of(a.merges_id, GGUF_TYPE_STRING)) {
        fail_file(path.string(), "has tokenizer.ggml.merges that are not strings");
    }
    for (size_t m = 0; a.merges_id >= 0 && m < gguf_get_arr_n(src, a.merges_id); ++m) {
        a.rank.emplace(gguf_get_arr_str(src, a.merges_id, m), m);
    }
    for (size_t i = 0; i < a.n; ++i) {
        a.id_of.emplace(gguf_get_arr_str(src, a.tokens_id, i), i);
    }
    return a;
}

std::vector<bool> tokens_to_keep(const gguf_context * src, const TokenizerArrays & a, int n_first,
                                 const fs::path & path) {
    constexpr int32_t normal_token = 1;  // LLAMA_TOKEN_TYPE_NORMAL as GGUF stores it
    std::vector<bool> keep(a.n, false);
    size_t n_ordinary = 0;
    for (size_t i = 0; i < a.n; ++i) {
        if (a.types[i] != normal_token) {
            keep[i] = true;
            continue;
        }
        if (n_ordinary < size_t(n_first)) {
            keep[i] = true;
            ++n_ordinary;
        }
        bool valid = false;
        const std::string piece = gguf_get_arr_str(src, a.tokens_id, i);
        const std::string bytes = decode_byte_level(piece);
        if (utf8_codepoints(bytes.empty() ? piece : bytes, &valid).size() == 1 && valid) {
            keep[i] = true;
            for (const std::string & step : bpe_steps(piece, a.rank)) {
                if (const auto it = a.id_of.find(step); it != a.id_of.end()) {
                    keep[it->second] = true;
                }
            }
        }
    }
    if (n_ordinary < size_t(n_first)) {
        fail_file(path.string(), fmt::format("has {} ordinary tokens, fewer than --vocab-first {}", n_ordinary, n_first));
    }
    return keep;
}

void set_kept_merges(gguf_context * out, const gguf_context * src, const TokenizerArrays & a,
                     const std::vector<bool> & keep) {
    std::vector<const char *> merges;
    for (size_t m = 0; m < gguf_get_arr_n(src, a.merges_id); ++m) {
        const std::string merge = gguf_get_arr_str(src, a.merges_id, m);
        const size_t space = merge.find(' ');
        const auto kept = [&](const std::string & piece) {
            const auto it = a.id_of.find(piece);
            return it != a.id_of.end() && keep[it->second];
        };
        if (space != std::string::npos && kept(merge.substr(0, space)) && kept(merge.substr(space + 1)) &&
            kept(merge.substr(0, space) + merge.substr(space + 1))) {
            merges.push_back(gguf_get_arr_str(src, a.merges_id, m));
        }
    }
    gguf_set_arr_str(out, "tokenizer.ggml.merges", merges.data(), merges.size());
}

// Token-id keys (bos, eos, ...) renumbered, or removed with their token.
void renumber_token_ids(gguf_context * out, const gguf_context * src, const std::vector<int64_t> & new_id) {
    for (int64_t k = 0; k < gguf_get_n_kv(src); ++k) {
        const std::string key = gguf_get_key(src, k);
        if (key.starts_with("tokenizer.ggml.") && key.ends_with("_token_id") && gguf_get_kv_type(src, k) == GGUF_TYPE_UINT32) {
            const uint32_t old = gguf_get_val_u32(src, k);
            if (old < new_id.size() && new_id[old] >= 0) {
                gguf_set_val_u32(out, key.c_str(), uint32_t(new_id[old]));
            } else {
                gguf_remove_key(out, key.c_str());
            }
        }
    }
}

} // namespace

// Keeps the first `n_first` ordinary tokens, every ordinary token of one character with the
// pieces BPE builds it from (so text in any script keeps one token per character the
// vocabulary knows), and every special token, renumbered in their old order. Merges survive
// when both parts and their result are kept, so tokenizing never produces a dropped token;
// token-id keys (bos, eos, ...) follow their tokens.
GgufPtr cut_vocabulary(const gguf_context * src, int n_first, const fs::path & path) {
    const TokenizerArrays a = read_tokenizer_arrays(src, path);
    const std::vector<bool> keep = tokens_to_keep(src, a, n_first, path);
    const size_t n = a.n;
    std::vector<int64_t> new_id(n, -1);
    std::vector<const char *> texts;
    std::vector<int32_t> kept_types;
    for (size_t i = 0; i < n; ++i) {
        if (keep[i]) {
            new_id[i] = int64_t(texts.size());
            texts.push_back(gguf_get_arr_str(src, a.tokens_id, i));
            kept_types.push_back(a.types[i]);
        }
    }
    GgufPtr out(gguf_init_empty());
    gguf_set_kv(out.get(), src);
    gguf_set_arr_str(out.get(), "tokenizer.ggml.tokens", texts.data(), texts.size());
    gguf_set_arr_data(out.get(), "tokenizer.ggml.token_type", GGUF_TYPE_INT32, kept_types.data(), kept_types.size());
    if (a.scores_id >= 0) {
        const auto * scores = static_cast<const float *>(gguf_get_arr_data(src, a.scores_id));
        std::vector<float> kept_scores;
        for (size_t i = 0; i < n; ++i) {
            if (keep[i]) {
                kept_scores.push_back(scores[i]);
            }
        }
        gguf_set_arr_data(out.get(), "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, kept_scores.data(), kept_scores.size());
    }
    if (a.merges_id >= 0) {
        set_kept_merges(out.get(), src, a, keep);
    }
    renumber_token_ids(out.get(), src, new_id);
    return out;
}

} // namespace moeprune
