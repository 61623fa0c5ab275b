#include "core/errors.h"

namespace moeprune {

void fail_file(const std::string & path, const std::string & message) {
    throw Error(path + ": " + message);
}

} // namespace moeprune
