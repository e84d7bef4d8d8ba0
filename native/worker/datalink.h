// The direct data plane (proto/dgr/v1/shard.proto, DataFrame): forward mode's links between
// plaintext workers as framed TCP streams on the worker's own port, read and written by the
// threads that compute. Over gRPC a boundary arriving at a stage woke a poller thread, which woke
// the handler blocked in Read: two wake-ups per seam on the token's critical path, each one a
// scheduler latency on a host whose cores the stages share. Here the kernel wakes the thread
// that computes.
//
// - Listener: the worker's port. It tells a data stream ("DGR1") from a gRPC connection by its
//   first bytes and hands the latter to the gRPC server, so one address serves both and whatever
//   stands in front of it (a proxy, a port forward) carries both. Connections wait in one event
//   loop, bounded in count, bytes and time, until they are classified (ListenerLimits).
// - FrameConn: one connected stream; frames in and out, heartbeats (ALIVE) sent for it by one
//   thread of the process, and a peer that sent nothing for keepalive x 1.5 dropped.
// - connect_data: the connecting side (DataLink in forwarding.h).
#pragma once

#include "dgr/v1/shard.pb.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dgr::worker {

constexpr char kDataMagic[4] = {'D', 'G', 'R', '1'};
// The data plane's protocol version (DataHello.version) and what this build's streams may carry
// beyond its frames (DataHello.capabilities): cohorts of batched steps, drafted steps in parts,
// prefix reuse, MTP drafts
constexpr uint32_t kDataVersion = 1;
const std::vector<std::string> & data_capabilities();
// the HELLO a connecting side of this build sends for `stream`
dgr::v1::DataHello make_hello(dgr::v1::DataStream stream, const std::string & token);
// a HELLO this worker can serve: its version (FAILED_PRECONDITION naming both versions) and every
// capability it lists (FAILED_PRECONDITION naming the one this worker lacks)
grpc::Status check_hello(const dgr::v1::DataHello & hello);
constexpr size_t kFrameHeader = 5;  // uint32 little-endian payload length, one DataFrame byte

// HOST:PORT or [V6]:PORT into its host (brackets dropped) and port; false when it is neither or
// the port is not a number in 0..65535
bool split_address(const std::string & address, std::string * host, std::string * port);

// an address a stage can dial: HOST:PORT with a port in 1..65535, or unix:PATH
bool peer_address(const std::string & address);

// a frame's header for a payload of n bytes: uint32 little-endian length, then the kind
void encode_frame_header(dgr::v1::DataFrame kind, uint32_t n, uint8_t out[kFrameHeader]);
// a whole frame: the header, then the payload
std::string encode_frame(dgr::v1::DataFrame kind, const std::string & payload);

// a frame's header, checked: a known kind and a payload of at most max_payload bytes
grpc::Status decode_frame_header(const uint8_t * header, uint64_t max_payload, dgr::v1::DataFrame * kind,
                                 uint32_t * length);

class FrameConn {
public:
    // takes the connected socket (closed on destruction); frames of at most max_payload bytes
    FrameConn(int fd, int keepalive_ms, uint64_t max_payload);
    ~FrameConn();
    FrameConn(const FrameConn &) = delete;
    FrameConn & operator=(const FrameConn &) = delete;

    // one frame (payload: the message, or none); false when the stream is broken
    bool send(dgr::v1::DataFrame kind, const google::protobuf::MessageLite * message = nullptr);
    bool send_raw(const void * data, size_t n);  // bytes as they are (the magic)

    // the next frame that is not a heartbeat. OK with *kind set; OK with *ended when the peer
    // closed the stream between frames; otherwise why the stream is broken (a malformed frame,
    // a reset, or a peer silent for keepalive x 1.5)
    grpc::Status receive(dgr::v1::DataFrame * kind, std::string * payload, bool * ended);
    // a message of the kind expected next; INVALID_ARGUMENT naming the frame otherwise
    grpc::Status receive_message(dgr::v1::DataFrame want, google::protobuf::MessageLite * message, bool * ended);

    void shutdown_write();  // the peer reads the end of the stream
    void abort();           // both directions: a thread blocked in receive returns

    // the heartbeat: ALIVE unless something was sent within half the keepalive (never blocks)
    void beat();
    int keepalive_ms() const { return keepalive_ms_; }

private:
    grpc::Status fill(size_t need, bool * ended);  // at least `need` bytes buffered

    int fd_;
    const int keepalive_ms_;
    const uint64_t max_payload_;
    std::mutex send_mutex_;
    std::atomic<int64_t> last_sent_ms_;
    std::string in_;   // received, not yet taken
    size_t in_at_ = 0;
};

// Connects to HOST:PORT within timeout, opens a data stream (magic, HELLO) and returns it.
std::unique_ptr<FrameConn> connect_data(const std::string & address, const dgr::v1::DataHello & hello,
                                        int keepalive_ms, uint64_t max_payload, std::chrono::milliseconds timeout,
                                        std::string * error);

// The heartbeat thread of the process: every registered stream gets beat() every quarter of its
// keepalive. Streams are held weakly; the thread starts with the first one.
void keep_alive(const std::shared_ptr<FrameConn> & conn);

// What a connection may do before the worker serves it. Until then it costs a socket and a
// place in the listener's one event loop, never a thread: it must send the data magic and a
// HELLO frame of at most max_hello bytes, or HTTP/2's preface (gRPC), within hello_timeout, else
// it is closed; one that closes or stalls part-way is dropped as soon as the kernel says so.
struct ListenerLimits {
    int keepalive_ms = 10000;
    uint64_t max_payload = 128ull << 20;       // a frame's payload, once served
    uint32_t max_hello = 4096;                 // bytes of HELLO payload before authentication
    std::chrono::milliseconds hello_timeout{5000};
    size_t max_pending = 1024;                 // connections not yet classified; past it the oldest goes
    size_t max_streams = 64;                   // data streams served at once; past it refused (END)
};

// How a connection's first bytes classify it (pure: the listener's decision, testable alone)
enum class Opening { wait, data, grpc, refuse };
Opening classify_opening(const uint8_t * bytes, size_t n, uint32_t max_hello);

// The worker's port (plaintext): accepts connections, passes gRPC ones to the server and data
// streams to on_data, each served stream on a thread of its own (as gRPC's sync server gives
// each call one), at most limits.max_streams at once.
class Listener {
public:
    using OnData = std::function<void(std::shared_ptr<FrameConn>)>;
    // binds HOST:PORT ([V6]:PORT; port 0 picks one); throws std::invalid_argument when it cannot
    Listener(const std::string & address, ListenerLimits limits);
    ~Listener();  // stop()
    int port() const { return port_; }
    void start(grpc::Server * server, OnData on_data);
    // no more connections; data streams in flight may finish within `grace`, then are cut
    void stop(std::chrono::milliseconds grace);

private:
    struct Pending;
    void event_loop();
    void accept_all(std::vector<Pending> & pending);
    bool examine(int fd, uint32_t events, std::vector<uint8_t> & peek);  // true: settled (gone from the loop)
    void hand_over(int fd, Opening kind);
    void serve(std::shared_ptr<FrameConn> conn);

    int fd_ = -1, port_ = 0, epoll_ = -1, wake_ = -1;
    const ListenerLimits limits_;
    grpc::Server * server_ = nullptr;
    OnData on_data_;
    std::thread loop_;
    std::atomic<bool> stopping_{false};
    std::mutex mutex_;
    std::condition_variable idle_cv_;
    int live_ = 0;  // threads serving a data stream
    std::vector<std::weak_ptr<FrameConn>> streams_;
};

}  // namespace dgr::worker
