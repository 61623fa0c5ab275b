#pragma once
// Little-endian fields of moeprune's binary formats, appended to and read from byte buffers
// (the formats are defined little-endian and moeprune runs on little-endian machines).
#include <cstdint>
#include <cstring>
#include <vector>

namespace moeprune {

template <typename T> void put_bytes(std::vector<uint8_t> & buf, T v) {
    const auto * p = reinterpret_cast<const uint8_t *>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
}

template <typename T> T get_bytes(const uint8_t * p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

} // namespace moeprune
