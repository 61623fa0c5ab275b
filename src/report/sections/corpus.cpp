// The corpus: tokens per domain on each side, and the leak check between them.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

namespace {

json corpus_rows(const CorpusReport & corpus) {
    json corpus_rows = json::array();
    for (const CorpusDomainRow & d : corpus.domains) {
        for (const auto & [side, s] : {std::pair{"calib", d.calib}, std::pair{"eval", d.eval}}) {
            corpus_rows.push_back({{"domain", d.domain},
                                   {"side", side},
                                   {"tokens", s.tokens},
                                   {"target_share", s.target_share},
                                   {"share", s.share}});
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
                const CorpusReport & c = d.corpus;
                d.report["corpus"] = {{"domains", c.domains},
                                      {"leak_check", c.leak_check},
                                      {"dedupe", c.dedupe},
                                      {"boilerplate", c.boilerplate},
                                      {"outputs", c.outputs}};
                return corpus_rows(c);
            },
            .charts = corpus_charts,
            .html = [](const ReportData & d) {
                const CorpusLeakCheck & leak = d.corpus.leak_check;
                return chart_place("corpus_composition", "Corpus", "") +
                       "<h3>Leak check (eval against calib)</h3>\n" +
                       table({{"exact duplicates", std::to_string(leak.exact)},
                              {"near duplicates", std::to_string(leak.near)},
                              {"documents sharing a long n-gram", std::to_string(leak.shared_ngrams)},
                              {"groups on both sides", std::to_string(leak.shared_groups)},
                              {"clean", leak.clean ? "true" : "false"}}) +
                       "\n";
            }};
}

} // namespace moeprune
