#pragma once
// What every section of run's report builds its part with: HTML cells and tables, a
// Vega-Lite chart with its data inside, a chart's place on the page, CSV, keep map names.
#include "formats/plan_option.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moeprune {

std::string html_escape(const std::string & s);

// JSON to put inside a <script> element: `<`, `>` and `&` as \u escapes, so that no string
// in it (a domain name from whoever supplied the corpus) can close the element or open a
// comment, and U+2028/U+2029 escaped for older JavaScript parsers. Still the same JSON.
std::string script_json(const nlohmann::json & v);

// A value as a table cell: strings as they are, floats to 4 significant digits.
std::string cell(const nlohmann::json & v);

// Two columns: a name, and its value.
std::string table(const std::vector<std::pair<std::string, std::string>> & rows);

// Rows of objects as a table, columns in the order given.
std::string rows_table(const nlohmann::json & rows, const std::vector<std::string> & columns);

// A chart's heading, note and place on the page; its spec is the section's chart `id`.
std::string chart_place(const std::string & id, const std::string & title, const std::string & note);

// A Vega-Lite spec with its title and data inside.
nlohmann::json chart(const std::string & title, const nlohmann::json & values, nlohmann::json spec);

// Rows of objects as CSV, columns in the order given.
std::string to_csv(const nlohmann::json & rows, const std::vector<std::string> & columns);

// Criterion and K from a keep map's path; "none" and every expert for the unpruned model.
std::pair<std::string, int64_t> map_name(const std::string & path, int64_t n_expert);

// "reap-k8", or "unpruned".
std::string map_label(const std::string & criterion, int64_t k);

// An option as the plan's chart and the draft table name it: "reap K6 lru 4".
std::string plan_option_label(const PlanOption & o);

template <class T> nlohmann::json or_null(const std::optional<T> & v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }

} // namespace moeprune
