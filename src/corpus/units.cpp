// Token units: counting a document as collect and eval will, and cutting it to doc_tokens.
#include "corpus/units.h"
#include "core/errors.h"
#include "engine/session.h"

#include <fmt/format.h>

#include <algorithm>

namespace moeprune::corpus_build {

size_t char_start(const std::string & s, size_t at) {
    while (at > 0 && at < s.size() && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) {
        --at;
    }
    return at;
}


uint64_t Tokenizer::count(const std::string & text, const std::string & where) const {
    return tokenize(vocab_, text, true, where).size();
}

bool Tokenizer::templated(const std::string & prompt) const {
    std::vector<llama_token> t(prompt.size() + 8);
    const int n = llama_tokenize(vocab_, prompt.data(), int32_t(prompt.size()), t.data(), int32_t(t.size()), false, true);
    for (int i = 0; i < n; ++i) {
        if (llama_vocab_get_attr(vocab_, t[size_t(i)]) & LLAMA_TOKEN_ATTR_CONTROL) {
            return true;
        }
    }
    return false;
}

uint64_t Tokenizer::count_chat(const std::vector<CorpusMessage> & msgs, const std::string & where) const {
    CorpusDocument c;
    c.messages = msgs;
    const std::string text = render_chat(model_, c, false, where);
    const std::vector<CorpusMedia> media = media_of(msgs);
    if (media.empty()) {
        return count(text, where);
    }
    if (!media_) {
        fail_file(where, fmt::format("has an {} ({}): give the model's projector with --mmproj FILE, so its tokens "
                                     "are counted as libmtmd counts them", modality_name(media[0].modality),
                                     media[0].path.string()));
    }
    std::lock_guard<std::mutex> lock(media_mutex_);  // one libmtmd context for the tokenizing threads
    return media_->tokenize(text, media, true, where).tokens.size();
}

std::vector<Unit> Tokenizer::units(size_t index, const SourceDocument & src, Truncate rule, const std::string & where) const {
    SourceDocument d = src;
    if (d.prompt_response && templated(d.messages[0].content)) {
        d.text = d.messages[0].content + d.messages[1].content;  // used as it is: never wrapped twice
        d.messages.clear();
    }
    const bool chat = !d.messages.empty() || src.prompt_response;
    if (rule == Truncate::Auto) {
        rule = chat ? Truncate::Left : Truncate::Pieces;
    }
    Unit u{index, d.text, d.messages, 0, false, false};
    u.tokens = d.messages.empty() ? count(d.text, where) : count_chat(d.messages, where);
    if (u.tokens <= limit_) {
        return {std::move(u)};
    }
    if (!d.media_key.empty()) {
        fail_file(where, fmt::format("takes {} tokens with its media as libmtmd counts them, over doc_tokens {}: a "
                                     "document with media is never cut, so raise doc_tokens", u.tokens, limit_));
    }
    if (!d.messages.empty()) {
        return rule == Truncate::Left ? std::vector<Unit>{chat_tail(index, d.messages, where)}
                                      : chat_pieces(index, d.messages, where);
    }
    return rule == Truncate::Left ? std::vector<Unit>{text_tail(index, d.text, u.tokens, where)}
                                  : text_pieces(index, d.text, u.tokens, where);
}

Unit Tokenizer::text_tail(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const {
    double keep = 0.95 * double(limit_) / double(tokens);
    for (;;) {
        size_t at = char_start(text, text.size() - size_t(keep * double(text.size())));
        const size_t line = text.find('\n', at);
        if (line != std::string::npos && line + 1 < text.size() && line - at < 200) {
            at = line + 1;
        }
        Unit u{index, text.substr(at), {}, 0, true, false};
        u.tokens = count(u.text, where);
        if (u.tokens <= limit_ || u.text.size() <= 1) {
            return u;
        }
        keep *= 0.85;
    }
}

std::vector<Unit> Tokenizer::text_pieces(size_t index, const std::string & text, uint64_t tokens, const std::string & where) const {
    std::vector<Unit> out;
    const double bytes_per_token = double(text.size()) / double(tokens);
    size_t pos = 0;
    while (pos < text.size()) {
        double want = 0.95 * double(limit_) * bytes_per_token;
        for (;;) {
            size_t end = std::min(text.size(), pos + std::max<size_t>(1, size_t(want)));
            if (end < text.size()) {
                const size_t line = text.rfind('\n', end - 1);
                const size_t space = text.find_last_of(" \t", end - 1);
                if (line != std::string::npos && line > pos && line + 1 - pos > (end - pos) / 2) {
                    end = line + 1;
                } else if (space != std::string::npos && space > pos && space + 1 - pos > (end - pos) / 2) {
                    end = space + 1;
                } else {
                    end = std::max(pos + 1, char_start(text, end));
                }
            }
            Unit u{index, text.substr(pos, end - pos), {}, 0, false, true};
            u.tokens = count(u.text, where);
            if (u.tokens <= limit_ || end - pos <= 4) {
                pos = end;
                if (u.text.find_first_not_of(" \t\r\n") != std::string::npos) {
                    out.push_back(std::move(u));
                }
                break;
            }
            want *= 0.85;
        }
    }
    return out;
}

Unit Tokenizer::chat_tail(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const {
    size_t lo = std::min<size_t>(1, msgs.size() - 1), hi = msgs.size() - 1;  // drops that many, in [lo, hi]
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (count_chat({msgs.begin() + long(mid), msgs.end()}, where) <= limit_) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Unit u{index, {}, {msgs.begin() + long(lo), msgs.end()}, 0, true, false};
    u.tokens = count_chat(u.messages, where);
    double keep = 0.9;
    while (u.tokens > limit_ && u.messages.back().content.size() > 1) {
        std::string & c = u.messages.back().content;
        c = c.substr(char_start(c, c.size() - size_t(keep * double(c.size()))));
        u.tokens = count_chat(u.messages, where);
        keep = 0.85;
    }
    return u;
}

std::vector<Unit> Tokenizer::chat_pieces(size_t index, const std::vector<CorpusMessage> & msgs, const std::string & where) const {
    std::vector<Unit> out;
    size_t start = 0;
    while (start < msgs.size()) {
        size_t end = start + 1;
        while (end < msgs.size() && count_chat({msgs.begin() + long(start), msgs.begin() + long(end + 1)}, where) <= limit_) {
            ++end;
        }
        std::vector<CorpusMessage> part(msgs.begin() + long(start), msgs.begin() + long(end));
        Unit u = count_chat(part, where) <= limit_ ? Unit{index, {}, part, count_chat(part, where), false, true}
                                                   : chat_tail(index, part, where);
        u.piece = true;
        out.push_back(std::move(u));
        start = end;
    }
    return out;
}

} // namespace moeprune::corpus_build
