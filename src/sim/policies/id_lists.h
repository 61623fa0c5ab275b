#pragma once
// Intrusive lists over expert ids and chosen-expert marks, shared by the list-based
// policies (slru, arc, s3fifo).
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace moeprune::policies {

// Several FIFO/recency lists over expert ids, each id in at most one of them, as one
// set of intrusive links (list i's sentinel is node n_expert + i). Front = oldest.
class IdLists {
public:
    static constexpr int8_t kNone = -1;
    IdLists(int n_expert, int n_lists)
        : n_expert_(n_expert), prev_(size_t(n_expert + n_lists)), next_(size_t(n_expert + n_lists)),
          where_(size_t(n_expert), kNone), size_(size_t(n_lists), 0) {
        clear();
    }
    void clear() {
        for (size_t i = 0; i < size_.size(); ++i) {
            const int32_t s = sentinel(int(i));
            prev_[size_t(s)] = next_[size_t(s)] = s;
            size_[i] = 0;
        }
        std::fill(where_.begin(), where_.end(), kNone);
    }
    int8_t where(int32_t e) const { return where_[size_t(e)]; }
    int size(int list) const { return size_[size_t(list)]; }
    void push_back(int list, int32_t e) {
        const int32_t s = sentinel(list), last = prev_[size_t(s)];
        prev_[size_t(e)] = last;
        next_[size_t(e)] = s;
        next_[size_t(last)] = e;
        prev_[size_t(s)] = e;
        where_[size_t(e)] = int8_t(list);
        ++size_[size_t(list)];
    }
    void remove(int32_t e) {
        next_[size_t(prev_[size_t(e)])] = next_[size_t(e)];
        prev_[size_t(next_[size_t(e)])] = prev_[size_t(e)];
        --size_[size_t(where_[size_t(e)])];
        where_[size_t(e)] = kNone;
    }
    void move_back(int list, int32_t e) {
        remove(e);
        push_back(list, e);
    }
    // The oldest member for which skip(e) is false, or -1. `skip` by reference: a
    // ChosenMarks holds one mark per id, and copying it would cost every request O(ids).
    template <class Skip> int32_t oldest(int list, const Skip & skip) const {
        const int32_t s = sentinel(list);
        for (int32_t e = next_[size_t(s)]; e != s; e = next_[size_t(e)]) {
            if (!skip(e)) {
                return e;
            }
        }
        return -1;
    }
    int32_t oldest(int list) const {
        return oldest(list, [](int32_t) { return false; });
    }
private:
    int32_t sentinel(int list) const { return n_expert_ + list; }
    int n_expert_;
    std::vector<int32_t> prev_, next_;
    std::vector<int8_t> where_;
    std::vector<int> size_;
};

// Marks the chosen experts of the current request so list walks can pass them over.
class ChosenMarks {
public:
    explicit ChosenMarks(int n_expert) : at_(size_t(n_expert), 0) {}
    // One mark per id: a copy per request would cost O(ids), so none is allowed.
    ChosenMarks(const ChosenMarks &) = delete;
    ChosenMarks & operator=(const ChosenMarks &) = delete;
    void mark(std::span<const int32_t> chosen) {
        ++now_;
        for (int32_t e : chosen) {
            at_[size_t(e)] = now_;
        }
    }
    bool operator()(int32_t e) const { return at_[size_t(e)] == now_; }
private:
    uint64_t now_ = 0;
    std::vector<uint64_t> at_;
};

} // namespace moeprune::policies
