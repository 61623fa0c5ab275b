// The baseline of no information: a seeded random order of the experts. Every
// criterion's shared rules still apply (select_layer: never-routed experts go first),
// so what a report compares it with is the worth of knowing more than which experts
// were routed at all.
#include "select/criteria/criteria.h"
#include "select/select.h"

#include <xxhash.h>

#include <array>

namespace moeprune::criteria_impl {

std::vector<double> random_scores(const CriterionInput & in) {
    std::vector<double> s(in.layer_stats.n_expert());
    for (size_t e = 0; e < s.size(); ++e) {
        const std::array<uint64_t, 2> key{in.layer, e};
        s[e] = double(XXH3_64bits_withSeed(key.data(), sizeof key, in.opt.seed) >> 11) * 0x1p-53;
    }
    return s;
}

nlohmann::json random_settings(const SelectOptions & opt) { return {{"seed", opt.seed}}; }

} // namespace moeprune::criteria_impl
