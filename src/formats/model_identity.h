#pragma once
// Which model a stage's report was made on, as its writer recorded it (eval's "base",
// a trace's meta "model", measure's "model"): what plan checks every input against.
#include "core/json.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct ModelIdentity {
    JsonPlace place;                                  // the object in its file, for refusals
    std::optional<std::string> digest;                // the model's content (model_digest); none from older writers
    std::optional<int64_t> n_expert;
    std::vector<double> routed_layer_expert_bytes;    // where recorded (measure)

    std::string where() const { return place.path.empty() ? place.file : place.file + ": " + place.path; }
};

// `f`: the object; its fields are optional, each checked when present.
ModelIdentity read_model_identity(const JsonFields & f);

} // namespace moeprune
