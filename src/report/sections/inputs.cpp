// What the figures rest on: the throughput model's inputs, and the run's settings.
#include "report/html.h"
#include "report/section.h"

namespace moeprune {

using nlohmann::json;

ReportSection inputs_section() {
    return {.id = "inputs", .html = [](const ReportData & d) {
                const PlanInputFigures & in = d.plan_inputs;
                // A measured plan's timing is the measurement's, not the guesses the replays were priced with.
                const ThroughputFigures & t =
                    !d.replay_throughput || in.measured ? in.throughput : *d.replay_throughput;
                const auto text = [](const json & v) { return v.dump(); };
                return "<h2>Throughput model inputs</h2>\n" +
                       table({{"model geometry", in.source},
                              {"MoE layers", text(in.moe_layers)},
                              {"experts, used per token", text(in.experts) + ", " + text(in.used)},
                              {"bytes of one expert (first layer)", text(in.expert_bytes.at(0))},
                              {"other weights (bytes)", text(or_null(in.other_bytes))},
                              {"RAM budget (bytes)", text(or_null(in.budget_bytes))},
                              {"SSD GB/s", text(t.ssd_gbps)},
                              {"read latency (us)", text(t.read_latency_us)},
                              {"queue depth", text(t.queue_depth)},
                              {"compute per token (ms)", text(t.compute_ms)},
                              {"formula", in.throughput_model}}) +
                       "\n<h2>Settings</h2>\n<pre>" + html_escape(d.in.config) + "</pre>\n";
            }};
}

} // namespace moeprune
