#include "forwarding.h"

#include <chrono>
#include <optional>

namespace dgr::worker {

namespace {
constexpr auto kCloseGrace = std::chrono::seconds(2);
}

Peers::Peers(PeerOptions options) : options_(std::move(options)) {
    if (options_.ca.empty()) {
        creds_ = grpc::InsecureChannelCredentials();
    } else {
        grpc::SslCredentialsOptions ssl;
        ssl.pem_root_certs = options_.ca;
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
            on_error_(reply.error());
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

}  // namespace dgr::worker
