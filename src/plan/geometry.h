#pragma once
// What a plan is made for: the model's geometry (read from its file, or given by hand)
// and the settings, each checked before anything else is read.
#include "plan/plan.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moeprune {

struct Geometry {
    std::string source;
    std::string digest;  // the model's content (model_digest); empty when planned by hand
    int64_t n_expert = 0, used = 0;
    std::vector<double> bytes;  // one routed expert, per MoE layer
    std::vector<double> mtp_bytes;  // one routed expert, per MTP (nextn) layer
    double other = 0;
    bool other_known = false;
    // The experts' tensor types llama.cpp's CPU backend repacks into anonymous memory on
    // some CPU (ggml-cpu/repack.cpp): mapped, they cannot stream from disk unless --no-repack.
    std::vector<std::string> repacked_expert_types;
    double sum() const {
        double s = 0;
        for (const double b : bytes) {
            s += b;
        }
        return s;
    }
    double mean() const { return bytes.empty() ? 0 : sum() / double(bytes.size()); }
};

Geometry geometry(const PlanOptions & opt);

// The settings a plan is made with, each possible before anything is read.
void check_plan_options(const PlanOptions & opt);

inline double gb(double bytes) { return bytes / 1e9; }

} // namespace moeprune
