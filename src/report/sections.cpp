// The report's sections, in page order.
#include "report/section.h"

namespace moeprune {

ReportSection summary_section();
ReportSection quality_section();
ReportSection modality_section();
ReportSection tasks_section();
ReportSection layers_section();
ReportSection replay_section();
ReportSection plan_section();
ReportSection runs_on_section();
ReportSection measured_section();
ReportSection draft_section();
ReportSection closed_loop_section();
ReportSection corpus_section();
ReportSection inputs_section();

const std::vector<ReportSection> & report_sections() {
    static const std::vector<ReportSection> sections = {
        summary_section(),  quality_section(),  modality_section(), tasks_section(),    layers_section(), replay_section(),
        plan_section(),     runs_on_section(), measured_section(), draft_section(),       closed_loop_section(), corpus_section(),
        inputs_section(),
    };
    return sections;
}

} // namespace moeprune
