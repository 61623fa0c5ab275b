#include "eval/behaviour.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

namespace moeprune {

size_t divergence(const Continuation & base, const Continuation & candidate) {
    const size_t n = std::min(base.tokens.size(), candidate.tokens.size());
    size_t i = 0;
    while (i < n && base.tokens[i] == candidate.tokens[i]) {
        ++i;
    }
    return i;
}

std::optional<std::vector<std::string>> tool_call_names(const std::string & text) {
    static const std::string open = "<tool_call>", close = "</tool_call>";
    std::vector<std::string> names;
    for (size_t at = text.find(open); at != std::string::npos; at = text.find(open, at)) {
        const size_t body = at + open.size();
        const size_t end = text.find(close, body);
        if (end == std::string::npos) {
            return std::nullopt;
        }
        const nlohmann::json call = nlohmann::json::parse(text.substr(body, end - body), nullptr, false);
        if (!call.is_object() || !call.contains("name") || !call["name"].is_string()) {
            return std::nullopt;
        }
        names.push_back(call["name"].get<std::string>());
        at = end + close.size();
    }
    return names;
}

std::optional<bool> think_closed(const std::string & text, bool opens_think) {
    static const std::string open = "<think>", close = "</think>";
    int depth = opens_think ? 1 : 0;
    bool seen = opens_think;
    for (size_t i = 0; i < text.size();) {
        if (text.compare(i, open.size(), open) == 0) {
            ++depth;
            seen = true;
            i += open.size();
        } else if (text.compare(i, close.size(), close) == 0) {
            if (--depth < 0) {
                return false;
            }
            seen = true;
            i += close.size();
        } else {
            ++i;
        }
    }
    if (!seen) {
        return std::nullopt;
    }
    return depth == 0;
}

double repeated_4gram_share(const std::vector<int32_t> & tokens) {
    if (tokens.size() < 4) {
        return 0.0;
    }
    std::set<std::vector<int32_t>> seen;
    size_t repeated = 0;
    for (size_t i = 0; i + 4 <= tokens.size(); ++i) {
        repeated += !seen.insert({tokens.begin() + long(i), tokens.begin() + long(i + 4)}).second;
    }
    return double(repeated) / double(tokens.size() - 3);
}

DraftWalk draft_walk(const std::vector<int8_t> & accept) {
    DraftWalk w;
    for (size_t j = 0; j < accept.size(); j += accept[j] ? 2 : 1) {
        ++w.steps;
        w.tokens += accept[j] ? 2 : 1;
    }
    return w;
}

BehaviourStats behaviour_stats(const std::vector<BehaviourSample> & samples) {
    BehaviourStats s;
    s.prompts = samples.size();
    if (samples.empty()) {
        return s;
    }
    std::vector<double> div;
    uint64_t exact = 0, base_terminated = 0, cand_terminated = 0, calls = 0, calls_ok = 0, thinks = 0, thinks_ok = 0;
    double repeat = 0;
    DraftWalk drafts;
    for (const BehaviourSample & x : samples) {
        const DraftWalk w = draft_walk(x.candidate->mtp_accept);
        drafts.steps += w.steps;
        drafts.tokens += w.tokens;
        const size_t d = divergence(*x.base, *x.candidate);
        div.push_back(double(d));
        exact += x.base->tokens == x.candidate->tokens;
        if (x.base->terminated) {
            ++base_terminated;
            // An answer that is nothing but the end token, where the base said something,
            // looks like a clean stop and is the failure of a heavily pruned model.
            const bool answered = x.candidate->tokens.size() > 1 || x.base->tokens.size() <= 1;
            cand_terminated += x.candidate->terminated && answered;
        }
        const auto base_calls = tool_call_names(x.base->text);
        if (base_calls && !base_calls->empty()) {
            ++calls;
            calls_ok += tool_call_names(x.candidate->text) == base_calls;
        }
        if (x.candidate->terminated) {
            if (const auto closed = think_closed(x.candidate->text, x.opens_think)) {
                ++thinks;
                thinks_ok += *closed;
            }
        }
        repeat += repeated_4gram_share(x.candidate->tokens);
    }
    if (drafts.steps > 0) {
        s.mtp_tokens_per_step = double(drafts.tokens) / double(drafts.steps);
    }
    const double n = double(samples.size());
    s.exact_match = double(exact) / n;
    double sum = 0;
    for (double d : div) {
        sum += d;
    }
    s.divergence_mean = sum / n;
    std::sort(div.begin(), div.end());
    s.divergence_median = div.size() % 2 ? div[div.size() / 2] : (div[div.size() / 2 - 1] + div[div.size() / 2]) / 2;
    if (base_terminated) {
        s.clean_termination = double(cand_terminated) / double(base_terminated);
    }
    if (calls) {
        s.tool_call_ok = double(calls_ok) / double(calls);
    }
    if (thinks) {
        s.think_balanced = double(thinks_ok) / double(thinks);
    }
    s.repeat_4gram = repeat / n;
    return s;
}

} // namespace moeprune
