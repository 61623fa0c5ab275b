// The report's head: the recommendation and why, and select's warnings.
#include "report/html.h"
#include "report/section.h"

#include <fmt/format.h>

namespace moeprune {

using nlohmann::json;

namespace {

// The first screen: what to run, how fast it measured, at what quality cost and under
// which conditions, a sentence each.
std::vector<std::string> answer_sentences(const ReportData & d) {
    const PlanOption * o = d.plan.recommendation();
    if (!o) {
        return {"Nothing to run: " + d.plan.why};
    }
    std::vector<std::string> out;
    const std::string what = o->measured ? fmt::format("the model itself, all {} experts, mapped from disk", o->k)
                             : o->policy == kPolicyResident
                                 ? (o->k < d.plan.n_expert ? fmt::format("the model sliced to {} experts per layer by {}, "
                                                                         "every kept expert in RAM", o->k, o->criterion)
                                                           : "the model itself, every expert in RAM")
                                 : fmt::format("K {} by {} with a simulated {} cache of {} experts, which no llama.cpp "
                                               "release runs", o->k, o->criterion, o->policy, o->cache_experts.value_or(0));
    out.push_back("Run " + what + (d.plan.commands ? ", with the commands below." : "."));
    if (o->shortlist) {
        const PlanShortlistFigures & s = *o->shortlist;
        out.push_back(fmt::format("It decoded {:.2f} tokens/s, measured by llama.cpp under {}{}.", s.measured_tok_per_s,
                                  s.ram,
                                  s.predicted_tok_per_s ? fmt::format(" (predicted {:.2f} before, error {:.0f}%)",
                                                                      *s.predicted_tok_per_s, 100 * *s.error())
                                                        : std::string()));
    } else if (o->measured) {
        out.push_back(fmt::format("It decoded {:.2f} tokens/s, measured by llama.cpp under {}.", o->tok_per_s.value_or(0),
                                  o->measured->ram));
    } else {
        out.push_back(o->tok_per_s ? fmt::format("Its speed, {:.2f} tokens/s, is predicted, not measured (run --measure "
                                                 "measures it).", *o->tok_per_s)
                                   : "Its speed is unknown: nothing in the model takes time (run --measure measures it).");
    }
    out.push_back(o->kld_mean ? fmt::format("It costs a mean KL divergence of {:.4g} from the unpruned model on the "
                                            "held-out text ({}).", *o->kld_mean,
                                            o->kld_measured.value_or(false) ? "measured" : "interpolated in K")
                              : "Its quality cost was not measured.");
    std::string conditions = o->shortlist ? "a memory limit of " + o->shortlist->ram
                             : o->measured ? "a memory limit of " + o->measured->ram
                             : d.plan_inputs.budget_bytes
                                 ? fmt::format("{:.3f} GB for the model (--ram less the reserve)", *d.plan_inputs.budget_bytes / 1e9)
                                 : std::string("no memory limit");
    if (d.measure && d.measure->report.read_ahead_kb) {
        conditions += fmt::format(", the model's device at a read-ahead of {} KB", *d.measure->report.read_ahead_kb);
    }
    out.push_back("Conditions: " + conditions + (d.measure ? ", timing measured on this machine." : ", timing guessed."));
    return out;
}

} // namespace

ReportSection summary_section() {
    return {.id = "summary",
            .rows = [](ReportData & d) {
                d.report["recommendation"] = {{"option", or_null(d.plan.recommended)},
                                              {"why", d.plan.why},
                                              {"commands", d.plan.commands ? to_json(*d.plan.commands) : json(nullptr)},
                                              {"answer", answer_sentences(d)}};
                d.report["warnings"] = d.select.warnings;
                return json::array();
            },
            .html = [](const ReportData & d) {
                std::string body = "<h1>moeprune run report</h1>\n<ul class=\"answer\">";
                for (const std::string & sentence : answer_sentences(d)) {
                    body += "<li>" + html_escape(sentence) + "</li>";
                }
                body += "</ul>\n<p class=\"why\"><b>Recommended:</b> " + html_escape(d.plan.why) + "</p>\n";
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
