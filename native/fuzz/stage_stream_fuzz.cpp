// libFuzzer harness over the data plane as a stage after the head reads it: bytes as they come
// off a peer's data stream, after the magic the listener takes, into a middle stage and into the
// tail (ShardService::serve_data over a socket pair: the HELLO check, the FORWARD frame reader, validation, the engine, the tail's
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
#include "fuzz_support.h"
#include "service.h"
#include "wire.h"

#include <memory>
#include <string>
#include <vector>

namespace {

using dgr::fuzz::frame;

std::vector<std::unique_ptr<dgr::worker::ShardService>> g_stages;  // a middle stage and the tail

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    dgr::worker::PeerOptions peers;
    peers.admit = [](const std::string & address) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fuzzing: no link to " + address.substr(0, 64));
    };
    g_stages = dgr::fuzz::open_stages("dgr-fuzz-stage-stream", 1, peers);  // every stage after the head
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string bytes((const char *) data, size);
    // what follows the magic, which the listener takes before serve_data sees the stream
    const std::string hello =
        frame(dgr::v1::DATA_FRAME_HELLO, dgr::worker::make_hello(dgr::v1::DATA_STREAM_FORWARD, "").SerializeAsString());
    const size_t cut = size > 0 ? data[0] % (size + 1) : 0;
    for (auto & stage : g_stages) {
        dgr::fuzz::serve_stream(*stage, bytes);
        dgr::fuzz::serve_stream(*stage, hello + frame(dgr::v1::DATA_FRAME_REQUEST, bytes));
        dgr::fuzz::serve_stream(*stage, hello + frame(dgr::v1::DATA_FRAME_REQUEST, bytes.substr(0, cut)) +
                                frame(dgr::v1::DATA_FRAME_REQUEST, bytes.substr(cut)));
    }
    for (size_t i = 0; i < g_stages.size(); ++i) {
        const auto & e = g_stages[i]->engine();
        if (e.session_count() != 0) {
            dgr::fuzz::invariant("dgr-fuzz-stage-stream", "session_count", i + 1, (uint32_t) e.session_count());
        }
    }
    dgr::v1::ForwardRequest req;
    return req.ParseFromArray(data, (int) size) ? 0 : -1;  // keep non-messages out of the corpus
}
