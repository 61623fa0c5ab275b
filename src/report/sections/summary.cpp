// The report's head: the recommendation and why, and select's warnings.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

ReportSection summary_section() {
    return {.id = "summary",
            .rows = [](ReportData & d) {
                d.report["recommendation"] = {{"option", or_null(d.plan.recommended)},
                                              {"why", d.plan.why},
                                              {"commands", d.plan.commands ? to_json(*d.plan.commands) : json(nullptr)}};
                d.report["warnings"] = d.select.warnings;
                return json::array();
            },
            .html = [](const ReportData & d) {
                std::string body = "<h1>moeprune run report</h1>\n<p class=\"why\"><b>Recommended:</b> " +
                                   html_escape(d.plan.why) + "</p>\n";
                if (d.plan.commands) {
                    body += "<p><b>To run it</b> (plan.json's commands):</p>\n<pre>";
                    for (const std::string & line : d.plan.commands->lines) {
                        body += html_escape(line) + "\n";
                    }
                    body += "</pre>\n";
                }
                for (const std::string & w : d.select.warnings) {
                    body += "<p class=\"warning\"><b>WARNING:</b> " + html_escape(w) + "</p>\n";
                }
                return body;
            }};
}

} // namespace moeprune
