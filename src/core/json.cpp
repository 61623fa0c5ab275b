#include "core/json.h"
#include "core/errors.h"

namespace moeprune {

nlohmann::json parse_json(const std::string & text, const std::string & origin) {
    try {
        return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error & e) {
        fail_file(origin, std::string("not valid JSON: ") + e.what());
    }
}

} // namespace moeprune
