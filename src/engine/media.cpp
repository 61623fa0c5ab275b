#include "engine/media.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "model/model_file.h"

#include "clip.h"
#include "mtmd-helper.h"
#include "mtmd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <sys/wait.h>
#include <unistd.h>

namespace moeprune {

namespace fs = std::filesystem;

void MediaChunksDeleter::operator()(mtmd_input_chunks * c) const { mtmd_input_chunks_free(c); }

namespace {

struct BitmapDeleter {
    void operator()(mtmd_bitmap * b) const { mtmd_bitmap_free(b); }
};
using BitmapPtr = std::unique_ptr<mtmd_bitmap, BitmapDeleter>;

// Causal attention off for the chunks whose model wants it (Gemma 3's images), on again after.
class NonCausalScope {
public:
    NonCausalScope(llama_context * ctx, bool enabled) : ctx_(ctx), enabled_(enabled) {
        if (enabled_) {
            llama_set_causal_attn(ctx_, false);
        }
    }
    ~NonCausalScope() {
        if (enabled_) {
            llama_set_causal_attn(ctx_, true);
        }
    }
    NonCausalScope(const NonCausalScope &) = delete;
    NonCausalScope & operator=(const NonCausalScope &) = delete;

private:
    llama_context * ctx_;
    bool enabled_;
};

} // namespace

int32_t walk_rows(const std::vector<MediaSpan> & spans, size_t n_rows, size_t batch,
                  const std::function<void(size_t, size_t, int32_t)> & text,
                  const std::function<int32_t(const MediaSpan &, int32_t)> & media) {
    int32_t pos = 0;
    auto span = spans.begin();
    for (size_t i = 0; i < n_rows;) {
        if (span != spans.end() && span->offset == i) {
            pos += media(*span, pos);
            i += span->n_tokens;
            ++span;
            continue;
        }
        const size_t end = std::min({n_rows, i + batch, span != spans.end() ? span->offset : n_rows});
        text(i, end - i, pos);
        pos += int32_t(end - i);
        i = end;
    }
    return pos;
}

namespace {

// The last lines of what a child wrote, for an error message.
std::string tail_lines(const std::string & text, size_t n) {
    size_t at = text.size();
    while (at > 0 && text[at - 1] == '\n') {
        --at;
    }
    const std::string trimmed = text.substr(0, at);
    for (size_t lines = 0; at > 0; --at) {
        if (trimmed[at - 1] == '\n' && ++lines == n) {
            break;
        }
    }
    return trimmed.substr(at);
}

// libmtmd aborts the whole process (GGML_ASSERT, or gguf's type checks) on many
// malformed projectors instead of failing: a key of the wrong type, hyperparameters out
// of range for the projector type, and sizes or shapes only an encode meets (an image
// size of 0 or 1, a patch larger than the image). So a child process loads the projector
// for `model` (on the CPU, without warm-up) and encodes a small grey image and a second
// of silence, whichever it takes, on one thread (ggml's CPU backend then leaves OpenMP,
// which a forked child may not use, alone); a projector that kills it, fails, or yields
// a non-finite embedding is refused by name with what libmtmd printed.
void probe_projector(const fs::path & mmproj, const llama_model * model) {
    int err[2];
    if (pipe(err) != 0) {
        fail_file(mmproj.string(), std::string("could not start the projector check: ") + std::strerror(errno));
    }
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
        fail_file(mmproj.string(), std::string("could not start the projector check: ") + std::strerror(errno));
    }
    if (pid == 0) {
        close(err[0]);
        dup2(err[1], STDERR_FILENO);
        dup2(err[1], STDOUT_FILENO);
        setenv("GGML_NO_BACKTRACE", "1", 1);  // ggml would attach gdb to print one
        mtmd_context_params p = mtmd_context_params_default();
        p.use_gpu = false;
        p.n_threads = 1;
        p.print_timings = false;
        p.warmup = false;
        p.media_marker = kMediaMarker;
        mtmd_context * ctx = mtmd_init_from_file(mmproj.c_str(), model, p);
        if (!ctx) {
            _exit(3);
        }
        std::vector<BitmapPtr> probes;
        if (mtmd_support_vision(ctx)) {
            const std::vector<unsigned char> grey(64 * 64 * 3, 128);
            probes.emplace_back(mtmd_bitmap_init(64, 64, grey.data()));
        }
        if (mtmd_support_audio(ctx)) {
            const std::vector<float> silence(size_t(std::max(1, mtmd_get_audio_sample_rate(ctx))), 0.0f);
            probes.emplace_back(mtmd_bitmap_init_from_audio(silence.size(), silence.data()));
        }
        const int n_embd = llama_model_n_embd_inp(model);
        for (const BitmapPtr & probe : probes) {
            std::unique_ptr<mtmd_input_chunks, MediaChunksDeleter> chunks(mtmd_input_chunks_init());
            const mtmd_input_text input{kMediaMarker, std::strlen(kMediaMarker), false, true};
            const mtmd_bitmap * raw = probe.get();
            if (mtmd_tokenize(ctx, chunks.get(), &input, &raw, 1) != 0) {
                _exit(4);
            }
            for (size_t i = 0; i < mtmd_input_chunks_size(chunks.get()); ++i) {
                const mtmd_input_chunk * chunk = mtmd_input_chunks_get(chunks.get(), i);
                if (mtmd_input_chunk_get_type(chunk) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
                    continue;
                }
                if (mtmd_encode_chunk(ctx, chunk) != 0) {
                    _exit(5);
                }
                const float * embd = mtmd_get_output_embd(ctx);
                const size_t n = mtmd_input_chunk_get_n_tokens(chunk) * size_t(n_embd);
                for (size_t j = 0; j < n; ++j) {
                    if (!std::isfinite(embd[j])) {
                        _exit(6);
                    }
                }
            }
        }
        _exit(0);
    }
    close(err[1]);
    std::string said;
    char buf[4096];
    for (ssize_t n; (n = read(err[0], buf, sizeof(buf))) != 0;) {
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            break;
        }
        said.append(buf, size_t(n));
    }
    close(err[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const std::string printed = said.empty() ? "" : ": " + tail_lines(said, 3);
    if (WIFSIGNALED(status)) {
        fail_file(mmproj.string(), fmt::format("llama.cpp's libmtmd aborts loading it as a projector, or encoding a "
                                               "small probe with it ({}){}", strsignal(WTERMSIG(status)), printed));
    }
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 5 || code == 4) {
        fail_file(mmproj.string(), "llama.cpp's libmtmd could not encode a small probe " +
                                       std::string(code == 4 ? "input for it" : "image or second of audio with it") + printed);
    }
    if (code == 6) {
        fail_file(mmproj.string(), "encodes a small probe image or second of silence into embeddings that are not "
                                   "finite (NaN or infinite weights?)");
    }
    if (code != 0) {
        fail_file(mmproj.string(), "llama.cpp's libmtmd could not load it as a projector for this model (a projector "
                                   "GGUF whose output width is the model's input width)" + printed);
    }
}

} // namespace

void check_projector_file(const fs::path & mmproj) {
    // moeprune's own header walk first: ggml's reader has undefined behaviour on some
    // malformed headers (docs/reliability.md), and libmtmd calls it unguarded.
    const GgufPtr meta = open_gguf_metadata(mmproj);
    const int64_t arch = gguf_find_key(meta.get(), "general.architecture");
    const std::string name = arch >= 0 && gguf_get_kv_type(meta.get(), arch) == GGUF_TYPE_STRING
                                 ? gguf_get_val_str(meta.get(), arch)
                                 : "";
    if (name != "clip") {
        fail_file(mmproj.string(), fmt::format("is not a projector: its general.architecture is '{}', a projector "
                                               "GGUF's (what --mmproj names) is 'clip'", name));
    }
    // Every tensor's data inside the file, as for models: libmtmd reads a cut file's
    // missing bytes as zeros, and its images then change without an error.
    const GgufModel file = GgufModel::open(mmproj);
    for (const TensorEntry & t : file.tensors()) {
        if (t.file_offset > file.shard_bytes(0) || t.nbytes > file.shard_bytes(0) - t.file_offset) {
            fail_file(mmproj.string(), fmt::format("is truncated (or {} has a wrong dimension): the tensor's data ends "
                                                   "at byte {}, the file at {}", t.name, t.file_offset + t.nbytes,
                                                   file.shard_bytes(0)));
        }
    }
}

MediaEncoder::MediaEncoder(const fs::path & mmproj, const llama_model * model, int threads, bool use_gpu) : path_(mmproj) {
    // libmtmd's loader reads whatever it is given; a FIFO or a folder is refused by name first.
    std::error_code ec;
    if (!fs::is_regular_file(mmproj, ec)) {
        fail_file(mmproj.string(), "is not a regular file (--mmproj names a projector GGUF)");
    }
    mtmd_helper_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            std::fputs(text, stderr);
        }
    }, nullptr);
    check_projector_file(mmproj);
    probe_projector(mmproj, model);
    mtmd_context_params p = mtmd_context_params_default();
    p.use_gpu = use_gpu;
    p.n_threads = threads;
    p.print_timings = false;
    p.warmup = false;
    p.media_marker = kMediaMarker;
    ctx_ = mtmd_init_from_file(mmproj.c_str(), model, p);
    if (!ctx_) {
        fail_file(mmproj.string(), "llama.cpp's libmtmd could not load it as a projector for this model (a projector "
                                   "GGUF whose output width is the model's input width)");
    }
}

MediaEncoder::~MediaEncoder() { mtmd_free(ctx_); }

bool MediaEncoder::supports(Modality m) const {
    return m == Modality::Image ? mtmd_support_vision(ctx_) : m == Modality::Audio ? mtmd_support_audio(ctx_) : true;
}

MediaPrompt MediaEncoder::tokenize(const std::string & text, const std::vector<CorpusMedia> & media, bool parse_special,
                                   const std::string & where) const {
    std::vector<BitmapPtr> bitmaps;
    for (const CorpusMedia & m : media) {
        if (!supports(m.modality)) {
            fail_file(where, fmt::format("has an {} ({}), but the projector {} encodes no {}", modality_name(m.modality),
                                         m.path.string(), path_.string(), modality_name(m.modality)));
        }
        const std::string bytes = read_text_file(m.path);
        mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_buf(
            ctx_, reinterpret_cast<const unsigned char *>(bytes.data()), bytes.size(), false, mtmd_helper_init_opt_default());
        BitmapPtr bitmap(w.bitmap);
        if (w.video_ctx) {
            fail_file(m.path.string(), "is a video; collect and eval read images and audio");
        }
        if (!bitmap) {
            fail_file(m.path.string(), fmt::format("is not an {} libmtmd can read (images: jpg, png, bmp, gif; audio: wav, "
                                                   "mp3, flac)",
                                                   modality_name(m.modality)));
        }
        if (mtmd_bitmap_is_audio(bitmap.get()) != (m.modality == Modality::Audio)) {
            fail_file(m.path.string(), fmt::format("is given as an {} part, but it is {}", modality_name(m.modality),
                                                   mtmd_bitmap_is_audio(bitmap.get()) ? "audio" : "an image"));
        }
        bitmaps.push_back(std::move(bitmap));
    }
    std::vector<const mtmd_bitmap *> raw;
    for (const auto & b : bitmaps) {
        raw.push_back(b.get());
    }
    MediaPrompt out;
    out.chunks = std::shared_ptr<mtmd_input_chunks>(mtmd_input_chunks_init(), MediaChunksDeleter());
    const mtmd_input_text input{text.c_str(), text.size(), true, parse_special};
    const int32_t rc = mtmd_tokenize(ctx_, out.chunks.get(), &input, raw.data(), raw.size());
    if (rc == 1) {
        fail_file(where, fmt::format("holds {} media but its text has a different number of media markers ({})",
                                     media.size(), kMediaMarker));
    }
    if (rc != 0) {
        fail_file(where, fmt::format("libmtmd could not prepare its media (error {})", rc));
    }
    for (size_t i = 0; i < mtmd_input_chunks_size(out.chunks.get()); ++i) {
        const mtmd_input_chunk * chunk = mtmd_input_chunks_get(out.chunks.get(), i);
        const auto type = mtmd_input_chunk_get_type(chunk);
        if (type == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            size_t n = 0;
            const llama_token * toks = mtmd_input_chunk_get_tokens_text(chunk, &n);
            out.tokens.insert(out.tokens.end(), toks, toks + n);
            continue;
        }
        MediaSpan span;
        span.offset = out.tokens.size();
        span.n_tokens = mtmd_input_chunk_get_n_tokens(chunk);
        span.n_pos = mtmd_input_chunk_get_n_pos(chunk);
        span.modality = type == MTMD_INPUT_CHUNK_TYPE_AUDIO ? Modality::Audio : Modality::Image;
        span.chunk = i;
        out.tokens.insert(out.tokens.end(), span.n_tokens, LLAMA_TOKEN_NULL);
        out.media.push_back(span);
    }
    return out;
}

int32_t MediaEncoder::decode(llama_context * ctx, const MediaPrompt & prompt, const MediaSpan & span, llama_pos pos0,
                             int n_batch, const std::function<void(size_t, size_t)> & before,
                             const std::function<void()> & after) const {
    const mtmd_input_chunk * chunk = mtmd_input_chunks_get(prompt.chunks.get(), span.chunk);
    if (mtmd_encode_chunk(ctx_, chunk) != 0) {
        throw Error(fmt::format("libmtmd could not encode an {} with {}", modality_name(span.modality), path_.string()));
    }
    const float * embd = mtmd_get_output_embd(ctx_);
    const int n_embd = llama_model_n_embd_inp(llama_get_model(ctx));
    const size_t n = span.n_tokens;
    // Positions as libmtmd's own helper lays them out: one per row, or M-RoPE's four
    // planes (t, y, x, z) of every row, an image's in its 2-D grid.
    const bool mrope = mtmd_decode_use_mrope(ctx_);
    std::vector<llama_pos> pos(n * (mrope ? 4 : 1));
    if (!mrope) {
        for (size_t i = 0; i < n; ++i) {
            pos[i] = pos0 + llama_pos(i);
        }
    } else if (span.modality == Modality::Image) {
        std::vector<mtmd_decoder_pos> rel(n);
        mtmd_helper_image_get_decoder_pos(mtmd_input_chunk_get_tokens_image(chunk), pos0, rel.data());
        for (size_t i = 0; i < n; ++i) {
            pos[i] = llama_pos(rel[i].t);
            pos[i + n] = llama_pos(rel[i].y);
            pos[i + 2 * n] = llama_pos(rel[i].x);
            pos[i + 3 * n] = llama_pos(rel[i].z);
        }
    } else {
        for (size_t i = 0; i < n; ++i) {
            for (size_t plane = 0; plane < 4; ++plane) {
                pos[i + plane * n] = pos0 + llama_pos(i);
            }
        }
    }
    const NonCausalScope non_causal(ctx, mtmd_decode_use_non_causal(ctx_, chunk));
    for (size_t first = 0; first < n; first += size_t(n_batch)) {
        const size_t rows = std::min(n - first, size_t(n_batch));
        std::vector<llama_pos> view;
        for (size_t plane = 0; plane < (mrope ? 4u : 1u); ++plane) {
            view.insert(view.end(), pos.begin() + long(plane * n + first), pos.begin() + long(plane * n + first + rows));
        }
        llama_seq_id seq = 0;
        std::vector<int32_t> n_seq(rows, 1);
        std::vector<llama_seq_id *> seqs(rows, &seq);
        std::vector<int8_t> outputs(rows, 1);  // every row through the last layer
        llama_batch batch{int32_t(rows),  nullptr,      const_cast<float *>(embd + first * size_t(n_embd)),
                          view.data(),    n_seq.data(), seqs.data(),
                          outputs.data()};
        if (before) {
            before(span.offset + first, rows);
        }
        const int rc = llama_decode(ctx, batch);
        if (rc != 0) {
            throw Error(fmt::format("llama_decode failed ({}) on {} rows of an {}", rc, rows, modality_name(span.modality)));
        }
        if (after) {
            after();
        }
    }
    return span.n_pos;
}

} // namespace moeprune
