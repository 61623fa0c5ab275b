#include "core/digest.h"
#include "core/errors.h"
#include "core/file_io.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <memory>
#include <sys/stat.h>

namespace moeprune {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kWholeUpTo = 256ull << 20, kEnds = 16ull << 20, kPiece = 1ull << 20;
constexpr uint64_t kPieces = 64;

class Hasher {
public:
    Hasher() : state_(XXH3_createState(), XXH3_freeState), buf_(1 << 20) { XXH3_64bits_reset(state_.get()); }
    void bytes(const void * p, size_t n) { XXH3_64bits_update(state_.get(), p, n); }
    void range(const File & f, uint64_t from, uint64_t n) {
        while (n > 0) {
            const size_t chunk = size_t(std::min<uint64_t>(n, buf_.size()));
            f.pread_exact(buf_.data(), chunk, from);
            bytes(buf_.data(), chunk);
            from += chunk;
            n -= chunk;
        }
    }
    uint64_t digest() const { return XXH3_64bits_digest(state_.get()); }

private:
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state_;
    std::vector<char> buf_;
};

struct stat stat_of(const fs::path & p) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) {
        fail_file(p.string(), "cannot be read");
    }
    return st;
}

} // namespace

std::string identity_digest(const fs::path & p) {
    const struct stat st = stat_of(p);
    const File f = File::open_read(p);
    const uint64_t size = uint64_t(st.st_size);
    Hasher h;
    if (size <= kWholeUpTo) {
        h.range(f, 0, size);
        return fmt::format("xxh3:{:016x}", h.digest());
    }
    h.range(f, 0, kEnds);
    h.range(f, size - kEnds, kEnds);
    return fmt::format("xxh3-ends:{}:{}:{:016x}", size, int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                       h.digest());
}

std::string model_digest(const std::vector<fs::path> & shards) {
    uint64_t total = 0;
    for (const fs::path & p : shards) {
        total += uint64_t(stat_of(p).st_size);
    }
    Hasher h;
    for (const fs::path & p : shards) {
        const File f = File::open_read(p);
        const uint64_t size = f.size();
        if (total <= kWholeUpTo) {
            h.range(f, 0, size);
            continue;
        }
        h.bytes(&size, sizeof size);
        if (size <= 2 * kEnds + kPieces * kPiece) {
            h.range(f, 0, size);
            continue;
        }
        h.range(f, 0, kEnds);
        const uint64_t span = size - 2 * kEnds - kPiece;
        for (uint64_t i = 0; i < kPieces; ++i) {
            h.range(f, kEnds + span * i / (kPieces - 1), kPiece);
        }
        h.range(f, size - kEnds, kEnds);
    }
    return total <= kWholeUpTo ? fmt::format("xxh3:{:016x}", h.digest())
                               : fmt::format("xxh3-sampled:{}:{:016x}", total, h.digest());
}

Xxh64::Xxh64() : state_(XXH64_createState(), XXH64_freeState) { XXH64_reset(state_.get(), 0); }

Xxh64 & Xxh64::update(const void * p, size_t n) {
    XXH64_update(state_.get(), p, n);
    return *this;
}

uint64_t Xxh64::value() const { return XXH64_digest(state_.get()); }

std::string Xxh64::hex() const { return fmt::format("{:016x}", value()); }

std::string Xxh64::named() const { return "xxh64:" + hex(); }

std::string content_digest(std::string_view bytes) { return Xxh64().update(bytes).named(); }

std::string xxh64_hex(std::string_view bytes) { return Xxh64().update(bytes).hex(); }

} // namespace moeprune
