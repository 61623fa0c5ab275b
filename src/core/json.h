#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace moeprune {

// Deepest nesting any moeprune JSON input may have; the formats need fewer than ten.
constexpr int kMaxJsonDepth = 64;

// Parses JSON text. Every failure is an Error naming `origin`: a syntax error with
// where parsing stopped, nesting deeper than kMaxJsonDepth (deep documents would
// exhaust the stack of code that walks them), a key given twice in one object
// (the JSON library would silently keep the last), a number too large for a double.
nlohmann::json parse_json(const std::string & text, const std::string & origin);

// Runs `read` over a parsed document and turns the JSON library's type and range
// errors ("type must be string", "cannot use value() with number") into an Error
// naming `origin`; readers check the fields they know with messages of their own.
template <typename F> auto with_json_errors(const std::string & origin, F && read) -> decltype(read());

} // namespace moeprune

#include "core/errors.h"

template <typename F> auto moeprune::with_json_errors(const std::string & origin, F && read) -> decltype(read()) {
    try {
        return read();
    } catch (const nlohmann::json::exception & e) {
        fail_file(origin, std::string("a field has the wrong type or range: ") + e.what());
    }
}
