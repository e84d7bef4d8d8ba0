// libFuzzer harness over the connecting side of a data stream: what a stage sends back to the
// one that streams to it (DataLink's reader, read_stage_stream in forwarding.h), over a socket
// pair. Each input goes in as it is (frame headers, REPLY and END frames of any content, any
// other kind) and framed as a REPLY carrying it followed by an END carrying it, so that mutated
// messages reach the parsers. The reader must end with a non-OK status, every relayed error a
// gRPC error code and bounded text (relayed_error).
#include "datalink.h"
#include "forwarding.h"
#include "fuzz_support.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using dgr::fuzz::frame;

[[noreturn]] void broken(const char * what) {
    std::fprintf(stderr, "dgr-fuzz-datalink: %s\n", what);
    std::abort();
}

void read_back(const std::string & bytes) {
    int fds[2];
    dgr::fuzz::roomy_pair(fds);
    if (write(fds[0], bytes.data(), bytes.size()) != (ssize_t) bytes.size()) std::abort();
    close(fds[0]);
    dgr::worker::FrameConn conn(fds[1], 1000, 1 << 20);  // owns fds[1]
    const grpc::Status st = dgr::worker::read_stage_stream(conn, [](const dgr::v1::StageError & e) {
        if (e.code() < 1 || e.code() > 16) broken("a relayed error without a gRPC error code");
        if (e.message().size() > 4096 || e.address().size() > 255) broken("a relayed error's text unbounded");
    });
    if (st.ok()) broken("the reader ended with OK");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string bytes((const char *) data, size);
    read_back(bytes);
    read_back(frame(dgr::v1::DATA_FRAME_REPLY, bytes) + frame(dgr::v1::DATA_FRAME_END, bytes));
    dgr::v1::ForwardReply reply;
    return reply.ParseFromArray(data, (int) size) ? 0 : -1;
}
