#include "corpus/sources.h"
#include "core/digest.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/json.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <regex>
#include <set>

namespace moeprune {

using nlohmann::json;

namespace {

bool is_glob(const std::string & p) {
    return p.find_first_of("*?[") != std::string::npos;
}

bool hidden(const std::filesystem::path & p) {
    const std::string n = p.filename().string();
    return !n.empty() && n[0] == '.';
}

SourceFormat format_of(const SourceSpec & s, const std::filesystem::path & path) {
    if (s.format != SourceFormat::Auto) {
        return s.format;
    }
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return ext == ".jsonl" ? SourceFormat::Jsonl : ext == ".md" || ext == ".markdown" ? SourceFormat::Markdown
                                                                                      : SourceFormat::Text;
}

std::string scalar_field(const json & j, const std::string & name, const std::string & where) {
    if (!j.contains(name)) {
        fail_file(where, fmt::format("has no field \"{}\" to take its group from", name));
    }
    const json & v = j[name];
    if (v.is_string() && !v.get<std::string>().empty()) {
        return v.get<std::string>();
    }
    if (v.is_number_integer()) {
        return v.dump();
    }
    fail_file(where, fmt::format("field \"{}\" must be a non-empty string or an integer to be a group key", name));
}

std::string group_key(const SourceSpec & s, const std::filesystem::path & file, const json * j, const std::string & where) {
    const GroupRule & g = s.group;
    std::filesystem::path path = file;
    if (!s.key_root.empty()) {
        const std::filesystem::path rel = file.lexically_relative(s.key_root);
        if (!rel.empty() && *rel.begin() != "..") {
            path = rel;
        }
    }
    switch (g.kind) {
    case GroupRule::Kind::File:
        return "file:" + path.string();
    case GroupRule::Kind::Document:
        // A JSONL line is a document of its own ("FILE:LINE"); a whole file is one.
        return "document:" + (j ? where : path.string());
    case GroupRule::Kind::Field:
        if (!j) {
            fail_file(where, fmt::format("group \"{}\" needs JSONL documents, but this is a whole-file document", g.written));
        }
        return "field:" + g.field + "=" + scalar_field(*j, g.field, where);
    case GroupRule::Kind::PathComponent: {
        std::vector<std::string> parts;
        for (const auto & part : path) {
            parts.push_back(part.string());
        }
        const long n = long(parts.size());
        const long i = g.component < 0 ? n + g.component : g.component;
        if (i < 0 || i >= n) {
            fail_file(where, fmt::format("group \"{}\": the path has only {} components", g.written, n));
        }
        return "path:" + parts[size_t(i)];
    }
    case GroupRule::Kind::Regex: {
        if (!g.field.empty() && !j) {
            fail_file(where, fmt::format("group_on \"field:{}\" needs JSONL documents", g.field));
        }
        const std::string subject = g.field.empty() ? path.string() : scalar_field(*j, g.field, where);
        thread_local std::string cached_pattern;
        thread_local std::regex re;
        if (cached_pattern != g.pattern) {
            re = std::regex(g.pattern);
            cached_pattern = g.pattern;
        }
        std::smatch m;
        if (!std::regex_search(subject, m, re)) {
            fail_file(where, fmt::format("group \"{}\" does not match \"{}\"", g.written, subject));
        }
        return "regex:" + (m.size() > 1 && m[1].matched ? m[1].str() : m[0].str());
    }
    }
    return {};
}

bool blank(const std::string & s) {
    return s.find_first_not_of(" \t\r\n") == std::string::npos;
}

std::string string_field(const json & j, const char * key, const std::string & where) {
    if (!j[key].is_string()) {
        fail_file(where, fmt::format("\"{}\" must be a string", key));
    }
    return j[key].get<std::string>();
}

// One JSONL line into a document; false for a document with no text at all.
bool parse_jsonl_document(const std::string & line, const std::string & where, const std::filesystem::path & folder,
                          SourceDocument & d, json & j) {
    j = parse_json(line, where);
    if (!j.is_object()) {
        fail_file(where, "a document must be a JSON object with \"text\", \"messages\", or \"prompt\" and \"response\"");
    }
    const int kinds = int(j.contains("text")) + int(j.contains("messages")) + int(j.contains("prompt") || j.contains("response"));
    if (kinds != 1) {
        fail_file(where, "a document needs exactly one of \"text\", \"messages\", or \"prompt\" with \"response\"");
    }
    if (j.contains("text")) {
        d.text = string_field(j, "text", where);
        return !blank(d.text);
    }
    if (j.contains("prompt") || j.contains("response")) {
        if (!j.contains("prompt") || !j.contains("response")) {
            fail_file(where, "needs both \"prompt\" and \"response\"");
        }
        d.prompt_response = true;
        d.messages = {{"user", string_field(j, "prompt", where), {}}, {"assistant", string_field(j, "response", where), {}}};
        return !blank(d.messages[0].content) || !blank(d.messages[1].content);
    }
    d.messages = parse_messages(j["messages"], where, &folder);
    return std::any_of(d.messages.begin(), d.messages.end(), [](const CorpusMessage & m) { return !blank(m.content); });
}

std::string media_key(const std::vector<CorpusMessage> & messages) {
    std::string key;
    for (const CorpusMedia & m : media_of(messages)) {
        const std::string bytes = read_text_file(m.path);
        key += fmt::format("{}media:{}", key.empty() ? "" : " ", xxh64_hex(bytes));
    }
    return key;
}

// stb_image's formats for images, miniaudio's for audio: what libmtmd decodes.
const std::set<std::string> & media_extensions(Modality m) {
    static const std::set<std::string> image = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tga", ".psd",
                                                ".pnm", ".ppm", ".pgm", ".hdr", ".pic"};
    static const std::set<std::string> audio = {".wav", ".mp3", ".flac"};
    static const std::set<std::string> none;
    return m == Modality::Image ? image : m == Modality::Audio ? audio : none;
}

std::string upper(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::toupper(c)); });
    return s;
}

std::string lower_extension(const std::filesystem::path & path) {
    std::string ext = path.extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return ext;
}

// One image or audio file of a media source: the user gives it with the source's prompt,
// and the caption beside it (NAME.txt) is the answer.
void read_media_file(const SourceSpec & s, uint32_t index, const std::filesystem::path & path, SourceFiles & out) {
    const std::string file = path.string();
    if (!is_media_file(s.media, path)) {
        std::error_code ec;
        bool caption = false;
        if (lower_extension(path) == ".txt") {
            for (const std::string & ext : media_extensions(s.media)) {
                for (const std::string & spelled : {ext, upper(ext)}) {
                    std::filesystem::path media = path;
                    caption |= std::filesystem::is_regular_file(media.replace_extension(spelled), ec);
                }
            }
        }
        if (!caption) {
            out.not_media_skipped.push_back(file);
        }
        out.files.push_back({path, std::filesystem::file_size(path, ec), ""});
        return;
    }
    const std::string bytes = read_text_file(path);
    out.files.push_back({path, bytes.size(), xxh64_hex(bytes)});
    SourceDocument d;
    d.source = index;
    d.file = uint32_t(out.files.size() - 1);
    d.group = group_key(s, path, nullptr, file);
    const std::string prompt = !s.prompt.empty()                  ? s.prompt
                               : s.media == Modality::Image ? "Describe this image."
                                                            : "Transcribe this audio.";
    d.messages.push_back({"user", std::string(kMediaMarker) + "\n" + prompt, {{s.media, std::filesystem::absolute(path)}}});
    std::filesystem::path caption_path = path;
    caption_path.replace_extension(".txt");
    std::error_code ec;
    if (std::filesystem::is_regular_file(caption_path, ec)) {
        std::string caption = read_text_file(caption_path);
        const size_t bad = invalid_utf8_at(caption);
        if (bad != std::string::npos || caption.find('\0') != std::string::npos) {
            fail_file(caption_path.string(), "is not UTF-8 text: a caption beside " + file + " must be");
        }
        if (caption.rfind("\xEF\xBB\xBF", 0) == 0) {
            caption.erase(0, 3);
        }
        while (!caption.empty() && (caption.back() == '\n' || caption.back() == '\r')) {
            caption.pop_back();
        }
        if (!blank(caption)) {
            d.messages.push_back({"assistant", caption, {}});
        }
    }
    d.media_key = fmt::format("media:{}", out.files.back().digest);
    out.documents.push_back(std::move(d));
}

} // namespace

bool is_media_file(Modality m, const std::filesystem::path & path) {
    return media_extensions(m).count(lower_extension(path)) > 0;
}

size_t invalid_utf8_at(std::string_view text) {
    const auto * s = reinterpret_cast<const unsigned char *>(text.data());
    const size_t n = text.size();
    size_t i = 0;
    while (i < n) {
        // Eight ASCII bytes at a time: most text is mostly ASCII.
        while (i + 8 <= n) {
            uint64_t w;
            std::memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ull) {
                break;
            }
            i += 8;
        }
        if (i >= n) {
            break;
        }
        const unsigned char c = s[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        size_t len;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2, cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3, cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4, cp = c & 0x07;
        } else {
            return i;
        }
        if (i + len > n) {
            return i;
        }
        for (size_t k = 1; k < len; ++k) {
            if ((s[i + k] & 0xC0) != 0x80) {
                return i;
            }
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) {
            return i;
        }
        i += len;
    }
    return std::string_view::npos;
}

std::filesystem::path source_key_root(const SourceSpec & s, const std::filesystem::path & base_dir) {
    namespace fs = std::filesystem;
    const fs::path given(s.path);
    if (given.is_relative()) {
        return base_dir;
    }
    fs::path root;
    for (const fs::path & part : given) {
        if (is_glob(part.string())) {
            return root;
        }
        root /= part;
    }
    std::error_code ec;
    return fs::is_directory(root, ec) ? root : root.parent_path();
}

std::vector<std::filesystem::path> expand_source_path(const SourceSpec & s, const std::filesystem::path & base_dir) {
    namespace fs = std::filesystem;
    const fs::path given = fs::path(s.path).is_absolute() || base_dir.empty() ? fs::path(s.path) : base_dir / s.path;
    std::vector<fs::path> out;
    const auto add_dir = [&](const fs::path & dir) {
        std::error_code ec;
        for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
             it.increment(ec)) {
            if (hidden(it->path())) {
                if (it->is_directory()) {
                    it.disable_recursion_pending();
                }
                continue;
            }
            std::error_code type_ec;
            if (it->is_regular_file(type_ec)) {
                out.push_back(it->path());
            } else if (!it->is_directory(type_ec)) {
                // A FIFO would block the read, a device never end: left out, but by name.
                std::fprintf(stderr, "moeprune: source \"%s\": skipped %s: not a regular file (a FIFO, device, socket "
                                     "or broken link, or a link to one)\n", s.name.c_str(), it->path().c_str());
            }
        }
        if (ec) {
            fail_file(dir.string(), "cannot list source directory: " + ec.message());
        }
    };
    if (is_glob(given.string())) {
        glob_t g{};
        const int rc = ::glob(given.c_str(), GLOB_ERR, nullptr, &g);
        if (rc == 0) {
            for (size_t i = 0; i < g.gl_pathc; ++i) {
                const fs::path p = g.gl_pathv[i];
                if (fs::is_directory(p)) {
                    add_dir(p);
                } else if (fs::is_regular_file(p)) {
                    out.push_back(p);
                }
            }
        }
        globfree(&g);
        if (rc == GLOB_ABORTED) {
            fail_file(given.string(), fmt::format("source \"{}\": a directory of the glob cannot be read", s.name));
        }
    } else if (fs::is_directory(given)) {
        add_dir(given);
    } else if (fs::exists(given)) {
        out.push_back(given);
    }
    if (out.empty()) {
        fail_file(given.string(), fmt::format("source \"{}\" matches no file", s.name));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

void read_source_file(const SourceSpec & s, uint32_t index, const std::filesystem::path & path, bool skip_binary,
                      SourceFiles & out) {
    if (s.media != Modality::Text) {
        read_media_file(s, index, path, out);
        return;
    }
    const std::string file = path.string();
    std::string bytes = read_text_file(path);
    const uint32_t file_index = uint32_t(out.files.size());
    out.files.push_back({path, bytes.size(), xxh64_hex(bytes)});
    const size_t bad = invalid_utf8_at(bytes);
    if (skip_binary) {
        const size_t head = std::min<size_t>(bytes.size(), 8192);
        // A code point cut by the 8 KiB boundary is not binary.
        if (bytes.find('\0') < head || (bad != std::string::npos && bad + 4 < head)) {
            out.binary_skipped.push_back(file);
            return;
        }
    }
    if (bad != std::string::npos) {
        const size_t line = size_t(std::count(bytes.begin(), bytes.begin() + long(bad), '\n')) + 1;
        fail_file(fmt::format("{}:{}", file, line), fmt::format("is not UTF-8 text (invalid byte 0x{:02x} at offset {})",
                                                                 (unsigned char)bytes[bad], bad));
    }
    if (bytes.rfind("\xEF\xBB\xBF", 0) == 0) {
        bytes.erase(0, 3);
    }
    if (format_of(s, path) != SourceFormat::Jsonl) {
        if (bytes.find('\0') != std::string::npos) {
            fail_file(file, "holds a NUL byte: not text");
        }
        if (blank(bytes)) {
            ++out.empty_skipped;
            return;
        }
        SourceDocument d;
        d.source = index;
        d.file = file_index;
        d.group = group_key(s, path, nullptr, file);
        d.text = std::move(bytes);
        out.documents.push_back(std::move(d));
        return;
    }
    size_t start = 0;
    uint64_t line_no = 0;
    json j;
    while (start < bytes.size()) {
        size_t end = bytes.find('\n', start);
        if (end == std::string::npos) {
            end = bytes.size();
        }
        ++line_no;
        std::string line = bytes.substr(start, end - start);
        start = end + 1;
        if (!line.empty() && line.back() == '\r') {
            line.pop_back();
        }
        if (blank(line)) {
            continue;
        }
        const std::string where = fmt::format("{}:{}", file, line_no);
        if (line.find('\0') != std::string::npos) {
            fail_file(where, "holds a NUL byte: not a line of JSON text");
        }
        SourceDocument d;
        d.source = index;
        d.file = file_index;
        d.line = line_no;
        if (!parse_jsonl_document(line, where, std::filesystem::absolute(path).parent_path(), d, j)) {
            ++out.empty_skipped;
            continue;
        }
        d.group = group_key(s, path, &j, where);
        d.media_key = media_key(d.messages);
        out.documents.push_back(std::move(d));
    }
}

} // namespace moeprune
