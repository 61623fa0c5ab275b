#pragma once
// plan's private header: one plan in the making, the options priced so far and the quality
// measured for them. plan.cpp reads the inputs and prices the options, rank.cpp sets
// quality on them and chooses, plan_json.cpp writes the plan.
#include "formats/measure_report.h"
#include "formats/plan_option.h"
#include "formats/stage_reports.h"
#include "plan/calibration.h"
#include "plan/geometry.h"
#include "plan/plan.h"
#include "sim/throughput.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace moeprune::plan_impl {

using nlohmann::json;

// Criterion and K of a keep map: from the map itself, or from select's file name.
std::pair<std::string, int64_t> map_identity(const std::string & path, const std::string & name);

// Tokens/s of a time per token; none when nothing takes time (unbounded).
std::optional<double> tok_per_s(double seconds);

class Planner {
public:
    Planner(const PlanOptions & opt, Geometry g, std::optional<Measured> measured)
        : opt(opt), g(std::move(g)), measured(std::move(measured)), tp(opt.throughput), L(this->g.bytes.size()),
          budget(opt.ram_bytes > 0 ? opt.ram_bytes - opt.reserve_bytes : 0), model_digest_seen(this->g.digest),
          model_digest_from(this->g.source) {}

    void check_settings() const;

    // Quality measured per (criterion, K), and per (criterion, K, policy, cache, λ) in the
    // closed loop: an option that reroutes (λ > 0) has only the closed loop's KLD.
    void read_evals();

    // The draft acceptance of (criterion, K): from the greedy continuations' accepted length
    // per step where eval generated, else the teacher-forced share.
    void read_acceptance(const EvalFigures & f, const std::pair<std::string, int64_t> & key,
                         const std::filesystem::path & path);

    static double measured_kld(const EvalFileCandidate & c);

    // Replayed caches.
    void read_replays();

    // One replayed cache of the map (criterion, K), priced.
    void add_replayed_option(const ReplayRecordFigures & rec, const std::string & criterion, int64_t k, bool global,
                             bool with_mtp, const std::filesystem::path & path,
                             const std::optional<std::string> & keep_map);

    // Every K: all of it resident, and the caches given by hand.
    void add_given_options();

    // An option of (K, criterion) with the keep map it was read from, when one was.
    PlanOption option_of(int64_t k, const std::string & criterion) const;

    // Every limit measure ran the whole model under: an option measured, not modelled.
    void add_measured_options();

    // Sliced models streamed from disk under the limit, where every kept expert does not fit.
    void add_streamed_options();

    // The shortlist's measurements replace the predictions of the options they ran.
    void apply_shortlist();

    bool has_task_accuracy() const { return base_accuracy.has_value(); }
    // With --min-accuracy, a sentence for `why` where the share it allows the options to lose
    // is within two standard errors of the base's accuracy: the filter then reads noise.
    std::string accuracy_noise() const;

    // Whether the recommendation may be `o`: with --runs-on llama.cpp, only what stock
    // llama.cpp runs; after a shortlist, only what llama.cpp was measured running, so that
    // an optimistic prediction cannot beat a measurement; never a prediction outside what
    // the predictor models.
    bool eligible(const PlanOption & o) const {
        return (opt.runs_on == RunsOn::Any || o.runs_on == kRunsOnLlamaCpp) &&
               (opt.shortlist.empty() || o.shortlist || o.measured) && answered(o) &&
               (!opt.min_accuracy || (o.task_accuracy && base_accuracy && *o.task_accuracy >= *opt.min_accuracy * *base_accuracy));
    }

    // Whether the option's tokens/s is an answer: measured, or predicted where the predictor
    // models the regime (an option outside it is left out until measured).
    static bool answered(const PlanOption & o) { return o.outside_model.empty() || o.shortlist || o.measured; }

    // Pareto front of tokens/s (higher; unknown is unbounded) against KLD (lower), of every
    // option or of the eligible ones.
    std::vector<size_t> pareto_front(bool eligible_only) const;

    // From the front of the eligible options: the fastest within --max-kld, else the most
    // accurate within --speed-share of the fastest; without quality, the fastest.
    std::pair<std::optional<size_t>, std::string> recommend(const std::vector<size_t> & pareto) const;

    json to_plan_json(const std::vector<size_t> & pareto, const std::vector<size_t> & pareto_eligible,
                      const std::optional<size_t> & recommended, const std::string & why) const;

private:
    std::string runs_on_words() const {
        return std::string(opt.runs_on == RunsOn::Any ? "" : " that stock llama.cpp runs") +
               (opt.shortlist.empty() ? "" : " and that were measured") + accuracy_words();
    }

    std::string accuracy_words() const {
        return opt.min_accuracy ? fmt::format(" with task accuracy at least {} of the base's", *opt.min_accuracy) : "";
    }

    // What the recommendation's sentence adds: its RAM, its draft, and what runs it.
    std::string recommendation_details(const PlanOption & o) const;

    // Which runtime would run a simulated cache.
    static std::string runs_on_note(const PlanOption & o);

    json measured_inputs() const;

    // Planned by hand, a measurement must be of a model of the same geometry: its routed
    // layers, their expert bytes (within 5%, for sizes given rounded) and, when given, the
    // bytes outside the experts.
    void check_geometry(const MeasureFile & measure) const;

    // Which model every input was measured on: the plan's model by content, or, planned
    // by hand, the first input that names one.
    void check_model(const ModelIdentity & identity, const char * what);

    // Measured KLD of (criterion, K), or interpolated linearly in K between the nearest
    // measured Ks of the same criterion; the flag says which.
    std::pair<std::optional<double>, bool> kld_of(const std::string & criterion, int64_t k) const;

    // What an option's speculative decoding with the MTP head reads beyond the trunk.
    struct DraftTraffic {
        TokenTraffic mtp;                     // per token the head runs on
        std::optional<double> resident_bytes; // the option's RAM with the head's experts
        std::string unknown;                  // why the head's traffic is unknown, if it is
    };

    double mtp_sum() const;

    // The option with one draft token per step (sim/throughput.h), beside it without.
    PlanDraft draft_option(const PlanOption & o, const TokenTraffic & trunk, const DraftTraffic & d) const;

    void add(PlanOption o, const TokenTraffic & trunk, const DraftTraffic & d);

    void add(PlanOption o);

    const PlanOptions & opt;
    const Geometry g;
    const std::optional<Measured> measured;
    const ThroughputParams & tp;
    const size_t L;
    const double budget;
    std::string model_digest_seen, model_digest_from;
    std::map<std::pair<std::string, int64_t>, double> kld;
    std::map<std::pair<std::string, int64_t>, double> accuracy;   // on the eval's choice tasks
    std::optional<double> base_accuracy;
    double base_accuracy_stderr = 0;
    int64_t base_task_count = 0;
    std::map<std::pair<std::string, int64_t>, std::pair<double, std::string>> acceptance;  // and where it came from
    using ClosedKey = std::tuple<std::string, int64_t, std::string, int64_t, double>;
    std::map<ClosedKey, double> closed_kld;
    std::set<std::pair<std::string, int64_t>> planned;
    std::map<std::pair<std::string, int64_t>, std::string> keep_maps;   // the file each (criterion, K) was read from
    std::vector<PlanOption> options;
    uint64_t infeasible = 0;
    json eval_inputs = json::array(), replay_inputs = json::array(), shortlist_inputs = json::array();
};

} // namespace moeprune::plan_impl
