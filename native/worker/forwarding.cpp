#include "forwarding.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <optional>

namespace dgr::worker {

namespace {
constexpr auto kCloseGrace = std::chrono::seconds(2);
}

Peers::Peers(PeerOptions options) : options_(std::move(options)) {
    if (!options_.ca.empty()) options_.tls = true;
    if (!options_.tls) {
        creds_ = grpc::InsecureChannelCredentials();
    } else {
        grpc::SslCredentialsOptions ssl;
        ssl.pem_root_certs = options_.ca;  // empty: the system's trust store
        ssl.pem_private_key = options_.key;
        ssl.pem_cert_chain = options_.cert;
        creds_ = grpc::SslCredentials(ssl);
    }
}

std::shared_ptr<grpc::Channel> Peers::connect(const std::string & address) const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize((int) std::min<uint64_t>(options_.max_message_bytes * 2, INT32_MAX));
    args.SetMaxSendMessageSize((int) std::min<uint64_t>(options_.max_message_bytes, INT32_MAX));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, options_.keepalive_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_timeout_ms(options_.keepalive_ms));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    // a connection of its own, not the process-wide subchannel another session may hold
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(address, creds_, args);
}

bool loopback_address(const std::string & address) {
    if (address.rfind("unix:", 0) == 0) return true;
    std::string host, port;
    if (!split_address(address, &host, &port)) return false;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
    bool all = found != nullptr;
    for (addrinfo * ai = found; ai; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            const uint32_t a = ntohl(((const sockaddr_in *) ai->ai_addr)->sin_addr.s_addr);
            all = all && (a >> 24) == 127;
        } else if (ai->ai_family == AF_INET6) {
            all = all && IN6_IS_ADDR_LOOPBACK(&((const sockaddr_in6 *) ai->ai_addr)->sin6_addr);
        } else {
            all = false;
        }
    }
    freeaddrinfo(found);
    return all;
}

grpc::Status Peers::check_link(const std::string & address) const {
    if (options_.admit) {
        if (grpc::Status st = options_.admit(address); !st.ok()) return st;
    }
    if (options_.tls || options_.token.empty() || loopback_address(address)) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "the link to " + address + " is not TLS and leaves this host: the bearer token is "
                        "never sent in clear (start the workers with --tls-cert/--tls-key and --peer-ca)");
}

namespace {

// a link that was refused before any byte went out: its first write reports why, once
class RefusedLink final : public Downstream, public TokenReturn {
public:
    RefusedLink(dgr::v1::StageError error, Peers::OnError on_error) : error_(std::move(error)), on_error_(std::move(on_error)) {}
    bool write(const dgr::v1::ForwardRequest &) override { return refuse(); }
    bool write(const dgr::v1::ForwardReply &) override { return refuse(); }

private:
    bool refuse() {
        if (!reported_.exchange(true)) on_error_(error_);
        return false;
    }
    const dgr::v1::StageError error_;
    Peers::OnError on_error_;
    std::atomic<bool> reported_{false};
};

}  // namespace

void Peers::prepare(grpc::ClientContext & ctx) const {
    if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
}

dgr::v1::StageError stage_error(uint32_t stage, const std::string & address, const grpc::Status & status) {
    dgr::v1::StageError e;
    e.set_stage(stage);
    e.set_address(address);
    e.set_code((int32_t) status.error_code());
    e.set_message(status.error_message());
    return e;
}

dgr::v1::StageError relayed_error(dgr::v1::StageError e) {
    if (e.code() < 1 || e.code() > 16) {
        e.set_message("(the stage sent status code " + std::to_string(e.code()) + ", not a gRPC error) " + e.message());
        e.set_code((int32_t) grpc::StatusCode::UNKNOWN);
    }
    if (e.message().size() > 4096) e.mutable_message()->resize(4096);
    if (e.address().size() > 255) e.mutable_address()->resize(255);
    return e;
}

DownstreamLink::DownstreamLink(Peers & peers, const std::string & address, uint32_t stage, OnError on_error)
    : address_(address), stage_(stage), on_error_(std::move(on_error)) {
    peers.prepare(ctx_);
    stub_ = dgr::v1::ShardService::NewStub(peers.connect(address));
    stream_ = stub_->Forward(&ctx_);
    reader_ = std::thread([this] { read_until_end(); });
}

void DownstreamLink::read_until_end() {
    // a failure further down arrives as an error reply while the stream stays open (the next
    // stage drains until it is closed): report it at once; otherwise report how the stream ended
    dgr::v1::ForwardReply reply;
    bool reported = false;
    while (stream_->Read(&reply)) {
        if (reply.has_error() && !reported) {
            reported = true;
            on_error_(relayed_error(reply.error()));
        }
    }
    grpc::Status status;
    bool closing;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        status = stream_->Finish();
        closing = closing_;
        ended_ = true;
    }
    ended_cv_.notify_all();
    if (reported || closing) return;
    on_error_(stage_error(stage_, address_,
                          status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stage ended the stream")
                                      : status));
}

bool DownstreamLink::write(const dgr::v1::ForwardRequest & request) {
    std::lock_guard<std::mutex> lock(mutex_);
    return !ended_ && stream_->Write(request);
}

DownstreamLink::~DownstreamLink() {
    std::unique_lock<std::mutex> lock(mutex_);
    closing_ = true;
    if (!ended_) stream_->WritesDone();
    if (!ended_cv_.wait_for(lock, kCloseGrace, [this] { return ended_; })) ctx_.TryCancel();
    lock.unlock();
    reader_.join();
}

LoopLink::LoopLink(Peers & peers, const std::string & address) {
    peers.prepare(ctx_);
    stub_ = dgr::v1::ShardService::NewStub(peers.connect(address));
    writer_ = stub_->Loop(&ctx_, &reply_);
}

bool LoopLink::write(const dgr::v1::ForwardReply & token) { return writer_->Write(token); }

LoopLink::~LoopLink() {
    // every token was written (synchronously) before the session's stream ended: nothing waits
    writer_->WritesDone();
    ctx_.TryCancel();
    writer_->Finish();
}

std::unique_ptr<Downstream> Peers::downstream(const std::string & address, uint32_t stage, OnError on_error) {
    if (grpc::Status st = check_link(address); !st.ok()) {
        return std::make_unique<RefusedLink>(stage_error(stage, address, st), std::move(on_error));
    }
    if (data_links()) return std::make_unique<DataLink>(*this, address, dgr::v1::DATA_STREAM_FORWARD, stage, std::move(on_error));
    return std::make_unique<DownstreamLink>(*this, address, stage, std::move(on_error));
}

std::unique_ptr<TokenReturn> Peers::token_return(const std::string & address, OnError on_error) {
    if (grpc::Status st = check_link(address); !st.ok()) {
        return std::make_unique<RefusedLink>(stage_error(0, address, st), std::move(on_error));
    }
    if (data_links()) return std::make_unique<DataLink>(*this, address, dgr::v1::DATA_STREAM_LOOP, 0, std::move(on_error));
    return std::make_unique<LoopLink>(*this, address);  // a failed write is reported by the tail
}

grpc::Status read_stage_stream(FrameConn & conn, const std::function<void(const dgr::v1::StageError &)> & on_relayed) {
    for (;;) {
        dgr::v1::DataFrame kind{};
        std::string payload;
        bool ended = false;
        if (grpc::Status st = conn.receive(&kind, &payload, &ended); !st.ok()) return st;
        if (ended) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stage closed the data stream without ending it");
        if (kind == dgr::v1::DATA_FRAME_END) {
            dgr::v1::DataEnd end;
            if (!end.ParseFromString(payload)) {
                return grpc::Status(grpc::StatusCode::INTERNAL, "the stage ended its data stream with an END that does not parse");
            }
            if (end.code() <= 0 || end.code() > 16) {  // OK, or not a gRPC status code
                return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                    end.code() == 0 ? "the stage ended the stream"
                                                    : "the stage ended the stream with status " + std::to_string(end.code()) +
                                                          ", not a gRPC status code");
            }
            return grpc::Status((grpc::StatusCode) end.code(), end.message().substr(0, 4096));
        }
        dgr::v1::ForwardReply reply;
        if (kind == dgr::v1::DATA_FRAME_REPLY && reply.ParseFromString(payload) && reply.has_error()) {
            on_relayed(relayed_error(reply.error()));
        }
    }
}

DataLink::DataLink(Peers & peers, const std::string & address, dgr::v1::DataStream kind, uint32_t stage,
                   Peers::OnError on_error)
    : options_(peers.options()), address_(address), kind_(kind), stage_(stage), on_error_(std::move(on_error)) {
    reader_ = std::thread([this, hello = make_hello(kind, options_.token)] { run(hello); });
}

bool DataLink::first_report() {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool first = !reported_ && !closing_;
    reported_ = true;
    return first;
}

void DataLink::report(const grpc::Status & status) {
    if (first_report()) on_error_(stage_error(stage_, address_, status));
}

void DataLink::run(dgr::v1::DataHello hello) {
    // as long as a gRPC channel would try before a call fails: the keepalive bound
    const auto timeout = std::chrono::milliseconds(options_.keepalive_ms + options_.keepalive_ms / 2);
    std::string error;
    std::shared_ptr<FrameConn> conn =
        connect_data(address_, hello, options_.keepalive_ms, options_.max_message_bytes * 2, timeout, &error);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        conn_ = conn;
        connected_ = conn != nullptr;
        ended_ = !connected_;
    }
    cv_.notify_all();
    if (!conn) return report(grpc::Status(grpc::StatusCode::UNAVAILABLE, error));
    keep_alive(conn);
    const grpc::Status status = read_stage_stream(*conn, [this](const dgr::v1::StageError & e) {
        if (first_report()) on_error_(e);  // not under our lock: it takes locks of its own
    });
    {
        std::lock_guard<std::mutex> lock(mutex_);
        ended_ = true;
    }
    cv_.notify_all();
    report(status);
}

bool DataLink::send(dgr::v1::DataFrame kind, const google::protobuf::MessageLite & message) {
    std::shared_ptr<FrameConn> conn;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return connected_ || ended_; });
        if (ended_) return false;
        conn = conn_;
    }
    return conn->send(kind, &message);
}

bool DataLink::write(const dgr::v1::ForwardRequest & request) { return send(dgr::v1::DATA_FRAME_REQUEST, request); }
bool DataLink::write(const dgr::v1::ForwardReply & token) { return send(dgr::v1::DATA_FRAME_REPLY, token); }

DataLink::~DataLink() {
    std::unique_lock<std::mutex> lock(mutex_);
    closing_ = true;
    cv_.wait(lock, [this] { return connected_ || ended_; });  // connecting is bounded by its timeout
    if (conn_ && !ended_) {
        conn_->shutdown_write();
        // a stage frees the session before it ends the stream: wait briefly for that (the head
        // needs nothing back)
        if (kind_ == dgr::v1::DATA_STREAM_FORWARD) cv_.wait_for(lock, kCloseGrace, [this] { return ended_; });
    }
    if (conn_) conn_->abort();
    lock.unlock();
    reader_.join();
}

}  // namespace dgr::worker
