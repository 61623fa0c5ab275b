#include "plan/commands.h"

#include "formats/keep_map.h"

#include <fmt/format.h>

#include <cstdint>

namespace moeprune {

namespace {

std::string tool(const PlanOptions & opt, const char * name) {
    return opt.llama_bin.empty() ? std::string(name) : (opt.llama_bin / name).string();
}

// The flags llama-completion and llama-server share for this option.
std::vector<std::string> model_flags(const PlanOption & o, const PlanOptions & opt, const Geometry & g,
                                     const std::string & model, int threads, std::vector<std::string> & notes) {
    std::vector<std::string> flags{"-m", model};
    if (threads > 0) {
        flags.insert(flags.end(), {"-t", std::to_string(threads)});
    }
    if (opt.ctx > 0) {
        flags.insert(flags.end(), {"-c", std::to_string(opt.ctx)});
    }
    const bool streams = o.policy != kPolicyResident;
    if (!g.repacked_expert_types.empty()) {
        const std::string types = fmt::format("{}", fmt::join(g.repacked_expert_types, ", "));
        if (streams) {
            flags.push_back("--no-repack");
            notes.push_back(fmt::format("--no-repack: llama.cpp's CPU backend copies {} experts into anonymous memory "
                                        "(repacking), which cannot stream from disk; with it they stay mapped",
                                        types));
        } else {
            notes.push_back(fmt::format("every kept expert is resident, so the {} experts are left to llama.cpp's "
                                        "repacking (faster in RAM); add --no-repack to stream them instead", types));
        }
    }
    if (!streams) {
        notes.push_back("--mlock and --no-mmap are left out: neither was measured faster here");
    }
    return flags;
}

} // namespace

PlanCommands commands_of(const PlanOption & o, const PlanOptions & opt, const Geometry & g,
                         const std::optional<Measured> & measured) {
    PlanCommands c;
    const std::string original = opt.model.empty() ? std::string("MODEL.gguf") : opt.model.string();
    if (opt.model.empty()) {
        c.notes.push_back("planned by hand: MODEL.gguf stands for the model of this geometry");
    }
    c.model = original;
    if (o.k < g.n_expert) {
        const std::string label = keep_map_label(o.criterion, o.k);
        c.model = (opt.sliced_dir / (label + ".gguf")).string();
        std::string map;
        if (o.keep_map) {
            // Absolute, so that the commands run from any folder; eval.json's paths are relative
            // to the folder eval ran in, which is this one when run made both.
            map = std::filesystem::absolute(*o.keep_map).lexically_normal().string();
            if (std::filesystem::path(*o.keep_map).is_relative()) {
                c.notes.push_back(fmt::format("the keep map {} was named relative to the folder the plan ran in, {}",
                                              *o.keep_map, std::filesystem::current_path().string()));
            }
        } else {
            map = fmt::format("KEEP-MAP-K{}.json", o.k);
            c.notes.push_back(fmt::format("{} stands for a keep map of K {}: the plan read none (give eval's report, "
                                          "--eval); `moeprune select --stats STATS -k {} -o DIR` writes one",
                                          map, o.k, o.k));
        }
        c.slice = {opt.moeprune_bin.string(), "slice", "-m", original, "--keep", map, "-o", c.model};
    }
    if (opt.ram_bytes > 0 || o.measured) {
        const double limit = o.measured ? o.measured->limit_bytes : opt.ram_bytes;
        // moeprune's own, not systemd-run: it is how measure limited llama.cpp, on cgroup v1
        // or v2, and needs no systemd (a container's PID 1 is seldom systemd).
        c.memory_limit = {opt.moeprune_bin.string(), "limit", "--ram", std::to_string(uint64_t(limit)), "--"};
        c.notes.push_back(fmt::format(
            "moeprune limit holds llama.cpp, its page cache included, to the {:.3f} GB {} in a memory cgroup of its "
            "own, as measure did (root, or a delegated cgroup); with systemd, `systemd-run --scope -p MemoryMax={} --` "
            "does the same",
            limit / 1e9, o.measured ? "limit it was measured under" : "--ram the plan was made for", uint64_t(limit)));
    }
    // Without -t, the threads llama.cpp was measured with: its own default differs.
    const int threads = opt.threads > 0 ? opt.threads : measured ? measured->report().threads : 0;
    std::vector<std::string> flags = model_flags(o, opt, g, c.model, threads, c.notes);
    c.llama_completion = {tool(opt, "llama-completion")};
    if (!opt.llama_bin.empty() && !std::filesystem::exists(opt.llama_bin / "llama-completion")) {
        c.notes.push_back(fmt::format("{} has no llama-completion: build it there (make build, target "
                                      "llama-completion) or give --llama-bin the folder that has it",
                                      opt.llama_bin.string()));
    }
    c.llama_completion.insert(c.llama_completion.end(), flags.begin(), flags.end());
    // moeprune builds llama.cpp without its server: where --llama-bin has none, the PATH's.
    const bool server_there = !opt.llama_bin.empty() && std::filesystem::exists(opt.llama_bin / "llama-server");
    c.llama_server = {server_there ? tool(opt, "llama-server") : std::string("llama-server")};
    if (!opt.llama_bin.empty() && !server_there) {
        c.notes.push_back(fmt::format("{} has no llama-server: the command names the one on the PATH", opt.llama_bin.string()));
    }
    c.llama_server.insert(c.llama_server.end(), flags.begin(), flags.end());
    // The read-ahead the option was measured or priced at.
    const std::optional<uint64_t> at = o.measured ? o.measured->read_ahead_kb : o.read_ahead_kb;
    if (measured && at && measured->report().read_ahead_kb && *at != *measured->report().read_ahead_kb &&
        !measured->report().storage_device.empty()) {
        const MeasureReport & r = measured->report();
        // blockdev counts 512-byte sectors.
        c.read_ahead = {"blockdev", "--setra", std::to_string(*at * 2), "/dev/" + r.storage_device};
        std::string compared;
        for (const MeasuredRun & run : r.runs) {
            if (o.measured && run.ram == o.measured->ram && run.read_ahead_kb == r.read_ahead_kb &&
                run.decode.tokens_per_second > 0) {
                compared = fmt::format(": measured {:.2f}× the tokens/s of the device's current {} KB under the same limit",
                                       o.tok_per_s.value_or(0) / run.decode.tokens_per_second, *r.read_ahead_kb);
            }
        }
        c.notes.push_back(fmt::format("blockdev (as root) sets /dev/{}'s read-ahead to {} KB, the one this was {} "
                                      "at{}; it lasts until a reboot, and `blockdev --setra {} /dev/{}` puts it back",
                                      r.storage_device, *at, o.measured || o.shortlist ? "measured" : "priced", compared,
                                      *r.read_ahead_kb * 2, r.storage_device));
    } else if (measured && measured->report().read_ahead_kb && o.policy != kPolicyResident) {
        const MeasureReport & r = measured->report();
        c.notes.push_back(fmt::format("the speed streams from {} at its read-ahead when measured, {} KB (blockdev "
                                      "--getra /dev/{} shows it in 512-byte sectors); another setting changes it",
                                      r.storage_device.empty() ? "the model's device" : "/dev/" + r.storage_device,
                                      *r.read_ahead_kb, r.storage_device.empty() ? "DEVICE" : r.storage_device));
    }
    if (!c.slice.empty()) {
        c.lines.push_back(shell_line(c.slice));
    }
    if (!c.read_ahead.empty()) {
        std::vector<std::string> as_root{"sudo"};
        as_root.insert(as_root.end(), c.read_ahead.begin(), c.read_ahead.end());
        c.lines.push_back(shell_line(as_root));
    }
    std::vector<std::string> prompt = c.llama_completion;
    prompt.insert(prompt.end(), {"-p", "Hello", "-n", "64", "-no-cnv"});
    std::vector<std::string> limited = c.memory_limit;
    limited.insert(limited.end(), prompt.begin(), prompt.end());
    c.lines.push_back(shell_line(limited));
    limited = c.memory_limit;
    limited.insert(limited.end(), c.llama_server.begin(), c.llama_server.end());
    c.lines.push_back(shell_line(limited));
    return c;
}

} // namespace moeprune
