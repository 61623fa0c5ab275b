#pragma once
// The recommendation as commands to type: the slice that makes its model, then
// llama-completion and llama-server with the flags it was priced or measured with, under
// the memory limit it was planned for.
#include "formats/plan_option.h"
#include "plan/calibration.h"
#include "plan/geometry.h"

#include <optional>

namespace moeprune {

PlanCommands commands_of(const PlanOption & o, const PlanOptions & opt, const Geometry & g,
                         const std::optional<Measured> & measured);

} // namespace moeprune
