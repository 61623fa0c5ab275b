#include "report/report.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"
#include "formats/keep_map.h"
#include "formats/stage_reports.h"
#include "sim/policy.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>

namespace moeprune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json load(const fs::path & p) { return parse_json(read_text_file(p), p.string()); }

std::string html_escape(const std::string & s) {
    std::string out;
    for (const char c : s) {
        switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&quot;"; break;
        default: out += c;
        }
    }
    return out;
}

std::string csv_field(const json & v) {
    if (v.is_null()) {
        return "";
    }
    if (!v.is_string()) {
        return v.dump();
    }
    const std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) {
        return s;
    }
    std::string out = "\"";
    for (const char c : s) {
        out += c == '"' ? std::string("\"\"") : std::string(1, c);
    }
    return out + "\"";
}

// Rows of objects as CSV, columns in the order given.
std::string to_csv(const json & rows, const std::vector<std::string> & columns) {
    std::string out;
    for (size_t i = 0; i < columns.size(); ++i) {
        out += i ? "," : "";
        out += columns[i];
    }
    out += "\n";
    for (const json & r : rows) {
        for (size_t i = 0; i < columns.size(); ++i) {
            out += i ? "," : "";
            out += csv_field(r.value(columns[i], json(nullptr)));
        }
        out += "\n";
    }
    return out;
}

// "reap-k8" from a keep map path; "none" for the unpruned model.
std::pair<std::string, int64_t> map_name(const std::string & path, int64_t n_expert) {
    if (path.empty()) {
        return {"none", n_expert};
    }
    const KeepMapName n = parse_keep_map_name(path);
    return {n.criterion, n.k};
}

json chart(const std::string & title, const json & values, json spec) {
    spec["$schema"] = "https://vega.github.io/schema/vega-lite/v6.json";  // an identifier, never fetched
    spec["title"] = title;
    spec["data"] = {{"values", values}};
    if (!spec.contains("width") && !spec.contains("facet")) {
        spec["width"] = 520;
        spec["height"] = 260;
    }
    return spec;
}

std::string table(const std::vector<std::pair<std::string, std::string>> & rows) {
    std::string out = "<table>";
    for (const auto & [k, v] : rows) {
        out += "<tr><th>" + html_escape(k) + "</th><td>" + html_escape(v) + "</td></tr>";
    }
    return out + "</table>";
}

} // namespace

fs::path chart_library_dir() { return fs::path(MOEPRUNE_VEGA_DIR); }

namespace {

// The run's figures as rows, the form the charts, the CSV files and report.json share.
struct ReportRows {
    json kld = json::array(), layers = json::array(), replay = json::array(), closed = json::array(),
         plan = json::array(), corpus = json::array();
    json modality = json::array();   // per keep map and modality (text, image, audio); empty without media
    std::vector<std::string> warnings;  // select's, e.g. a multimodal model calibrated without media
    json measured = json::array();   // predicted vs measured, per measured RAM limit
    json throughput_inputs;   // the replays' throughput settings; null without replays
};

const std::vector<std::string> kMeasuredColumns = {
    "ram", "limit_bytes", "predicted_tok_per_s", "measured_tok_per_s", "error", "predicted_read_bytes_per_token",
    "measured_read_bytes_per_token", "predicted_faults_per_token", "measured_major_faults_per_token"};

// Every limit `measure` ran llama.cpp under, its prediction beside it.
json measured_rows(const json & m) {
    json rows = json::array();
    for (const json & r : m.at("runs")) {
        const json & d = r.at("decode");
        const json & p = r.at("predicted");
        rows.push_back({{"ram", r.at("ram")},
                        {"limit_bytes", r.at("limit_bytes")},
                        {"predicted_tok_per_s", p.is_null() ? json(nullptr) : p.at("tokens_per_second")},
                        {"measured_tok_per_s", d.at("tokens_per_second")},
                        {"error", r.at("error")},
                        {"predicted_read_bytes_per_token", p.is_null() ? json(nullptr) : p.at("read_bytes_per_token")},
                        {"measured_read_bytes_per_token", d.at("read_bytes_per_token")},
                        {"predicted_faults_per_token", p.is_null() ? json(nullptr) : p.at("faults_per_token")},
                        {"measured_major_faults_per_token", d.at("major_faults_per_token")}});
    }
    return rows;
}

const std::vector<std::string> kClosedColumns = {"map", "policy", "cache", "lambda", "kld_mean", "same_top1",
                                                 "misses_per_token", "open_loop_misses_per_token", "tok_per_s",
                                                 "open_loop_tok_per_s"};

template <class T> json or_null(const std::optional<T> & v) { return v ? json(*v) : json(nullptr); }

// Quality: KLD per criterion, K and domain.
json kld_rows(const EvalFile & eval, int64_t n_expert) {
    json kld_rows = json::array();
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind != "keep") {
            continue;
        }
        // Named, not bound: a lambda of clang 15 cannot capture a structured binding.
        const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
        const std::string & criterion = map.first;
        const int64_t k = map.second;
        const auto row = [&](const std::string & domain, const EvalFigures & st) {
            kld_rows.push_back({{"criterion", criterion},
                                {"k", k},
                                {"domain", domain},
                                {"kld_mean", or_null(st.kld_mean)},
                                {"kld_p99", or_null(st.kld_p99)},
                                {"same_top1", or_null(st.same_top1)},
                                {"tokens", st.tokens}});
        };
        row("all", c.all);
        for (const auto & [d, st] : c.domains) {
            row(d, st);
        }
    }
    return kld_rows;
}

// Quality per modality: text, and the text after images or audio.
json modality_rows(const EvalFile & eval, int64_t n_expert) {
    json rows = json::array();
    for (const EvalFileCandidate & c : eval.candidates) {
        if (c.kind != "keep") {
            continue;
        }
        const std::pair<std::string, int64_t> map = map_name(c.source, n_expert);
        for (const auto & [modality, st] : c.modalities) {
            rows.push_back({{"map", keep_map_label(map.first, map.second)},
                            {"criterion", map.first},
                            {"k", map.second},
                            {"modality", modality},
                            {"kld_mean", or_null(st.kld_mean)},
                            {"same_top1", or_null(st.same_top1)},
                            {"tokens", st.tokens}});
        }
    }
    return rows;
}

// Per layer: kept share (statistics and held out) and substitution.
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

std::string map_label(const std::string & criterion, int64_t k) {
    return criterion == "none" ? std::string("unpruned") : keep_map_label(criterion, k);
}

// Caches: misses/token per policy and size, for every map, with Belady as the bound.
json replay_rows(const std::vector<fs::path> & replays, int64_t n_expert, json & throughput_inputs) {
    json rows = json::array();
    for (const fs::path & p : replays) {
        const ReplayFile r = read_replay_report(p);
        const auto [criterion, k] = map_name(r.keep.value_or(""), n_expert);
        throughput_inputs = r.throughput;
        for (const ReplayRecordFigures & rec : r.records) {
            rows.push_back({{"map", map_label(criterion, k)},
                            {"criterion", criterion},
                            {"k", k},
                            {"policy", rec.policy},
                            {"cache", rec.slots.at(0)},
                            {"lambda", rec.lambda},
                            {"misses_per_token", rec.misses_per_token},
                            {"hit_rate", or_null(rec.hit_rate)},
                            {"tokens_per_s", or_null(rec.tokens_per_s)},
                            {"bound", policy_reads_future(rec.policy) ? "Belady (offline bound)" : "online policy"}});
        }
    }
    return rows;
}

// Cache-aware routing (λ > 0) in the closed loop, beside the open-loop replay of the
// same tokens: the difference is the open-loop error.
json closed_loop_rows(const std::vector<fs::path> & evals, int64_t n_expert) {
    json rows = json::array();
    for (const fs::path & p : evals) {
        for (const EvalFileCandidate & c : read_eval_report(p).candidates) {
            if (c.kind != "closed-loop") {
                continue;
            }
            const auto [criterion, k] = map_name(c.keep.value_or(""), n_expert);
            rows.push_back({{"map", map_label(criterion, k)},
                            {"criterion", criterion},
                            {"k", k},
                            {"policy", c.policy},
                            {"cache", c.cache},
                            {"lambda", c.lambda},
                            {"kld_mean", or_null(c.all.kld_mean)},
                            {"same_top1", or_null(c.all.same_top1)},
                            {"misses_per_token", or_null(c.loop.misses_per_token)},
                            {"open_loop_misses_per_token", or_null(c.loop.open_loop_misses_per_token)},
                            {"tok_per_s", or_null(c.loop.tok_per_s)},
                            {"open_loop_tok_per_s", or_null(c.loop.open_loop_tok_per_s)}});
        }
    }
    return rows;
}

// The plan's options, with the front and the recommendation marked.
json plan_rows(const PlanFile & plan) {
    json plan_rows = json::array();
    const std::set<size_t> front(plan.pareto.begin(), plan.pareto.end());
    for (size_t i = 0; i < plan.options.size(); ++i) {
        const PlanOptionFigures & o = plan.options[i];
        json row = o.fields;
        row["option"] = i;
        row["resident_gb"] = o.resident_bytes ? json(*o.resident_bytes / 1e9) : json(nullptr);
        row["pareto"] = front.count(i) > 0;
        row["recommended"] = plan.recommended == i;
        row["label"] = fmt::format("{} K{} {} {}", o.criterion, o.k, o.policy,
                                   o.cache_experts ? std::to_string(*o.cache_experts) : std::string("-"));
        const json draft = o.fields.value("mtp_draft", json::object());
        row["mtp_acceptance"] = draft.value("acceptance", json());
        row["mtp_tok_per_s"] = draft.value("tok_per_s", json());
        plan_rows.push_back(row);
    }
    return plan_rows;
}

// Corpus composition.
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

json charts_of(const ReportRows & rows) {
    const json & kld_rows = rows.kld;
    const json & layer_rows = rows.layers;
    const json & replay_rows = rows.replay;
    const json & plan_rows = rows.plan;
    const json & corpus_rows = rows.corpus;
    json charts = json::object();
    charts["kld_vs_k"] = chart("Mean KLD against the original model, by K and criterion (per domain)", kld_rows,
                               {{"mark", {{"type", "line"}, {"point", true}}},
                                {"encoding", {{"x", {{"field", "k"}, {"type", "quantitative"}, {"title", "experts kept per layer (K)"}}},
                                              {"y", {{"field", "kld_mean"}, {"type", "quantitative"}, {"title", "mean KLD (nats)"}}},
                                              {"color", {{"field", "criterion"}, {"type", "nominal"}}},
                                              {"strokeDash", {{"field", "domain"}, {"type", "nominal"}}},
                                              {"tooltip", json::array({{{"field", "criterion"}}, {{"field", "k"}}, {{"field", "domain"}},
                                                                       {{"field", "kld_mean"}}, {{"field", "same_top1"}}})}}}});
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
    charts["misses_vs_cache"] = chart("Misses per token against cache size, per policy (Belady dashed: the offline bound)", replay_rows,
                                      {{"facet", {{"field", "map"}, {"type", "nominal"}}},
                                       {"columns", 3},
                                       {"spec", {{"width", 220}, {"height", 160},
                                                 {"mark", {{"type", "line"}, {"point", true}}},
                                                 {"encoding", {{"x", {{"field", "cache"}, {"type", "quantitative"}, {"title", "experts cached per layer"}}},
                                                               {"y", {{"field", "misses_per_token"}, {"type", "quantitative"}}},
                                                               {"color", {{"field", "policy"}, {"type", "nominal"}}},
                                                               {"strokeDash", {{"field", "bound"}, {"type", "nominal"}}}}}}},
                                       {"resolve", {{"scale", {{"y", "independent"}}}}}});
    charts["speed_vs_ram"] = chart(
        "Tokens/s against resident RAM: every feasible option, the Pareto front (line) and the recommendation (star)", plan_rows,
        {{"layer", json::array({{{"mark", {{"type", "point"}, {"filled", true}, {"opacity", 0.6}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}, {"title", "resident GB"},
                                                      {"scale", {{"zero", false}}}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}, {"title", "tokens/s"}}},
                                               {"color", {{"field", "kld_mean"}, {"type", "quantitative"}, {"title", "mean KLD"}}},
                                               {"tooltip", json::array({{{"field", "label"}}, {{"field", "tok_per_s"}}, {{"field", "kld_mean"}}})}}}},
                                {{"transform", json::array({{{"filter", "datum.pareto"}}})},
                                 {"mark", {{"type", "line"}, {"color", "#444"}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}}},
                                               {"order", {{"field", "resident_gb"}}}}}},
                                {{"transform", json::array({{{"filter", "datum.recommended"}}})},
                                 {"mark", {{"type", "point"}, {"shape", "diamond"}, {"size", 300}, {"color", "#d62728"}, {"filled", true}}},
                                 {"encoding", {{"x", {{"field", "resident_gb"}, {"type", "quantitative"}}},
                                               {"y", {{"field", "tok_per_s"}, {"type", "quantitative"}}}}}}})}});
    charts["corpus_composition"] = chart("Corpus tokens per domain, calib and eval", corpus_rows,
                                         {{"mark", "bar"},
                                          {"encoding", {{"x", {{"field", "tokens"}, {"type", "quantitative"}}},
                                                        {"y", {{"field", "side"}, {"type", "nominal"}}},
                                                        {"color", {{"field", "domain"}, {"type", "nominal"}}}}}});
    return charts;
}

// CSV next to the report.
void write_csvs(const fs::path & run_dir, const ReportRows & rows, std::vector<fs::path> & written) {
    const fs::path data_dir = run_dir / "report";
    fs::create_directories(data_dir);
    const auto csv = [&](const std::string & name, const json & table, const std::vector<std::string> & cols) {
        write_file_atomic(data_dir / name, to_csv(table, cols));
        written.push_back(data_dir / name);
    };
    csv("kld.csv", rows.kld, {"criterion", "k", "domain", "kld_mean", "kld_p99", "same_top1", "tokens"});
    csv("layers.csv", rows.layers, {"map", "criterion", "k", "layer", "kept_reap_share", "kept_count_share",
                                    "heldout_reap_share", "replaced_share", "moved_mass"});
    csv("replay.csv", rows.replay,
        {"map", "criterion", "k", "policy", "cache", "lambda", "misses_per_token", "hit_rate", "tokens_per_s"});
    csv("plan.csv", rows.plan, {"option", "k", "criterion", "policy", "cache_experts", "cache_scope", "lambda",
                                "routed_bytes", "resident_bytes", "misses_per_token", "tok_per_s", "kld_mean",
                                "kld_measured", "pareto", "recommended", "mtp_acceptance", "mtp_tok_per_s"});
    csv("corpus.csv", rows.corpus, {"domain", "side", "tokens", "target_share", "share"});
    if (!rows.closed.empty()) {
        csv("closed_loop.csv", rows.closed, kClosedColumns);
    }
    if (!rows.modality.empty()) {
        csv("modality.csv", rows.modality, {"map", "criterion", "k", "modality", "kld_mean", "same_top1", "tokens"});
    }
    if (!rows.measured.empty()) {
        csv("measured.csv", rows.measured, kMeasuredColumns);
    }
}

// The chart library inlined into the page.
std::string chart_scripts() {
    std::string libs;
    for (const char * f : {"vega.min.js", "vega-lite.min.js", "vega-embed.min.js"}) {
        const fs::path p = chart_library_dir() / f;
        std::error_code ec;
        if (!fs::exists(p, ec)) {
            fail_file(p.string(), "is missing: the report's chart library is fetched by set-up (make build, scripts/fetch-vega.sh)");
        }
        std::string js = read_text_file(p);
        for (size_t at = js.find("</script"); at != std::string::npos; at = js.find("</script", at)) {
            js.replace(at, 2, "<\\/");
        }
        libs += "<script>" + js + "</script>\n";
    }
    return libs;
}

std::string cell(const json & v) {
    return html_escape(v.is_string() ? v.get<std::string>() : v.is_number_float() ? fmt::format("{:.4g}", v.get<double>()) : v.dump());
}

// Quality per modality: a row per keep map, a column per modality.
std::string modality_section(const json & rows) {
    std::string body = "<h3>Quality per modality</h3>\n";
    if (rows.empty()) {
        return body + "<p>The held-out corpus has no images or audio: every KLD here is on text.</p>\n";
    }
    std::vector<std::string> modalities, maps;
    std::map<std::pair<std::string, std::string>, json> at;
    for (const json & r : rows) {
        const std::string map = r.at("map").get<std::string>(), modality = r.at("modality").get<std::string>();
        if (std::find(maps.begin(), maps.end(), map) == maps.end()) {
            maps.push_back(map);
        }
        if (std::find(modalities.begin(), modalities.end(), modality) == modalities.end()) {
            modalities.push_back(modality);
        }
        at[{map, modality}] = r;
    }
    std::stable_partition(modalities.begin(), modalities.end(), [](const std::string & m) { return m == "text"; });
    body += "<p>Mean KLD (same top-1) of each keep map on text, and on the text that follows an image or audio "
            "(report/modality.csv).</p>\n<table><tr><th>keep map</th>";
    for (const std::string & m : modalities) {
        body += "<th>" + html_escape(m) + "</th>";
    }
    body += "</tr>";
    for (const std::string & map : maps) {
        body += "<tr><td>" + html_escape(map) + "</td>";
        for (const std::string & m : modalities) {
            const auto it = at.find({map, m});
            body += it == at.end() || it->second.at("kld_mean").is_null()
                        ? "<td>-</td>"
                        : "<td>" + cell(it->second.at("kld_mean")) + " (" + cell(it->second.at("same_top1")) + ")</td>";
        }
        body += "</tr>";
    }
    return body + "</table>\n";
}

std::string measured_section(const json & rows, const PlanFile & plan) {
    std::string body = "<h2>Predicted vs measured</h2>\n";
    if (rows.empty()) {
        return body + "<p>Nothing measured in this run (run --measure): every tokens/s here rests on the guessed SSD "
                      "bandwidth and compute time below.</p>\n";
    }
    const json & m = plan.inputs.at("measured");
    body += "<p>llama.cpp's own decode of the whole model under each memory limit (moeprune measure, measure/measure.json), "
            "beside what moeprune predicts for it from the resident run, the storage probe and the router trace alone "
            "(report/measured.csv). Error is |predicted - measured| / measured tokens/s";
    if (!m.is_null() && !m.at("median_error").is_null()) {
        body += fmt::format(": median {:.0f}%, max {:.0f}%", 100 * m.at("median_error").get<double>(),
                            100 * m.at("max_error").get<double>());
    }
    body += ".</p>\n<table><tr>";
    for (const std::string & col : kMeasuredColumns) {
        body += "<th>" + html_escape(col) + "</th>";
    }
    body += "</tr>";
    for (const json & row : rows) {
        body += "<tr>";
        for (const std::string & col : kMeasuredColumns) {
            body += "<td>" + cell(row[col]) + "</td>";
        }
        body += "</tr>";
    }
    return body + "</table>\n";
}

// A model with an MTP head: each option of the front, and the recommendation, with and
// without one draft token per step.
std::string draft_section(const json & plan_rows, const PlanFile & plan) {
    if (plan.inputs.at("geometry").value("mtp_layers", 0) == 0) {
        return "";
    }
    std::string body = "<h2>With and without the MTP draft</h2>\n<p>Speculative decoding with the model's MTP head "
                       "drafting one token per step: tokens per step = 1 + acceptance, at the cost of a step that "
                       "verifies two positions and runs the head (plan.json's mtp_draft; report/plan.csv's mtp_* "
                       "columns). Acceptance is what eval measured for the keep map; a blank is not measured.</p>\n"
                       "<table><tr><th>option</th><th>tokens/s</th><th>acceptance</th><th>tokens/s with the draft</th>"
                       "<th>source</th></tr>";
    for (const json & row : plan_rows) {
        if (!row["pareto"].get<bool>() && !row["recommended"].get<bool>()) {
            continue;
        }
        const json draft = row.value("mtp_draft", json::object());
        body += "<tr><td>" + html_escape(row["label"].get<std::string>()) + (row["recommended"].get<bool>() ? " (recommended)" : "") +
                "</td><td>" + cell(row.value("tok_per_s", json())) + "</td><td>" + cell(row["mtp_acceptance"]) + "</td><td>" +
                cell(row["mtp_tok_per_s"]) + "</td><td>" +
                cell(draft.value("acceptance_source", draft.value("note", json()))) + "</td></tr>";
    }
    return body + "</table>\n";
}

std::string closed_loop_section(const json & closed_rows) {
    std::string body = "<h2>Open- vs closed-loop cache routing</h2>\n";
    if (closed_rows.empty()) {
        body += "<p>Not measured in this run (no λ > 0 asked for): every cache figure here is open-loop (the trace was "
                "recorded with the unbiased router).</p>\n";
    } else {
        body += "<p>Cache-aware routing (λ > 0) measured in the closed loop: the model routed with its cache, KLD against "
                "the unbiased base, misses beside the open-loop replay of the base pass's trace (report/closed_loop.csv). "
                "The plan gives these options only their closed-loop KLD.</p>\n<table><tr>";
        for (const std::string & col : kClosedColumns) {
            body += "<th>" + html_escape(col) + "</th>";
        }
        body += "</tr>";
        for (const json & row : closed_rows) {
            body += "<tr>";
            for (const std::string & col : kClosedColumns) {
                body += "<td>" + cell(row[col]) + "</td>";
            }
            body += "</tr>";
        }
        body += "</table>\n";
    }
    return body;
}

// The HTML: the chart library inlined, every spec with its data.
std::string report_html(const ReportInputs & in, const PlanFile & plan, const json & corpus, const ReportRows & rows,
                        const json & charts) {
    const std::string libs = chart_scripts();
    const json & leak = corpus.at("leak_check");
    const json & throughput_inputs = rows.throughput_inputs;
    // A measured plan's timing is the measurement's, not the guesses the replays were priced with.
    const json & ti = throughput_inputs.is_null() || !plan.inputs.value("measured", json()).is_null()
                          ? plan.inputs.at("throughput")
                          : throughput_inputs;
    const json & geo = plan.inputs.at("geometry");
    std::string body;
    body += "<h1>moeprune run report</h1>\n<p class=\"why\"><b>Recommended:</b> " + html_escape(plan.why) + "</p>\n";
    const auto section = [&](const std::string & id, const std::string & title, const std::string & note) {
        body += "<h2>" + html_escape(title) + "</h2>\n";
        if (!note.empty()) {
            body += "<p>" + html_escape(note) + "</p>\n";
        }
        body += "<div class=\"chart\" id=\"" + id + "\"></div>\n";
    };
    for (const std::string & w : rows.warnings) {
        body += "<p class=\"warning\"><b>WARNING:</b> " + html_escape(w) + "</p>\n";
    }
    section("kld_vs_k", "Quality cost", "Keep maps masked inside the original model, scored on the held-out side (report/kld.csv).");
    body += modality_section(rows.modality);
    section("kept_share_per_layer", "Kept share per layer", "");
    section("substitution_per_layer", "Substitution per layer", "");
    section("misses_vs_cache", "Expert cache", "Replayed on the held-out router trace (report/replay.csv).");
    section("speed_vs_ram", "Speed, RAM and quality", "From the plan (plan/plan.json, report/plan.csv).");
    body += measured_section(rows.measured, plan);
    body += draft_section(rows.plan, plan);
    body += closed_loop_section(rows.closed);
    section("corpus_composition", "Corpus", "");
    body += "<h3>Leak check (eval against calib)</h3>\n" +
            table({{"exact duplicates", leak.at("exact").dump()}, {"near duplicates", leak.at("near").dump()},
                   {"documents sharing a long n-gram", leak.at("shared_ngrams").dump()}, {"groups on both sides", leak.at("shared_groups").dump()},
                   {"clean", leak.at("clean").dump()}}) +
            "\n";
    body += "<h2>Throughput model inputs</h2>\n" +
            table({{"model geometry", geo.at("source").get<std::string>()},
                   {"MoE layers", geo.at("moe_layers").dump()},
                   {"experts, used per token", geo.at("experts").dump() + ", " + geo.at("used").dump()},
                   {"bytes of one expert (first layer)", geo.at("expert_bytes")[0].dump()},
                   {"other weights (bytes)", geo.at("other_bytes").dump()},
                   {"RAM budget (bytes)", plan.inputs.at("budget_bytes").dump()},
                   {"SSD GB/s", ti.value("ssd_gbps", json(nullptr)).dump()},
                   {"read latency (us)", ti.value("read_latency_us", json(nullptr)).dump()},
                   {"queue depth", ti.value("queue_depth", json(nullptr)).dump()},
                   {"compute per token (ms)", ti.value("compute_ms", json(nullptr)).dump()},
                   {"formula", plan.inputs.at("throughput").at("model").get<std::string>()}}) +
            "\n<h2>Settings</h2>\n<pre>" + html_escape(in.config) + "</pre>\n";
    const std::string specs = charts.dump(-1, ' ', false, json::error_handler_t::replace);
    std::string page = "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>moeprune report</title>\n<style>"
                       "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
                       "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}"
                       "pre{background:#f6f6f6;padding:1em;overflow:auto}.why{font-size:1.1em}.chart{margin:1em 0}"
                       "#errors{color:#b00}.warning{color:#b00;border:2px solid #b00;padding:0.5em}</style>\n";
    page += libs;
    page += "</head><body data-charts=\"" + std::to_string(charts.size()) + "\" data-rendered=\"0\">\n" + body;
    page += "<pre id=\"errors\"></pre>\n<script>\nconst specs = " + specs + ";\n" + R"JS(
const errors = document.getElementById('errors');
window.addEventListener('error', e => { errors.textContent += 'error: ' + e.message + '\n'; });
let rendered = 0;
Promise.all(Object.entries(specs).map(([id, spec]) =>
  vegaEmbed('#' + id, spec, {renderer: 'svg', actions: false})
    .then(() => { rendered += 1; document.body.dataset.rendered = String(rendered); })
    .catch(e => { errors.textContent += id + ': ' + e + '\n'; })));
</script>
</body></html>
)JS";
    return page;
}

} // namespace

std::vector<fs::path> write_report(const ReportInputs & in) {
    const json corpus = load(in.corpus);
    const PlanFile plan = read_plan_report(in.plan);
    const int64_t n_expert = plan.n_expert;
    // A stage output without a field the report reads is refused naming the file.
    ReportRows rows;
    const EvalFile eval = read_eval_report(in.eval);
    rows.kld = kld_rows(eval, n_expert);
    rows.modality = modality_rows(eval, n_expert);
    const SelectFile select = read_select_report(in.select);
    rows.layers = layer_rows(select);
    rows.warnings = select.warnings;
    rows.replay = replay_rows(in.replays, n_expert, rows.throughput_inputs);
    rows.closed = closed_loop_rows(in.closed_loop_evals, n_expert);
    rows.plan = plan_rows(plan);
    rows.corpus = with_json_errors(in.corpus.string(), [&] { return corpus_rows(corpus); });
    if (!in.measure.empty()) {
        rows.measured = with_json_errors(in.measure.string(), [&] { return measured_rows(load(in.measure)); });
    }
    const json charts = charts_of(rows);
    std::vector<fs::path> written;
    write_csvs(in.run_dir, rows, written);
    const json report = with_json_errors(fmt::format("{} or {}", in.plan.string(), in.corpus.string()), [&] {
        const json & leak = corpus.at("leak_check");
        return json{{"format", "moeprune-report"},
                    {"version", 1},
                    {"config", in.config},
                    {"recommendation", {{"option", plan.recommended ? json(*plan.recommended) : json(nullptr)}, {"why", plan.why}}},
                    {"corpus",
                     {{"domains", corpus.at("domains")},
                      {"leak_check", leak},
                      {"dedupe", corpus.at("dedupe")},
                      {"boilerplate", corpus.at("boilerplate")},
                      {"outputs", corpus.at("outputs")}}},
                    {"kld", rows.kld},
                    {"modalities", rows.modality.empty() ? json(nullptr) : rows.modality},
                    {"warnings", rows.warnings},
                    {"layers", rows.layers},
                    {"replay", rows.replay},
                    {"plan", load(in.plan)},
                    {"throughput", rows.throughput_inputs},
                    {"closed_loop", rows.closed.empty() ? json(nullptr) : rows.closed},
                    {"measured", rows.measured.empty() ? json(nullptr) : rows.measured},
                    {"charts", charts}};
    });
    write_file_atomic(in.run_dir / "report.json", report.dump(1) + "\n");
    written.push_back(in.run_dir / "report.json");
    const std::string page = with_json_errors(fmt::format("{} or {}", in.plan.string(), in.corpus.string()),
                                              [&] { return report_html(in, plan, corpus, rows, charts); });
    write_file_atomic(in.run_dir / "report.html", page);
    written.push_back(in.run_dir / "report.html");
    return written;
}

} // namespace moeprune
