// Forward mode's outbound links: a stage streams its output to the next stage (DownstreamLink),
// and the tail returns sampled tokens to the head (LoopLink). Links reach peers with this
// worker's own credentials (TLS/mTLS material and bearer token), over connections of the session's
// own with keepalive, so a peer that vanishes without a reset is noticed.
#pragma once

#include "dgr/v1/shard.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace dgr::worker {

struct PeerOptions {
    std::string ca;            // PEM: verify peers' certificates (TLS when set)
    std::string cert, key;     // PEM: this worker's certificate, presented to peers requiring mTLS
    std::string token;         // bearer token sent to peers (a route shares one)
    uint64_t max_message_bytes = 64ull << 20;
    int keepalive_ms = 10000;  // ping an idle link this often; dead after another half of it
};

// keepalive for every link, client and server side alike (--keepalive-ms): a peer that vanished
// without a reset is noticed within keepalive + keepalive / 2, and its sessions freed
constexpr int kKeepaliveMs = 10000;
inline int keepalive_timeout_ms(int keepalive_ms) { return keepalive_ms / 2; }

// How this worker reaches its peers. Every forward-mode session gets connections of its own
// (a channel per link, no shared subchannel), opened when the session starts so that the
// handshake overlaps the stage's first compute: a connection over a path that died without a
// reset (a blackhole, a half-open NAT entry) then takes one session down with it, not every
// later session routed the same way until keepalive gives up on it.
class Peers {
public:
    explicit Peers(PeerOptions options);
    std::shared_ptr<grpc::Channel> connect(const std::string & address) const;
    void prepare(grpc::ClientContext & ctx) const;  // credentials on a call

private:
    PeerOptions options_;
    std::shared_ptr<grpc::ChannelCredentials> creds_;
};

dgr::v1::StageError stage_error(uint32_t stage, const std::string & address, const grpc::Status & status);

// One forward-mode Forward stream to the next stage. The stage's handler thread writes; a reader
// thread reports a failure once through on_error: an error the next stage relays from further
// down as soon as it arrives, else the next stage named with the status its stream ended with.
class DownstreamLink {
public:
    using OnError = std::function<void(const dgr::v1::StageError &)>;
    DownstreamLink(Peers & peers, const std::string & address, uint32_t stage, OnError on_error);
    ~DownstreamLink();  // half-close, wait briefly for the peer to finish, then cancel
    DownstreamLink(const DownstreamLink &) = delete;
    DownstreamLink & operator=(const DownstreamLink &) = delete;

    bool write(const dgr::v1::ForwardRequest & request);  // false: broken (on_error reports it)

private:
    void read_until_end();

    std::string address_;
    uint32_t stage_;
    OnError on_error_;
    grpc::ClientContext ctx_;
    std::unique_ptr<dgr::v1::ShardService::Stub> stub_;
    std::unique_ptr<grpc::ClientReaderWriter<dgr::v1::ForwardRequest, dgr::v1::ForwardReply>> stream_;
    std::mutex mutex_;  // Write, WritesDone and Finish never overlap
    std::condition_variable ended_cv_;
    bool ended_ = false, closing_ = false;
    std::thread reader_;
};

// The tail's stream of sampled tokens back to the head (ShardService.Loop), for one session.
class LoopLink {
public:
    LoopLink(Peers & peers, const std::string & address);
    ~LoopLink();
    LoopLink(const LoopLink &) = delete;
    LoopLink & operator=(const LoopLink &) = delete;

    bool write(const dgr::v1::ForwardReply & token);

private:
    grpc::ClientContext ctx_;
    dgr::v1::LoopReply reply_;
    std::unique_ptr<dgr::v1::ShardService::Stub> stub_;
    std::unique_ptr<grpc::ClientWriter<dgr::v1::ForwardReply>> writer_;
};

}  // namespace dgr::worker
