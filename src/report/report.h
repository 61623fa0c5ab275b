#pragma once
// The report of a run: report.json with every number, report.html (one self-contained
// file: the pinned Vega-Lite inlined, every chart's data inside its spec, so it opens
// offline), and the chart data as CSV in report/. docs/run.md describes the charts.
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct ReportInputs {
    std::filesystem::path run_dir;
    std::string config;                     // run.toml's text
    std::filesystem::path corpus, select, eval, plan;
    std::filesystem::path measure;          // moeprune-measure JSON; empty: nothing measured
    std::vector<std::filesystem::path> replays;
    std::vector<std::filesystem::path> closed_loop_evals;  // eval reports of closed-loop candidates (λ > 0)
};

// Writes run_dir/report.html, run_dir/report.json and run_dir/report/*.csv; returns them.
std::vector<std::filesystem::path> write_report(const ReportInputs & in);

// Where the pinned chart library was fetched (set-up's scripts/fetch-vega.sh).
std::filesystem::path chart_library_dir();

} // namespace moeprune
