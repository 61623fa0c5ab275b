#include "report/html.h"

#include "formats/keep_map.h"

#include <fmt/format.h>

namespace moeprune {

using nlohmann::json;

namespace {

std::string csv_field(const json & v) {
    if (v.is_null()) {
        return "";
    }
    if (!v.is_string()) {
        return v.dump();
    }
    const std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) {
        return s;
    }
    std::string out = "\"";
    for (const char c : s) {
        out += c == '"' ? std::string("\"\"") : std::string(1, c);
    }
    return out + "\"";
}

} // namespace

std::string html_escape(const std::string & s) {
    std::string out;
    for (const char c : s) {
        switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&quot;"; break;
        default: out += c;
        }
    }
    return out;
}

std::string script_json(const json & v) {
    const std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (c == '<') {
            out += "\\u003c";
        } else if (c == '>') {
            out += "\\u003e";
        } else if (c == '&') {
            out += "\\u0026";
        } else if (c == '\xE2' && i + 2 < text.size() && text[i + 1] == '\x80' && (text[i + 2] == '\xA8' || text[i + 2] == '\xA9')) {
            out += text[i + 2] == '\xA8' ? "\\u2028" : "\\u2029";
            i += 2;
        } else {
            out += c;
        }
    }
    return out;
}

std::string plan_option_label(const PlanOption & o) {
    return fmt::format("{} K{} {} {}", o.criterion, o.k, o.policy,
                       o.cache_experts ? std::to_string(*o.cache_experts) : std::string("-"));
}

std::string cell(const json & v) {
    return html_escape(v.is_string() ? v.get<std::string>() : v.is_number_float() ? fmt::format("{:.4g}", v.get<double>()) : v.dump());
}

std::string table(const std::vector<std::pair<std::string, std::string>> & rows) {
    std::string out = "<table>";
    for (const auto & [k, v] : rows) {
        out += "<tr><th>" + html_escape(k) + "</th><td>" + html_escape(v) + "</td></tr>";
    }
    return out + "</table>";
}

std::string rows_table(const json & rows, const std::vector<std::string> & columns) {
    std::string body = "<table><tr>";
    for (const std::string & col : columns) {
        body += "<th>" + html_escape(col) + "</th>";
    }
    body += "</tr>";
    for (const json & row : rows) {
        body += "<tr>";
        for (const std::string & col : columns) {
            body += "<td>" + cell(row.value(col, json(nullptr))) + "</td>";
        }
        body += "</tr>";
    }
    return body + "</table>\n";
}

std::string chart_place(const std::string & id, const std::string & title, const std::string & note) {
    std::string body = "<h2>" + html_escape(title) + "</h2>\n";
    if (!note.empty()) {
        body += "<p>" + html_escape(note) + "</p>\n";
    }
    return body + "<div class=\"chart\" id=\"" + id + "\"></div>\n";
}

json chart(const std::string & title, const json & values, json spec) {
    spec["$schema"] = "https://vega.github.io/schema/vega-lite/v6.json";  // an identifier, never fetched
    spec["title"] = title;
    spec["data"] = {{"values", values}};
    if (!spec.contains("width") && !spec.contains("facet")) {
        spec["width"] = 520;
        spec["height"] = 260;
    }
    return spec;
}

std::string to_csv(const json & rows, const std::vector<std::string> & columns) {
    std::string out;
    for (size_t i = 0; i < columns.size(); ++i) {
        out += i ? "," : "";
        out += columns[i];
    }
    out += "\n";
    for (const json & r : rows) {
        for (size_t i = 0; i < columns.size(); ++i) {
            out += i ? "," : "";
            out += csv_field(r.value(columns[i], json(nullptr)));
        }
        out += "\n";
    }
    return out;
}

std::pair<std::string, int64_t> map_name(const std::string & path, int64_t n_expert) {
    if (path.empty()) {
        return {"none", n_expert};
    }
    const KeepMapName n = parse_keep_map_name(path);
    return {n.criterion, n.k};
}

std::string map_label(const std::string & criterion, int64_t k) {
    return criterion == "none" ? std::string("unpruned") : keep_map_label(criterion, k);
}

} // namespace moeprune
