#include "formats/corpus.h"
#include "core/errors.h"
#include "core/atomic_file.h"
#include "core/json.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cctype>

namespace moeprune {

using nlohmann::json;

namespace {

CorpusDocument parse_line(const std::string & line, uint64_t line_no, const std::string & origin) {
    const std::string where = fmt::format("{}:{}", origin, line_no);
    if (line.find('\0') != std::string::npos) {
        fail_file(where, fmt::format("holds a NUL byte at column {}: not a line of JSON text", line.find('\0') + 1));
    }
    const json j = parse_json(line, where);
    if (!j.is_object()) {
        fail_file(where, "a document must be a JSON object with \"text\" or \"messages\"");
    }
    CorpusDocument d;
    d.line = line_no;
    if (j.contains("text") == j.contains("messages")) {
        fail_file(where, "a document needs exactly one of \"text\" and \"messages\"");
    }
    if (j.contains("text")) {
        if (!j["text"].is_string() || j["text"].get<std::string>().empty()) {
            fail_file(where, "\"text\" must be a non-empty string");
        }
        d.text = j["text"].get<std::string>();
    } else {
        d.messages = parse_messages(j["messages"], where);
    }
    if (j.contains("domain")) {
        if (!j["domain"].is_string() || j["domain"].get<std::string>().empty()) {
            fail_file(where, "\"domain\" must be a non-empty string");
        }
        d.domain = j["domain"].get<std::string>();
    }
    for (const auto & [key, field] : {std::pair{"session", &d.session}, std::pair{"turn", &d.turn}}) {
        if (j.contains(key)) {
            if (!j[key].is_number_integer() || j[key].get<int64_t>() < 0) {
                fail_file(where, fmt::format("\"{}\" must be a non-negative integer", key));
            }
            *field = j[key].get<int64_t>();
        }
    }
    return d;
}

} // namespace

std::vector<CorpusMessage> parse_messages(const json & messages, const std::string & where) {
    if (!messages.is_array() || messages.empty()) {
        fail_file(where, "\"messages\" must be a non-empty array of {\"role\", \"content\"}");
    }
    std::vector<CorpusMessage> out;
    for (const json & m : messages) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
            !m["content"].is_string()) {
            fail_file(where, "every message needs string \"role\" and \"content\"");
        }
        const std::string role = m["role"].get<std::string>();
        // A role outside these is rendered by no chat template the same way, and one
        // holding template text could forge turns.
        if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
            fail_file(where, fmt::format("message role \"{}\" is not one of system, user, assistant, tool", role));
        }
        out.push_back({role, m["content"].get<std::string>()});
    }
    return out;
}

Corpus read_corpus(const std::filesystem::path & path) {
    Corpus c;
    c.path = path;
    const std::string bytes = read_text_file(path);
    c.bytes = bytes.size();
    c.digest = fmt::format("{:016x}", XXH64(bytes.data(), bytes.size(), 0));
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
    c.jsonl = ext == ".jsonl";
    if (!c.jsonl) {
        if (bytes.empty()) {
            fail_file(path.string(), "is empty: nothing to collect statistics on");
        }
        c.documents.push_back({bytes, {}, "", std::nullopt, std::nullopt, 0});
        return c;
    }
    size_t start = 0;
    uint64_t line_no = 0;
    while (start < bytes.size()) {
        size_t end = bytes.find('\n', start);
        if (end == std::string::npos) {
            end = bytes.size();
        }
        ++line_no;
        const std::string line = bytes.substr(start, end - start);
        start = end + 1;
        if (line.find_first_not_of(" \t\r") == std::string::npos) {
            continue;
        }
        c.documents.push_back(parse_line(line, line_no, path.string()));
        const std::string & domain = c.documents.back().domain;
        if (!domain.empty() && std::find(c.domains.begin(), c.domains.end(), domain) == c.domains.end()) {
            c.domains.push_back(domain);
        }
    }
    if (c.documents.empty()) {
        fail_file(path.string(), "holds no documents");
    }
    return c;
}

} // namespace moeprune
