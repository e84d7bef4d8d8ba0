// dgr-shard-worker: one ShardEngine served over gRPC (dgr.v1.ShardService, grpc.health.v1).
//
// The server starts listening only after the model range is loaded, so "reachable" means ready.
// Every request is validated before the engine sees it; a bad message ends that stream with
// INVALID_ARGUMENT and a reason, a cache mismatch with FAILED_PRECONDITION, and the worker keeps
// serving its other sessions. SIGTERM/SIGINT drain: new streams are refused, in-flight requests
// finish (bounded by --drain-seconds), then the process exits 0.
#include "dgr/shard_engine.h"
#include "dgr/v1/shard.grpc.pb.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <zlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <fstream>
#include <iterator>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

struct Args {
    std::string model, listen = "127.0.0.1:0", lane = "cpu", fingerprint, llama_commit, patch_hash;
    int32_t first = 0, last = -1, threads = 2, n_ctx = 2048, n_batch = 512, max_sessions = 4;
    uint64_t max_message_bytes = 64ull << 20;
    int max_queue = 16;  // forwards that may wait behind the one computing; more are refused
    int drain_seconds = 10;
    int poll = 50;  // ggml threadpool spin level between graphs (0 sleeps, 100 spins)
    bool mtp = false;  // serve MTP (nextn) layers: reserved, the engine refuses it in alpha
    std::string token;  // from --auth-token-file (a file, so the token never shows in ps)
    std::string tls_cert, tls_key, tls_client_ca;  // PEM contents; client CA: require mTLS
};

std::atomic<bool> g_stop{false};

constexpr uint64_t kFnvOffset = 0xCBF29CE484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001B3ull;

uint64_t fnv1a(uint64_t h, const int32_t * tokens, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        uint32_t v = (uint32_t) tokens[i];
        for (int b = 0; b < 4; ++b) {
            h ^= (v >> (8 * b)) & 0xFF;
            h *= kFnvPrime;
        }
    }
    return h;
}

Status from_shard_error(const dgr::ShardError & e) {
    switch (e.status()) {
        case dgr::Status::invalid_argument:
        case dgr::Status::invalid_range: return Status(StatusCode::INVALID_ARGUMENT, e.what());
        case dgr::Status::unknown_session:
        case dgr::Status::cache_mismatch: return Status(StatusCode::FAILED_PRECONDITION, e.what());
        case dgr::Status::capacity: return Status(StatusCode::RESOURCE_EXHAUSTED, e.what());
        default: return Status(StatusCode::INTERNAL, e.what());
    }
}

int32_t sample(const float * logits, int32_t n_vocab, const dgr::v1::Sampling & s, std::mt19937_64 & rng,
               float * logprob) {
    int32_t best = 0;
    for (int32_t i = 1; i < n_vocab; ++i) {
        if (logits[i] > logits[best]) best = i;
    }
    std::vector<std::pair<float, int32_t>> cand;
    if (s.temperature() <= 0.0f) {
        cand.push_back({logits[best], best});
    } else {
        cand.reserve(n_vocab);
        for (int32_t i = 0; i < n_vocab; ++i) cand.push_back({logits[i] / s.temperature(), i});
        std::sort(cand.begin(), cand.end(), [](auto & a, auto & b) { return a.first > b.first; });
        if (s.top_k() > 0 && (int32_t) s.top_k() < (int32_t) cand.size()) cand.resize(s.top_k());
    }
    const float max = cand.front().first;
    std::vector<double> p(cand.size());
    double sum = 0;
    for (size_t i = 0; i < cand.size(); ++i) sum += (p[i] = std::exp((double) cand[i].first - max));
    if (s.top_p() > 0.0f && s.top_p() < 1.0f) {
        double acc = 0;
        size_t keep = 0;
        while (keep < p.size() && acc < s.top_p() * sum) acc += p[keep++];
        p.resize(std::max<size_t>(keep, 1));
        cand.resize(p.size());
        sum = 0;
        for (double v : p) sum += v;
    }
    size_t pick = 0;
    if (cand.size() > 1) {
        std::discrete_distribution<size_t> dist(p.begin(), p.end());
        pick = dist(rng);
    }
    // log-probability of the pick under the full (temperature 1) distribution
    double z = 0;
    for (int32_t i = 0; i < n_vocab; ++i) z += std::exp((double) logits[i] - logits[best]);
    *logprob = (float) ((double) logits[cand[pick].second] - logits[best] - std::log(z));
    return cand[pick].second;
}

class ShardService final : public dgr::v1::ShardService::Service {
public:
    ShardService(std::unique_ptr<dgr::ShardEngine> engine, const Args & args)
        : engine_(std::move(engine)), args_(args), desc_(engine_->describe()) {}

    Status Describe(ServerContext * ctx, const dgr::v1::DescribeRequest *, dgr::v1::DescribeReply * reply) override {
        if (Status st = authorize(ctx); !st.ok()) return st;
        auto * c = reply->mutable_compatibility();
        c->set_model_fingerprint(args_.fingerprint);
        c->set_llama_cpp_commit(args_.llama_commit);
        c->set_patch_stack_sha256(args_.patch_hash);
        c->set_schema_version(1);
        c->set_lane(args_.lane);
        c->set_arch(desc_.arch);
        c->set_n_layer((uint32_t) desc_.n_layer);
        reply->set_layer_first((uint32_t) desc_.layer_first);
        reply->set_layer_last((uint32_t) desc_.layer_last);
        auto * b = reply->mutable_boundary();
        b->set_hc((uint32_t) desc_.boundary.hc);
        b->set_n_embd((uint32_t) desc_.boundary.n_embd);
        b->set_needs_token_ids(desc_.boundary.needs_token_ids);
        for (auto d : {dgr::v1::DTYPE_F32, dgr::v1::DTYPE_F16, dgr::v1::DTYPE_BF16}) b->add_dtypes(d);
        reply->set_n_ctx((uint32_t) desc_.n_ctx);
        reply->set_max_sessions((uint32_t) desc_.max_sessions);
        reply->set_max_tokens_per_message((uint32_t) desc_.n_batch);
        reply->set_max_message_bytes(args_.max_message_bytes);
        return Status::OK;
    }

    Status Health(ServerContext * ctx, const dgr::v1::HealthRequest *, dgr::v1::HealthReply * reply) override {
        if (Status st = authorize(ctx); !st.ok()) return st;
        const size_t sessions = engine_->sessions().size();
        reply->set_ready(true);
        reply->set_draining(g_stop.load());
        reply->set_sessions((uint32_t) sessions);
        reply->set_capacity((uint32_t) (desc_.max_sessions - (int32_t) sessions));
        reply->set_queue_depth((uint32_t) in_flight_.load());
        return Status::OK;
    }

    Status OpenSession(ServerContext * ctx, const dgr::v1::OpenSessionRequest *, dgr::v1::OpenSessionReply * reply) override {
        if (Status st = authorize(ctx); !st.ok()) return st;
        reply->set_n_ctx((uint32_t) desc_.n_ctx);
        return Status::OK;
    }

    Status CloseSession(ServerContext * ctx, const dgr::v1::CloseSessionRequest * req, dgr::v1::CloseSessionReply *) override {
        if (Status st = authorize(ctx); !st.ok()) return st;
        try {
            engine_->release(req->session_id());
        } catch (const dgr::ShardError & e) {
            return from_shard_error(e);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        hashes_.erase(req->session_id());
        return Status::OK;
    }

    Status Forward(ServerContext * ctx,
                   grpc::ServerReaderWriter<dgr::v1::ForwardReply, dgr::v1::ForwardRequest> * stream) override {
        if (Status st = authorize(ctx); !st.ok()) return st;
        if (g_stop.load()) {
            return Status(StatusCode::UNAVAILABLE, "draining: not accepting new streams");
        }
        dgr::v1::ForwardRequest req;
        std::set<uint64_t> seen;
        // a stream that ends abnormally (deadline, cancellation, a dead client) frees the
        // sessions it carried: nobody will continue them, and their KV slots are scarce
        auto abandon = [&](Status st) {
            for (uint64_t sid : seen) {
                try {
                    engine_->release(sid);
                } catch (const dgr::ShardError &) {
                }
                std::lock_guard<std::mutex> lock(mutex_);
                hashes_.erase(sid);
            }
            return st;
        };
        while (stream->Read(&req)) {
            if (ctx->IsCancelled()) {
                return abandon(Status(StatusCode::CANCELLED, "cancelled by the client"));
            }
            seen.insert(req.session_id());
            // backpressure: a bounded queue, refused beyond it (the session's cache is untouched
            // and the client may retry); the requests admitted compute in arrival order
            const int ahead = in_flight_++;
            if (ahead > args_.max_queue) {
                in_flight_--;
                return Status(StatusCode::RESOURCE_EXHAUSTED,
                              "queue full: " + std::to_string(ahead) + " forwards in flight, at most " +
                                  std::to_string(args_.max_queue) + " may wait; retry later");
            }
            dgr::v1::ForwardReply reply;
            Status st;
            {
                Turn turn(turnstile_);
                st = handle(req, &reply);
            }
            in_flight_--;
            if (!st.ok()) {
                return st;  // a refused request leaves the session's cache as it was
            }
            if (!stream->Write(reply)) {
                return abandon(Status(StatusCode::CANCELLED, "client went away"));
            }
        }
        if (ctx->IsCancelled()) {
            return abandon(Status(StatusCode::CANCELLED, "cancelled or past its deadline"));
        }
        return Status::OK;
    }

private:
    // with --auth-token-file, every ShardService call carries "authorization: Bearer <token>"
    // (grpc.health.v1 stays open for liveness probes)
    Status authorize(ServerContext * ctx) const {
        if (args_.token.empty()) return Status::OK;
        const auto & md = ctx->client_metadata();
        auto it = md.find("authorization");
        if (it == md.end()) {
            return Status(StatusCode::UNAUTHENTICATED, "missing authorization: this worker needs a bearer token");
        }
        const std::string got(it->second.data(), it->second.size());
        const std::string want = "Bearer " + args_.token;
        unsigned char diff = got.size() == want.size() ? 0 : 1;
        for (size_t i = 0; i < got.size() && i < want.size(); ++i) diff |= (unsigned char) (got[i] ^ want[i]);
        if (diff != 0) return Status(StatusCode::UNAUTHENTICATED, "wrong bearer token");
        return Status::OK;
    }

    Status handle(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply) {
        const auto & exp = req.expect();
        const int n_tok_ids = req.token_ids_size();
        if (req.boundary_dtype() != dgr::v1::DTYPE_UNSPECIFIED && !from_wire(req.boundary_dtype())) {
            return Status(StatusCode::INVALID_ARGUMENT,
                          "boundary_dtype: unknown dtype " + std::to_string(req.boundary_dtype()));
        }
        dgr::ForwardRequest fr;
        fr.session = req.session_id();
        fr.epoch = exp.epoch();
        fr.n_past = (int32_t) exp.n_past();
        std::vector<int32_t> tokens(req.token_ids().begin(), req.token_ids().end());
        if (desc_.is_head) {
            if (n_tok_ids < 1) return Status(StatusCode::INVALID_ARGUMENT, "token_ids: the head stage needs token ids");
            if (req.has_boundary()) return Status(StatusCode::INVALID_ARGUMENT, "boundary: the head stage takes token ids");
            fr.tokens = tokens.data();
            fr.n_tokens = n_tok_ids;
        } else {
            if (!req.has_boundary()) return Status(StatusCode::INVALID_ARGUMENT, "boundary: missing for a stage after the head");
            const auto & b = req.boundary();
            if (b.shape_size() != 3) return Status(StatusCode::INVALID_ARGUMENT, "boundary.shape: expected [n_tokens, hc, n_embd]");
            const uint64_t n = b.shape(0), hc = b.shape(1), n_embd = b.shape(2);
            if (hc != (uint64_t) desc_.boundary.hc || n_embd != (uint64_t) desc_.boundary.n_embd) {
                return Status(StatusCode::INVALID_ARGUMENT,
                              "boundary.shape: [" + std::to_string(n) + ", " + std::to_string(hc) + ", " +
                                  std::to_string(n_embd) + "] does not match this stage's [n_tokens, " +
                                  std::to_string(desc_.boundary.hc) + ", " + std::to_string(desc_.boundary.n_embd) + "]");
            }
            if (n < 1 || n > (uint64_t) desc_.n_batch) {
                return Status(StatusCode::INVALID_ARGUMENT, "boundary.shape: n_tokens " + std::to_string(n) +
                                                                 " outside [1, " + std::to_string(desc_.n_batch) + "]");
            }
            const std::optional<dgr::DType> wire = from_wire(b.dtype());
            if (!wire) {
                return Status(StatusCode::INVALID_ARGUMENT, "boundary.dtype: unknown dtype " + std::to_string(b.dtype()));
            }
            const dgr::DType dt = *wire;
            const uint64_t want = n * hc * n_embd * dgr::dtype_size(dt);
            if (b.payload().size() != want) {
                return Status(StatusCode::INVALID_ARGUMENT, "boundary.payload: " + std::to_string(b.payload().size()) +
                                                                 " bytes, shape and dtype say " + std::to_string(want));
            }
            if ((uint32_t) crc32(0L, (const Bytef *) b.payload().data(), (uInt) b.payload().size()) != b.crc32()) {
                return Status(StatusCode::INVALID_ARGUMENT, "boundary.crc32: checksum mismatch (corrupted in transit)");
            }
            if (n_tok_ids != 0 && (uint64_t) n_tok_ids != n) {
                return Status(StatusCode::INVALID_ARGUMENT, "token_ids: sideband length differs from the boundary's n_tokens");
            }
            fr.boundary = b.payload().data();
            fr.boundary_dtype = dt;
            fr.n_tokens = (int32_t) n;
            if (n_tok_ids > 0) fr.tokens = tokens.data();  // the sideband for hash-routed layers
        }
        // cache expectation: the prefix hash of the session's tokens, where they travel
        uint64_t before = kFnvOffset;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = hashes_.find(fr.session);
            if (fr.n_past > 0 && it != hashes_.end()) before = it->second;
        }
        if (n_tok_ids > 0 && exp.prefix_hash() != 0 && fr.n_past > 0 && exp.prefix_hash() != before) {
            return Status(StatusCode::FAILED_PRECONDITION,
                          "cache_mismatch: prefix hash differs from this shard's (its KV holds another token history)");
        }
        const dgr::DType out = req.has_boundary() ? fr.boundary_dtype : dgr::DType::f32;
        dgr::ForwardResult res;
        try {
            res = engine_->forward(fr, desc_.is_tail ? dgr::DType::f32 : out_dtype(req, out));
        } catch (const dgr::ShardError & e) {
            return from_shard_error(e);
        }
        const uint64_t after = n_tok_ids > 0 ? fnv1a(before, tokens.data(), tokens.size()) : 0;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (n_tok_ids > 0) hashes_[fr.session] = after;
        }
        reply->set_session_id(fr.session);
        reply->set_n_past((uint32_t) res.n_past);
        reply->set_prefix_hash(after);
        if (res.is_logits) {
            std::mt19937_64 rng(req.sampling().seed() ^ ((uint64_t) res.n_past * 0x9E3779B97F4A7C15ull));
            float logprob = 0;
            const float * logits = (const float *) res.data.data();
            auto * tok = reply->mutable_token();
            tok->set_token_id(sample(logits, res.row_width, req.sampling(), rng, &logprob));
            tok->set_logprob(logprob);
            if (req.sampling().want_logits()) {
                auto * lb = tok->mutable_logits();
                lb->set_dtype(dgr::v1::DTYPE_F32);
                lb->add_shape(1);
                lb->add_shape(1);
                lb->add_shape((uint32_t) res.row_width);
                lb->set_payload(res.data.data(), res.data.size());
                lb->set_crc32((uint32_t) crc32(0L, (const Bytef *) res.data.data(), (uInt) res.data.size()));
            }
        } else {
            auto * b = reply->mutable_boundary();
            b->set_dtype(res.dtype == dgr::DType::f32 ? dgr::v1::DTYPE_F32
                         : res.dtype == dgr::DType::f16 ? dgr::v1::DTYPE_F16 : dgr::v1::DTYPE_BF16);
            b->add_shape((uint32_t) res.n_rows);
            b->add_shape((uint32_t) desc_.boundary.hc);
            b->add_shape((uint32_t) desc_.boundary.n_embd);
            b->set_payload(res.data.data(), res.data.size());
            b->set_crc32((uint32_t) crc32(0L, (const Bytef *) res.data.data(), (uInt) res.data.size()));
        }
        return Status::OK;
    }

    static std::optional<dgr::DType> from_wire(int dtype) {
        switch (dtype) {
            case dgr::v1::DTYPE_F32: return dgr::DType::f32;
            case dgr::v1::DTYPE_F16: return dgr::DType::f16;
            case dgr::v1::DTYPE_BF16: return dgr::DType::bf16;
            default: return std::nullopt;
        }
    }

    static dgr::DType out_dtype(const dgr::v1::ForwardRequest & req, dgr::DType fallback) {
        // the coordinator's choice; else the head answers in f32 and later stages in the dtype
        // they were sent
        if (const auto chosen = from_wire(req.boundary_dtype())) return *chosen;
        return req.has_boundary() ? fallback : dgr::DType::f32;
    }

    std::unique_ptr<dgr::ShardEngine> engine_;
    Args args_;
    dgr::Description desc_;
    std::mutex mutex_;
    std::map<uint64_t, uint64_t> hashes_;
    std::atomic<int> in_flight_{0};

    // FIFO turns on the engine: sessions are served in the order their requests arrived
    struct Turnstile {
        std::mutex m;
        std::condition_variable cv;
        uint64_t next = 0, serving = 0;
    };
    struct Turn {
        explicit Turn(Turnstile & t) : t_(t) {
            std::unique_lock<std::mutex> lock(t_.m);
            const uint64_t mine = t_.next++;
            t_.cv.wait(lock, [&] { return t_.serving == mine; });
        }
        ~Turn() {
            std::lock_guard<std::mutex> lock(t_.m);
            t_.serving++;
            t_.cv.notify_all();
        }
        Turnstile & t_;
    };
    Turnstile turnstile_;
};

std::string read_file(const std::string & path, const std::string & option) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::invalid_argument(option + ": cannot read " + path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool parse_args(int argc, char ** argv, Args & a) {
    for (int i = 1; i < argc; ++i) {
        std::string k = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
            return argv[++i];
        };
        if (k == "--model") a.model = val();
        else if (k == "--layers") {
            std::string v = val();
            auto colon = v.find(':');
            if (colon == std::string::npos) throw std::invalid_argument("--layers takes FIRST:LAST");
            a.first = std::stoi(v.substr(0, colon));
            a.last = std::stoi(v.substr(colon + 1));
        } else if (k == "--listen") a.listen = val();
        else if (k == "--threads") a.threads = std::stoi(val());
        else if (k == "--n-ctx") a.n_ctx = std::stoi(val());
        else if (k == "--n-batch") a.n_batch = std::stoi(val());
        else if (k == "--max-sessions") a.max_sessions = std::stoi(val());
        else if (k == "--max-message-bytes") a.max_message_bytes = std::stoull(val());
        else if (k == "--max-queue") a.max_queue = std::stoi(val());
        else if (k == "--lane") a.lane = val();
        else if (k == "--model-fingerprint") a.fingerprint = val();
        else if (k == "--llama-commit") a.llama_commit = val();
        else if (k == "--patch-stack") a.patch_hash = val();
        else if (k == "--drain-seconds") a.drain_seconds = std::stoi(val());
        else if (k == "--poll") a.poll = std::stoi(val());
        else if (k == "--mtp") a.mtp = true;
        else if (k == "--auth-token-file") {
            a.token = read_file(val(), "--auth-token-file");
            while (!a.token.empty() && (a.token.back() == '\n' || a.token.back() == '\r' || a.token.back() == ' ')) a.token.pop_back();
            if (a.token.empty()) throw std::invalid_argument("--auth-token-file: the file holds no token");
        } else if (k == "--tls-cert") a.tls_cert = read_file(val(), "--tls-cert");
        else if (k == "--tls-key") a.tls_key = read_file(val(), "--tls-key");
        else if (k == "--tls-client-ca") a.tls_client_ca = read_file(val(), "--tls-client-ca");
        else throw std::invalid_argument("unknown option " + k);
    }
    if (a.model.empty()) throw std::invalid_argument("--model is required");
    if (a.tls_cert.empty() != a.tls_key.empty()) throw std::invalid_argument("--tls-cert and --tls-key go together");
    if (!a.tls_client_ca.empty() && a.tls_cert.empty()) throw std::invalid_argument("--tls-client-ca needs --tls-cert and --tls-key");
    return true;
}

}  // namespace

int main(int argc, char ** argv) {
    Args args;
    try {
        parse_args(argc, argv, args);
    } catch (const std::exception & e) {
        std::cerr << "dgr-shard-worker: " << e.what() << "\n"
                  << "usage: dgr-shard-worker --model PATH --layers FIRST:LAST [--listen HOST:PORT] [--threads N]\n"
                     "  [--n-ctx N] [--n-batch N] [--max-sessions N] [--max-message-bytes N] [--max-queue N] [--lane cpu]\n"
                     "  [--model-fingerprint HEX] [--llama-commit SHA] [--patch-stack SHA] [--drain-seconds N]\n"
                     "  [--poll 0-100] [--mtp] [--auth-token-file F] [--tls-cert F --tls-key F [--tls-client-ca F]]\n";
        return 2;
    }
    std::unique_ptr<dgr::ShardEngine> engine;
    try {
        dgr::EngineOptions o;
        o.model_path = args.model;
        o.layer_first = args.first;
        o.layer_last = args.last;
        o.n_threads = args.threads;
        o.n_ctx = args.n_ctx;
        o.n_batch = args.n_batch;
        o.max_sessions = args.max_sessions;
        o.poll = args.poll;
        o.load_mtp = args.mtp;
        engine = dgr::ShardEngine::open(o);
    } catch (const dgr::ShardError & e) {
        std::cerr << "dgr-shard-worker: " << e.what() << "\n";
        return 3;
    }
    ShardService service(std::move(engine), args);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
    if (!args.tls_cert.empty()) {
        // TLS; with a client CA, mutual TLS: a client without a certificate it signed is refused
        grpc::SslServerCredentialsOptions ssl(args.tls_client_ca.empty()
                                                  ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
        ssl.pem_root_certs = args.tls_client_ca;
        ssl.pem_key_cert_pairs.push_back({args.tls_key, args.tls_cert});
        creds = grpc::SslServerCredentials(ssl);
    }
    builder.AddListeningPort(args.listen, creds, &port);
    builder.SetMaxReceiveMessageSize((int) std::min<uint64_t>(args.max_message_bytes, INT32_MAX));
    builder.SetMaxSendMessageSize((int) std::min<uint64_t>(args.max_message_bytes * 2, INT32_MAX));
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server || port == 0) {
        std::cerr << "dgr-shard-worker: cannot listen on " << args.listen << "\n";
        return 4;
    }
    server->GetHealthCheckService()->SetServingStatus(true);
    // the launcher reads this line to learn the port (and that the model is loaded)
    std::cout << "DGR-WORKER-READY port=" << port << std::endl;

    std::signal(SIGTERM, [](int) { g_stop.store(true); });
    std::signal(SIGINT, [](int) { g_stop.store(true); });
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(args.drain_seconds));
    std::cout << "DGR-WORKER-STOPPED" << std::endl;
    return 0;
}
