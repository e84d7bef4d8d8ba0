// dgr-shard-worker: one ShardEngine served over gRPC (dgr.v1.ShardService, grpc.health.v1); a thin
// shell over ShardService (service.h), in the manner of llama.cpp's rpc-server.
//
// The engine is loaded and warmed up (a prefill and a few decode steps on a scratch session, as
// llama-server does) before the server listens, so "reachable" means ready at steady-state
// speed. SIGTERM/SIGINT drain: new streams are refused, in-flight requests finish (bounded by
// --drain-seconds), then the process exits 0.
#include "dgr/shard_engine.h"
#include "options.h"
#include "service.h"
#include "tokenizer.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <csignal>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <cstdlib>
#include <unistd.h>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::atomic<bool> g_stop{false};

using Args = dgr::worker::WorkerOptions;

// Whether this process may give its threads a realtime policy (CAP_SYS_NICE, or RLIMIT_RTPRIO):
// tried on a thread of its own, so that no thread of the worker keeps it.
bool realtime_allowed() {
    bool ok = false;
    std::thread([&ok] {
        sched_param p{};
        p.sched_priority = 40;  // ggml's GGML_SCHED_PRIO_MEDIUM
        ok = pthread_setschedparam(pthread_self(), SCHED_FIFO, &p) == 0;
    }).join();
    return ok;
}

// --prio auto (opt-in). ggml's barriers spin: a compute thread preempted by any other thread of
// the host (gRPC's pollers and handlers, a neighbouring stage passing its output on, the
// coordinator) stalls its whole graph until it runs again; on a 2-core host running 3 stages at
// 2 threads each, that cost a route 15-20% of its decode speed. Compute threads at SCHED_FIFO
// (llama.cpp's --prio 1) are never preempted by them, and in turn nothing at normal priority runs
// on the cores they use while a graph computes: with as many compute threads as cores, the
// worker's own Health and keepalive, a co-located coordinator or HTTP server wait for the graph
// (a 1.5 s Health reply behind long prefills), which is why it is not the default. Realtime
// threads that spin must never outnumber the cores, which the compute slots see to (a graph that
// got no slot computes at normal priority): with slots off, or where the policy is not allowed,
// compute stays at normal priority.
int resolve_prio(const Args & a) {
    if (a.prio >= 0) return a.prio;
    if (a.compute_slots == "none") return 0;
    if (!realtime_allowed()) {
        std::cerr << "dgr-shard-worker: compute threads at normal priority (SCHED_FIFO needs CAP_SYS_NICE)\n";
        return 0;
    }
    return 1;
}

// a prefill and a few decode steps on a scratch session, so that buffers, threads and pages are
// in place before the first real request
void warm_up(dgr::ShardEngine & engine) {
    const dgr::Description d = engine.describe();
    constexpr uint64_t kScratch = ~0ull;
    const int32_t prefill = std::min<int32_t>(d.n_batch, std::min<int32_t>(16, d.n_ctx - 4));
    if (prefill < 1) return;
    const int32_t row = d.boundary.hc * d.boundary.n_embd;
    std::vector<int32_t> tokens((size_t) prefill, 1);
    std::vector<float> zeros((size_t) prefill * row, 0.0f);
    int32_t n_past = 0;
    for (int32_t n : {prefill, 1, 1, 1}) {
        dgr::ForwardRequest r;
        r.session = kScratch;
        r.epoch = 1;
        r.n_past = n_past;
        r.n_tokens = n;
        r.tokens = tokens.data();
        r.boundary = d.is_head ? nullptr : zeros.data();
        r.mtp = d.mtp;
        n_past = engine.forward(r).n_past;
        if (d.mtp) engine.draft_mtp(kScratch, n_past, 1, 2);  // the MTP graph too
    }
    engine.release(kScratch);
}

// exits with `code` after saying why on stderr
struct Exit {
    int code;
};

[[noreturn]] void fail(int code, const std::string & why) {
    std::cerr << "dgr-shard-worker: " << why << "\n";
    throw Exit{code};
}

// compute slots shared with the other workers of this host (slots.h); "auto": a directory per
// user and thread count under the temporary directory
void place_compute_slots(Args & args) {
    if (args.compute_slots == "none") return;
    std::string dir = args.compute_slots;
    if (dir == "auto") {
        const char * tmp = std::getenv("TMPDIR");
        dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/dgr-compute-slots-" + std::to_string(getuid());
    }
    args.service.compute_slots_dir = dir;
    args.service.compute_slots = dgr::worker::default_slot_count(args.threads);
    if (args.pin) args.service.pin_threads = args.threads;
}

// the engine over the range, warmed up (exit 3: the model does not load; 2: a slot directory it
// cannot use)
std::unique_ptr<dgr::ShardEngine> open_engine(const Args & args) {
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
        o.sleep_when_idle = true;
        o.prio = args.prio;
        o.rollback = args.rollback;
        o.gpu_layers = args.gpu_layers;
        o.load_mtp = args.mtp;
        o.batch_invariant = args.batch_invariant;
        o.cache_sessions = args.cache_sessions < 0 ? args.max_sessions : args.cache_sessions;  // (the engine caps it)
        o.cache_bytes = args.cache_bytes;
        std::unique_ptr<dgr::ShardEngine> engine = dgr::ShardEngine::open(o);
        if (args.warmup) {  // a compute like any other: in a slot
            dgr::worker::ComputeSlots slots(args.service.compute_slots_dir, args.service.compute_slots,
                                            args.service.pin_threads);
            const auto hold = slots.acquire();
            hold.place(*engine);
            warm_up(*engine);
        }
        return engine;
    } catch (const dgr::ShardError & e) {
        fail(3, e.what());
    } catch (const std::invalid_argument & e) {  // --compute-slots: a directory it cannot use
        fail(2, e.what());
    }
}

// peers (the next stage, the head) are reached with this worker's own credentials: a worker that
// serves TLS reaches them over TLS only (its token never crosses a plaintext link)
dgr::worker::PeerOptions peer_options(const Args & args) {
    dgr::worker::PeerOptions peers;
    peers.ca = args.peer_ca.empty() ? args.tls_client_ca : args.peer_ca;
    peers.tls = !args.tls_cert.empty() || !peers.ca.empty();
    if (peers.tls) {
        peers.cert = args.tls_cert;
        peers.key = args.tls_key;
    }
    peers.token = args.service.token;
    peers.max_message_bytes = args.service.max_message_bytes;
    peers.keepalive_ms = args.keepalive_ms;
    peers.data_links = args.data_links;
    return peers;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const Args & args) {
    if (args.tls_cert.empty()) return grpc::InsecureServerCredentials();
    // TLS; with a client CA, mutual TLS: a client without a certificate it signed is refused
    grpc::SslServerCredentialsOptions ssl(args.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                                     : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = args.tls_client_ca;
    ssl.pem_key_cert_pairs.push_back({args.tls_key, args.tls_cert});
    return grpc::SslServerCredentials(ssl);
}

// plaintext: the worker's own listener serves gRPC and data streams on one port (datalink.h);
// with TLS (or a unix socket) gRPC listens, and links to this worker are gRPC calls (null)
std::unique_ptr<dgr::worker::Listener> own_listener(const Args & args) {
    if (!args.tls_cert.empty() || args.listen.rfind("unix", 0) == 0) return nullptr;
    try {
        dgr::worker::ListenerLimits limits;
        limits.keepalive_ms = args.keepalive_ms;
        limits.max_payload = args.service.max_message_bytes * 2;
        // a session holds at most a FORWARD stream in and a LOOP stream (the head): headroom
        // beyond that for streams of sessions that are ending while new ones start
        limits.max_streams = args.max_data_streams > 0 ? (size_t) args.max_data_streams : (size_t) args.max_sessions * 4 + 16;
        return std::make_unique<dgr::worker::Listener>(args.listen, limits);
    } catch (const std::invalid_argument & e) {
        fail(4, e.what());
    }
}

void configure_server(grpc::ServerBuilder & builder, const Args & args) {
    const uint64_t max_bytes = args.service.max_message_bytes;
    builder.SetMaxReceiveMessageSize((int) std::min<uint64_t>(max_bytes, INT32_MAX));
    builder.SetMaxSendMessageSize((int) std::min<uint64_t>(max_bytes * 2, INT32_MAX));
    // keepalive: a client that vanished without a reset is dropped (and its sessions freed) after
    // about keepalive + keepalive / 2; clients may ping as often as every second
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, args.keepalive_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, dgr::worker::keepalive_timeout_ms(args.keepalive_ms));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

// --cpus: every thread of the process on those cores (threads made later inherit it); a core
// this process may not use is refused by name (exit 2)
void restrict_cpus(const Args & args) {
    if (args.cpus.empty()) return;
    cpu_set_t allowed, want;
    CPU_ZERO(&want);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) fail(2, "--cpus: cannot read this process's affinity");
    for (int32_t c : args.cpus) {
        if (c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed)) fail(2, "--cpus: core " + std::to_string(c) + " is not one this process may use");
        CPU_SET(c, &want);
    }
    if (sched_setaffinity(0, sizeof(want), &want) != 0) fail(2, "--cpus: sched_setaffinity failed");
}

// More compute threads than the cores this process may use: ggml's threads meet at a barrier
// after every op, spinning (--poll), so each op waits for threads that have no core (64 threads
// on 2 cores took minutes per token). Said, not refused: parity is checked at 4 threads on 2.
void warn_oversubscribed(const Args & args) {
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
    const int cores = CPU_COUNT(&allowed);
    if (args.threads > cores) {
        std::cerr << "dgr-shard-worker: warning: --threads " << args.threads << " is more than the " << cores
                  << " cores this process may use: every op's threads wait for cores, expect it many times slower"
                  << std::endl;
    }
}

// serves until SIGTERM/SIGINT, then drains: new streams refused, those in flight finish within
// --drain-seconds
int serve(Args & args) {
    restrict_cpus(args);
    warn_oversubscribed(args);
    place_compute_slots(args);
    args.prio = resolve_prio(args);
    std::unique_ptr<dgr::ShardEngine> engine = open_engine(args);
    std::unique_ptr<dgr::worker::ShardService> service_ptr;
    try {
        service_ptr = std::make_unique<dgr::worker::ShardService>(std::move(engine), args.service, peer_options(args));
    } catch (const std::exception & e) {
        fail(2, e.what());
    }
    dgr::worker::ShardService & service = *service_ptr;
    if (!args.metrics_listen.empty()) {
        try {
            const int metrics_port = service.metrics().listen(args.metrics_listen);
            std::cout << "DGR-WORKER-METRICS port=" << metrics_port << std::endl;
        } catch (const std::exception & e) {
            fail(4, e.what());
        }
    }
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    std::unique_ptr<dgr::worker::Listener> listener = own_listener(args);
    if (listener) {
        port = listener->port();
    } else {
        builder.AddListeningPort(args.listen, server_credentials(args), &port);
    }
    configure_server(builder, args);
    builder.RegisterService(&service);
    dgr::worker::TokenizerService tokenizer(service.engine(),
                                            [&service](grpc::ServerContext * ctx) { return service.authorize(ctx); });
    builder.RegisterService(&tokenizer);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server || port == 0) fail(4, "cannot listen on " + args.listen + " (in use, not this host's, or TLS credentials gRPC refused: its error above says which)");
    if (listener) listener->start(server.get(), [&service](std::shared_ptr<dgr::worker::FrameConn> conn) { service.serve_data(conn); });
    server->GetHealthCheckService()->SetServingStatus(true);
    // the launcher reads this line to learn the port (and that the model is loaded and warm)
    std::cout << "DGR-WORKER-READY port=" << port << std::endl;

    std::signal(SIGTERM, [](int) { g_stop.store(true); });
    std::signal(SIGINT, [](int) { g_stop.store(true); });
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    service.set_draining();
    server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(args.drain_seconds));
    if (listener) listener->stop(std::chrono::seconds(args.drain_seconds));
    std::cout << "DGR-WORKER-STOPPED" << std::endl;
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    // glibc gives every thread that allocates an arena of its own and keeps what it frees there;
    // gRPC's handler threads come and go with the streams, so a long-running worker's RSS would
    // creep up arena by arena. A few shared arenas keep it flat (the soak checks it).
    mallopt(M_ARENA_MAX, 2);
    Args args;
    if (const int code = dgr::worker::parse_options(argc, argv, args); code >= 0) return code;
    try {
        return serve(args);
    } catch (const Exit & e) {
        return e.code;
    }
}
