// Forward mode's outbound links: a stage streams its output to the next stage (Downstream), and
// the tail returns sampled tokens to the head (TokenReturn). Links reach peers with this worker's
// own credentials (TLS/mTLS material and bearer token), over connections of the session's own
// with keepalive, so a peer that vanishes without a reset is noticed. Between plaintext workers
// they are data streams (datalink.h), read by the thread that computes; with TLS, gRPC calls.
#pragma once

#include "datalink.h"
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
    // TLS to every peer: set where the worker serves TLS itself (--tls-cert) or was given a CA for
    // its peers. A worker that has TLS speaks nothing else to its peers, verifying them with `ca`,
    // or with the system's trust store where `ca` is empty
    bool tls = false;
    std::string ca;            // PEM: verify peers' certificates
    std::string cert, key;     // PEM: this worker's certificate, presented to peers requiring mTLS
    // bearer token sent to peers (a route shares one): only over TLS, or in clear to a peer on
    // this host's loopback; a link that would carry it in clear off the host is refused
    std::string token;
    uint64_t max_message_bytes = 64ull << 20;
    int keepalive_ms = 10000;  // ping an idle link this often; dead after another half of it
    bool data_links = true;    // plaintext peers: data streams (datalink.h); false: gRPC calls
    // a check of every peer address before a link to it opens, after the rules above (empty:
    // none). The fuzz harnesses refuse every address, so that no input opens a connection
    std::function<grpc::Status(const std::string & address)> admit;
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
class Downstream;
class TokenReturn;

class Peers {
public:
    using OnError = std::function<void(const dgr::v1::StageError &)>;
    explicit Peers(PeerOptions options);
    std::shared_ptr<grpc::Channel> connect(const std::string & address) const;
    void prepare(grpc::ClientContext & ctx) const;  // credentials on a call
    const PeerOptions & options() const { return options_; }
    bool data_links() const { return options_.data_links && !options_.tls; }
    // OK, or why a link to `address` may not be opened: the token would cross it in clear
    grpc::Status check_link(const std::string & address) const;

    // the link to the next stage (index `stage`) and the tail's link back to the head; a broken
    // link is reported once through on_error, naming the stage it leads to
    std::unique_ptr<Downstream> downstream(const std::string & address, uint32_t stage, OnError on_error);
    std::unique_ptr<TokenReturn> token_return(const std::string & address, OnError on_error);

private:
    PeerOptions options_;
    std::shared_ptr<grpc::ChannelCredentials> creds_;
};

dgr::v1::StageError stage_error(uint32_t stage, const std::string & address, const grpc::Status & status);

// A StageError relayed from further down the route, as it goes on upstream: a code that is not a
// gRPC error becomes UNKNOWN (saying which it was), message and address bounded
dgr::v1::StageError relayed_error(dgr::v1::StageError e);

// The connecting side's reader of a data stream (DataLink): errors the stage relays from further
// down come as REPLY frames, each handed to on_relayed; the stream ends with END. Returns the
// status it ended with (never OK: a link the stage ended is over), bytes off the wire checked
// (an END whose code is not a gRPC status is UNAVAILABLE saying so).
grpc::Status read_stage_stream(FrameConn & conn, const std::function<void(const dgr::v1::StageError &)> & on_relayed);

// whether every address HOST:PORT resolves to is this host's loopback (unix sockets count)
bool loopback_address(const std::string & address);

// Forward mode's link to the next stage. The stage's thread writes; a failure is reported once
// through on_error: an error the next stage relays from further down as soon as it arrives, else
// the next stage named with the status its stream ended with. Closing half-closes, waits briefly
// for the next stage to finish (it frees the session first), then cancels.
class Downstream {
public:
    virtual ~Downstream() = default;
    virtual bool write(const dgr::v1::ForwardRequest & request) = 0;  // false: broken (on_error reports it)
};

// The tail's stream of sampled tokens back to the head, for one session.
class TokenReturn {
public:
    virtual ~TokenReturn() = default;
    virtual bool write(const dgr::v1::ForwardReply & token) = 0;
};

// A Forward call to the next stage.
class DownstreamLink final : public Downstream {
public:
    using OnError = Peers::OnError;
    DownstreamLink(Peers & peers, const std::string & address, uint32_t stage, OnError on_error);
    ~DownstreamLink() override;
    DownstreamLink(const DownstreamLink &) = delete;
    DownstreamLink & operator=(const DownstreamLink &) = delete;

    bool write(const dgr::v1::ForwardRequest & request) override;

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

// A ShardService.Loop call to the head.
class LoopLink final : public TokenReturn {
public:
    LoopLink(Peers & peers, const std::string & address);
    ~LoopLink() override;
    LoopLink(const LoopLink &) = delete;
    LoopLink & operator=(const LoopLink &) = delete;

    bool write(const dgr::v1::ForwardReply & token) override;

private:
    grpc::ClientContext ctx_;
    dgr::v1::LoopReply reply_;
    std::unique_ptr<dgr::v1::ShardService::Stub> stub_;
    std::unique_ptr<grpc::ClientWriter<dgr::v1::ForwardReply>> writer_;
};

// A data stream to the next stage (FORWARD) or to the head (LOOP). It connects on a thread of its
// own, which then reads what comes back, so that connecting overlaps the stage's compute; the
// first write waits for it.
class DataLink final : public Downstream, public TokenReturn {
public:
    DataLink(Peers & peers, const std::string & address, dgr::v1::DataStream kind, uint32_t stage,
             Peers::OnError on_error);
    ~DataLink() override;
    DataLink(const DataLink &) = delete;
    DataLink & operator=(const DataLink &) = delete;

    bool write(const dgr::v1::ForwardRequest & request) override;
    bool write(const dgr::v1::ForwardReply & token) override;

private:
    bool send(dgr::v1::DataFrame kind, const google::protobuf::MessageLite & message);
    void run(dgr::v1::DataHello hello);
    bool first_report();  // true once, unless the link is closing: the one failure on_error hears
    void report(const grpc::Status & status);

    const PeerOptions options_;
    const std::string address_;
    const dgr::v1::DataStream kind_;
    const uint32_t stage_;
    Peers::OnError on_error_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::shared_ptr<FrameConn> conn_;
    bool connected_ = false, ended_ = false, closing_ = false, reported_ = false;
    std::thread reader_;
};

}  // namespace dgr::worker
