#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

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

// Where a field of a file sits, kept after the document is gone: a typed record read
// from another command's result refuses a value later by file and field, as
// JsonFields does.
struct JsonPlace {
    std::string file, path;   // path: "records[3]"; empty for the whole file
    [[noreturn]] void fail(const std::string & key, const std::string & why) const;
};

// One object of a result another command wrote, read field by field: every refusal names
// the file, the path to the field ("records[3].misses_per_token") and what a possible
// value is, never the JSON library's words. A reader of another command's numbers
// checks each one is possible before it trusts it.
class JsonFields {
public:
    // `path`: where the object sits in the file ("records[3]"); empty for the whole file.
    JsonFields(const nlohmann::json & object, std::string file, std::string path = "");
    std::string where() const { return path_.empty() ? file_ : file_ + ": " + path_; }
    JsonPlace place() const { return {file_, path_}; }
    bool has(const std::string & key) const;
    const nlohmann::json & any(const std::string & key) const;
    JsonFields object(const std::string & key) const;
    // The elements of an array field, each with its place ("records[3]").
    std::vector<JsonFields> objects(const std::string & key) const;
    const nlohmann::json & array(const std::string & key) const;
    std::string string(const std::string & key) const;
    bool boolean(const std::string & key) const;
    // A finite number in [lo, hi].
    double number(const std::string & key, double lo, double hi) const;
    // An integer in [lo, hi].
    int64_t integer(const std::string & key, int64_t lo, int64_t hi) const;
    // Numbers of an array field, each finite and in [lo, hi].
    std::vector<double> numbers(const std::string & key, double lo, double hi) const;
    std::vector<int64_t> integers(const std::string & key, int64_t lo, int64_t hi) const;
    std::vector<std::string> strings(const std::string & key) const;
    [[noreturn]] void fail(const std::string & key, const std::string & why) const;

private:
    std::string child(const std::string & key) const { return path_.empty() ? key : path_ + "." + key; }
    const nlohmann::json & object_;
    std::string file_, path_;
};

} // namespace moeprune

#include "core/errors.h"

template <typename F> auto moeprune::with_json_errors(const std::string & origin, F && read) -> decltype(read()) {
    try {
        return read();
    } catch (const nlohmann::json::exception & e) {
        fail_file(origin, std::string("a field has the wrong type or range: ") + e.what());
    }
}
