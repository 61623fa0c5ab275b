#pragma once
// llama.cpp's importance matrix, gathered in collect's own pass: the same nodes, the
// same float accumulation in the same order and the same GGUF file as llama-imatrix
// (tools/imatrix in the pinned release), so quantizing the pruned model needs no second
// pass over the corpus and the result can be compared with llama-imatrix bit for bit.
#include "core/atomic_file.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

struct ggml_tensor;

namespace moeprune {

class ImatrixAccumulator {
public:
    // Whether llama-imatrix reads this node: every indirect matmul, and direct matmuls of
    // a layer's weights (blk.*) over at least 16 f32 rows. The output head is left out,
    // as llama-imatrix leaves it out without --process-output.
    static bool wants(const ggml_tensor * t);
    // Adds the squared activations of the node's input per column (per expert for
    // MUL_MAT_ID) and counts the rows; non-finite sums stop the run naming the weight.
    void observe(const ggml_tensor * t);

    // The GGUF imatrix: NAME.in_sum2 [columns, matrices] and NAME.counts [1, matrices]
    // per weight in name order, with general.type, imatrix.datasets,
    // imatrix.chunk_count and imatrix.chunk_size; written under `file`'s temporary name,
    // for the caller to commit with its other outputs.
    void write(const AtomicOutput & file, const std::vector<std::string> & datasets, uint32_t chunk_size) const;

    bool empty() const { return entries_.empty(); }

private:
    struct Entry {
        std::vector<float> in_sum2;
        std::vector<int64_t> counts;
    };
    std::map<std::string, Entry> entries_;
    std::vector<char> host_, ids_;
};

} // namespace moeprune
