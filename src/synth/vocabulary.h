#pragma once
// The tokenizer side of synth: which text kind a token is (for planted specialists), and a
// real vocabulary cut to fewer tokens that still tokenizes every text.
#include "model/model_file.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

// The text kinds specialists are planted for, and how a token is classified.
const std::vector<std::string> & specialist_kinds();
// Returns the index into specialist_kinds() of a token's decoded UTF-8 text, or -1.
int classify_token_text(const std::string & utf8);

// The code points of UTF-8 text; *valid is false (and the result partial) where it is not UTF-8.
std::vector<uint32_t> utf8_codepoints(const std::string & s, bool * valid);
// GPT-2 byte-level BPE stores every byte as a printable code point; this undoes it ("" if
// the piece is not byte-level).
std::string decode_byte_level(const std::string & piece);

// `src`'s metadata with its tokenizer cut to the first `n_first` ordinary tokens, one token per
// character and the special tokens (synth --vocab-first); `path` names it in errors.
GgufPtr cut_vocabulary(const gguf_context * src, int n_first, const std::filesystem::path & path);

} // namespace moeprune
