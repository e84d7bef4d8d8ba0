#include "datalink.h"
#include "clock.h"

#include <grpcpp/server_posix.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

namespace {

// TCP_NODELAY: a small message (a boundary, a token) goes out at once, not after the peer's
// delayed ACK of the one before
void send_at_once(int fd) {
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// a data stream's socket: sends at once, and TCP_USER_TIMEOUT (data unacknowledged for the
// keepalive bound breaks the stream, where the peer's host vanished)
void tune(int fd, int keepalive_ms) {
    send_at_once(fd);
    unsigned timeout = (unsigned) (keepalive_ms + keepalive_ms / 2);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout, sizeof(timeout));
}

std::string errno_text(const char * what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

bool split_address(const std::string & address, std::string * host, std::string * port) {
    const auto colon = address.rfind(':');
    if (colon == std::string::npos || colon + 1 == address.size()) return false;
    *host = address.substr(0, colon);
    *port = address.substr(colon + 1);
    if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
    // getaddrinfo takes a numeric port past 65535 modulo 2**16 (99999 binds or dials 34463)
    const bool digits = port->size() <= 5 && std::all_of(port->begin(), port->end(), ::isdigit);
    return !host->empty() && digits && std::stoul(*port) <= 65535;
}

bool peer_address(const std::string & address) {
    if (address.rfind("unix:", 0) == 0) return address.size() > 5;
    std::string host, port;
    return split_address(address, &host, &port) && std::stoul(port) != 0;
}

void encode_frame_header(dgr::v1::DataFrame kind, uint32_t n, uint8_t out[kFrameHeader]) {
    for (int i = 0; i < 4; ++i) out[i] = (uint8_t) ((n >> (8 * i)) & 0xff);
    out[4] = (uint8_t) kind;
}

std::string encode_frame(dgr::v1::DataFrame kind, const std::string & payload) {
    std::string f(kFrameHeader, '\0');
    encode_frame_header(kind, (uint32_t) payload.size(), (uint8_t *) f.data());
    return f + payload;
}

Status decode_frame_header(const uint8_t * header, uint64_t max_payload, dgr::v1::DataFrame * kind, uint32_t * length) {
    const uint32_t n = (uint32_t) header[0] | (uint32_t) header[1] << 8 | (uint32_t) header[2] << 16 |
                       (uint32_t) header[3] << 24;
    const int k = header[4];
    if (k == dgr::v1::DATA_FRAME_UNSPECIFIED || !dgr::v1::DataFrame_IsValid(k)) {
        return Status(StatusCode::INVALID_ARGUMENT, "data stream: unknown frame kind " + std::to_string(k));
    }
    if (n > max_payload) {
        return Status(StatusCode::INVALID_ARGUMENT, "data stream: a frame of " + std::to_string(n) +
                                                        " bytes, more than the " + std::to_string(max_payload) +
                                                        " this worker takes");
    }
    if ((k == dgr::v1::DATA_FRAME_ALIVE) && n != 0) {
        return Status(StatusCode::INVALID_ARGUMENT, "data stream: an ALIVE frame carries no payload");
    }
    *kind = (dgr::v1::DataFrame) k;
    *length = n;
    return Status::OK;
}

const std::vector<std::string> & data_capabilities() {
    static const std::vector<std::string> kCapabilities = {"cohorts", "draft-parts", "prefix-reuse", "mtp"};
    return kCapabilities;
}

dgr::v1::DataHello make_hello(dgr::v1::DataStream stream, const std::string & token) {
    dgr::v1::DataHello hello;
    hello.set_stream(stream);
    hello.set_token(token);
    hello.set_version(kDataVersion);
    for (const auto & c : data_capabilities()) hello.add_capabilities(c);
    return hello;
}

Status check_hello(const dgr::v1::DataHello & hello) {
    const uint32_t version = hello.version() == 0 ? 1 : hello.version();
    if (version != kDataVersion) {
        return Status(StatusCode::FAILED_PRECONDITION,
                      "data stream: the peer speaks data-plane version " + std::to_string(version) +
                          ", this worker version " + std::to_string(kDataVersion) +
                          " (every stage of a route runs the same DGR build)");
    }
    const auto & mine = data_capabilities();
    for (const std::string & c : hello.capabilities()) {
        if (std::find(mine.begin(), mine.end(), c) == mine.end()) {
            std::string have;
            for (const auto & m : mine) have += (have.empty() ? "" : ", ") + m;
            return Status(StatusCode::FAILED_PRECONDITION,
                          "data stream: the peer's HELLO needs capability '" + c.substr(0, 64) +
                              "', which this worker (data-plane version " + std::to_string(kDataVersion) +
                              ": " + have + ") lacks");
        }
    }
    return Status::OK;
}

FrameConn::FrameConn(int fd, int keepalive_ms, uint64_t max_payload)
    : fd_(fd), keepalive_ms_(keepalive_ms), max_payload_(max_payload), last_sent_ms_(steady_ms()) {
    tune(fd_, keepalive_ms_);
}

FrameConn::~FrameConn() { ::close(fd_); }

bool FrameConn::send_raw(const void * data, size_t n) {
    const char * p = (const char *) data;
    while (n > 0) {
        const ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += w;
        n -= (size_t) w;
    }
    last_sent_ms_.store(steady_ms());
    return true;
}

bool FrameConn::send(dgr::v1::DataFrame kind, const google::protobuf::MessageLite * message) {
    const size_t n = message ? message->ByteSizeLong() : 0;
    if (n > max_payload_ || n > UINT32_MAX) return false;
    std::string frame(kFrameHeader + n, '\0');
    encode_frame_header(kind, (uint32_t) n, (uint8_t *) frame.data());
    if (message && !message->SerializeToArray(frame.data() + kFrameHeader, (int) n)) return false;
    std::lock_guard<std::mutex> lock(send_mutex_);
    return send_raw(frame.data(), frame.size());
}

void FrameConn::beat() {
    if (steady_ms() - last_sent_ms_.load() < keepalive_ms_ / 2) return;
    std::unique_lock<std::mutex> lock(send_mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return;  // a frame is going out: that is a sign of life already
    uint8_t alive[kFrameHeader];
    encode_frame_header(dgr::v1::DATA_FRAME_ALIVE, 0, alive);
    send_raw(alive, sizeof(alive));
}

Status FrameConn::fill(size_t need, bool * ended) {
    *ended = false;
    if (in_at_ > 0 && in_at_ == in_.size()) {
        in_.clear();
        in_at_ = 0;
    }
    const int64_t silent_ms = keepalive_ms_ + keepalive_ms_ / 2;
    int64_t heard = steady_ms();
    while (in_.size() - in_at_ < need) {
        const int64_t left = silent_ms - (steady_ms() - heard);
        if (left <= 0) {
            return Status(StatusCode::UNAVAILABLE,
                          "the peer sent nothing for " + std::to_string(silent_ms) + " ms (keepalive)");
        }
        pollfd p{fd_, POLLIN, 0};
        const int ready = ::poll(&p, 1, (int) left);
        if (ready < 0) {
            if (errno == EINTR) continue;
            return Status(StatusCode::UNAVAILABLE, errno_text("data stream: poll"));
        }
        if (ready == 0) continue;
        char buf[1 << 16];
        const ssize_t r = ::recv(fd_, buf, sizeof(buf), 0);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return Status(StatusCode::UNAVAILABLE, errno_text("data stream"));
        }
        if (r == 0) {
            if (in_.size() == in_at_) {
                *ended = true;
                return Status::OK;
            }
            return Status(StatusCode::UNAVAILABLE, "data stream: the peer closed it within a frame");
        }
        in_.append(buf, (size_t) r);
        heard = steady_ms();
    }
    return Status::OK;
}

Status FrameConn::receive(dgr::v1::DataFrame * kind, std::string * payload, bool * ended) {
    for (;;) {
        if (Status st = fill(kFrameHeader, ended); !st.ok() || *ended) return st;
        uint32_t n = 0;
        if (Status st = decode_frame_header((const uint8_t *) in_.data() + in_at_, max_payload_, kind, &n); !st.ok()) {
            return st;
        }
        if (Status st = fill(kFrameHeader + n, ended); !st.ok()) return st;
        if (*ended) return Status(StatusCode::UNAVAILABLE, "data stream: the peer closed it within a frame");
        payload->assign(in_, in_at_ + kFrameHeader, n);
        in_at_ += kFrameHeader + n;
        if (*kind != dgr::v1::DATA_FRAME_ALIVE) return Status::OK;
    }
}

Status FrameConn::receive_message(dgr::v1::DataFrame want, google::protobuf::MessageLite * message, bool * ended) {
    dgr::v1::DataFrame kind{};
    std::string payload;
    if (Status st = receive(&kind, &payload, ended); !st.ok() || *ended) return st;
    if (kind != want) {
        return Status(StatusCode::INVALID_ARGUMENT, "data stream: a " + dgr::v1::DataFrame_Name(kind) +
                                                        " frame where " + dgr::v1::DataFrame_Name(want) +
                                                        " was expected");
    }
    if (!message->ParseFromString(payload)) {
        return Status(StatusCode::INVALID_ARGUMENT,
                      "data stream: a " + dgr::v1::DataFrame_Name(kind) + " frame that does not parse as " +
                          message->GetTypeName());
    }
    return Status::OK;
}

void FrameConn::shutdown_write() { ::shutdown(fd_, SHUT_WR); }
void FrameConn::abort() { ::shutdown(fd_, SHUT_RDWR); }

std::unique_ptr<FrameConn> connect_data(const std::string & address, const dgr::v1::DataHello & hello,
                                        int keepalive_ms, uint64_t max_payload, std::chrono::milliseconds timeout,
                                        std::string * error) {
    std::string host, port;
    if (!split_address(address, &host, &port)) {
        *error = "not HOST:PORT: " + address;
        return nullptr;
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found = nullptr;
    if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
        *error = "cannot resolve " + address + ": " + gai_strerror(rc);
        return nullptr;
    }
    std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> list(found, freeaddrinfo);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    *error = "cannot connect to " + address;
    for (addrinfo * ai = found; ai; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) continue;
        int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
            pollfd p{fd, POLLOUT, 0};
            int err = ETIMEDOUT;
            if (left.count() > 0 && ::poll(&p, 1, (int) left.count()) == 1) {
                socklen_t len = sizeof(err);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            }
            rc = err == 0 ? 0 : -1;
            errno = err;
        }
        if (rc < 0) {
            *error = errno_text(("cannot connect to " + address).c_str());
            ::close(fd);
            continue;
        }
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        auto conn = std::make_unique<FrameConn>(fd, keepalive_ms, max_payload);
        if (!conn->send_raw(kDataMagic, sizeof(kDataMagic)) || !conn->send(dgr::v1::DATA_FRAME_HELLO, &hello)) {
            *error = errno_text(("cannot open a data stream to " + address).c_str());
            return nullptr;
        }
        error->clear();
        return conn;
    }
    return nullptr;
}

namespace {

class Heartbeats {
public:
    static Heartbeats & get() {
        static Heartbeats * h = new Heartbeats();  // never destroyed: its thread outlives main's objects
        return *h;
    }
    void add(const std::shared_ptr<FrameConn> & conn) {
        std::lock_guard<std::mutex> lock(mutex_);
        interval_ms_ = std::min(interval_ms_, std::max(50, conn->keepalive_ms() / 4));
        conns_.push_back(conn);
        if (!thread_.joinable()) {
            thread_ = std::thread([this] { run(); });
            pthread_setname_np(thread_.native_handle(), "dgr-heartbeat");  // one per process, for good
        }
    }

private:
    void run() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            cv_.wait_for(lock, std::chrono::milliseconds(interval_ms_));
            std::vector<std::shared_ptr<FrameConn>> live;
            std::vector<std::weak_ptr<FrameConn>> kept;
            for (auto & w : conns_) {
                if (auto c = w.lock()) {
                    live.push_back(std::move(c));
                    kept.push_back(w);
                }
            }
            conns_.swap(kept);
            lock.unlock();
            for (auto & c : live) c->beat();
            live.clear();
            lock.lock();
        }
    }
    std::mutex mutex_;
    std::condition_variable cv_;
    int interval_ms_ = 2500;
    std::vector<std::weak_ptr<FrameConn>> conns_;
    std::thread thread_;
};

}  // namespace

void keep_alive(const std::shared_ptr<FrameConn> & conn) { Heartbeats::get().add(conn); }

Listener::Listener(const std::string & address, ListenerLimits limits) : limits_(limits) {
    std::string host, port;
    if (!split_address(address, &host, &port)) throw std::invalid_argument("--listen: not HOST:PORT: " + address);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo * found = nullptr;
    if (int rc = getaddrinfo(host == "*" ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0) {
        throw std::invalid_argument("--listen: cannot resolve " + address + ": " + gai_strerror(rc));
    }
    std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> list(found, freeaddrinfo);
    std::string why = "no address";
    for (addrinfo * ai = found; ai; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
            sockaddr_storage bound{};
            socklen_t len = sizeof(bound);
            getsockname(fd, (sockaddr *) &bound, &len);
            port_ = ntohs(bound.ss_family == AF_INET6 ? ((sockaddr_in6 *) &bound)->sin6_port
                                                      : ((sockaddr_in *) &bound)->sin_port);
            fd_ = fd;
            return;
        }
        why = std::strerror(errno);
        ::close(fd);
    }
    throw std::invalid_argument("--listen: cannot listen on " + address + ": " + why);
}

namespace {

// HTTP/2's connection preface, which a gRPC client sends first
constexpr char kHttp2Preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kHttp2PrefaceLen = sizeof(kHttp2Preface) - 1;

}  // namespace

Opening classify_opening(const uint8_t * bytes, size_t n, uint32_t max_hello) {
    if (n == 0) return Opening::wait;
    if (bytes[0] == (uint8_t) kDataMagic[0]) {
        const size_t m = std::min(n, sizeof(kDataMagic));
        if (std::memcmp(bytes, kDataMagic, m) != 0) return Opening::refuse;  // not the data magic
        if (n < sizeof(kDataMagic) + kFrameHeader) return Opening::wait;
        dgr::v1::DataFrame kind{};
        uint32_t length = 0;
        // a frame header that does not decode, a HELLO over max_hello, another frame before it
        if (!decode_frame_header(bytes + sizeof(kDataMagic), max_hello, &kind, &length).ok()) return Opening::refuse;
        if (kind != dgr::v1::DATA_FRAME_HELLO) return Opening::refuse;
        return n < sizeof(kDataMagic) + kFrameHeader + length ? Opening::wait : Opening::data;
    }
    const size_t m = std::min(n, kHttp2PrefaceLen);
    if (std::memcmp(bytes, kHttp2Preface, m) != 0) return Opening::refuse;  // neither protocol
    return n < kHttp2PrefaceLen ? Opening::wait : Opening::grpc;
}

// a connection the event loop holds until its first bytes classify it
struct Listener::Pending {
    int fd;
    std::chrono::steady_clock::time_point deadline;
};

Listener::~Listener() { stop(std::chrono::milliseconds(2000)); }

void Listener::start(grpc::Server * server, OnData on_data) {
    server_ = server;
    on_data_ = std::move(on_data);
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epoll_ < 0 || wake_ < 0) throw std::runtime_error(errno_text("listener: epoll"));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd_;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd_, &ev);
    ev.data.fd = wake_;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
    loop_ = std::thread([this] { event_loop(); });
    pthread_setname_np(loop_.native_handle(), "dgr-accept");
}

void Listener::event_loop() {
    // pending connections in the order they came, which is also their deadlines' order; a
    // settled one leaves a -1 behind, swept from the front
    std::vector<Pending> pending;
    size_t front = 0, waiting = 0;
    std::vector<uint8_t> peek(sizeof(kDataMagic) + kFrameHeader + std::max<size_t>(limits_.max_hello, kHttp2PrefaceLen));
    std::vector<epoll_event> events(256);
    auto drop = [&](Pending & p) {
        ::epoll_ctl(epoll_, EPOLL_CTL_DEL, p.fd, nullptr);
        ::close(p.fd);
        p.fd = -1;
        --waiting;
    };
    auto sweep = [&] {
        while (front < pending.size() && pending[front].fd < 0) ++front;
        if (front > 1024 && front * 2 > pending.size()) {  // compact now and then
            pending.erase(pending.begin(), pending.begin() + (std::ptrdiff_t) front);
            front = 0;
        }
    };
    while (!stopping_.load()) {
        sweep();
        int timeout = -1;
        if (front < pending.size()) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(pending[front].deadline -
                                                                                    std::chrono::steady_clock::now());
            timeout = (int) std::max<int64_t>(0, left.count() + 1);
        }
        const int n = ::epoll_wait(epoll_, events.data(), (int) events.size(), timeout);
        if (n < 0 && errno != EINTR) break;
        for (int i = 0; i < n; ++i) {
            const int fd = events[(size_t) i].data.fd;
            if (fd == wake_) continue;
            if (fd == fd_) {
                for (;;) {  // everything the kernel queued
                    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
                    if (c < 0) {
                        if (errno == EINTR || errno == ECONNABORTED) continue;
                        if ((errno == EMFILE || errno == ENFILE) && waiting > 0) {
                            sweep();
                            drop(pending[front]);  // the oldest unclassified one makes room
                            continue;
                        }
                        if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(50));
                        break;
                    }
                    send_at_once(c);  // every connection it accepts, classified or not yet
                    if (waiting >= limits_.max_pending) {
                        sweep();
                        drop(pending[front]);
                    }
                    epoll_event ev{};
                    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;  // edge: peeked bytes do not wake it again
                    ev.data.fd = c;
                    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, c, &ev) != 0) {
                        ::close(c);
                        continue;
                    }
                    pending.push_back(Pending{c, std::chrono::steady_clock::now() + limits_.hello_timeout});
                    ++waiting;
                }
                continue;
            }
            if (examine(fd, events[(size_t) i].events, peek)) {
                // settled: forget it (its place in `pending` is found by fd, newest last)
                for (size_t k = pending.size(); k-- > front;) {
                    if (pending[k].fd == fd) {
                        pending[k].fd = -1;
                        --waiting;
                        break;
                    }
                }
            }
        }
        const auto now = std::chrono::steady_clock::now();
        for (size_t k = front; k < pending.size() && pending[k].deadline <= now; ++k) {
            if (pending[k].fd >= 0) drop(pending[k]);  // silent or too slow: closed
        }
    }
    for (size_t k = front; k < pending.size(); ++k) {
        if (pending[k].fd >= 0) ::close(pending[k].fd);
    }
}

bool Listener::examine(int fd, uint32_t events, std::vector<uint8_t> & peek) {
    const ssize_t r = ::recv(fd, peek.data(), peek.size(), MSG_PEEK | MSG_DONTWAIT);
    Opening kind = Opening::refuse;
    if (r > 0) {
        kind = classify_opening(peek.data(), (size_t) r, limits_.max_hello);
        // the peer closed (or broke) the connection before it said enough: it will say no more
        if (kind == Opening::wait && (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) kind = Opening::refuse;
    } else if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
        kind = (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) ? Opening::refuse : Opening::wait;
    }
    if (kind == Opening::wait) return false;
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    hand_over(fd, kind);
    return true;
}

void Listener::hand_over(int fd, Opening kind) {
    if (stopping_.load() || kind == Opening::refuse) {
        ::close(fd);
        return;
    }
    if (kind == Opening::grpc) {
        // gRPC owns the socket from here, and reads it without blocking. Its own listener would
        // have set TCP_NODELAY (set at accept): without it, Nagle held a reply (a token to the
        // coordinator) while an earlier segment was unacknowledged, until the client's delayed ACK
        grpc::AddInsecureChannelFromFd(server_, fd);
        return;
    }
    char magic[sizeof(kDataMagic)];
    ::recv(fd, magic, sizeof(magic), MSG_DONTWAIT);  // peeked already: the HELLO follows, whole
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    auto conn = std::make_shared<FrameConn>(fd, limits_.keepalive_ms, limits_.max_payload);
    std::unique_lock<std::mutex> lock(mutex_);
    if ((size_t) live_ >= limits_.max_streams) {
        lock.unlock();
        dgr::v1::DataEnd end;  // a small frame into an empty socket buffer: it does not block
        end.set_code((int32_t) StatusCode::RESOURCE_EXHAUSTED);
        end.set_message("this worker serves " + std::to_string(limits_.max_streams) +
                        " data streams at once (--max-data-streams); try again later");
        conn->send(dgr::v1::DATA_FRAME_END, &end);
        return;
    }
    ++live_;
    streams_.erase(std::remove_if(streams_.begin(), streams_.end(),
                                  [](const std::weak_ptr<FrameConn> & w) { return w.expired(); }),
                   streams_.end());
    streams_.push_back(conn);
    lock.unlock();
    try {
        std::thread([this, conn]() mutable { serve(std::move(conn)); }).detach();
    } catch (const std::system_error &) {  // no thread to be had: the stream goes, and its count
        lock.lock();
        --live_;
        idle_cv_.notify_all();
    }
}

void Listener::serve(std::shared_ptr<FrameConn> conn) {
    keep_alive(conn);
    on_data_(conn);
    conn.reset();
    std::lock_guard<std::mutex> lock(mutex_);
    --live_;
    idle_cv_.notify_all();
}

void Listener::stop(std::chrono::milliseconds grace) {
    if (fd_ < 0 || stopping_.exchange(true)) return;
    if (loop_.joinable()) {
        const uint64_t one = 1;
        if (::write(wake_, &one, sizeof(one)) < 0) { /* the loop also sees stopping_ on its next wake */ }
        loop_.join();
    }
    ::close(fd_);
    if (epoll_ >= 0) ::close(epoll_);
    if (wake_ >= 0) ::close(wake_);
    // streams in flight finish within the grace; the rest are cut
    std::unique_lock<std::mutex> lock(mutex_);
    if (idle_cv_.wait_for(lock, grace, [this] { return live_ == 0; })) return;
    for (auto & w : streams_) {
        if (auto c = w.lock()) c->abort();
    }
    idle_cv_.wait_for(lock, std::chrono::seconds(2), [this] { return live_ == 0; });
}

}  // namespace dgr::worker
