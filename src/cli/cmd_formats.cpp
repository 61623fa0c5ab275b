#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/errors.h"
#include "core/digest.h"
#include "formats/keep_map.h"
#include "formats/stats.h"
#include "formats/trace.h"
#include "select/select.h"

#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <memory>

namespace moeprune::cli {

void add_trace(CLI::App & app, Action & action) {
    CLI::App * sub = app.add_subcommand("trace", "Read router traces");
    sub->require_subcommand(1);

    auto info_file = std::make_shared<std::string>();
    auto info_json = std::make_shared<bool>(false);
    CLI::App * info = sub->add_subcommand("info", "Tokens, layers, experts, top-M, phases and sequences of a trace");
    info->add_option("file", *info_file, "Trace file (moeprune or Q4RT v1)")->required();
    info->add_flag("--json", *info_json, "JSON output");
    info->callback([=, &action] {
        action = [=] {
            const TraceReader r = TraceReader::open(*info_file);
            const nlohmann::json j = trace_info_json(r);
            if (*info_json) {
                std::printf("%s\n", j.dump(1).c_str());
                return 0;
            }
            std::printf("format     %s\ntokens     %llu\nlayers     %u\nexperts    %u\ntop-M      %u\n", r.format().c_str(),
                        (unsigned long long) r.n_tokens(), r.header().n_layer, r.header().n_expert, r.header().top_m);
            std::printf("phases     prefill %s, decode %s\nsequences  %s\n", j["phases"]["prefill"].dump().c_str(),
                        j["phases"]["decode"].dump().c_str(), j["n_sequences"].dump().c_str());
            for (const auto & [name, n] : j["domains"].items()) {
                std::printf("domain     %s: %s tokens\n", name.c_str(), n.dump().c_str());
            }
            if (r.truncated_tail()) {
                std::printf("note       an incomplete last block was ignored (the writer was interrupted)\n");
            }
            return 0;
        };
    });

    auto verify_file = std::make_shared<std::string>();
    CLI::App * verify = sub->add_subcommand(
        "verify", "Read and check a whole trace: every block's checksums (v2), every section decoded, every expert id");
    verify->add_option("file", *verify_file, "Trace file (moeprune or Q4RT v1)")->required();
    verify->callback([=, &action] {
        action = [=] {
            const TraceReader r = TraceReader::open(*verify_file);
            const std::vector<std::string> problems = r.verify();
            for (const std::string & p : problems) {
                std::printf("%s\n", p.c_str());
            }
            if (!problems.empty()) {
                std::fprintf(stderr, "moeprune: error: %s: %zu damaged sections\n", verify_file->c_str(), problems.size());
                return 1;
            }
            std::printf("%s: %s, %llu tokens x %u layers, %s%s\n", verify_file->c_str(), r.format().c_str(),
                        (unsigned long long) r.n_tokens(), r.header().n_layer,
                        r.has_header_checksum() ? "every checksum matches and every section decodes"
                        : r.has_checksums() ? "every section's checksum matches and every section decodes (a version 2 "
                                              "trace: its file header has no checksum)"
                                          : "no checksums in this format: every section decodes and every id is in range",
                        r.truncated_tail() ? " (an incomplete last block was ignored)" : "");
            return 0;
        };
    });

    auto exp_file = std::make_shared<std::string>();
    auto exp_dir = std::make_shared<std::string>();
    CLI::App * exp = sub->add_subcommand("export", "Write a trace as numpy arrays");
    exp->add_option("file", *exp_file, "Trace file")->required();
    exp->add_option("--npy", *exp_dir, "Directory for ids.npy, logits.npy, token.npy, pos.npy, seq.npy, domain.npy, phase.npy")
        ->required();
    exp->callback([=, &action] {
        action = [=] {
            const TraceReader r = TraceReader::open(*exp_file);
            export_trace_npy(r, *exp_dir);
            std::printf("exported %llu tokens to %s\n", (unsigned long long) r.n_tokens(), exp_dir->c_str());
            return 0;
        };
    });
}

void add_merge(CLI::App & app, Action & action) {
    auto inputs = std::make_shared<std::vector<std::string>>();
    auto output = std::make_shared<std::string>();
    CLI::App * sub = app.add_subcommand("merge", "Add saliency statistics collected over disjoint tokens");
    sub->add_option("inputs", *inputs, "Statistics files (moeprune-stats)")->required()->expected(2, -1);
    sub->add_option("-o,--output", *output, "Merged statistics file")->required();
    sub->callback([=, &action] {
        action = [=] {
            std::vector<std::filesystem::path> in_paths(inputs->begin(), inputs->end());
            refuse_output_clashes({*output}, in_paths);
            // Two files with the same bytes are refused below.
            refuse_repeated_inputs(in_paths, "its tokens would count twice");
            std::map<std::string, std::string> digests;
            SaliencyStats merged;
            nlohmann::json sources = nlohmann::json::array();
            for (size_t i = 0; i < inputs->size(); ++i) {
                const std::string & path = (*inputs)[i];
                const std::string text = read_text_file(path);
                const auto [it, fresh] = digests.emplace(xxh64_hex(text), path);
                if (!fresh) {
                    fail_file(path, "has the same bytes as " + it->second + ": merging it would count its tokens twice");
                }
                SaliencyStats s = parse_stats(text, path);
                validate_stats_for_selection(s, path, {});
                if (i == 0) {
                    merged = std::move(s);
                } else {
                    merge_stats(merged, s, inputs->front(), path);
                }
                sources.push_back(path);
            }
            merged.settings["merged_from"] = sources;
            write_stats(*output, merged);
            std::printf("merged %zu files, %llu tokens -> %s\n", inputs->size(), (unsigned long long) merged.n_tokens,
                        output->c_str());
            return 0;
        };
    });
}

void add_keep(CLI::App & app, Action & action) {
    CLI::App * sub = app.add_subcommand("keep", "Keep maps");
    sub->require_subcommand(1);
    auto file = std::make_shared<std::string>();
    auto output = std::make_shared<std::string>();
    CLI::App * check = sub->add_subcommand("check", "Validate a keep map (either form) and optionally rewrite it in moeprune-keep form");
    check->add_option("file", *file, "Keep map JSON")->required();
    check->add_option("-o,--output", *output, "Write the normalized moeprune-keep form here");
    check->callback([=, &action] {
        action = [=] {
            const KeepMap km = read_keep_map(*file);
            std::printf("%s: %zu layers, k = %lld, digest %s\n", file->c_str(), km.layers.size(), (long long) km.k,
                        keep_map_digest(km).c_str());
            if (!output->empty()) {
                refuse_output_clashes({*output}, {*file});
                write_keep_map(*output, km);
            }
            return 0;
        };
    });
}

} // namespace moeprune::cli
