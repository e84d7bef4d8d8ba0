// The worker's one monotonic clock, read as integers: for timestamps kept in atomics and compared
// across threads (when a boundary went out, when a link last spoke, how long slots were calm).
#pragma once

#include <chrono>
#include <cstdint>

namespace dgr::worker {

inline int64_t steady_ns() {
    return (int64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

inline int64_t steady_ms() { return steady_ns() / 1000000; }

}  // namespace dgr::worker
