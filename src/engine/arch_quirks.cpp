#include "engine/arch_quirks.h"

#include <array>

namespace moeprune {

namespace {

constexpr std::array kQuirks = {
    ArchQuirks{.arch = "llama4", .weights_before_experts = true, .vision_language = true},
    ArchQuirks{.arch = "grovemoe", .gate_reads_derived_ids = true},
    ArchQuirks{.arch = "qwen2vl", .vision_language = true},
    ArchQuirks{.arch = "qwen3vl", .vision_language = true},
    ArchQuirks{.arch = "qwen3vlmoe", .vision_language = true},
    ArchQuirks{.arch = "hunyuan_vl", .vision_language = true},
};

constexpr ArchQuirks kNone{};

} // namespace

const ArchQuirks & arch_quirks(std::string_view arch) {
    for (const ArchQuirks & q : kQuirks) {
        if (q.arch == arch) {
            return q;
        }
    }
    return kNone;
}

} // namespace moeprune
