// The report's sections on hand-made inputs.
#include "report/html.h"
#include "report/section.h"

#include <gtest/gtest.h>

#include <algorithm>

using namespace moeprune;

namespace {

PlanOption option(int64_t k, const std::string & policy, double tok_per_s, double kld, double lambda = 0) {
    PlanOption o;
    o.k = k;
    o.criterion = "reap";
    o.policy = policy;
    o.cache_experts = policy == "resident" || policy == "page-cache" ? std::optional<int64_t>() : 16;
    o.lambda = lambda;
    o.tok_per_s = tok_per_s;
    o.kld_mean = kld;
    o.runs_on = runs_on_of(policy);
    return o;
}

std::string runs_on_page(const PlanFile & plan) {
    const auto & sections = report_sections();
    const auto it = std::find_if(sections.begin(), sections.end(), [](const ReportSection & s) { return s.id == "runs_on"; });
    const ReportInputs in;
    const ReportData d{in, plan};
    return it->html(d);
}

} // namespace

// What runs today apart from what a cache would add: the simulated caches, Belady's bound,
// and what cache-aware routing (MoCE) adds to its cache, with the KLD it costs.
TEST(ReportSections, TheCacheSectionSaysWhatMoceAddsToItsCache) {
    PlanFile plan;
    plan.options = {option(12, "resident", 900, 0.30), option(24, "lru", 40, 0.10), option(24, "lru", 52, 0.14, 0.5),
                    option(24, "page-cache", 30, 0.10)};
    plan.options[2].kld_loop = "closed";
    plan.options[3].read_ahead_kb = 128;
    PlanOption belady = option(24, "belady", 80, 0.10);
    belady.bound = true;
    plan.options.push_back(belady);
    plan.pareto = {0, 2, 3};
    plan.pareto_runs_on = {0, 3};
    plan.recommended = 0;
    const std::string page = runs_on_page(plan);
    EXPECT_NE(page.find("Belady's offline optimum"), std::string::npos) << page;
    EXPECT_NE(page.find("K 24 by reap, sliced and mapped from disk, read-ahead 128 KB"), std::string::npos) << page;
    EXPECT_NE(page.find("Cache-aware routing (MoCE, λ 0.5) on K 24 by reap, lru of 16 experts, MoCE λ 0.5: "
                        "52 tokens/s at mean KLD 0.14 (closed loop), against 40 tokens/s (× 1.30) at mean KLD 0.1 "
                        "routed as trained"),
              std::string::npos)
        << page;

    // Without a λ above 0, it says how to get one.
    plan.options.erase(plan.options.begin() + 2);
    plan.pareto = {0, 2};
    plan.pareto_runs_on = {0, 2};
    const std::string without = runs_on_page(plan);
    EXPECT_EQ(without.find("MoCE, λ"), std::string::npos) << without;
    EXPECT_NE(without.find("was not replayed: a <code>lambdas</code> value above 0"), std::string::npos) << without;
}

// JSON inside a <script>: nothing in a string can end the element or open a comment, and
// it parses back to the same value.
TEST(ReportSections, ScriptJsonEscapesWhatWouldEndTheScript) {
    const nlohmann::json v = {{"domain", "</script><script>alert(1)</script><!-- & \u2028\u2029"}, {"n", 3}};
    const std::string text = script_json(v);
    for (const char * bad : {"<", ">", "&", "\u2028", "\u2029"}) {
        EXPECT_EQ(text.find(bad), std::string::npos) << bad << " in " << text;
    }
    EXPECT_EQ(nlohmann::json::parse(text), v);
    EXPECT_NE(text.find("\\u003c/script\\u003e"), std::string::npos) << text;
}
