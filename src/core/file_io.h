#pragma once
// Checked file I/O for large model files. Every short read or write and every
// errno is turned into an error naming the file; no single system call moves
// more than kMaxIoChunk bytes, since Linux caps one read/write near 2 GiB and
// other systems reject larger requests outright.
#include <cstdint>
#include <filesystem>
#include <vector>

namespace moeprune {

constexpr uint64_t kMaxIoChunk = uint64_t(1) << 30;

class File {
public:
    static File open_read(const std::filesystem::path & path);
    // Creates a new file; refuses to replace one that exists.
    static File create_new(const std::filesystem::path & path);
    File(File && other) noexcept;
    File & operator=(File && other) noexcept;
    File(const File &) = delete;
    File & operator=(const File &) = delete;
    ~File();

    const std::filesystem::path & path() const { return path_; }
    uint64_t size() const;

    // Reads exactly n bytes at offset; hitting the end first is an error ("truncated").
    void pread_exact(void * buf, uint64_t n, uint64_t offset) const;
    void pwrite_all(const void * buf, uint64_t n, uint64_t offset);
    void truncate(uint64_t size);
    void sync();
    // Starts writing [offset, offset + n) to the device (sync_file_range); with `wait`,
    // also waits until it is written. Only a head start for sync(), which stays the one
    // durability point and the one place write errors are reported.
    void write_back(uint64_t offset, uint64_t n, bool wait);

    // Copies n bytes of src at src_offset to this file at dst_offset, in the kernel
    // (copy_file_range) where it can, else through `buffer` (sized on first need), which
    // bounds memory.
    void copy_from(const File & src, uint64_t src_offset, uint64_t dst_offset, uint64_t n,
                   std::vector<char> & buffer);

private:
    File(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
    int fd_ = -1;
    std::filesystem::path path_;
    bool kernel_copy_ = true;
};

} // namespace moeprune
