// Writes that either put every byte on a file descriptor or say why not: short writes are
// continued and EINTR retried, so callers keep one error (errno) per failed write.
#pragma once

#include <cstddef>

namespace sp::runtime {

// 0 when all `size` bytes were written, else the errno of the write that failed (ENOSPC for
// a write that wrote nothing without an error).
int write_all(int fd, const void* data, std::size_t size);

}  // namespace sp::runtime
