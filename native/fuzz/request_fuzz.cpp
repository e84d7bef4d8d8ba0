// libFuzzer harness over a worker's request path: bytes as they come off the wire, parsed as a
// dgr.v1.ForwardRequest and handed to ShardService::compute, which validates and decodes them
// (validate.cpp), computes them on the engine (boundary decode included) and, at the tail, verifies
// and samples (verify.cpp, sampling.cpp). Each input goes to a head, a middle stage and a tail of a small random-weight
// model ($DGR_FUZZ_MODEL, its layers split at $DGR_FUZZ_SPLIT, default "0:3,3:6,6:8").
//
// Beyond ASan/UBSan findings, the harness checks the invariant a refused request must keep: after
// every input (its sessions closed), no stage holds a session or an in-flight counter.
//
// An input whose session id is odd gets its boundary's CRC-32 made right, so that mutated payloads
// (NaN, infinities, any value) reach the engine instead of stopping at the checksum.
//
// The same bytes also go to the worker's TokenizerService (tokenizer.cpp) as a DetokenizeRequest,
// a TokenizeRequest and a ChatTemplateRequest: ids outside the vocabulary, any text, any roles.
//
// And they go to the head as data streams (datalink.cpp, ShardService::serve_data), through a
// socket pair: once as they are (frame headers, HELLO, any frame kind), and once framed as a
// HELLO (FORWARD or LOOP, by the first byte) and a REQUEST or REPLY carrying them. The head takes
// no FORWARD data stream and holds no session to loop a token into, so no link to a peer opens.
#include "datalink.h"
#include "fuzz_support.h"
#include "service.h"
#include "tokenizer.h"
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

using dgr::fuzz::frame;

std::vector<std::unique_ptr<dgr::worker::ShardService>> g_stages;
std::unique_ptr<dgr::worker::TokenizerService> g_tokenizer;

void tokenizer_requests(const uint8_t * data, size_t size) {
    dgr::v1::DetokenizeRequest detok;
    if (detok.ParseFromArray(data, (int) size)) {
        dgr::v1::DetokenizeReply reply;
        g_tokenizer->detokenize(detok, &reply);
    }
    dgr::v1::TokenizeRequest tok;
    if (tok.ParseFromArray(data, (int) size)) {
        dgr::v1::TokenizeReply reply;
        g_tokenizer->tokenize(tok, &reply);
    }
    dgr::v1::ChatTemplateRequest chat;
    if (chat.ParseFromArray(data, (int) size)) {
        dgr::v1::ChatTemplateReply reply;
        g_tokenizer->chat_template(chat, &reply);
    }
}

void data_streams(const uint8_t * data, size_t size) {
    const std::string bytes((const char *) data, size);
    dgr::fuzz::serve_stream(*g_stages.front(), bytes);
    dgr::v1::DataHello hello;
    const bool loop = size > 0 && (data[0] & 1);
    hello.set_stream(loop ? dgr::v1::DATA_STREAM_LOOP : dgr::v1::DATA_STREAM_FORWARD);
    dgr::fuzz::serve_stream(*g_stages.front(),
                            frame(dgr::v1::DATA_FRAME_HELLO, hello.SerializeAsString()) +
                                frame(loop ? dgr::v1::DATA_FRAME_REPLY : dgr::v1::DATA_FRAME_REQUEST, bytes));
}

[[noreturn]] void invariant(const char * what, size_t stage, uint32_t value) {
    dgr::fuzz::invariant("dgr-fuzz-request", what, stage, value);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    g_stages = dgr::fuzz::open_stages("dgr-fuzz-request", 0, dgr::worker::PeerOptions{});
    g_tokenizer = std::make_unique<dgr::worker::TokenizerService>(
        g_stages.front()->engine(), [](grpc::ServerContext *) { return grpc::Status::OK; });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    tokenizer_requests(data, size);
    data_streams(data, size);
    dgr::v1::ForwardRequest req;
    if (!req.ParseFromArray(data, (int) size)) return -1;  // not a message: keep it out of the corpus
    if (req.has_boundary() && (req.session_id() & 1)) {
        const std::string & payload = req.boundary().payload();
        req.mutable_boundary()->set_crc32(dgr::worker::crc32_of(payload.data(), payload.size()));
    }
    for (size_t i = 0; i < g_stages.size(); ++i) {
        dgr::worker::ShardService & stage = *g_stages[i];
        dgr::v1::ForwardReply reply;
        if (stage.compute(req, &reply).ok()) {
            grpc::ServerContext ctx;
            dgr::v1::CloseSessionRequest close;
            dgr::v1::CloseSessionReply closed;
            close.set_session_id(req.session_id());
            if (!stage.CloseSession(&ctx, &close, &closed).ok()) invariant("a session it computed and cannot close", i, 1);
        }
        grpc::ServerContext ctx;
        dgr::v1::HealthRequest hreq;
        dgr::v1::HealthReply health;
        stage.Health(&ctx, &hreq, &health);
        if (health.sessions() != 0) invariant("sessions", i, health.sessions());
        if (health.queue_depth() != 0) invariant("queue_depth", i, health.queue_depth());
    }
    return 0;
}
