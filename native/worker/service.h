// dgr.v1.ShardService over one ShardEngine.
//
// Relay mode (a ForwardRequest without `route`): each request yields one reply to its sender, in
// order; the coordinator carries boundaries from stage to stage.
//
// Forward mode (`route` set; one session per stream): a stage computes each request and writes
// its boundary straight to the next stage; the tail samples and returns the token to the head
// over ShardService.Loop; the head streams every token to the coordinator and, until max_tokens
// or a stop id, computes the next decode step itself. A failure anywhere is relayed back up as a
// StageError naming the stage, and ends the coordinator's stream with that status.
//
// Every request is validated before the engine sees it (validate.h). Counters and session slots
// are held by RAII guards, so every path releases them.
#pragma once

#include "batcher.h"
#include "convoy.h"
#include "drafting.h"
#include "metrics.h"
#include "dgr/shard_engine.h"
#include "dgr/v1/shard.grpc.pb.h"
#include "forwarding.h"
#include "verify.h"

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace dgr::worker {

struct ServiceOptions {
    std::string fingerprint;  // of the GGUF, given by the launcher; the build's identity is compiled in
    std::string recipe;  // id of the recipe served (checked against the manifest by the launcher)
    std::string model_name;  // the GGUF's file name less .gguf (Describe: a client's name for the model)
    std::string token;  // bearer token every ShardService call must carry (empty: none)
    uint64_t max_message_bytes = 64ull << 20;
    int max_queue = 16;  // forwards that may wait behind the one computing; more are refused
    int max_batch = 16;  // sessions' decode steps computed in one llama_decode (1: FIFO turns)
    int gather_us = 5000;  // how long a decode step that arrived in a cohort waits for the rest (batcher.h)
    // the head: its sessions travel apart where the links take much more than the stages'
    // compute (convoy.h); false: always as a convoy (within the gather window)
    bool convoy_auto = true;
    std::string compute_slots_dir;  // shared by the host's workers (empty: no slots)
    int compute_slots = 1;
    int pin_threads = 0;  // > 1: each forward's threads on its slot's cores; > 0: settle (slots.h)
    // the head, forward mode: a drafted step of more rows than this travels in parts of about this
    // many rows, which the stages pipeline (verify.h; 0: drafted steps travel whole)
    int draft_part_rows = 2;
};

struct HeadFlow;

// Where a stage after the head reads its forward-mode requests and writes its error replies
// upstream: a gRPC Forward call, or a data stream (datalink.h).
class Upstream {
public:
    virtual ~Upstream() = default;
    virtual bool read(dgr::v1::ForwardRequest * request) = 0;  // false: the stream ended
    virtual bool write(const dgr::v1::ForwardReply & reply) = 0;
};

class GrpcUpstream final : public Upstream {
public:
    using Stream = grpc::ServerReaderWriter<dgr::v1::ForwardReply, dgr::v1::ForwardRequest>;
    explicit GrpcUpstream(Stream * stream) : stream_(stream) {}
    bool read(dgr::v1::ForwardRequest * request) override { return stream_->Read(request); }
    bool write(const dgr::v1::ForwardReply & reply) override { return stream_->Write(reply); }

private:
    Stream * stream_;
};

class DataUpstream final : public Upstream {
public:
    explicit DataUpstream(FrameConn & conn) : conn_(conn) {}
    bool read(dgr::v1::ForwardRequest * request) override { return next(dgr::v1::DATA_FRAME_REQUEST, request); }
    bool read_reply(dgr::v1::ForwardReply * reply) { return next(dgr::v1::DATA_FRAME_REPLY, reply); }
    bool write(const dgr::v1::ForwardReply & reply) override { return conn_.send(dgr::v1::DATA_FRAME_REPLY, &reply); }
    FrameConn & conn() { return conn_; }
    // why reading stopped, when it was not the peer closing the stream (a malformed frame, a
    // silent peer)
    const grpc::Status & failure() const { return failure_; }

private:
    bool next(dgr::v1::DataFrame kind, google::protobuf::MessageLite * message) {
        bool ended = false;
        failure_ = conn_.receive_message(kind, message, &ended);
        return failure_.ok() && !ended;
    }
    FrameConn & conn_;
    grpc::Status failure_;
};

class ShardService final : public dgr::v1::ShardService::Service {
public:
    ShardService(std::unique_ptr<dgr::ShardEngine> engine, ServiceOptions options, PeerOptions peers);
    ~ShardService() override;

    grpc::Status Describe(grpc::ServerContext * ctx, const dgr::v1::DescribeRequest *, dgr::v1::DescribeReply * reply) override;
    grpc::Status Health(grpc::ServerContext * ctx, const dgr::v1::HealthRequest *, dgr::v1::HealthReply * reply) override;
    grpc::Status CloseSession(grpc::ServerContext * ctx, const dgr::v1::CloseSessionRequest * req, dgr::v1::CloseSessionReply *) override;
    grpc::Status Forward(grpc::ServerContext * ctx,
                         grpc::ServerReaderWriter<dgr::v1::ForwardReply, dgr::v1::ForwardRequest> * stream) override;
    grpc::Status Loop(grpc::ServerContext * ctx, grpc::ServerReader<dgr::v1::ForwardReply> * reader, dgr::v1::LoopReply *) override;

    void set_draining() { draining_.store(true); }

    // a data stream accepted by the worker's Listener (datalink.h), served on the calling thread
    // until it ends
    void serve_data(const std::shared_ptr<FrameConn> & conn);

    // One request through validation, the engine and (at the tail) the sampler, into its reply:
    // what both modes run for every request that arrives. (Public for the fuzz harness, which
    // feeds it bytes as they come off the wire.)
    // (`peers`: see Batcher::run; `check`: at the tail of a forward-mode stream, its verification
    // of drafted steps that come in parts, verify.h; without it each request is a whole step)
    grpc::Status compute(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply, uint32_t peers = 0,
                         StepCheck * check = nullptr);

    // counters and histograms (served at --metrics-listen by main)
    Metrics & metrics() { return metrics_; }

    // the engine, read-only (its vocabulary serves the TokenizerService of the same worker)
    const dgr::ShardEngine & engine() const { return *engine_; }
    // the bearer token check every call of this worker passes (counted as an error when refused)
    grpc::Status authorize(grpc::ServerContext * ctx) const;

private:
    using Stream = grpc::ServerReaderWriter<dgr::v1::ForwardReply, dgr::v1::ForwardRequest>;
    class HeadStream;  // the head's HeadPort over the coordinator's stream (head_session.h)
    grpc::Status compute_one(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply, uint32_t peers,
                             StepCheck & check);
    // the head: sessions whose step left this head after `me`'s, at most the gather window after:
    // their tokens come back that soon after `me`'s, and its next step waits for them
    uint32_t peers_behind(const HeadFlow * me, int64_t sent_ns);
    grpc::Status relay(grpc::ServerContext * ctx, Stream * stream, dgr::v1::ForwardRequest req);
    grpc::Status forward_stage(Upstream & stream, dgr::v1::ForwardRequest req);
    grpc::Status serve_data_stream(DataUpstream & up);
    grpc::Status loop_tokens(const std::function<bool(dgr::v1::ForwardReply *)> & read);
    grpc::Status check_token(const std::string & token) const;  // a data stream's HELLO
    grpc::Status forward_head(grpc::ServerContext * ctx, Stream * stream, dgr::v1::ForwardRequest req);
    void release(uint64_t session, uint64_t epoch);

    std::unique_ptr<dgr::ShardEngine> engine_;
    ServiceOptions options_;
    dgr::Description desc_;
    Peers peers_;
    std::atomic<bool> draining_{false};
    std::atomic<int> in_flight_{0};

    std::mutex mutex_;
    std::map<uint64_t, std::shared_ptr<HeadFlow>> flows_;  // forward-mode sessions this head drives

    ComputeSlots slots_;
    Batcher batcher_;  // turns on the engine, in arrival order; decode steps batched
    ConvoyRules convoy_;  // the head: each route's sessions as a convoy or apart
    DraftCosts draft_costs_;  // speculative decoding: what steps cost per route, across generations
    mutable Metrics metrics_;  // counted from const paths too (a refused authorization)
};

}  // namespace dgr::worker
