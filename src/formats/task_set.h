#pragma once
// tasks.json, written by `moeprune corpus` beside tasks.txt (docs/corpus.md, "Choice
// tasks"): the settings the held-out choice tasks were made with, and each task's domain,
// so that eval can report accuracy per domain. corpus writes it; eval and run read it.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moeprune {

struct TaskSetDomain {
    std::string domain;
    uint64_t tasks = 0;
    uint64_t documents = 0;        // held-out documents of the domain the tasks could draw on
    uint64_t overlapping = 0;      // tasks whose window overlaps another's (too little text for all apart)
    std::string skipped;           // why the domain has no tasks; empty when it has
    bool operator==(const TaskSetDomain &) const = default;
};

struct TaskSet {
    std::string file;              // tasks.txt, llama.cpp's HellaSwag format
    std::string file_digest;       // xxh64 of its bytes
    std::string eval;              // the held-out eval.jsonl the tasks come from
    uint64_t seed = 0;
    int64_t context_tokens = 0, ending_tokens = 0, tasks_per_domain = 0;
    std::vector<TaskSetDomain> domains;
    std::vector<std::string> task_domains;   // per task of the file, in its order
    bool operator==(const TaskSet &) const = default;
};

nlohmann::json to_json(const TaskSet & t);

// Refuses another format, per-domain counts that do not add up to the tasks, and a domain
// name per task that the domains do not list, by file and field.
TaskSet read_task_set(const std::filesystem::path & path);

} // namespace moeprune
