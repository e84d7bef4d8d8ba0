// Shared helpers of the worker's unit tests.
#pragma once

#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>

namespace dgr::test {

// the model the engine-backed tests load (nox -s test-native sets DGR_TEST_MODEL)
inline std::string model_path() {
    const char * p = std::getenv("DGR_TEST_MODEL");
    REQUIRE_MESSAGE(p != nullptr, "DGR_TEST_MODEL must name a GGUF (nox -s test-native sets it)");
    return p;
}

// a connected pair of stream sockets: (ours, theirs)
inline std::pair<int, int> socket_pair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
    return {fds[0], fds[1]};
}

inline void write_all(int fd, const std::string & bytes) {
    size_t at = 0;
    while (at < bytes.size()) {
        const ssize_t w = ::write(fd, bytes.data() + at, bytes.size() - at);
        REQUIRE(w > 0);
        at += (size_t) w;
    }
}

// a frame as the data plane writes it: uint32 little-endian length, kind byte, payload
inline std::string frame(int kind, const std::string & payload) {
    std::string f(5, '\0');
    const uint32_t n = (uint32_t) payload.size();
    for (int i = 0; i < 4; ++i) f[(size_t) i] = (char) ((n >> (8 * i)) & 0xff);
    f[4] = (char) kind;
    return f + payload;
}

}  // namespace dgr::test
