#include "core/file_io.h"
#include "core/errors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

namespace moeprune {

namespace fs = std::filesystem;

static std::string errno_text() { return std::strerror(errno); }

File File::open_read(const fs::path & path) {
    // Checked before opening: opening a FIFO for reading blocks until a writer appears.
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        fail_file(path.string(), "not a regular file (a directory, FIFO or device cannot be read as an input)");
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fail_file(path.string(), "cannot open for reading: " + errno_text());
    }
    return File(fd, path);
}

File File::create_new(const fs::path & path) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        fail_file(path.string(), "cannot create: " + errno_text());
    }
    return File(fd, path);
}

File::File(File && other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), kernel_copy_(other.kernel_copy_) {}

File & File::operator=(File && other) noexcept {
    if (this != &other) {
        if (fd_ >= 0) {
            ::close(fd_);
        }
        fd_ = std::exchange(other.fd_, -1);
        path_ = std::move(other.path_);
        kernel_copy_ = other.kernel_copy_;
    }
    return *this;
}

File::~File() {
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

uint64_t File::size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
        fail_file(path_.string(), "cannot stat: " + errno_text());
    }
    return uint64_t(st.st_size);
}

void File::pread_exact(void * buf, uint64_t n, uint64_t offset) const {
    char * p = static_cast<char *>(buf);
    while (n > 0) {
        const ssize_t got = ::pread(fd_, p, size_t(std::min(n, kMaxIoChunk)), off_t(offset));
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            fail_file(path_.string(), fmt::format("read failed at offset {}: {}", offset, errno_text()));
        }
        if (got == 0) {
            fail_file(path_.string(), fmt::format("ends at offset {} where {} more bytes were expected (truncated file?)",
                                                  offset, n));
        }
        p += got;
        n -= uint64_t(got);
        offset += uint64_t(got);
    }
}

void File::pwrite_all(const void * buf, uint64_t n, uint64_t offset) {
    const char * p = static_cast<const char *>(buf);
    while (n > 0) {
        const ssize_t put = ::pwrite(fd_, p, size_t(std::min(n, kMaxIoChunk)), off_t(offset));
        if (put < 0) {
            if (errno == EINTR) {
                continue;
            }
            fail_file(path_.string(), fmt::format("write failed at offset {}: {}", offset, errno_text()));
        }
        if (put == 0) {
            fail_file(path_.string(), fmt::format("write made no progress at offset {}", offset));
        }
        p += put;
        n -= uint64_t(put);
        offset += uint64_t(put);
    }
}

void File::truncate(uint64_t size) {
    if (::ftruncate(fd_, off_t(size)) != 0) {
        fail_file(path_.string(), fmt::format("cannot set the size to {} bytes: {}", size, errno_text()));
    }
}

void File::sync() {
    if (::fsync(fd_) != 0) {
        fail_file(path_.string(), "fsync failed: " + errno_text());
    }
}

void File::write_back(uint64_t offset, uint64_t n, bool wait) {
    const unsigned flags = wait ? SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
                                : SYNC_FILE_RANGE_WRITE;
    // A failure here (a file system without the call, an I/O error) resurfaces in sync().
    (void) ::sync_file_range(fd_, off64_t(offset), off64_t(n), flags);
}

void File::copy_from(const File & src, uint64_t src_offset, uint64_t dst_offset, uint64_t n,
                     std::vector<char> & buffer) {
    while (n > 0 && kernel_copy_) {
        loff_t in = loff_t(src_offset), out = loff_t(dst_offset);
        const ssize_t moved = ::copy_file_range(src.fd_, &in, fd_, &out, size_t(std::min(n, kMaxIoChunk)), 0);
        if (moved < 0) {
            if (errno == EINTR) {
                continue;
            }
            // Not every pair of file systems supports in-kernel copies: fall back to a buffer.
            if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
                kernel_copy_ = false;
                break;
            }
            fail_file(path_.string(), fmt::format("write failed at offset {} (copying from {}): {}", dst_offset,
                                                  src.path_.string(), errno_text()));
        }
        if (moved == 0) {
            fail_file(src.path_.string(), fmt::format("ends at offset {} where {} more bytes were expected (truncated file?)",
                                                      src_offset, n));
        }
        src_offset += uint64_t(moved);
        dst_offset += uint64_t(moved);
        n -= uint64_t(moved);
    }
    if (n > 0 && buffer.empty()) {
        buffer.resize(size_t(8) << 20);
    }
    while (n > 0) {
        const uint64_t step = std::min<uint64_t>(n, buffer.size());
        src.pread_exact(buffer.data(), step, src_offset);
        pwrite_all(buffer.data(), step, dst_offset);
        src_offset += step;
        dst_offset += step;
        n -= step;
    }
}

} // namespace moeprune
