#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace moeprune {

// Parses JSON text; a syntax error names `origin` and where parsing stopped.
nlohmann::json parse_json(const std::string & text, const std::string & origin);

} // namespace moeprune
