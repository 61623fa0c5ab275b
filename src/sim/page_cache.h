#pragma once
// What the Linux kernel does with the pages of a mapped model under a memory limit, at
// the grain of whole units (an expert, a dense tensor): the two-list reclaim of file
// pages (mm/vmscan.c) with the accessed bit of the page tables, the referenced flag and
// refault activation (mm/workingset.c). It is the cache of llama.cpp with a model mapped
// from disk: one cache for every layer, sized in bytes. Approximations (docs/replay.md,
// "page-cache"): whole units instead of pages, no readahead (the caller charges it as a
// factor measured by `measure`'s probe), reclaim only when the limit is passed and never
// of the units the current request holds, the classic LRU (not the multi-gen one).
#include <cstdint>
#include <span>
#include <vector>

namespace moeprune {

class PageCacheModel {
public:
    // `inactive_ratio`: the inactive list is kept at least 1/ratio of the active one;
    // 0: as the kernel sets it from the lists' size, sqrt(10 * GiB) and 1 under 1 GiB.
    PageCacheModel(uint64_t capacity, uint32_t inactive_ratio);

    // A unit of `bytes`; its id is the number of units added before it.
    uint32_t add_unit(uint64_t bytes);
    size_t n_units() const { return bytes_.size(); }

    // Touches every unit of `units` (distinct) as one access: the missing ones are
    // faulted in, in order, then reclaim brings the cache back under its capacity
    // without evicting any of them. Returns the bytes faulted in.
    uint64_t access(std::span<const uint32_t> units);
    // How many units the last access() faulted in.
    int last_misses() const { return last_misses_; }
    // Brings the missing units of `units` in as readahead does: inactive, not accessed,
    // without reclaim (the next access() reclaims). Returns how many came in.
    uint64_t read_ahead(std::span<const uint32_t> units);

    bool resident(uint32_t unit) const { return list_[unit] != kNone; }
    uint64_t used() const { return used_; }
    void reset();

private:
    static constexpr uint8_t kNone = 0, kInactive = 1, kActive = 2;
    static constexpr uint32_t kNil = UINT32_MAX;
    struct List {
        uint32_t head = kNil, tail = kNil;   // head: newest
        uint64_t bytes = 0;
    };

    void push_head(uint8_t list, uint32_t u);
    void unlink(uint32_t u);
    void reclaim();
    bool inactive_is_low() const;

    uint64_t capacity_;
    uint32_t inactive_ratio_;
    std::vector<uint64_t> bytes_;
    std::vector<uint8_t> list_;
    std::vector<uint32_t> newer_, older_;
    std::vector<uint8_t> young_, referenced_, pinned_;
    std::vector<uint64_t> shadow_;     // the eviction clock when evicted; kNoShadow if never
    List lists_[3];
    uint64_t used_ = 0;
    uint64_t clock_ = 0;               // bytes evicted or activated on refault so far (the nonresident age)
    int last_misses_ = 0;
};

// The files of a model mapped by llama.cpp, page by page in the cache above: a touch of a
// byte range faults its missing pages in with the kernel's mmap read-around (a window of
// the file's readahead size centred on the faulting page, do_sync_mmap_readahead, with
// its readahead mark a quarter window from the end), reads the next window ahead when a
// touch meets a mark (do_async_mmap_readahead), then touches every page of the range as
// one access.
class MappedFileCache {
public:
    // `readaround_bytes`: the file's readahead window (read_ahead_kb, doubled by the
    // POSIX_FADV_SEQUENTIAL llama.cpp advises).
    MappedFileCache(const std::vector<uint64_t> & file_bytes, uint64_t capacity, uint64_t page_bytes,
                    uint64_t readaround_bytes);

    struct Touch {
        uint64_t faults = 0;       // read-arounds started
        uint64_t read_bytes = 0;   // pages they brought in
    };
    Touch touch(size_t file, uint64_t offset, uint64_t bytes);
    // Whether every page of the range is cached (touching it would not fault).
    bool resident(size_t file, uint64_t offset, uint64_t bytes) const;

private:
    // Reads the missing pages of [from, to) of the file ending at `end`, marking `mark`.
    uint64_t read_window(uint32_t from, uint32_t to, uint32_t mark);

    PageCacheModel cache_;
    std::vector<uint32_t> first_page_;   // per file, and one past the last
    uint64_t page_bytes_, window_pages_;
    std::vector<uint8_t> mark_;          // PG_readahead
    std::vector<uint32_t> range_, window_;
};

} // namespace moeprune
