#include "sim/page_cache.h"

#include <algorithm>
#include <cmath>

namespace moeprune {

namespace {
constexpr uint64_t kNoShadow = UINT64_MAX;
} // namespace

PageCacheModel::PageCacheModel(uint64_t capacity, uint32_t inactive_ratio)
    : capacity_(capacity), inactive_ratio_(inactive_ratio) {}

uint32_t PageCacheModel::add_unit(uint64_t bytes) {
    bytes_.push_back(bytes);
    list_.push_back(kNone);
    newer_.push_back(kNil);
    older_.push_back(kNil);
    young_.push_back(0);
    referenced_.push_back(0);
    pinned_.push_back(0);
    shadow_.push_back(kNoShadow);
    return uint32_t(bytes_.size() - 1);
}

void PageCacheModel::reset() {
    std::fill(list_.begin(), list_.end(), kNone);
    std::fill(young_.begin(), young_.end(), 0);
    std::fill(referenced_.begin(), referenced_.end(), 0);
    std::fill(shadow_.begin(), shadow_.end(), kNoShadow);
    for (List & l : lists_) {
        l = List{};
    }
    used_ = clock_ = 0;
}

void PageCacheModel::push_head(uint8_t list, uint32_t u) {
    List & l = lists_[list];
    list_[u] = list;
    older_[u] = l.head;
    newer_[u] = kNil;
    if (l.head != kNil) {
        newer_[l.head] = u;
    } else {
        l.tail = u;
    }
    l.head = u;
    l.bytes += bytes_[u];
}

void PageCacheModel::unlink(uint32_t u) {
    List & l = lists_[list_[u]];
    (newer_[u] != kNil ? older_[newer_[u]] : l.head) = older_[u];
    (older_[u] != kNil ? newer_[older_[u]] : l.tail) = newer_[u];
    l.bytes -= bytes_[u];
    list_[u] = kNone;
}

// shrink_active_list's trigger: inactive * ratio < active.
bool PageCacheModel::inactive_is_low() const {
    uint64_t ratio = inactive_ratio_;
    if (ratio == 0) {
        const uint64_t gib = (lists_[kInactive].bytes + lists_[kActive].bytes) >> 30;
        ratio = gib ? uint64_t(std::sqrt(double(10 * gib))) : 1;
    }
    return lists_[kInactive].bytes * ratio < lists_[kActive].bytes;
}

uint64_t PageCacheModel::access(std::span<const uint32_t> units) {
    last_misses_ = 0;
    uint64_t faulted = 0;
    for (uint32_t u : units) {
        pinned_[u] = 1;
    }
    for (uint32_t u : units) {
        young_[u] = 1;   // the access sets the page-table entries' accessed bit
        if (list_[u] != kNone) {
            continue;
        }
        ++last_misses_;
        faulted += bytes_[u];
        // A refault within the active list's size of its eviction was part of the working
        // set: it comes back active (workingset_refault).
        const bool working_set = shadow_[u] != kNoShadow && clock_ - shadow_[u] <= lists_[kActive].bytes;
        shadow_[u] = kNoShadow;
        referenced_[u] = 0;
        if (working_set) {
            clock_ += bytes_[u];
        }
        push_head(working_set ? kActive : kInactive, u);
        used_ += bytes_[u];
    }
    reclaim();
    for (uint32_t u : units) {
        pinned_[u] = 0;
    }
    return faulted;
}

uint64_t PageCacheModel::read_ahead(std::span<const uint32_t> units) {
    uint64_t in = 0;
    for (uint32_t u : units) {
        if (list_[u] != kNone) {
            continue;
        }
        ++in;
        const bool working_set = shadow_[u] != kNoShadow && clock_ - shadow_[u] <= lists_[kActive].bytes;
        shadow_[u] = kNoShadow;
        young_[u] = referenced_[u] = 0;
        if (working_set) {
            clock_ += bytes_[u];
        }
        push_head(working_set ? kActive : kInactive, u);
        used_ += bytes_[u];
    }
    return in;
}

MappedFileCache::MappedFileCache(const std::vector<uint64_t> & file_bytes, uint64_t capacity, uint64_t page_bytes,
                                 uint64_t readaround_bytes)
    : cache_(capacity, 0), page_bytes_(page_bytes), window_pages_(std::max<uint64_t>(1, readaround_bytes / page_bytes)) {
    first_page_.push_back(0);
    for (uint64_t bytes : file_bytes) {
        const uint64_t pages = (bytes + page_bytes - 1) / page_bytes;
        for (uint64_t p = 0; p < pages; ++p) {
            cache_.add_unit(page_bytes);
        }
        first_page_.push_back(first_page_.back() + uint32_t(pages));
    }
    mark_.assign(first_page_.back(), 0);
}

uint64_t MappedFileCache::read_window(uint32_t from, uint32_t to, uint32_t mark) {
    window_.clear();
    for (uint32_t w = from; w < to; ++w) {
        window_.push_back(w);
        if (!cache_.resident(w)) {
            mark_[w] = 0;   // a mark left on a page since evicted
        }
    }
    const uint64_t in = cache_.read_ahead(window_);
    if (mark < to && in > 0) {
        mark_[mark] = 1;
    }
    return in * page_bytes_;
}

bool MappedFileCache::resident(size_t file, uint64_t offset, uint64_t bytes) const {
    const uint32_t begin = first_page_[file], end = first_page_[file + 1];
    const uint32_t first = begin + uint32_t(offset / page_bytes_);
    const uint32_t last = std::min(end - 1, begin + uint32_t((offset + std::max<uint64_t>(bytes, 1) - 1) / page_bytes_));
    for (uint32_t p = first; p <= last; ++p) {
        if (!cache_.resident(p)) {
            return false;
        }
    }
    return true;
}

MappedFileCache::Touch MappedFileCache::touch(size_t file, uint64_t offset, uint64_t bytes) {
    Touch t;
    if (bytes == 0) {
        return t;
    }
    const uint32_t begin = first_page_[file], end = first_page_[file + 1];
    const uint32_t first = begin + uint32_t(offset / page_bytes_);
    const uint32_t last = std::min(end - 1, begin + uint32_t((offset + bytes - 1) / page_bytes_));
    range_.clear();
    for (uint32_t p = first; p <= last; ++p) {
        range_.push_back(p);
        if (cache_.resident(p)) {
            if (mark_[p]) {
                // The next window, from the first page not cached after the mark, sized
                // as page_cache_async_ra sizes one that does not continue the last: the
                // distance from the mark, grown by get_next_ra_size.
                mark_[p] = 0;
                uint32_t from = p + 1;
                while (from < end && cache_.resident(from)) {
                    ++from;
                }
                const uint64_t cur = uint64_t(from - p) + 1;
                const uint64_t size = std::min(window_pages_, cur < window_pages_ / 16 ? 4 * cur
                                                              : cur <= window_pages_ / 2 ? 2 * cur
                                                                                         : window_pages_);
                const uint32_t to = uint32_t(std::min<uint64_t>(end, uint64_t(from) + size));
                t.read_bytes += read_window(from, to, from);
            }
            continue;
        }
        const uint32_t from = uint32_t(std::max<int64_t>(begin, int64_t(p) - int64_t(window_pages_ / 2)));
        const uint32_t to = uint32_t(std::min<uint64_t>(end, uint64_t(from) + window_pages_));
        ++t.faults;
        t.read_bytes += read_window(from, to, uint32_t(to - window_pages_ / 4));
    }
    cache_.access(range_);
    return t;
}

void PageCacheModel::reclaim() {
    while (used_ > capacity_) {
        // Deactivation clears the accessed bits and keeps nothing active for them (the
        // kernel keeps only executable file pages active when referenced).
        while (inactive_is_low() && lists_[kActive].tail != kNil) {
            const uint32_t u = lists_[kActive].tail;
            unlink(u);
            young_[u] = 0;
            push_head(kInactive, u);
        }
        uint32_t u = lists_[kInactive].tail;
        while (u != kNil && pinned_[u]) {
            u = newer_[u];
        }
        if (u == kNil) {
            // Only the current request's units are inactive: deactivate an older one.
            uint32_t a = lists_[kActive].tail;
            while (a != kNil && pinned_[a]) {
                a = newer_[a];
            }
            if (a == kNil) {
                return;   // the request alone fills the cache
            }
            unlink(a);
            young_[a] = 0;
            push_head(kInactive, a);
            continue;
        }
        unlink(u);
        if (young_[u]) {
            // folio_check_references: used twice (accessed bit and referenced flag) is
            // activated; used once gets the referenced flag and another round.
            young_[u] = 0;
            if (referenced_[u]) {
                referenced_[u] = 0;
                push_head(kActive, u);
            } else {
                referenced_[u] = 1;
                push_head(kInactive, u);
            }
            continue;
        }
        referenced_[u] = 0;
        shadow_[u] = clock_;
        clock_ += bytes_[u];
        used_ -= bytes_[u];
    }
}

} // namespace moeprune
