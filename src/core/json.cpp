#include "core/json.h"
#include "core/errors.h"

#include <fmt/format.h>

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

} // namespace moeprune
