// What the libFuzzer harnesses share: data-plane frames, a data stream fed to a stage through a
// socket pair, the stages of the fuzz model, and the invariant check's report.
#pragma once

#include "datalink.h"
#include "service.h"

#include "llama.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace dgr::fuzz {

inline std::string frame(dgr::v1::DataFrame kind, const std::string & payload) {
    return dgr::worker::encode_frame(kind, payload);
}

// a connected socket pair whose buffers hold a whole input and what is written back (4 MiB)
inline void roomy_pair(int fds[2]) {
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
    const int buffer = 4 << 20;
    for (int i = 0; i < 2; ++i) {
        setsockopt(fds[i], SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
        setsockopt(fds[i], SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
    }
}

// `bytes` as the whole of a data stream into `stage` (ShardService::serve_data), served to its end
inline void serve_stream(dgr::worker::ShardService & stage, const std::string & bytes) {
    int fds[2];
    roomy_pair(fds);
    if (write(fds[0], bytes.data(), bytes.size()) != (ssize_t) bytes.size()) std::abort();
    shutdown(fds[0], SHUT_WR);
    auto conn = std::make_shared<dgr::worker::FrameConn>(fds[1], 1000, 1 << 20);  // owns fds[1]
    stage.serve_data(conn);
    conn.reset();
    close(fds[0]);
}

[[noreturn]] inline void invariant(const char * harness, const char * what, size_t stage, uint32_t value) {
    std::fprintf(stderr, "%s: stage %zu: %s is %u after the input (must be 0)\n", harness, stage, what, value);
    std::abort();
}

// The stages of $DGR_FUZZ_MODEL split at $DGR_FUZZ_SPLIT (default "0:3,3:6,6:8"), from range
// `first` on, small (1 thread, n_ctx 64, 2 sessions); llama.cpp's log silenced
inline std::vector<std::unique_ptr<dgr::worker::ShardService>> open_stages(const char * harness, size_t first,
                                                                           const dgr::worker::PeerOptions & peers) {
    const char * model = std::getenv("DGR_FUZZ_MODEL");
    if (model == nullptr) {
        std::fprintf(stderr, "%s: set DGR_FUZZ_MODEL to a GGUF (nox -s fuzz does)\n", harness);
        std::abort();
    }
    const char * split = std::getenv("DGR_FUZZ_SPLIT");
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    std::stringstream ranges(split ? split : "0:3,3:6,6:8");
    std::vector<std::unique_ptr<dgr::worker::ShardService>> stages;
    std::string range;
    for (size_t i = 0; std::getline(ranges, range, ','); ++i) {
        if (i < first) continue;
        dgr::EngineOptions o;
        o.model_path = model;
        o.layer_first = std::stoi(range.substr(0, range.find(':')));
        o.layer_last = std::stoi(range.substr(range.find(':') + 1));
        o.n_threads = 1;
        o.n_ctx = 64;
        o.n_batch = 32;
        o.max_sessions = 2;
        dgr::worker::ServiceOptions so;
        so.max_batch = 4;
        stages.push_back(std::make_unique<dgr::worker::ShardService>(dgr::ShardEngine::open(o), so, peers));
    }
    return stages;
}

}  // namespace dgr::fuzz
