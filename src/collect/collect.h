#pragma once
// Runs a model through llama.cpp over a calibration corpus and records, from the
// router nodes of llama.cpp's own graph (watched through the eval callback), per-layer
// per-expert saliency statistics and optionally a router trace. Every gating variant
// of build_moe_ffn is read from the nodes it names; a missing or misshapen node stops
// the run with the architecture and node named, never a silent zero.
#include "core/defaults.h"
#include "formats/stats.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct CollectOptions {
    std::filesystem::path model, corpus, output;
    std::filesystem::path trace;          // optional
    std::filesystem::path imatrix;        // optional: llama.cpp's importance matrix (GGUF) from the same pass
    std::filesystem::path mmproj;         // projector for the corpus' images and audio (llama.cpp's libmtmd)
    int trace_top = kDefaultTraceTop;                 // candidates per layer and token in the trace
    uint64_t trace_tokens = 0;            // trace only the first N tokens; 0: all
    int ctx = kDefaultContext;                      // window of a long document
    int batch = 512;
    int ubatch = 512;
    int threads = 0;                      // 0: one per core
    int gpu_layers = 0;
    int64_t chunks = -1;                  // windows to evaluate; -1: all
    bool parse_special = true;
    int generate = 0;                     // tokens to generate after each prompt
    int64_t seed = -1;                    // sampling seed for generation; -1: greedy
    std::vector<std::string> rpc;         // llama.cpp RPC servers host:port
    int save_every = 0;                   // checkpoint every N windows; 0: only at the end
    bool resume = false;
    bool coact = false;
    bool mtp = true;                      // also run the MTP (nextn) head, where the model has one
    bool strict = false;                  // stop at the first non-finite value
    bool progress = true;                 // on a terminal only
};

struct CollectResult {
    SaliencyStats stats;
    uint64_t windows = 0, tokens = 0, traced_tokens = 0;
    uint64_t decodes = 0;        // llama_decode calls of this process
    bool head_skipped = false;   // every one stopped before the output head (no --generate)
};

CollectResult collect(const CollectOptions & opt);

// Where --save-every keeps the unfinished statistics of `output` (OUT.checkpoint), and
// where --resume reads them; removed once the statistics are whole under OUT.
std::filesystem::path collect_checkpoint_path(const std::filesystem::path & output);

} // namespace moeprune
