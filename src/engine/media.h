#pragma once
// Images and audio through llama.cpp's libmtmd: a projector loaded beside the text model,
// documents whose media markers become media chunks, and those chunks encoded into the
// embeddings the text model decodes (through the same graph, so the router callbacks see
// media positions as they see text).
#include "formats/corpus.h"

#include "llama.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct mtmd_context;
struct mtmd_input_chunks;

namespace moeprune {

// A run of media positions inside a tokenized prompt.
struct MediaSpan {
    size_t offset = 0;          // first row in MediaPrompt::tokens
    size_t n_tokens = 0;        // its embeddings (rows)
    int32_t n_pos = 0;          // positions it takes (M-RoPE images take fewer than rows)
    Modality modality = Modality::Image;
    size_t chunk = 0;           // index in the prompt's chunks
};

struct MediaChunksDeleter {
    void operator()(mtmd_input_chunks * c) const;
};

// A prompt as the text model reads it: one row per token or media embedding, media rows
// holding LLAMA_TOKEN_NULL.
struct MediaPrompt {
    std::vector<llama_token> tokens;
    std::vector<MediaSpan> media;
    std::shared_ptr<mtmd_input_chunks> chunks;
};

// The rows [0, n_rows) of a prompt in decode order: text runs of at most `batch` rows that
// stop at a media span (`text(first_row, n, pos0)`), and each span whole (`media(span,
// pos0)`, returning the positions it took). Returns the position after them.
int32_t walk_rows(const std::vector<MediaSpan> & spans, size_t n_rows, size_t batch,
                  const std::function<void(size_t, size_t, int32_t)> & text,
                  const std::function<int32_t(const MediaSpan &, int32_t)> & media);

// A projector's file as moeprune reads it before libmtmd does: a GGUF header walk, the
// architecture `clip`, and every tensor's data inside the file. Fails naming `mmproj`.
void check_projector_file(const std::filesystem::path & mmproj);

// Refuses, naming `path`, a JPEG, PNG, WAV or MP3 whose container ends before its data
// does (a file cut short): decoders read such a file without an error. Other formats pass.
void check_media_complete(const std::string & bytes, const std::filesystem::path & path);

class MediaEncoder {
public:
    // Fails naming `mmproj` when libmtmd cannot load it or it does not fit `model`.
    MediaEncoder(const std::filesystem::path & mmproj, const llama_model * model, int threads, bool use_gpu);
    ~MediaEncoder();
    MediaEncoder(const MediaEncoder &) = delete;
    MediaEncoder & operator=(const MediaEncoder &) = delete;

    bool supports(Modality m) const;
    // `text` holds kMediaMarker where each of `media` goes; `where` names the document in errors.
    MediaPrompt tokenize(const std::string & text, const std::vector<CorpusMedia> & media, bool parse_special,
                         const std::string & where) const;
    // Encodes the span's chunk and decodes its embeddings from position `pos0` in batches of
    // at most `n_batch` rows, every row an output; `before(first_row, n_rows)` runs before
    // each llama_decode and `after()` once it succeeded. Returns the positions the span took.
    int32_t decode(llama_context * ctx, const MediaPrompt & prompt, const MediaSpan & span, llama_pos pos0, int n_batch,
                   const std::function<void(size_t, size_t)> & before, const std::function<void()> & after) const;

private:
    mtmd_context * ctx_ = nullptr;
    std::filesystem::path path_;
};

} // namespace moeprune
