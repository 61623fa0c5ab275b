#include "core/sizes.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <regex>
#include <stdexcept>

namespace moeprune {

double parse_size(const std::string & text, const std::string & what, SizeUnits units) {
    static const std::regex form(R"(\s*([0-9]+(\.[0-9]+)?)\s*([KMGT]?)(i?B?)\s*)", std::regex::icase);
    std::smatch m;
    if (!std::regex_match(text, m, form)) {
        throw Error(fmt::format("{} \"{}\" is not a size (24G, 24GiB, 24GB, 512M, or bytes)", what, text));
    }
    double v = 0;
    try {
        v = std::stod(m[1].str());
    } catch (const std::out_of_range &) {
        v = std::numeric_limits<double>::infinity();
    }
    const char unit = m[3].str().empty() ? ' ' : char(std::toupper(m[3].str()[0]));
    const std::string suffix = m[4].str();
    const bool decimal = suffix.empty() ? units == SizeUnits::decimal : suffix.size() == 1;  // "GB": 10^9, "GiB": 2^30
    const int power = unit == 'K' ? 1 : unit == 'M' ? 2 : unit == 'G' ? 3 : unit == 'T' ? 4 : 0;
    const double bytes = v * std::pow(decimal ? 1000.0 : 1024.0, power);
    if (!std::isfinite(bytes) || bytes >= 0x1p64) {
        throw Error(fmt::format("{} \"{}\" is 2^64 bytes or more: not a size of memory", what, text));
    }
    return bytes;
}

} // namespace moeprune
