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

// Where libmtmd's helper logs go while one medium is read (null: errors to stderr).
thread_local std::string * g_helper_log = nullptr;

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

uint32_t be32(const std::string & b, size_t at) {
    return uint32_t(uint8_t(b[at])) << 24 | uint32_t(uint8_t(b[at + 1])) << 16 | uint32_t(uint8_t(b[at + 2])) << 8 |
           uint32_t(uint8_t(b[at + 3]));
}
uint32_t le32(const std::string & b, size_t at) {
    return uint32_t(uint8_t(b[at])) | uint32_t(uint8_t(b[at + 1])) << 8 | uint32_t(uint8_t(b[at + 2])) << 16 |
           uint32_t(uint8_t(b[at + 3])) << 24;
}

// JPEG: segments up to a scan, then the entropy-coded data (where 0xFF is followed by 0
// or a restart marker) up to the next marker, until the end-of-image marker.
bool jpeg_complete(const std::string & b) {
    size_t at = 2;
    while (at + 2 <= b.size()) {
        if (uint8_t(b[at]) != 0xFF) {
            return false;
        }
        const uint8_t marker = uint8_t(b[at + 1]);
        if (marker == 0xD9) {
            return true;
        }
        if (marker == 0xFF || (marker >= 0xD0 && marker <= 0xD7) || marker == 0x01) {
            at += marker == 0xFF ? 1 : 2;
            continue;
        }
        if (at + 4 > b.size()) {
            return false;
        }
        const size_t length = size_t(uint8_t(b[at + 2])) << 8 | uint8_t(b[at + 3]);
        at += 2 + length;
        if (marker == 0xDA) {  // a scan: its data runs to the next marker
            while (at + 1 < b.size() && !(uint8_t(b[at]) == 0xFF && uint8_t(b[at + 1]) != 0 &&
                                          !(uint8_t(b[at + 1]) >= 0xD0 && uint8_t(b[at + 1]) <= 0xD7))) {
                ++at;
            }
        }
    }
    return false;
}

// PNG: chunks (length, type, data, CRC) up to IEND.
bool png_complete(const std::string & b) {
    for (size_t at = 8; at + 12 <= b.size();) {
        const uint64_t length = be32(b, at);
        if (b.compare(at + 4, 4, "IEND") == 0) {
            return true;
        }
        at += 12 + length;
    }
    return false;
}

// RIFF WAVE: every chunk, the samples' included, inside the file.
bool wav_complete(const std::string & b) {
    for (size_t at = 12; at + 8 <= b.size();) {
        const uint64_t length = le32(b, at + 4);
        if (at + 8 + length > b.size()) {
            return false;
        }
        if (b.compare(at, 4, "data") == 0) {
            return true;
        }
        at += 8 + length + (length & 1);
    }
    return false;
}

// MPEG audio: frames from the first one, each length from its header; false when a
// frame runs past the end, or no whole frame is there. Bytes that are no frame (a tag
// after the last one) end the walk.
bool mp3_complete(const std::string & b) {
    size_t at = 0;
    if (b.size() >= 10 && b.compare(0, 3, "ID3") == 0) {
        const size_t tag = size_t(b[6] & 0x7F) << 21 | size_t(b[7] & 0x7F) << 14 | size_t(b[8] & 0x7F) << 7 | size_t(b[9] & 0x7F);
        at = 10 + tag;
        if (at > b.size()) {
            return false;
        }
    }
    static const int kbps[2][3][15] = {
        {{0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448},
         {0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384},
         {0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320}},
        {{0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256},
         {0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160},
         {0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160}}};
    static const int rates[3] = {44100, 48000, 32000};
    size_t frames = 0;
    while (at + 4 <= b.size()) {
        const uint32_t h = be32(b, at);
        const int version = (h >> 19) & 3, layer = (h >> 17) & 3, bitrate = (h >> 12) & 15, rate = (h >> 10) & 3;
        if ((h & 0xFFE00000u) != 0xFFE00000u || version == 1 || layer == 0 || bitrate == 0 || bitrate == 15 || rate == 3) {
            break;
        }
        const bool v1 = version == 3;
        const int sample_rate = rates[rate] >> (version == 3 ? 0 : version == 2 ? 1 : 2);
        const int kb = kbps[v1 ? 0 : 1][3 - layer][bitrate] * 1000;
        const int padding = (h >> 9) & 1;
        const size_t length = layer == 3 ? size_t((12 * kb / sample_rate + padding) * 4)
                                         : size_t((layer == 1 && !v1 ? 72 : 144) * kb / sample_rate + padding);
        if (at + length > b.size()) {
            return false;
        }
        at += length;
        ++frames;
    }
    return frames > 0;
}

} // namespace

void check_media_complete(const std::string & bytes, const fs::path & path) {
    const auto starts = [&](const char * magic, size_t n) { return bytes.size() >= n && bytes.compare(0, n, magic, n) == 0; };
    const char * kind = nullptr;
    bool whole = true;
    if (starts("\xFF\xD8\xFF", 3)) {
        kind = "a JPEG image";
        whole = jpeg_complete(bytes);
    } else if (starts("\x89PNG\r\n\x1A\n", 8)) {
        kind = "a PNG image";
        whole = png_complete(bytes);
    } else if (starts("RIFF", 4) && bytes.size() >= 12 && bytes.compare(8, 4, "WAVE") == 0) {
        kind = "a WAV file";
        whole = wav_complete(bytes);
    } else if (starts("ID3", 3) || (bytes.size() >= 2 && uint8_t(bytes[0]) == 0xFF && (uint8_t(bytes[1]) & 0xE0) == 0xE0)) {
        kind = "an MP3 file";
        whole = mp3_complete(bytes);
    }
    if (!whole) {
        fail_file(path.string(), fmt::format("is {} that ends early ({} bytes): cut or damaged; decoders would read "
                                             "what is there as the whole", kind, bytes.size()));
    }
}

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
        if (g_helper_log) {
            *g_helper_log += text;  // reading one medium: its own error says what matters
        } else if (level >= GGML_LOG_LEVEL_ERROR) {
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
        const std::string bytes = read_text_file(m.path);
        check_media_complete(bytes, m.path);
        if (!supports(m.modality)) {
            fail_file(where, fmt::format("has an {} ({}), but the projector {} encodes no {}", modality_name(m.modality),
                                         m.path.string(), path_.string(), modality_name(m.modality)));
        }
        // libmtmd's helper tries every decoder (ffprobe for video among them) and logs each
        // failure; those lines are kept out of the way of the one error below.
        std::string helper_log;
        g_helper_log = &helper_log;
        mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_buf(
            ctx_, reinterpret_cast<const unsigned char *>(bytes.data()), bytes.size(), false, mtmd_helper_init_opt_default());
        g_helper_log = nullptr;
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
