#include "core/toml_fields.h"
#include "core/errors.h"

#include <fmt/format.h>

namespace moeprune::toml_fields {

std::string where(const std::string & file, const toml::source_region & r) {
    return r.begin.line ? fmt::format("{}:{}:{}", file, r.begin.line, r.begin.column) : file;
}

void fail(const std::string & where, const std::string & key, const std::string & must) {
    fail_file(where, fmt::format("\"{}\" must {}", key, must));
}

void fail_not_one_of(const std::string & where, const std::string & key, const std::string & value, const std::string & names) {
    fail_file(where, fmt::format("\"{}\" is \"{}\", not one of {}", key, value, names));
}

uint64_t count(const toml::node & n, const std::string & where, const std::string & key, int64_t min) {
    if (!n.is_integer() || n.as_integer()->get() < min) {
        fail(where, key, fmt::format("be an integer of at least {}", min));
    }
    return uint64_t(n.as_integer()->get());
}

void check_keys(const toml::table & t, const std::string & file, const std::set<std::string> & known, const std::string & table) {
    for (const auto & [key, node] : t) {
        (void)node;
        if (!known.count(std::string(key.str()))) {
            std::string names;
            for (const std::string & k : known) {
                names += (names.empty() ? "" : ", ") + k;
            }
            fail_file(where(file, key.source()), fmt::format("unknown key \"{}\" in {} (known: {})", key.str(), table, names));
        }
    }
}

} // namespace moeprune::toml_fields
