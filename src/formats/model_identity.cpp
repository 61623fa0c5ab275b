#include "formats/model_identity.h"

namespace moeprune {

ModelIdentity read_model_identity(const JsonFields & f) {
    ModelIdentity m;
    m.place = f.place();
    if (f.has("digest")) {
        m.digest = f.string("digest");
    }
    if (f.has("n_expert")) {
        m.n_expert = f.integer("n_expert", 1, 65536);
    }
    if (f.has("routed_layer_expert_bytes")) {
        m.routed_layer_expert_bytes = f.numbers("routed_layer_expert_bytes", 0, 1e15);
    }
    return m;
}

} // namespace moeprune
