// libFuzzer harness over the data plane as a stage after the head reads it: bytes as they come
// off a peer's data stream into a middle stage and into the tail (ShardService::serve_data over a
// socket pair: the HELLO check, the FORWARD frame reader, validation, the engine, the tail's
// verification and sampling, the relay of errors upstream). Each input goes in as it is (magic,
// frame headers, HELLO and frames of any kind) and framed as a valid HELLO followed by REQUEST
// frames carrying it (whole, and cut in two at the position its first byte names), so that the
// mutations reach past the opening.
//
// The stages run a small random-weight model ($DGR_FUZZ_MODEL, layers split at
// $DGR_FUZZ_SPLIT) and may reach no peer: every link is refused before it opens (PeerOptions
// admit), which sends the error upstream as a real failure would. After each input no stage holds
// a session or an in-flight counter.
#include "datalink.h"
#include "service.h"
#include "wire.h"

#include "llama.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::unique_ptr<dgr::worker::ShardService>> g_stages;  // a middle stage and the tail

std::string frame(dgr::v1::DataFrame kind, const std::string & payload) {
    std::string f(dgr::worker::kFrameHeader, '\0');
    for (int i = 0; i < 4; ++i) f[(size_t) i] = (char) ((payload.size() >> (8 * i)) & 0xff);
    f[4] = (char) kind;
    return f + payload;
}

// `bytes` as the whole of a data stream into `stage`, served to its end; what the stage writes
// back is drained so that it never blocks on a full socket
void data_stream(dgr::worker::ShardService & stage, const std::string & bytes) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
    const int buffer = 4 << 20;
    for (int fd : fds) {
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
    }
    if (write(fds[0], bytes.data(), bytes.size()) != (ssize_t) bytes.size()) std::abort();
    shutdown(fds[0], SHUT_WR);
    auto conn = std::make_shared<dgr::worker::FrameConn>(fds[1], 1000, 1 << 20);  // owns fds[1]
    stage.serve_data(conn);
    conn.reset();
    close(fds[0]);
}

void quiet(ggml_log_level, const char *, void *) {}

[[noreturn]] void invariant(const char * what, size_t stage, uint32_t value) {
    std::fprintf(stderr, "dgr-fuzz-stage-stream: stage %zu: %s is %u after the input (must be 0)\n", stage, what, value);
    std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    const char * model = std::getenv("DGR_FUZZ_MODEL");
    if (model == nullptr) {
        std::fprintf(stderr, "dgr-fuzz-stage-stream: set DGR_FUZZ_MODEL to a GGUF (nox -s fuzz does)\n");
        std::abort();
    }
    const char * split = std::getenv("DGR_FUZZ_SPLIT");
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    std::stringstream ranges(split ? split : "0:3,3:6,6:8");
    std::string range;
    std::vector<std::string> all;
    while (std::getline(ranges, range, ',')) all.push_back(range);
    for (size_t i = 1; i < all.size(); ++i) {  // every stage after the head
        dgr::EngineOptions o;
        o.model_path = model;
        o.layer_first = std::stoi(all[i].substr(0, all[i].find(':')));
        o.layer_last = std::stoi(all[i].substr(all[i].find(':') + 1));
        o.n_threads = 1;
        o.n_ctx = 64;
        o.n_batch = 32;
        o.max_sessions = 2;
        dgr::worker::ServiceOptions so;
        so.max_batch = 4;
        dgr::worker::PeerOptions peers;
        peers.admit = [](const std::string & address) {
            return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fuzzing: no link to " + address.substr(0, 64));
        };
        g_stages.push_back(std::make_unique<dgr::worker::ShardService>(dgr::ShardEngine::open(o), so, peers));
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string bytes((const char *) data, size);
    const std::string hello = std::string(dgr::worker::kDataMagic, sizeof(dgr::worker::kDataMagic)) +
                              frame(dgr::v1::DATA_FRAME_HELLO,
                                    dgr::worker::make_hello(dgr::v1::DATA_STREAM_FORWARD, "").SerializeAsString());
    const size_t cut = size > 0 ? data[0] % (size + 1) : 0;
    for (auto & stage : g_stages) {
        data_stream(*stage, bytes);
        data_stream(*stage, hello + frame(dgr::v1::DATA_FRAME_REQUEST, bytes));
        data_stream(*stage, hello + frame(dgr::v1::DATA_FRAME_REQUEST, bytes.substr(0, cut)) +
                                frame(dgr::v1::DATA_FRAME_REQUEST, bytes.substr(cut)));
    }
    for (size_t i = 0; i < g_stages.size(); ++i) {
        const auto & e = g_stages[i]->engine();
        if (e.session_count() != 0) invariant("session_count", i + 1, (uint32_t) e.session_count());
    }
    dgr::v1::ForwardRequest req;
    return req.ParseFromArray(data, (int) size) ? 0 : -1;  // keep non-messages out of the corpus
}
