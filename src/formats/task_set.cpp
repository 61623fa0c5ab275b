#include "formats/task_set.h"

#include "core/errors.h"
#include "core/atomic_file.h"
#include "core/json.h"

#include <fmt/format.h>

#include <limits>
#include <map>

namespace moeprune {

using json = nlohmann::json;

json to_json(const TaskSet & t) {
    json domains = json::array();
    for (const TaskSetDomain & d : t.domains) {
        json row = {{"domain", d.domain}, {"tasks", d.tasks}, {"documents", d.documents}, {"overlapping", d.overlapping}};
        if (!d.skipped.empty()) {
            row["skipped"] = d.skipped;
        }
        domains.push_back(std::move(row));
    }
    return {{"format", "moeprune-tasks"},
            {"version", 1},
            {"file", t.file},
            {"xxh64", t.file_digest},
            {"eval", t.eval},
            {"settings",
             {{"seed", t.seed},
              {"context_tokens", t.context_tokens},
              {"ending_tokens", t.ending_tokens},
              {"tasks_per_domain", t.tasks_per_domain}}},
            {"tasks", t.task_domains.size()},
            {"domains", std::move(domains)},
            {"task_domains", t.task_domains}};
}

TaskSet read_task_set(const std::filesystem::path & path) {
    const std::string file = path.string();
    const json doc = parse_json(read_text_file(path), file);
    if (!doc.is_object() || doc.value("format", json()) != "moeprune-tasks") {
        fail_file(file, "is not a moeprune-tasks file (\"format\")");
    }
    const JsonFields f(doc, file);
    if (f.integer("version", 0, std::numeric_limits<int64_t>::max()) != 1) {
        f.fail("version", "is not 1, the version of moeprune-tasks this moeprune reads");
    }
    constexpr int64_t most = int64_t(1) << 40;
    TaskSet t;
    t.file = f.string("file");
    t.file_digest = f.string("xxh64");
    t.eval = f.string("eval");
    const JsonFields s = f.object("settings");
    t.seed = uint64_t(s.integer("seed", 0, std::numeric_limits<int64_t>::max()));
    t.context_tokens = s.integer("context_tokens", 1, most);
    t.ending_tokens = s.integer("ending_tokens", 1, most);
    t.tasks_per_domain = s.integer("tasks_per_domain", 0, most);
    std::map<std::string, uint64_t> listed;
    uint64_t sum = 0;
    for (const JsonFields & d : f.objects("domains")) {
        TaskSetDomain row;
        row.domain = d.string("domain");
        row.tasks = uint64_t(d.integer("tasks", 0, most));
        row.documents = uint64_t(d.integer("documents", 0, most));
        row.overlapping = uint64_t(d.integer("overlapping", 0, int64_t(row.tasks)));
        row.skipped = d.has("skipped") ? d.string("skipped") : "";
        if (!listed.emplace(row.domain, row.tasks).second) {
            d.fail("domain", fmt::format("\"{}\" is listed twice", row.domain));
        }
        sum += row.tasks;
        t.domains.push_back(std::move(row));
    }
    t.task_domains = f.strings("task_domains");
    if (uint64_t(f.integer("tasks", 0, most)) != t.task_domains.size() || sum != t.task_domains.size()) {
        f.fail("tasks", fmt::format("says {} tasks; task_domains has {} and the domains add up to {}",
                                    f.integer("tasks", 0, most), t.task_domains.size(), sum));
    }
    std::map<std::string, uint64_t> counted;
    for (const std::string & d : t.task_domains) {
        ++counted[d];
    }
    for (const auto & [domain, n] : counted) {
        const auto it = listed.find(domain);
        if (it == listed.end() || it->second != n) {
            f.fail("task_domains", fmt::format("has {} tasks of \"{}\", which the domains list with {}", n, domain,
                                               it == listed.end() ? uint64_t(0) : it->second));
        }
    }
    return t;
}

} // namespace moeprune
