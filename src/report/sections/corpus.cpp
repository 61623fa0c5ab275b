// The corpus: tokens per domain on each side, and the leak check between them.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

namespace {

json corpus_rows(const json & corpus) {
    json corpus_rows = json::array();
    for (const json & d : corpus.at("domains")) {
        for (const char * side : {"calib", "eval"}) {
            corpus_rows.push_back({{"domain", d.at("domain")},
                                   {"side", side},
                                   {"tokens", d[side].at("tokens")},
                                   {"target_share", d[side].at("target_share")},
                                   {"share", d[side].at("share")}});
        }
    }

    return corpus_rows;
}

json corpus_charts(const json & corpus_rows) {
    json charts = json::object();
    charts["corpus_composition"] = chart("Corpus tokens per domain, calib and eval", corpus_rows,
                                         {{"mark", "bar"},
                                          {"encoding", {{"x", {{"field", "tokens"}, {"type", "quantitative"}}},
                                                        {"y", {{"field", "side"}, {"type", "nominal"}}},
                                                        {"color", {{"field", "domain"}, {"type", "nominal"}}}}}});
    return charts;
}

} // namespace

ReportSection corpus_section() {
    return {.id = "corpus",
            .csv_columns = {"domain", "side", "tokens", "target_share", "share"},
            .csv_when_empty = true,
            .rows = [](ReportData & d) {
                const json & c = d.corpus;
                d.report["corpus"] = {{"domains", c.at("domains")},
                                      {"leak_check", c.at("leak_check")},
                                      {"dedupe", c.at("dedupe")},
                                      {"boilerplate", c.at("boilerplate")},
                                      {"outputs", c.at("outputs")}};
                return corpus_rows(c);
            },
            .charts = corpus_charts,
            .html = [](const ReportData & d) {
                const json & leak = d.corpus.at("leak_check");
                return chart_place("corpus_composition", "Corpus", "") +
                       "<h3>Leak check (eval against calib)</h3>\n" +
                       table({{"exact duplicates", leak.at("exact").dump()},
                              {"near duplicates", leak.at("near").dump()},
                              {"documents sharing a long n-gram", leak.at("shared_ngrams").dump()},
                              {"groups on both sides", leak.at("shared_groups").dump()},
                              {"clean", leak.at("clean").dump()}}) +
                       "\n";
            }};
}

} // namespace moeprune
