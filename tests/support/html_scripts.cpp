#include "support/html_scripts.h"

#include <fmt/format.h>
#include <gumbo.h>

#include <cstring>

namespace moeprune::test {

namespace {

void collect_scripts(const GumboNode * node, HtmlScripts & out) {
    if (node->type != GUMBO_NODE_ELEMENT) {
        return;
    }
    const GumboElement & e = node->v.element;
    const char * tag = gumbo_normalized_tagname(e.tag);
    for (unsigned i = 0; i < e.attributes.length; ++i) {
        const auto * a = static_cast<const GumboAttribute *>(e.attributes.data[i]);
        if (std::strncmp(a->name, "on", 2) == 0) {
            out.handlers.push_back(fmt::format("{} {}", tag, a->name));
        }
    }
    if (e.tag == GUMBO_TAG_SCRIPT) {
        std::string text;
        for (unsigned i = 0; i < e.children.length; ++i) {
            const auto * child = static_cast<const GumboNode *>(e.children.data[i]);
            if (child->type == GUMBO_NODE_TEXT || child->type == GUMBO_NODE_CDATA) {
                text += child->v.text.text;
            }
        }
        out.scripts.push_back(std::move(text));
    }
    for (unsigned i = 0; i < e.children.length; ++i) {
        collect_scripts(static_cast<const GumboNode *>(e.children.data[i]), out);
    }
}

} // namespace

HtmlScripts html_scripts(const std::string & html) {
    GumboOutput * parsed = gumbo_parse_with_options(&kGumboDefaultOptions, html.data(), html.size());
    HtmlScripts out;
    collect_scripts(parsed->root, out);
    gumbo_destroy_output(&kGumboDefaultOptions, parsed);
    return out;
}

} // namespace moeprune::test
