#include "core/json.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cmath>
#include <set>
#include <vector>

namespace moeprune {

using nlohmann::json;

nlohmann::json parse_json(const std::string & text, const std::string & origin) {
    std::vector<std::set<std::string>> keys_of_open_objects;
    const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json & parsed) {
        switch (event) {
            case json::parse_event_t::object_start:
            case json::parse_event_t::array_start:
                if (depth >= kMaxJsonDepth) {
                    fail_file(origin, fmt::format("JSON nested deeper than {} levels", kMaxJsonDepth));
                }
                if (event == json::parse_event_t::object_start) {
                    keys_of_open_objects.emplace_back();
                }
                break;
            case json::parse_event_t::object_end:
                keys_of_open_objects.pop_back();
                break;
            case json::parse_event_t::key:
                if (!keys_of_open_objects.back().insert(parsed.get<std::string>()).second) {
                    fail_file(origin, fmt::format("key \"{}\" appears twice in one object", parsed.get<std::string>()));
                }
                break;
            default:
                break;
        }
        return true;
    };
    try {
        return json::parse(text, check);
    } catch (const json::parse_error & e) {
        fail_file(origin, std::string("not valid JSON: ") + e.what());
    } catch (const json::exception & e) {
        fail_file(origin, std::string("not usable JSON: ") + e.what());
    }
}

namespace {

std::string range_text(double lo, double hi) {
    const auto end = [](double v) {
        return std::isinf(v) ? std::string(v < 0 ? "-inf" : "inf") : fmt::format("{:g}", v);
    };
    return "[" + end(lo) + ", " + end(hi) + "]";
}

std::string shown(const json & v) {
    std::string text = v.dump();
    return text.size() > 60 ? text.substr(0, 57) + "..." : text;
}

} // namespace

JsonFields::JsonFields(const json & object, std::string file, std::string path)
    : object_(object), file_(std::move(file)), path_(std::move(path)) {
    if (!object_.is_object()) {
        fail_file(where(), "is " + shown(object_) + ", not a JSON object");
    }
}

void JsonPlace::fail(const std::string & key, const std::string & why) const {
    fail_file(file + ": " + (path.empty() ? key : path + "." + key), why);
}

void JsonFields::fail(const std::string & key, const std::string & why) const { place().fail(key, why); }

bool JsonFields::has(const std::string & key) const { return object_.contains(key) && !object_[key].is_null(); }

const json & JsonFields::any(const std::string & key) const {
    if (!object_.contains(key)) {
        fail(key, "is missing");
    }
    return object_[key];
}

JsonFields JsonFields::object(const std::string & key) const {
    const json & v = any(key);
    if (!v.is_object()) {
        fail(key, "is " + shown(v) + ", not an object");
    }
    return JsonFields(v, file_, child(key));
}

const json & JsonFields::array(const std::string & key) const {
    const json & v = any(key);
    if (!v.is_array()) {
        fail(key, "is " + shown(v) + ", not an array");
    }
    return v;
}

std::vector<JsonFields> JsonFields::objects(const std::string & key) const {
    const json & a = array(key);
    std::vector<JsonFields> out;
    for (size_t i = 0; i < a.size(); ++i) {
        out.emplace_back(a[i], file_, fmt::format("{}[{}]", child(key), i));
    }
    return out;
}

std::string JsonFields::string(const std::string & key) const {
    const json & v = any(key);
    if (!v.is_string()) {
        fail(key, "is " + shown(v) + ", not a string");
    }
    return v.get<std::string>();
}

bool JsonFields::boolean(const std::string & key) const {
    const json & v = any(key);
    if (!v.is_boolean()) {
        fail(key, "is " + shown(v) + ", not true or false");
    }
    return v.get<bool>();
}

double JsonFields::number(const std::string & key, double lo, double hi) const {
    const json & v = any(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo || v.get<double>() > hi) {
        fail(key, "is " + shown(v) + ", not a number in " + range_text(lo, hi));
    }
    return v.get<double>();
}

int64_t JsonFields::integer(const std::string & key, int64_t lo, int64_t hi) const {
    const json & v = any(key);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
        fail(key, "is " + shown(v) + ", not an integer in " + range_text(double(lo), double(hi)));
    }
    return v.get<int64_t>();
}

std::vector<double> JsonFields::numbers(const std::string & key, double lo, double hi) const {
    const json & a = array(key);
    std::vector<double> out;
    for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].is_number() || !std::isfinite(a[i].get<double>()) || a[i].get<double>() < lo || a[i].get<double>() > hi) {
            fail(fmt::format("{}[{}]", key, i), "is " + shown(a[i]) + ", not a number in " + range_text(lo, hi));
        }
        out.push_back(a[i].get<double>());
    }
    return out;
}

std::vector<int64_t> JsonFields::integers(const std::string & key, int64_t lo, int64_t hi) const {
    const json & a = array(key);
    std::vector<int64_t> out;
    for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].is_number_integer() || (a[i].is_number_unsigned() && a[i].get<uint64_t>() > uint64_t(INT64_MAX)) ||
            a[i].get<int64_t>() < lo || a[i].get<int64_t>() > hi) {
            fail(fmt::format("{}[{}]", key, i), "is " + shown(a[i]) + ", not an integer in " + range_text(double(lo), double(hi)));
        }
        out.push_back(a[i].get<int64_t>());
    }
    return out;
}

std::vector<std::string> JsonFields::strings(const std::string & key) const {
    const json & a = array(key);
    std::vector<std::string> out;
    for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].is_string()) {
            fail(fmt::format("{}[{}]", key, i), "must be a string");
        }
        out.push_back(a[i].get<std::string>());
    }
    return out;
}

} // namespace moeprune
