#pragma once
// Runs independent work items on a few threads: items are handed out one at a time, so
// uneven items balance, and the first exception stops the rest and is rethrown.
#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moeprune {

// fn(i) for every i in [0, n_items), on up to `threads` threads (0: one per core).
template <class Fn> void run_parallel(size_t n_items, int threads, Fn fn) {
    std::atomic<size_t> next{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    const auto worker = [&] {
        for (size_t i = next++; i < n_items; i = next++) {
            try {
                fn(i);
            } catch (...) {
                std::lock_guard<std::mutex> lock(failure_mutex);
                if (!failure) {
                    failure = std::current_exception();
                }
                next = n_items;
                return;
            }
        }
    };
    const size_t wanted = threads > 0 ? size_t(threads) : size_t(std::max(1u, std::thread::hardware_concurrency()));
    const size_t n_threads = std::max<size_t>(1, std::min(wanted, n_items));
    std::vector<std::thread> pool;
    for (size_t i = 1; i < n_threads; ++i) {
        pool.emplace_back(worker);
    }
    worker();
    for (auto & th : pool) {
        th.join();
    }
    if (failure) {
        std::rethrow_exception(failure);
    }
}

} // namespace moeprune
