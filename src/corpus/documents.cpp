// A document's body, compared text and label.
#include "corpus/documents.h"

#include <fmt/format.h>

namespace moeprune::corpus_build {

std::string & body(SourceDocument & d) {
    return d.messages.empty() ? d.text : d.messages.front().content;
}

std::string content_text(const SourceDocument & d) {
    if (d.messages.empty()) {
        return d.text;
    }
    std::string s = d.media_key.empty() ? "" : d.media_key + "\n";
    for (const CorpusMessage & m : d.messages) {
        if (!d.media_key.empty() && m.role == "user") {
            continue;
        }
        s += m.content;
        s += '\n';
    }
    return s;
}

std::string label(const std::vector<SourceFile> & files, const SourceDocument & d) {
    const std::string f = files[d.file].path.string();
    return d.line ? fmt::format("{}:{}", f, d.line) : f;
}

} // namespace moeprune::corpus_build
