// What the figures rest on: the throughput model's inputs, and the run's settings.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

ReportSection inputs_section() {
    return {.id = "inputs", .html = [](const ReportData & d) {
                const json & inputs = d.plan.inputs;
                const json throughput_inputs = d.report.value("throughput", json());
                // A measured plan's timing is the measurement's, not the guesses the replays were priced with.
                const json & ti = throughput_inputs.is_null() || !inputs.value("measured", json()).is_null()
                                      ? inputs.at("throughput")
                                      : throughput_inputs;
                const json & geo = inputs.at("geometry");
                return "<h2>Throughput model inputs</h2>\n" +
                       table({{"model geometry", geo.at("source").get<std::string>()},
                              {"MoE layers", geo.at("moe_layers").dump()},
                              {"experts, used per token", geo.at("experts").dump() + ", " + geo.at("used").dump()},
                              {"bytes of one expert (first layer)", geo.at("expert_bytes")[0].dump()},
                              {"other weights (bytes)", geo.at("other_bytes").dump()},
                              {"RAM budget (bytes)", inputs.at("budget_bytes").dump()},
                              {"SSD GB/s", ti.value("ssd_gbps", json(nullptr)).dump()},
                              {"read latency (us)", ti.value("read_latency_us", json(nullptr)).dump()},
                              {"queue depth", ti.value("queue_depth", json(nullptr)).dump()},
                              {"compute per token (ms)", ti.value("compute_ms", json(nullptr)).dump()},
                              {"formula", inputs.at("throughput").at("model").get<std::string>()}}) +
                       "\n<h2>Settings</h2>\n<pre>" + html_escape(d.in.config) + "</pre>\n";
            }};
}

} // namespace moeprune
