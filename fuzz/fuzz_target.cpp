// One libFuzzer target per reader (readers.h), chosen at compile time by
// MOEPRUNE_FUZZ_READER. Each input is written to a file of this process, as every
// reader takes a path.
#include "readers.h"

#include "core/errors.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace {

const moeprune::fuzz::Reader & target() {
    static const moeprune::fuzz::Reader & r = moeprune::fuzz::reader(MOEPRUNE_FUZZ_READER);
    return r;
}

std::filesystem::path input_path() {
    const std::filesystem::path dir = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    return dir / ("moeprune-fuzz-" + std::to_string(::getpid()) + target().extension);
}

// The input's file, removed when the fuzzer exits (libFuzzer ends its runs with exit(),
// which destroys this): runs of every target otherwise leave one file each in /dev/shm.
struct InputFile {
    std::filesystem::path path = input_path();
    ~InputFile() {
        std::error_code ec;
        std::filesystem::remove(path, ec);
    }
};

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    static const InputFile input;
    const std::filesystem::path & path = input.path;
    FILE * f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
        std::perror(path.c_str());
        std::abort();
    }
    try {
        target().read(path);
    } catch (const moeprune::Error &) {
        // a clear refusal is the right answer to a malformed file
    }
    return 0;
}
