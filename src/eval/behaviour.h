#pragma once
// Behaviour checks after the KL screen: greedy continuations of chat prompts by the base
// and by a candidate, compared on what a user notices (the seed audits' behaviour tier):
// where they part, whether the candidate stops when the base stops, whether its tool
// calls still parse with the same function, whether its <think> blocks close, and how
// much it repeats itself. Definitions: docs/eval.md.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moeprune {

struct Continuation {
    std::vector<int32_t> tokens;   // generated, up to and including an end-of-generation token
    std::string text;              // their text (end-of-generation tokens rendered as nothing)
    bool terminated = false;       // ended with an end-of-generation token within the limit
    // With an MTP head: whether its draft made after generated token j (from that token and
    // the trunk's hidden state before it) is generated token j + 1, for j = 0 .. size - 2.
    std::vector<int8_t> mtp_accept;
};

// Speculative decoding with one draft token per step over a greedy continuation: greedy
// verification emits the same tokens, and a step that accepts its draft emits two (the
// draft and the trunk's next) and drafts again two tokens on, else one.
struct DraftWalk {
    uint64_t steps = 0, tokens = 0;
};
DraftWalk draft_walk(const std::vector<int8_t> & accept);

// One prompt's base and candidate continuations; `opens_think`: the prompt leaves a
// <think> block open (some chat templates start the answer inside one).
struct BehaviourSample {
    const Continuation * base = nullptr;
    const Continuation * candidate = nullptr;
    bool opens_think = false;
};

struct BehaviourStats {
    uint64_t prompts = 0;
    double exact_match = 0;                    // share of continuations identical to the base's
    double divergence_mean = 0, divergence_median = 0;   // tokens before the first that differs
    std::optional<double> clean_termination;   // where the base terminated: share where the candidate answered and did
    std::optional<double> tool_call_ok;        // where the base called tools: share with the same calls, parsed
    std::optional<double> think_balanced;      // terminated candidates using <think>: share with every block closed
    double repeat_4gram = 0;                   // mean share of 4-grams that repeat an earlier one
    std::optional<double> mtp_tokens_per_step; // with an MTP head: tokens per step of draft_walk, all prompts pooled
};

// Tokens before the first position where the two differ (the shorter length when one is
// a prefix of the other, the full length when equal).
size_t divergence(const Continuation & base, const Continuation & candidate);

// The function names of <tool_call>...</tool_call> blocks whose body parses as a JSON
// object with a string "name"; nullopt when some block does not (or is not closed).
std::optional<std::vector<std::string>> tool_call_names(const std::string & text);

// Whether <think> and </think> nest and all close by the end of `text`; nullopt when the
// text has no think tag and does not start inside a block.
std::optional<bool> think_closed(const std::string & text, bool opens_think);

// Share of the 4-grams of `tokens` equal to an earlier 4-gram of the same sequence.
double repeated_4gram_share(const std::vector<int32_t> & tokens);

BehaviourStats behaviour_stats(const std::vector<BehaviourSample> & samples);

} // namespace moeprune
