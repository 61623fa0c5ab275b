#include "select/criteria/criteria.h"
#include "core/errors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moeprune {

namespace criteria_impl {
nlohmann::json no_settings(const SelectOptions &) { return nlohmann::json::object(); }
} // namespace criteria_impl

const std::vector<Criterion> & criteria() {
    static const std::vector<Criterion> entries = {
#define MOEPRUNE_CRITERION(name, scores, settings, per_expert, rare_note)                                               \
    {name, &criteria_impl::scores, &criteria_impl::settings, per_expert, rare_note},
#include "select/criteria/registry.def"
#undef MOEPRUNE_CRITERION
    };
    return entries;
}

namespace {

std::vector<std::string> names(bool per_expert_only) {
    std::vector<std::string> out;
    for (const Criterion & c : criteria()) {
        if (c.per_expert || !per_expert_only) {
            out.push_back(c.name);
        }
    }
    return out;
}

} // namespace

const Criterion & criterion(const std::string & name) {
    const auto & all = criteria();
    const auto it = std::find_if(all.begin(), all.end(), [&](const Criterion & c) { return c.name == name; });
    if (it == all.end()) {
        throw Error(fmt::format("unknown metric \"{}\" (known: {})", name, fmt::join(names(false), ", ")));
    }
    return *it;
}

const Criterion & per_expert_criterion(const std::string & name, const std::string & use) {
    const auto & all = criteria();
    const auto it = std::find_if(all.begin(), all.end(), [&](const Criterion & c) { return c.name == name; });
    if (it == all.end() || !it->per_expert) {
        throw Error(fmt::format("{}: \"{}\" is not a per-expert criterion (known: {})", use, name,
                                fmt::join(names(true), ", ")));
    }
    return *it;
}

} // namespace moeprune
