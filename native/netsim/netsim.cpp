// dgr-netsim: a simulated WAN link for benches and chaos runs (this kernel has no netem).
//
// A TCP proxy in front of one upstream address. Every byte is delivered `--latency-ms` after it
// arrived, in order, through a link of `--mbps` (unlimited by default), in both directions. Each
// direction of each connection has a reader thread (blocking recv, stamps the chunk with its due
// time: the kernel's receive stamp plus the latency) and a writer thread (sleeps until the chunk is
// due on CLOCK_MONOTONIC, its timer aimed early by its own measured oversleep, then sends it): the
// link itself takes no CPU between chunks and adds no latency of its own, where the asyncio proxy
// it replaces took 0.3-0.7 ms of a shared core per crossing.
//
// Prints `DGR-NETSIM-READY port=N` once it listens. With --control it reads fault commands on
// stdin, one per line, and answers `DGR-NETSIM-OK` once each is applied:
//   blackhole on|off  from now on every byte is dropped and connections stay open (no FIN, no
//                     RST), as a dead path looks to both ends; a connection that lost bytes
//                     stays dead; a connection accepted meanwhile opens and passes nothing
//   reset             every open connection is closed with an RST on both sides
//   corrupt N         flip one byte in each of the next N chunks of at least 1 KiB travelling
//                     toward the upstream (boundaries)
//   delay MS          add MS to the one-way latency (a spike; `delay 0` ends it)
//   stats             answers `DGR-NETSIM-OK key=value ...`: how late chunks left against their
//                     due time (percentiles, us) and the readers' mean wake-up lag

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
    std::string upstream_host, listen_host = "127.0.0.1";
    int upstream_port = 0, listen_port = 0;
    double latency_s = 0.0;
    double bits_per_s = 0.0;  // 0: unlimited
    bool control = false;
};

int64_t now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void sleep_until(int64_t due_ns) {
    timespec ts{(time_t) (due_ns / 1000000000), (long) (due_ns % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
    }
}

// When bytes reached the socket, on CLOCK_MONOTONIC: the kernel's receive timestamp
// (SO_TIMESTAMPNS, CLOCK_REALTIME) moved onto the monotonic clock, so the reader thread's own
// wake-up does not lengthen the link; `now` where the kernel gave none.
int64_t arrival_ns(const msghdr & msg, int64_t now) {
    for (cmsghdr * c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr *>(&msg), c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
            timespec stamp{};
            std::memcpy(&stamp, CMSG_DATA(c), sizeof stamp);
            timespec real{};
            clock_gettime(CLOCK_REALTIME, &real);
            const int64_t age = ((int64_t) real.tv_sec - stamp.tv_sec) * 1000000000 + (real.tv_nsec - stamp.tv_nsec);
            return age >= 0 && age < 1000000000 ? now - age : now;
        }
    }
    return now;
}

// How late the link delivers each chunk against its due time (send() returning, less the due
// time): the link's accuracy, which `stats` reports as percentiles, for chunks of a decode step's
// size (under 8 KiB: boundaries of a token or two, token ids, replies) and for all, with the
// reader's mean wake-up after the bytes arrived (kept off the link by the kernel's stamp).
class Accuracy {
public:
    static constexpr size_t kSmall = 8 << 10;
    void add(size_t bytes, int64_t late_ns, int64_t stamp_lag_ns) {
        std::lock_guard<std::mutex> lock(mu_);
        if (bytes < kSmall) small_.add(late_ns);
        all_.add(late_ns);
        lag_sum_ns_ += stamp_lag_ns;
        ++chunks_;
    }
    std::string report() {
        std::lock_guard<std::mutex> lock(mu_);
        char line[512];
        std::snprintf(line, sizeof line,
                      "chunks=%lld small_late_p10_us=%d small_late_p50_us=%d small_late_p90_us=%d small_chunks=%lld "
                      "all_late_p50_us=%d all_late_p90_us=%d stamp_lag_mean_us=%.1f",
                      (long long) chunks_, small_.percentile(0.1), small_.percentile(0.5), small_.percentile(0.9),
                      (long long) small_.n, all_.percentile(0.5), all_.percentile(0.9),
                      chunks_ > 0 ? (double) lag_sum_ns_ / (double) chunks_ / 1e3 : 0.0);
        return line;
    }

private:
    // lateness in whole microseconds, -1000..9999 (clamped at both ends)
    struct Histogram {
        static constexpr int kLo = -1000, kHi = 9999;
        std::vector<int64_t> bins = std::vector<int64_t>(kHi - kLo + 1, 0);
        int64_t n = 0;
        void add(int64_t late_ns) {
            const int64_t us = std::clamp<int64_t>(late_ns / 1000, kLo, kHi);
            ++bins[(size_t) (us - kLo)];
            ++n;
        }
        int percentile(double q) const {
            int64_t seen = 0;
            for (size_t i = 0; i < bins.size(); ++i) {
                seen += bins[i];
                if (n > 0 && (double) seen >= q * (double) n) return (int) i + kLo;
            }
            return 0;
        }
    };
    std::mutex mu_;
    Histogram small_, all_;
    int64_t lag_sum_ns_ = 0, chunks_ = 0;
};
Accuracy g_accuracy;

// Aims a writer's timer early by the least of its recent oversleeps (a halted vCPU's timer wake
// takes tens of microseconds here), so bytes leave at their due time rather than one wake-up after
// it. The aim falls to a shorter oversleep at once and rises toward a longer one slowly, by 1/16 of
// the gap, capped at 50 us: a wake-up that comes early by the aim is rare, and one delayed by a
// busy core does not drag the aim with it.
class AimedTimer {
public:
    explicit AimedTimer(int64_t latency_ns) : cap_ns_(std::min<int64_t>(latency_ns / 4, 50000)) {}
    void sleep_until_due(int64_t due_ns) {
        const int64_t target = due_ns - aim_ns_;
        if (target <= now_ns()) return;
        sleep_until(target);
        const int64_t over = std::min(now_ns() - target, cap_ns_);  // this wake-up's oversleep
        aim_ns_ = over < aim_ns_ ? over : aim_ns_ + (over - aim_ns_) / 16;
    }

private:
    int64_t cap_ns_;
    int64_t aim_ns_ = 0;
};

// What a chaos run has turned on (see the header).
struct Faults {
    std::atomic<bool> blackhole{false};
    std::atomic<int> corrupt{0};
    std::atomic<int64_t> extra_ns{0};
};

// One proxied connection: client side `down`, upstream side `up`. Owns both descriptors; the
// last of its four threads to finish closes them.
struct Conn {
    int down = -1, up = -1;
    std::atomic<bool> dead{false};  // lost bytes: nothing more passes, both ways
    ~Conn() {
        if (down >= 0) ::close(down);
        if (up >= 0) ::close(up);
    }
};

class Registry {
public:
    void add(const std::shared_ptr<Conn> & c) {
        std::lock_guard<std::mutex> lock(mu_);
        open_.insert(c);
    }
    void remove(const std::shared_ptr<Conn> & c) {
        std::lock_guard<std::mutex> lock(mu_);
        open_.erase(c);
    }
    // linger 0: the descriptors' close sends an RST instead of a FIN; the shutdown ends the
    // threads blocked on them, the last of which closes them
    void reset_all() {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto & c : open_) {
            const linger lg{1, 0};
            for (int fd : {c->down, c->up}) {
                ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
                ::shutdown(fd, SHUT_RDWR);
            }
        }
        open_.clear();
    }

private:
    std::mutex mu_;
    std::set<std::shared_ptr<Conn>> open_;
};

struct Chunk {
    int64_t due_ns = 0;
    int64_t stamp_lag_ns = 0;  // the reader's wake-up after the bytes arrived (not on the link)
    std::vector<char> data;  // empty: the source ended
};

// One direction of a connection: `from` -> `to`.
class Pump {
public:
    Pump(std::shared_ptr<Conn> conn, int from, int to, bool upstream, const Options & opt, Faults & faults)
        : conn_(std::move(conn)), from_(from), to_(to), upstream_(upstream), opt_(opt), faults_(faults) {}

    void read_loop() {
        int64_t link_free = 0;
        std::vector<char> buf(1 << 16);
        const int on = 1;
        ::setsockopt(from_, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on);
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(timespec))];
        for (;;) {
            iovec iov{buf.data(), buf.size()};
            msghdr msg{};
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control;
            msg.msg_controllen = sizeof control;
            const ssize_t n = ::recvmsg(from_, &msg, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            if (faults_.blackhole.load()) conn_->dead.store(true);
            if (conn_->dead.load()) continue;
            Chunk chunk;
            chunk.data.assign(buf.data(), buf.data() + n);
            if (upstream_ && n >= 1024) {
                int left = faults_.corrupt.load();
                while (left > 0 && !faults_.corrupt.compare_exchange_weak(left, left - 1)) {
                }
                if (left > 0) chunk.data[(size_t) n * 3 / 4] ^= 0x5A;
            }
            const int64_t now = now_ns();
            const int64_t arrived = arrival_ns(msg, now);
            chunk.stamp_lag_ns = now - arrived;
            const int64_t transmit = opt_.bits_per_s > 0 ? (int64_t) (n * 8 / opt_.bits_per_s * 1e9) : 0;
            link_free = std::max(link_free, arrived) + transmit;
            chunk.due_ns = link_free + (int64_t) (opt_.latency_s * 1e9) + faults_.extra_ns.load();
            push(std::move(chunk));
        }
        push(Chunk{});
    }

    void write_loop() {
        AimedTimer timer((int64_t) (opt_.latency_s * 1e9));
        for (;;) {
            Chunk chunk = pop();
            if (chunk.data.empty()) break;
            timer.sleep_until_due(chunk.due_ns);
            if (conn_->dead.load()) continue;
            size_t off = 0;
            while (off < chunk.data.size()) {
                const ssize_t n = ::send(to_, chunk.data.data() + off, chunk.data.size() - off, MSG_NOSIGNAL);
                if (n < 0 && errno == EINTR) continue;
                if (n <= 0) break;
                off += (size_t) n;
            }
            if (off < chunk.data.size()) break;
            g_accuracy.add(chunk.data.size(), now_ns() - chunk.due_ns, chunk.stamp_lag_ns);
        }
        // the source ended (or the destination failed): close both ways, which also ends the
        // opposite direction's reader
        ::shutdown(to_, SHUT_RDWR);
        ::shutdown(from_, SHUT_RDWR);
    }

private:
    void push(Chunk c) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            queue_.push_back(std::move(c));
        }
        cv_.notify_one();
    }
    Chunk pop() {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        Chunk c = std::move(queue_.front());
        queue_.pop_front();
        return c;
    }

    std::shared_ptr<Conn> conn_;
    int from_, to_;
    bool upstream_;
    const Options & opt_;
    Faults & faults_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Chunk> queue_;
};

int connect_upstream(const Options & opt) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const std::string port = std::to_string(opt.upstream_port);
    if (getaddrinfo(opt.upstream_host.c_str(), port.c_str(), &hints, &res) != 0) return -1;
    int fd = -1;
    for (addrinfo * a = res; a != nullptr; a = a->ai_next) {
        fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        ::close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

void no_delay(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void serve(std::shared_ptr<Conn> conn, const Options & opt, Faults & faults, Registry & registry) {
    no_delay(conn->down);
    no_delay(conn->up);
    registry.add(conn);
    Pump toward_up(conn, conn->down, conn->up, true, opt, faults);
    Pump toward_down(conn, conn->up, conn->down, false, opt, faults);
    std::thread threads[] = {
        std::thread([&] { toward_up.read_loop(); }),
        std::thread([&] { toward_up.write_loop(); }),
        std::thread([&] { toward_down.read_loop(); }),
        std::thread([&] { toward_down.write_loop(); }),
    };
    for (auto & t : threads) t.join();
    registry.remove(conn);
}

// a dead path: the connection opens and nothing ever passes
void swallow(int fd) {
    char buf[1 << 14];
    while (::recv(fd, buf, sizeof buf, 0) > 0) {
    }
    ::close(fd);
}

bool parse_address(const std::string & value, std::string & host, int & port) {
    const auto colon = value.rfind(':');
    if (colon == std::string::npos) return false;
    host = value.substr(0, colon);
    char * end = nullptr;
    const long p = std::strtol(value.c_str() + colon + 1, &end, 10);
    if (*end != '\0' || p < 0 || p > 65535) return false;
    port = (int) p;
    return true;
}

[[noreturn]] void usage(const char * why) {
    std::fprintf(stderr,
                 "dgr-netsim: %s\nusage: dgr-netsim --upstream HOST:PORT [--listen HOST:PORT] [--latency-ms MS] "
                 "[--mbps MBIT] [--control]\n",
                 why);
    std::exit(2);
}

Options parse(int argc, char ** argv) {
    Options opt;
    bool have_upstream = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
            return argv[++i];
        };
        auto number = [&](double lo) {
            const std::string v = value();
            char * end = nullptr;
            const double x = std::strtod(v.c_str(), &end);
            if (end == v.c_str() || *end != '\0' || !(x >= lo) || x > 1e9) usage((arg + ": not a number >= 0: " + v).c_str());
            return x;
        };
        if (arg == "--upstream") {
            if (!parse_address(value(), opt.upstream_host, opt.upstream_port)) usage("--upstream: expected HOST:PORT");
            have_upstream = true;
        } else if (arg == "--listen") {
            if (!parse_address(value(), opt.listen_host, opt.listen_port)) usage("--listen: expected HOST:PORT");
        } else if (arg == "--latency-ms") {
            opt.latency_s = number(0.0) / 1000.0;
        } else if (arg == "--mbps") {
            opt.bits_per_s = number(0.0) * 1e6;
            if (opt.bits_per_s <= 0) usage("--mbps: must be > 0");
        } else if (arg == "--control") {
            opt.control = true;
        } else {
            usage(("unknown argument " + arg).c_str());
        }
    }
    if (!have_upstream) usage("--upstream is required");
    return opt;
}

void control_loop(Faults & faults, Registry & registry) {
    std::string line;
    while (std::getline(std::cin, line)) {
        const auto space = line.find(' ');
        const std::string word = line.substr(0, space);
        const std::string arg = space == std::string::npos ? "" : line.substr(space + 1);
        if (word == "blackhole") {
            faults.blackhole.store(arg.rfind("on", 0) == 0);
        } else if (word == "corrupt") {
            faults.corrupt.fetch_add(std::atoi(arg.c_str()));
        } else if (word == "delay") {
            faults.extra_ns.store((int64_t) (std::strtod(arg.c_str(), nullptr) * 1e6));
        } else if (word == "reset") {
            registry.reset_all();
        } else if (word == "stats") {
            std::printf("DGR-NETSIM-OK %s\n", g_accuracy.report().c_str());
            std::fflush(stdout);
            continue;
        } else {
            std::printf("DGR-NETSIM-ERROR unknown command %s\n", word.c_str());
            std::fflush(stdout);
            continue;
        }
        std::printf("DGR-NETSIM-OK\n");
        std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    const Options opt = parse(argc, argv);
    // the writers' deadlines are the link's latency: no timer slack on top of it
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    Faults faults;
    Registry registry;

    const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t) opt.listen_port);
    if (inet_pton(AF_INET, opt.listen_host.c_str(), &addr.sin_addr) != 1) usage("--listen: expected an IPv4 address");
    if (::bind(lfd, (sockaddr *) &addr, sizeof addr) != 0 || ::listen(lfd, 128) != 0) {
        std::fprintf(stderr, "dgr-netsim: cannot listen on %s:%d: %s\n", opt.listen_host.c_str(), opt.listen_port,
                     std::strerror(errno));
        return 1;
    }
    socklen_t len = sizeof addr;
    ::getsockname(lfd, (sockaddr *) &addr, &len);
    std::printf("DGR-NETSIM-READY port=%d\n", ntohs(addr.sin_port));
    std::fflush(stdout);
    if (opt.control) std::thread([&] { control_loop(faults, registry); }).detach();

    for (;;) {
        const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            std::fprintf(stderr, "dgr-netsim: accept: %s\n", std::strerror(errno));
            return 1;
        }
        if (faults.blackhole.load()) {
            std::thread(swallow, fd).detach();
            continue;
        }
        const int up = connect_upstream(opt);
        if (up < 0) {
            ::close(fd);
            continue;
        }
        auto conn = std::make_shared<Conn>();
        conn->down = fd;
        conn->up = up;
        std::thread(serve, std::move(conn), std::cref(opt), std::ref(faults), std::ref(registry)).detach();
    }
}
