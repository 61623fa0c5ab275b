#pragma once
// One section of run's report, whole in one place: its rows (a CSV beside the report and
// what its charts show), its entries in report.json, its charts and its part of the page.
// report/sections.cpp lists the sections in page order. Adding a section: a file in
// report/sections/ that returns its ReportSection, and its line in that list.
#include "formats/corpus_report.h"
#include "formats/measure_report.h"
#include "formats/stage_reports.h"
#include "report/report.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

// What the report is made from, each input read once, and what the sections made so far.
struct ReportData {
    const ReportInputs & in;
    PlanFile plan;
    PlanInputFigures plan_inputs;
    CorpusReport corpus;
    EvalFile eval;
    SelectFile select;
    std::optional<MeasureFile> measure;  // none: nothing measured
    std::optional<ThroughputFigures> replay_throughput;   // what the replays were priced with; none without replays
    nlohmann::json rows = nlohmann::json::object();     // each section's rows by its id, in page order
    nlohmann::json report = nlohmann::json::object();   // report.json's entries
};

struct ReportSection {
    std::string id;                            // its rows' name: ReportData::rows[id] and report/ID.csv
    std::vector<std::string> csv_columns;      // none: no CSV
    bool csv_when_empty = false;               // a CSV of a header alone rather than none
    std::function<nlohmann::json(ReportData &)> rows;             // may add entries to ReportData::report
    std::function<nlohmann::json(const nlohmann::json & rows)> charts;   // chart id -> spec
    std::function<std::string(const ReportData &)> html;          // its part of the page
};

const std::vector<ReportSection> & report_sections();

} // namespace moeprune
