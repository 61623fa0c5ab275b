// Quality per modality: text, and the text after images or audio.
#include "report/html.h"
#include "report/section.h"

#include "formats/keep_map.h"

#include <algorithm>
#include <map>

namespace moeprune {

using nlohmann::json;

namespace {

json modality_rows(const EvalFile & eval, int64_t n_expert) {
    json rows = json::array();
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind != "keep") {
            continue;
        }
        const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
        for (const auto & [modality, st] : c.modalities) {
            rows.push_back({{"map", keep_map_label(map.first, map.second)},
                            {"criterion", map.first},
                            {"k", map.second},
                            {"modality", modality},
                            {"kld_mean", or_null(st.kld_mean)},
                            {"same_top1", or_null(st.same_top1)},
                            {"tokens", st.tokens}});
        }
    }
    return rows;
}

// Quality per modality: a row per keep map, a column per modality.
std::string modality_table(const json & rows) {
    std::string body = "<h3>Quality per modality</h3>\n";
    if (rows.empty()) {
        return body + "<p>The held-out corpus has no images or audio: every KLD here is on text.</p>\n";
    }
    std::vector<std::string> modalities, maps;
    std::map<std::pair<std::string, std::string>, json> at;
    for (const json & r : rows) {
        const std::string map = r.at("map").get<std::string>(), modality = r.at("modality").get<std::string>();
        if (std::find(maps.begin(), maps.end(), map) == maps.end()) {
            maps.push_back(map);
        }
        if (std::find(modalities.begin(), modalities.end(), modality) == modalities.end()) {
            modalities.push_back(modality);
        }
        at[{map, modality}] = r;
    }
    std::stable_partition(modalities.begin(), modalities.end(), [](const std::string & m) { return m == "text"; });
    body += "<p>Mean KLD (same top-1) of each keep map on text, and on the text that follows an image or audio "
            "(report/modality.csv).</p>\n<table><tr><th>keep map</th>";
    for (const std::string & m : modalities) {
        body += "<th>" + html_escape(m) + "</th>";
    }
    body += "</tr>";
    for (const std::string & map : maps) {
        body += "<tr><td>" + html_escape(map) + "</td>";
        for (const std::string & m : modalities) {
            const auto it = at.find({map, m});
            body += it == at.end() || it->second.at("kld_mean").is_null()
                        ? "<td>-</td>"
                        : "<td>" + cell(it->second.at("kld_mean")) + " (" + cell(it->second.at("same_top1")) + ")</td>";
        }
        body += "</tr>";
    }
    return body + "</table>\n";
}

} // namespace

ReportSection modality_section() {
    return {.id = "modality",
            .csv_columns = {"map", "criterion", "k", "modality", "kld_mean", "same_top1", "tokens"},
            .rows = [](ReportData & d) {
                const json rows = modality_rows(d.eval, d.plan.n_expert);
                d.report["modalities"] = rows.empty() ? json(nullptr) : rows;
                return rows;
            },
            .html = [](const ReportData & d) { return modality_table(d.rows.at("modality")); }};
}

} // namespace moeprune
