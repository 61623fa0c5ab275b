// Per layer: the kept share of each keep map, and how much of the original top-k it replaces.
#include "report/html.h"
#include "report/section.h"

#include "formats/keep_map.h"

namespace moeprune {

using nlohmann::json;

namespace {

json layer_rows(const SelectFile & select) {
    json layer_rows = json::array();
    for (const SelectResultFigures & r : select.results) {
        for (const SelectLayerFigures & l : r.layers) {
            layer_rows.push_back({{"map", keep_map_label(r.criterion, r.k)},
                                  {"criterion", r.criterion},
                                  {"k", r.k},
                                  {"layer", l.layer},
                                  {"kept_reap_share", l.reap_share},
                                  {"kept_count_share", l.count_share},
                                  {"heldout_reap_share", or_null(l.heldout_reap_share)},
                                  {"replaced_share", or_null(l.replaced_share)},
                                  {"moved_mass", or_null(l.moved_mass)}});
        }
    }
    return layer_rows;
}

json layer_charts(const json & layer_rows) {
    json charts = json::object();
    charts["kept_share_per_layer"] = chart("Kept share of REAP mass per layer (calibration statistics)", layer_rows,
                                           {{"mark", {{"type", "line"}, {"point", true}}},
                                            {"encoding", {{"x", {{"field", "layer"}, {"type", "ordinal"}}},
                                                          {"y", {{"field", "kept_reap_share"}, {"type", "quantitative"}, {"title", "kept share"}}},
                                                          {"color", {{"field", "map"}, {"type", "nominal"}}}}}});
    charts["substitution_per_layer"] = chart("Slots of the original top-k replaced per layer (held-out trace)", layer_rows,
                                             {{"mark", {{"type", "line"}, {"point", true}}},
                                              {"encoding", {{"x", {{"field", "layer"}, {"type", "ordinal"}}},
                                                            {"y", {{"field", "replaced_share"}, {"type", "quantitative"}, {"title", "replaced share"}}},
                                                            {"color", {{"field", "map"}, {"type", "nominal"}}}}}});
    return charts;
}

} // namespace

ReportSection layers_section() {
    return {.id = "layers",
            .csv_columns = {"map", "criterion", "k", "layer", "kept_reap_share", "kept_count_share", "heldout_reap_share",
                            "replaced_share", "moved_mass"},
            .csv_when_empty = true,
            .rows = [](ReportData & d) { return d.report["layers"] = layer_rows(d.select); },
            .charts = layer_charts,
            .html = [](const ReportData &) {
                return chart_place("kept_share_per_layer", "Kept share per layer", "") +
                       chart_place("substitution_per_layer", "Substitution per layer", "");
            }};
}

} // namespace moeprune
