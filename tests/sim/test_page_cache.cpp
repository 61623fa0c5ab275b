// The mapped-file cache's read-around and reclaim order, worked by hand (the two-list
// rules themselves are checked against the reference replay as the "page-cache" policy).
#include "sim/page_cache.h"

#include <gtest/gtest.h>

namespace moeprune {
namespace {

constexpr uint64_t kPage = 4096;

// One file of 100 pages, read-around of 8 pages: a fault reads the 8 pages centred on it,
// clipped to the file, and only those not cached.
TEST(PageCache, FaultsReadTheWindowAroundThePage) {
    MappedFileCache cache({100 * kPage}, 1000 * kPage, kPage, 8 * kPage);
    MappedFileCache::Touch t = cache.touch(0, 50 * kPage, 1);
    EXPECT_EQ(t.faults, 1u);
    EXPECT_EQ(t.read_bytes, 8 * kPage);   // pages 46..53
    t = cache.touch(0, 49 * kPage + 7, 100);
    EXPECT_EQ(t.faults, 0u);
    t = cache.touch(0, 44 * kPage, 2 * kPage);   // 44, 45 miss: one window 40..47 brings 40..45
    EXPECT_EQ(t.faults, 1u);
    EXPECT_EQ(t.read_bytes, 6 * kPage);
    t = cache.touch(0, 1 * kPage, 1);            // clipped at the start: 0..7
    EXPECT_EQ(t.read_bytes, 8 * kPage);
    t = cache.touch(0, 99 * kPage, 1);           // 95..99, clipped at the end
    EXPECT_EQ(t.read_bytes, 5 * kPage);
    // Resident means every page of the range is cached: 40..53 and 95..99 are, 8..39 not.
    EXPECT_TRUE(cache.resident(0, 40 * kPage, 14 * kPage));
    EXPECT_TRUE(cache.resident(0, 95 * kPage + 100, 5 * kPage - 100));
    EXPECT_FALSE(cache.resident(0, 38 * kPage, 4 * kPage));
    EXPECT_FALSE(cache.resident(0, 8 * kPage, 1));
}

// The window's mark, a quarter window from its end, reads ahead when touched: from the
// first page not cached, twice the distance from the mark (4x under a sixteenth of the
// window, never more than a window), as page_cache_async_ra does off a sequential run.
TEST(PageCache, TouchingTheMarkReadsTheNextWindow) {
    MappedFileCache cache({100 * kPage}, 1000 * kPage, kPage, 8 * kPage);
    EXPECT_EQ(cache.touch(0, 50 * kPage, 1).read_bytes, 8 * kPage);   // 46..53, mark at 52
    EXPECT_EQ(cache.touch(0, 51 * kPage, 1).read_bytes, 0u);
    const MappedFileCache::Touch t = cache.touch(0, 52 * kPage, 1);
    EXPECT_EQ(t.faults, 0u);
    EXPECT_EQ(t.read_bytes, 6 * kPage);                                // distance 3: 54..59, marked at 54
    EXPECT_EQ(cache.touch(0, 54 * kPage, 1).read_bytes, 8 * kPage);   // distance 7: a window, 60..67
    EXPECT_EQ(cache.touch(0, 54 * kPage, 1).read_bytes, 0u);          // a mark works once
}

// Read-ahead pages nobody touched are reclaimed first; a touched page gets a second
// round. 16 pages of cache: faults at 10 and 50 fill it, the fault at 80 reclaims 8 from
// the oldest end: 6..9 and 11..13 (never touched), then 46; 10 was touched and survives.
TEST(PageCache, UntouchedReadaheadGoesBeforeTouchedPages) {
    MappedFileCache cache({100 * kPage}, 16 * kPage, kPage, 8 * kPage);
    EXPECT_EQ(cache.touch(0, 10 * kPage, 1).read_bytes, 8 * kPage);
    EXPECT_EQ(cache.touch(0, 50 * kPage, 1).read_bytes, 8 * kPage);
    EXPECT_EQ(cache.touch(0, 80 * kPage, 1).read_bytes, 8 * kPage);
    EXPECT_EQ(cache.touch(0, 10 * kPage, 1).faults, 0u);
    EXPECT_EQ(cache.touch(0, 47 * kPage, 1).faults, 0u);
    const MappedFileCache::Touch t = cache.touch(0, 46 * kPage, 1);
    EXPECT_EQ(t.faults, 1u);
    EXPECT_EQ(t.read_bytes, 5 * kPage);   // window 42..49: 42..46 were not cached
}

// The cache counts bytes, not units: 60 + 50 bytes pass a capacity of 100, and reclaim
// takes the 60 (its accessed bit gives it one round, then it is the oldest not in use).
TEST(PageCache, CountsBytesNotUnits) {
    PageCacheModel cache(100, 1);
    const uint32_t big = cache.add_unit(60), small = cache.add_unit(50);
    EXPECT_EQ(cache.access({&big, 1}), 60u);
    EXPECT_EQ(cache.access({&small, 1}), 50u);
    EXPECT_EQ(cache.used(), 50u);
    EXPECT_FALSE(cache.resident(big));
    EXPECT_TRUE(cache.resident(small));
}

} // namespace
} // namespace moeprune
