#include "formats/corpus.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/atomic_file.h"
#include "core/json.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <unordered_set>

namespace moeprune {

using nlohmann::json;

namespace {

CorpusDocument parse_line(const std::string & line, uint64_t line_no, const std::string & origin,
                          const std::filesystem::path & media_base) {
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
        d.messages = parse_messages(j["messages"], where, &media_base);
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

// One media part of a message, its file checked to be there and a regular file.
CorpusMedia parse_media(const json & part, Modality modality, const std::string & where,
                        const std::filesystem::path * media_base) {
    if (!part.contains("path") || !part["path"].is_string() || part["path"].get<std::string>().empty()) {
        fail_file(where, fmt::format("an {} part needs a non-empty string \"path\"", modality_name(modality)));
    }
    const std::string given = part["path"].get<std::string>();
    if (!media_base) {
        fail_file(where, fmt::format("has an {} part ({}), but media are read only from a corpus JSONL given to collect "
                                     "or eval",
                                     modality_name(modality), given));
    }
    const std::filesystem::path path = *media_base / given;
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::exists(status)) {
        fail_file(where, fmt::format("its {} {} is not there", modality_name(modality), path.string()));
    }
    if (!std::filesystem::is_regular_file(status)) {
        fail_file(where, fmt::format("its {} {} is not a regular file", modality_name(modality), path.string()));
    }
    return {modality, path};
}

// A message's content: a string, or text, image and audio parts.
void parse_content(const json & content, CorpusMessage & m, const std::string & where,
                   const std::filesystem::path * media_base) {
    if (content.is_string()) {
        m.content = content.get<std::string>();
        return;
    }
    if (!content.is_array() || content.empty()) {
        fail_file(where, "a message's \"content\" must be a string or a non-empty array of parts");
    }
    for (const json & part : content) {
        const std::string type = part.is_object() && part.contains("type") && part["type"].is_string()
                                     ? part["type"].get<std::string>()
                                     : std::string();
        if (type == "text") {
            if (!part.contains("text") || !part["text"].is_string()) {
                fail_file(where, "a text part needs a string \"text\"");
            }
            m.content += part["text"].get<std::string>();
        } else if (type == "image" || type == "audio") {
            m.media.push_back(parse_media(part, type == "image" ? Modality::Image : Modality::Audio, where, media_base));
            m.content += kMediaMarker;
        } else {
            fail_file(where, "every part of a message's content needs \"type\" text, image or audio");
        }
    }
}

} // namespace

const char * modality_name(Modality m) {
    switch (m) {
    case Modality::Image: return "image";
    case Modality::Audio: return "audio";
    default: return "text";
    }
}

std::vector<CorpusMedia> media_of(const std::vector<CorpusMessage> & messages) {
    std::vector<CorpusMedia> out;
    for (const CorpusMessage & m : messages) {
        out.insert(out.end(), m.media.begin(), m.media.end());
    }
    return out;
}

void add_modality_domains(Corpus & corpus) {
    for (const Modality m : corpus.media_modalities) {
        const std::string name = modality_name(m);
        if (std::find(corpus.domains.begin(), corpus.domains.end(), name) != corpus.domains.end()) {
            fail_file(corpus.path.string(), fmt::format("has a domain named \"{}\", the name its {} positions are "
                                                        "counted under: rename that domain", name, name));
        }
        corpus.domains.push_back(name);
    }
}

size_t drop_media_documents(Corpus & corpus) {
    const size_t before = corpus.documents.size();
    std::erase_if(corpus.documents, [](const CorpusDocument & d) { return !media_of(d.messages).empty(); });
    corpus.media_modalities.clear();
    return before - corpus.documents.size();
}

void refuse_media(const Corpus & corpus, const std::string & why) {
    for (const CorpusDocument & d : corpus.documents) {
        const std::vector<CorpusMedia> media = media_of(d.messages);
        if (!media.empty()) {
            fail_file(fmt::format("{}:{}", corpus.path.string(), d.line),
                      fmt::format("has an {} ({}): {}", modality_name(media.front().modality), media.front().path.string(),
                                  why));
        }
    }
}

std::vector<CorpusMessage> parse_messages(const json & messages, const std::string & where,
                                          const std::filesystem::path * media_base) {
    if (!messages.is_array() || messages.empty()) {
        fail_file(where, "\"messages\" must be a non-empty array of {\"role\", \"content\"}");
    }
    std::vector<CorpusMessage> out;
    for (const json & m : messages) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content")) {
            fail_file(where, "every message needs a string \"role\" and a \"content\"");
        }
        const std::string role = m["role"].get<std::string>();
        // A role outside these is rendered by no chat template the same way, and one
        // holding template text could forge turns.
        if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
            fail_file(where, fmt::format("message role \"{}\" is not one of system, user, assistant, tool", role));
        }
        CorpusMessage msg{role, "", {}};
        parse_content(m["content"], msg, where, media_base);
        out.push_back(std::move(msg));
    }
    return out;
}

std::vector<std::filesystem::path> media_paths(const Corpus & corpus) {
    std::vector<std::filesystem::path> out;
    for (const CorpusDocument & d : corpus.documents) {
        for (const CorpusMedia & m : media_of(d.messages)) {
            out.push_back(m.path);
        }
    }
    return out;
}

namespace {

// A plain text must be text: llama.cpp's tokenizer fails on invalid UTF-8 without naming
// the file (or passes it on), and a NUL byte ends its string early.
void check_utf8(const std::string & bytes, const std::filesystem::path & path) {
    for (size_t i = 0; i < bytes.size();) {
        const auto c = static_cast<unsigned char>(bytes[i]);
        const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = len > 0 && i + len <= bytes.size() && c != 0 && c != 0xC0 && c != 0xC1 && c <= 0xF4;
        for (size_t k = 1; ok && k < len; ++k) {
            ok = (static_cast<unsigned char>(bytes[i + k]) & 0xC0) == 0x80;
        }
        if (!ok) {
            fail_file(path.string(), fmt::format("is not UTF-8 text: {} at byte {} (binary data?)",
                                                 c == 0 ? "a NUL byte" : fmt::format("an invalid sequence starting 0x{:02x}", c), i));
        }
        i += len;
    }
}

} // namespace

Corpus read_corpus(const std::filesystem::path & path) {
    Corpus c;
    c.path = path;
    const std::string bytes = read_text_file(path);
    c.bytes = bytes.size();
    c.digest = xxh64_hex(bytes);
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
    c.jsonl = ext == ".jsonl";
    if (!c.jsonl) {
        if (bytes.empty()) {
            fail_file(path.string(), "is empty: nothing to collect statistics on");
        }
        check_utf8(bytes, path);
        c.documents.push_back({bytes, {}, "", std::nullopt, std::nullopt, 0});
        return c;
    }
    size_t start = 0;
    uint64_t line_no = 0;
    // A search of the list per document was quadratic: 65,536 domains took over a minute.
    std::unordered_set<std::string> seen;
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
        c.documents.push_back(parse_line(line, line_no, path.string(), path.parent_path()));
        const std::string & domain = c.documents.back().domain;
        if (!domain.empty() && seen.insert(domain).second) {
            c.domains.push_back(domain);
        }
    }
    if (c.documents.empty()) {
        fail_file(path.string(), "holds no documents");
    }
    // The media are part of what a run read: a changed image is a changed corpus.
    XXH64_hash_t digest = XXH64(bytes.data(), bytes.size(), 0);
    for (const CorpusDocument & d : c.documents) {
        for (const CorpusMedia & m : media_of(d.messages)) {
            const std::string media = read_text_file(m.path);
            digest = XXH64(media.data(), media.size(), digest);
            if (std::find(c.media_modalities.begin(), c.media_modalities.end(), m.modality) == c.media_modalities.end()) {
                c.media_modalities.push_back(m.modality);
            }
        }
    }
    c.digest = fmt::format("{:016x}", digest);
    return c;
}

} // namespace moeprune
