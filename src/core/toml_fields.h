#pragma once
// Typed reads of TOML values (corpus.toml, run.toml), each error naming the file, line,
// column and key, the way an editor jumps to it.
#include <toml++/toml.h>

#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moeprune::toml_fields {

// "PATH:LINE:COLUMN", or PATH where the parser knows no position.
std::string where(const std::string & file, const toml::source_region & r);

[[noreturn]] void fail(const std::string & where, const std::string & key, const std::string & must);
[[noreturn]] void fail_not_one_of(const std::string & where, const std::string & key, const std::string & value,
                                  const std::string & names);

// One value or an array of them.
template <class T> std::vector<T> values(const toml::node & n, const std::string & where, const std::string & key) {
    std::vector<T> out;
    const auto one = [&](const toml::node & v) {
        if constexpr (std::is_same_v<T, std::string>) {
            if (!v.is_string()) {
                fail(where, key, n.is_array() ? "hold strings" : "be a string");
            }
            out.push_back(v.as_string()->get());
        } else if constexpr (std::is_same_v<T, bool>) {
            if (!v.is_boolean()) {
                fail(where, key, "be true or false");
            }
            out.push_back(v.as_boolean()->get());
        } else if constexpr (std::is_integral_v<T>) {
            if (!v.is_integer()) {
                fail(where, key, n.is_array() ? "hold integers" : "be an integer");
            }
            out.push_back(T(v.as_integer()->get()));
        } else {
            if (!v.is_number()) {
                fail(where, key, n.is_array() ? "hold numbers" : "be a number");
            }
            out.push_back(v.is_integer() ? T(v.as_integer()->get()) : T(v.as_floating_point()->get()));
        }
    };
    if (const toml::array * a = n.as_array()) {
        for (const toml::node & v : *a) {
            one(v);
        }
    } else {
        one(n);
    }
    return out;
}

// Exactly one value.
template <class T> T value(const toml::node & n, const std::string & where, const std::string & key) {
    if (n.is_array()) {
        fail(where, key, "be a single value");
    }
    return values<T>(n, where, key)[0];
}

// An integer of at least `min`.
uint64_t count(const toml::node & n, const std::string & where, const std::string & key, int64_t min);

// A string that is one of `choices`' names.
template <class E>
E choice(const toml::node & n, const std::string & where, const std::string & key,
         std::initializer_list<std::pair<const char *, E>> choices) {
    const std::string v = value<std::string>(n, where, key);
    std::string names;
    for (const auto & [name, e] : choices) {
        if (v == name) {
            return e;
        }
        names += (names.empty() ? "" : ", ") + std::string(name);
    }
    fail_not_one_of(where, key, v, names);
}

// Refuses a key of `t` not in `known`; `table` names the table in the message.
void check_keys(const toml::table & t, const std::string & file, const std::set<std::string> & known, const std::string & table);

} // namespace moeprune::toml_fields
