// Shared helpers of the worker's unit tests.
#pragma once

#include "datalink.h"

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

// a frame as the data plane writes it (any kind byte, so that the tests can write unknown ones)
inline std::string frame(int kind, const std::string & payload) {
    return dgr::worker::encode_frame((dgr::v1::DataFrame) kind, payload);
}

}  // namespace dgr::test
