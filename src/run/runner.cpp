#include "run/runner.h"

#include "core/atomic_file.h"
#include "core/digest.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace moeprune::run_impl {

namespace {

// This moeprune executable's digest: a stage written by another build may hold what a bug
// since mended wrote, so it is redone, not skipped.
const std::string & this_build() {
    static const std::string build = identity_digest("/proc/self/exe");
    return build;
}

} // namespace

void Runner::stage(const std::string & name, const json & settings, const std::vector<fs::path> & inputs,
           const std::function<std::vector<fs::path>()> & work) {
    ++index_;
    forcing_ = forcing_ || from_ == name;
    const fs::path sdir = dir_ / name, manifest = sdir / "stage.json";
    json in = json::object();
    for (const fs::path & p : inputs) {
        in[fs::absolute(p).lexically_normal().string()] = digest(p);
    }
    std::error_code ec;
    if (!forcing_ && fs::exists(manifest, ec)) {
        const json m = parse_json(read_text_file(manifest), manifest.string());
        const bool same_work = m.value("settings", json()) == settings && m.value("inputs", json()) == in;
        const json build = m.value("build", json());
        if (same_work && build != this_build()) {
            std::printf("[%zu/%zu] %-8s was written by another moeprune build (%s): redone by this one\n", index_, n_,
                        name.c_str(), build.is_string() ? build.get<std::string>().substr(0, 12).c_str() : "unrecorded");
        } else if (same_work) {
            const JsonFields manifest_fields(m, manifest.string());
            const JsonFields outputs = manifest_fields.object("outputs");
            for (const auto & [rel, d] : m.at("outputs").items()) {
                const fs::path p = dir_ / rel;
                if (!fs::exists(p, ec)) {
                    fail_file(p.string(), fmt::format("is gone, but stage {} wrote it: run again with --from {} to redo it",
                                                      name, name));
                }
                if (digest(p) != outputs.string(rel)) {
                    fail_file(p.string(), fmt::format("changed since stage {} wrote it (edited by hand?): run again with "
                                                      "--from {} to redo it, or restore it", name, name));
                }
            }
            std::printf("[%zu/%zu] %-8s unchanged, skipped\n", index_, n_, name.c_str());
            std::fflush(stdout);
            return;
        }
    }
    // What the stage wrote before goes first: a run killed in it must leave no earlier
    // output under its final name for a later command to take as this run's.
    if (fs::exists(manifest, ec)) {
        try {
            const json old = parse_json(read_text_file(manifest), manifest.string());
            if (old.contains("outputs") && old.at("outputs").is_object()) {
                for (const auto & [rel, digest] : old.at("outputs").items()) {
                    const fs::path p = fs::path(rel).lexically_normal();
                    if (!p.is_absolute() && !p.empty() && *p.begin() != "..") {  // a hand-edited manifest stays in the run
                        fs::remove(dir_ / p, ec);
                    }
                }
            }
        } catch (const std::exception &) {
            // A damaged manifest is replaced below; the stage rewrites its outputs.
        }
    }
    fs::remove(manifest, ec);
    create_output_dir(sdir);
    std::printf("[%zu/%zu] %-8s running\n", index_, n_, name.c_str());
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<fs::path> outputs = work();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    json out = json::object();
    for (const fs::path & p : outputs) {
        digests_.erase(fs::absolute(p).lexically_normal().string());
        out[fs::relative(p, dir_).string()] = digest(p);
    }
    write_file_atomic(manifest, json({{"stage", name}, {"settings", settings}, {"inputs", in}, {"outputs", out},
                                      {"seconds", seconds}, {"build", this_build()}})
                                    .dump(1) +
                                    "\n");
    std::printf("[%zu/%zu] %-8s done in %.1f s\n", index_, n_, name.c_str(), seconds);
    std::fflush(stdout);
}

std::string Runner::digest(const fs::path & p) {
    const std::string key = fs::absolute(p).lexically_normal().string();
    if (auto it = digests_.find(key); it != digests_.end()) {
        return it->second;
    }
    return digests_[key] = identity_digest(p);
}

std::vector<fs::path> json_files(const fs::path & dir) {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto & e : fs::directory_iterator(dir, ec)) {
        if (e.path().extension() == ".json") {
            out.push_back(e.path());
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

} // namespace moeprune::run_impl
