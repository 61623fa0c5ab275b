#pragma once
// An HTML page as a browser splits it into elements (gumbo, the HTML5 parsing algorithm),
// for the report's tests: what a page would run, found without a grep.
#include <string>
#include <vector>

namespace moeprune::test {

struct HtmlScripts {
    std::vector<std::string> scripts;    // the text of each <script> element, in order
    std::vector<std::string> handlers;   // each element with an event handler: "img onerror", ...
};
HtmlScripts html_scripts(const std::string & html);

} // namespace moeprune::test
