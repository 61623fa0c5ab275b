#include "core/threads.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

namespace moeprune {

int check_threads(int64_t requested, const std::string & flag) {
    const int64_t cpus = std::max(1u, std::thread::hardware_concurrency());
    const int64_t most = std::max<int64_t>(8, 4 * cpus);
    if (requested < 0 || requested > most) {
        throw Error(fmt::format("{}{}: threads are 0 (one per CPU) to {} on this machine of {} CPUs",
                                flag.empty() ? "" : flag + " ", requested, most, cpus));
    }
    return requested > 0 ? int(requested) : int(cpus);
}

} // namespace moeprune
