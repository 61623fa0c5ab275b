#pragma once
// Where an architecture's MoE graph in the pinned llama.cpp differs from the common one
// (router logits -> probs -> top-k -> weights, experts applied to the input, weights
// after): one row per architecture that differs, by llama.cpp's name
// (src/llama-arch.cpp), as llama-arch is the one table of names there. Code that
// depends on one of these asks this table, never the name. Adding a quirk: a field here,
// its rows, and its users; docs/architecture.md lists the places.
#include <string_view>

namespace moeprune {

struct ArchQuirks {
    std::string_view arch;
    // The gate weights scale the input before the experts, and selection is on raw
    // logits (llama4): an expert's output already holds its weight, and a masked router
    // cannot reproduce what slicing does.
    bool weights_before_experts = false;
    // The gate reads expert ids scaled out of ffn_moe_topk (grovemoe's adjugate experts),
    // so ids written into the graph are not the experts used.
    bool gate_reads_derived_ids = false;
    // A vision-language family: its text model is meant to see images, so a calibration
    // without media is worth a warning even without a projector at hand.
    bool vision_language = false;
};

// The row of `arch`; an architecture without one has no quirk (every field false).
const ArchQuirks & arch_quirks(std::string_view arch);

} // namespace moeprune
