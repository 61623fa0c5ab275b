#include "formats/verify_summary.h"

#include "core/digest.h"
#include "core/errors.h"
#include "core/atomic_file.h"
#include "core/json.h"

#include <cmath>
#include <limits>

namespace moeprune {

using json = nlohmann::json;

std::optional<double> VerifySummary::error() const {
    if (!predicted_tok_per_s) {
        return std::nullopt;
    }
    return std::abs(*predicted_tok_per_s - measured_tok_per_s) / measured_tok_per_s;
}

std::optional<double> VerifySummary::drift() const {
    if (!resident_tok_per_s || !shortlist_resident_tok_per_s) {
        return std::nullopt;
    }
    return *resident_tok_per_s / *shortlist_resident_tok_per_s - 1;
}

json to_json(const VerifySummary & v) {
    const auto or_null = [](const std::optional<double> & x) { return x ? json(*x) : json(nullptr); };
    return {{"format", "moeprune-verify"},
            {"version", 1},
            {"plan", v.plan},
            {"option", v.option},
            {"model", v.model},
            {"ram", v.ram},
            {"predicted_tok_per_s", or_null(v.predicted_tok_per_s)},
            {"measured_tok_per_s", v.measured_tok_per_s},
            {"measured_read_bytes_per_token", or_null(v.measured_read_bytes_per_token)},
            {"measured_major_faults_per_token", v.measured_major_faults_per_token},
            {"error", or_null(v.error())},
            {"measure", v.measure},
            {"resident_tok_per_s", or_null(v.resident_tok_per_s)},
            {"shortlist_resident_tok_per_s", or_null(v.shortlist_resident_tok_per_s)},
            {"drift", or_null(v.drift())}};
}

VerifySummary read_verify_summary(const std::filesystem::path & path) {
    const std::string file = path.string();
    const std::string bytes = read_text_file(path);
    const json doc = parse_json(bytes, file);
    if (!doc.is_object() || doc.value("format", json()) != "moeprune-verify") {
        fail_file(file, "is not a moeprune-verify summary (\"format\")");
    }
    const JsonFields f(doc, file);
    if (f.integer("version", 0, std::numeric_limits<int64_t>::max()) != 1) {
        f.fail("version", "is not 1, the version of moeprune-verify this moeprune reads");
    }
    const auto optional = [&](const char * key, double most) {
        return f.has(key) ? std::optional(f.number(key, 0, most)) : std::nullopt;
    };
    VerifySummary v;
    v.digest = content_digest(bytes);
    v.plan = f.string("plan");
    (void)f.object("option");   // an object, or refused by name
    v.option = f.any("option");
    v.model = f.string("model");
    v.ram = f.string("ram");
    v.predicted_tok_per_s = optional("predicted_tok_per_s", 1e6);
    v.measured_tok_per_s = f.number("measured_tok_per_s", 1e-3, 1e6);
    v.measured_read_bytes_per_token = optional("measured_read_bytes_per_token", 0x1p50);
    v.measured_major_faults_per_token = f.number("measured_major_faults_per_token", 0, 1e12);
    v.measure = f.string("measure");
    v.resident_tok_per_s = optional("resident_tok_per_s", 1e6);
    v.shortlist_resident_tok_per_s = optional("shortlist_resident_tok_per_s", 1e6);
    return v;
}

} // namespace moeprune
