// The data plane's framing (FrameConn over a socketpair), its header and opening checks, and the
// listener's handling of connections that never authenticate.
#include "datalink.h"
#include "support.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

using dgr::test::frame;
using dgr::test::socket_pair;
using dgr::test::write_all;
using namespace dgr::worker;
using grpc::StatusCode;

namespace {

std::string magic() { return std::string(kDataMagic, sizeof(kDataMagic)); }

std::string hello_bytes(const std::string & token = "") {
    dgr::v1::DataHello hello;
    hello.set_stream(dgr::v1::DATA_STREAM_FORWARD);
    hello.set_token(token);
    return frame(dgr::v1::DATA_FRAME_HELLO, hello.SerializeAsString());
}

Opening classify(const std::string & bytes, uint32_t max_hello = 4096) {
    return classify_opening((const uint8_t *) bytes.data(), bytes.size(), max_hello);
}

// a TCP connection to 127.0.0.1:port
int dial(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t) port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, (sockaddr *) &addr, sizeof(addr)) == 0);
    return fd;
}

// whether the peer closed `fd` within `ms` (reads and discards whatever came first)
bool closed_within(int fd, int ms, std::string * got = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) return false;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, (int) left.count()) <= 0) continue;
        char buf[4096];
        const ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
        if (r <= 0) return true;
        if (got) got->append(buf, (size_t) r);
    }
}

}  // namespace

TEST_CASE("split_address takes HOST:PORT and [V6]:PORT and nothing else") {
    std::string host, port;
    CHECK(split_address("example.org:50051", &host, &port));
    CHECK(host == "example.org");
    CHECK(port == "50051");
    CHECK(split_address("[::1]:7", &host, &port));
    CHECK(host == "::1");
    CHECK(port == "7");
    CHECK_FALSE(split_address("example.org", &host, &port));
    CHECK_FALSE(split_address("example.org:", &host, &port));
    CHECK_FALSE(split_address(":50051", &host, &port));
    CHECK(split_address("h:65535", &host, &port));
    CHECK(split_address("h:0", &host, &port));
    CHECK_FALSE(split_address("h:65536", &host, &port));
    CHECK_FALSE(split_address("h:99999", &host, &port));
    CHECK_FALSE(split_address("h:080000", &host, &port));
    CHECK_FALSE(split_address("h:-1", &host, &port));
    CHECK_FALSE(split_address("h:http", &host, &port));
}

TEST_CASE("peer_address: a stage dials HOST:PORT with a port in 1..65535, or unix:PATH") {
    CHECK(peer_address("10.0.0.2:50051"));
    CHECK(peer_address("[::1]:7"));
    CHECK(peer_address("unix:/run/w.sock"));
    CHECK_FALSE(peer_address("10.0.0.2:0"));
    CHECK_FALSE(peer_address("10.0.0.2:99999"));
    CHECK_FALSE(peer_address("unix:"));
    CHECK_FALSE(peer_address("10.0.0.2"));
}

TEST_CASE("a frame header names its kind and a payload within the bound") {
    dgr::v1::DataFrame kind{};
    uint32_t n = 0;
    const std::string ok = frame(dgr::v1::DATA_FRAME_REQUEST, std::string(300, 'x'));
    REQUIRE(decode_frame_header((const uint8_t *) ok.data(), 1000, &kind, &n).ok());
    CHECK(kind == dgr::v1::DATA_FRAME_REQUEST);
    CHECK(n == 300);

    const auto over = decode_frame_header((const uint8_t *) ok.data(), 299, &kind, &n);
    CHECK(over.error_code() == StatusCode::INVALID_ARGUMENT);
    CHECK(over.error_message().find("300 bytes") != std::string::npos);

    for (int bad : {0, 6, 255}) {
        const std::string h = frame(bad, "");
        const auto st = decode_frame_header((const uint8_t *) h.data(), 1000, &kind, &n);
        CHECK(st.error_code() == StatusCode::INVALID_ARGUMENT);
        CHECK(st.error_message().find("unknown frame kind " + std::to_string(bad)) != std::string::npos);
    }
    const std::string alive = frame(dgr::v1::DATA_FRAME_ALIVE, "x");
    CHECK(decode_frame_header((const uint8_t *) alive.data(), 1000, &kind, &n).error_code() ==
          StatusCode::INVALID_ARGUMENT);
}

TEST_CASE("an opening is the data magic and a HELLO, HTTP/2's preface, or refused") {
    CHECK(classify("") == Opening::wait);
    CHECK(classify("D") == Opening::wait);
    CHECK(classify("DG") == Opening::wait);
    CHECK(classify("DGX") == Opening::refuse);
    CHECK(classify(magic()) == Opening::wait);
    const std::string hello = hello_bytes("t");
    CHECK(classify(magic() + hello.substr(0, 3)) == Opening::wait);          // a partial header
    CHECK(classify(magic() + hello.substr(0, hello.size() - 1)) == Opening::wait);  // a partial HELLO
    CHECK(classify(magic() + hello) == Opening::data);
    CHECK(classify(magic() + frame(dgr::v1::DATA_FRAME_REQUEST, "")) == Opening::refuse);  // no HELLO first
    CHECK(classify(magic() + frame(9, "")) == Opening::refuse);
    CHECK(classify(magic() + frame(dgr::v1::DATA_FRAME_HELLO, std::string(5000, 'x'))) == Opening::refuse);
    CHECK(classify(magic() + frame(dgr::v1::DATA_FRAME_HELLO, std::string(100, 'x')), 64) == Opening::refuse);
    CHECK(classify("PRI * HTTP") == Opening::wait);
    CHECK(classify("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == Opening::grpc);
    CHECK(classify("GET / HTTP/1.1\r\n") == Opening::refuse);
    CHECK(classify(std::string(1, '\0')) == Opening::refuse);
}

TEST_CASE("FrameConn carries messages both ways") {
    auto [a, b] = socket_pair();
    FrameConn left(a, 10000, 1 << 20), right(b, 10000, 1 << 20);
    dgr::v1::DataEnd end;
    end.set_code(7);
    end.set_message("bye");
    REQUIRE(left.send(dgr::v1::DATA_FRAME_END, &end));
    REQUIRE(left.send(dgr::v1::DATA_FRAME_REPLY));  // an empty message
    dgr::v1::DataEnd got;
    bool ended = true;
    REQUIRE(right.receive_message(dgr::v1::DATA_FRAME_END, &got, &ended).ok());
    CHECK_FALSE(ended);
    CHECK(got.code() == 7);
    CHECK(got.message() == "bye");
    dgr::v1::DataFrame kind{};
    std::string payload = "stale";
    REQUIRE(right.receive(&kind, &payload, &ended).ok());
    CHECK(kind == dgr::v1::DATA_FRAME_REPLY);
    CHECK(payload.empty());
}

TEST_CASE("FrameConn reassembles a frame that arrives a byte at a time") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 1 << 20);
    dgr::v1::DataEnd end;
    end.set_message(std::string(1000, 'm'));
    const std::string bytes = frame(dgr::v1::DATA_FRAME_END, end.SerializeAsString());
    std::thread writer([fd = a, bytes] {
        for (char c : bytes) {
            REQUIRE(::write(fd, &c, 1) == 1);
            if (c == 'm') continue;  // the header's bytes slowly, the payload at once
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    });
    dgr::v1::DataEnd got;
    bool ended = false;
    const auto st = conn.receive_message(dgr::v1::DATA_FRAME_END, &got, &ended);
    writer.join();
    ::close(a);
    REQUIRE(st.ok());
    CHECK(got.message() == end.message());
}

TEST_CASE("FrameConn passes over heartbeats and reads two frames sent in one write") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 1 << 20);
    write_all(a, frame(dgr::v1::DATA_FRAME_ALIVE, "") + frame(dgr::v1::DATA_FRAME_REPLY, "ab") +
                     frame(dgr::v1::DATA_FRAME_ALIVE, "") + frame(dgr::v1::DATA_FRAME_REQUEST, "cd"));
    dgr::v1::DataFrame kind{};
    std::string payload;
    bool ended = false;
    REQUIRE(conn.receive(&kind, &payload, &ended).ok());
    CHECK(kind == dgr::v1::DATA_FRAME_REPLY);
    CHECK(payload == "ab");
    REQUIRE(conn.receive(&kind, &payload, &ended).ok());
    CHECK(kind == dgr::v1::DATA_FRAME_REQUEST);
    CHECK(payload == "cd");
    ::close(a);
    REQUIRE(conn.receive(&kind, &payload, &ended).ok());
    CHECK(ended);  // closed between frames: the end of the stream, not an error
}

TEST_CASE("FrameConn: a peer that closes within a frame breaks the stream") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 1 << 20);
    SUBCASE("within the header") { write_all(a, frame(dgr::v1::DATA_FRAME_REPLY, "abcdef").substr(0, 3)); }
    SUBCASE("within the payload") { write_all(a, frame(dgr::v1::DATA_FRAME_REPLY, "abcdef").substr(0, 8)); }
    ::close(a);
    dgr::v1::DataFrame kind{};
    std::string payload;
    bool ended = false;
    const auto st = conn.receive(&kind, &payload, &ended);
    CHECK(st.error_code() == StatusCode::UNAVAILABLE);
    CHECK(st.error_message().find("within a frame") != std::string::npos);
}

TEST_CASE("FrameConn refuses an oversize frame before reading its payload") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 64);
    write_all(a, frame(dgr::v1::DATA_FRAME_REQUEST, std::string(65, 'x')).substr(0, 5));  // the header alone
    dgr::v1::DataFrame kind{};
    std::string payload;
    bool ended = false;
    const auto st = conn.receive(&kind, &payload, &ended);
    CHECK(st.error_code() == StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().find("65 bytes, more than the 64") != std::string::npos);
    ::close(a);
}

TEST_CASE("FrameConn names the frame it expected and one that does not parse") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 1 << 20);
    dgr::v1::DataEnd got;
    bool ended = false;
    write_all(a, frame(dgr::v1::DATA_FRAME_REPLY, ""));
    auto st = conn.receive_message(dgr::v1::DATA_FRAME_END, &got, &ended);
    CHECK(st.error_code() == StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().find("DATA_FRAME_REPLY frame where DATA_FRAME_END was expected") != std::string::npos);
    write_all(a, frame(dgr::v1::DATA_FRAME_END, "\xff\xff\xff"));  // a truncated varint key
    st = conn.receive_message(dgr::v1::DATA_FRAME_END, &got, &ended);
    CHECK(st.error_code() == StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().find("does not parse as dgr.v1.DataEnd") != std::string::npos);
    ::close(a);
}

TEST_CASE("FrameConn drops a peer silent for keepalive x 1.5") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 100, 1 << 20);
    dgr::v1::DataFrame kind{};
    std::string payload;
    bool ended = false;
    const auto t0 = std::chrono::steady_clock::now();
    const auto st = conn.receive(&kind, &payload, &ended);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    CHECK(st.error_code() == StatusCode::UNAVAILABLE);
    CHECK(st.error_message().find("150 ms") != std::string::npos);
    CHECK(ms >= 150);
    CHECK(ms < 2000);
    ::close(a);
}

TEST_CASE("FrameConn beats only when nothing went out for half the keepalive, and abort wakes a reader") {
    auto [a, b] = socket_pair();
    auto conn = std::make_shared<FrameConn>(b, 200, 1 << 20);
    conn->beat();  // just made: nothing to send
    char buf[16];
    CHECK(::recv(a, buf, sizeof(buf), MSG_DONTWAIT) < 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    conn->beat();
    REQUIRE(::recv(a, buf, sizeof(buf), MSG_DONTWAIT) == 5);
    CHECK(buf[4] == (char) dgr::v1::DATA_FRAME_ALIVE);

    auto reader = std::async(std::launch::async, [conn] {
        dgr::v1::DataFrame kind{};
        std::string payload;
        bool ended = false;
        auto st = conn->receive(&kind, &payload, &ended);
        return st.ok() && ended;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    conn->abort();
    REQUIRE(reader.wait_for(std::chrono::seconds(2)) == std::future_status::ready);
    CHECK(reader.get());  // the read side shut: the end of the stream
    ::close(a);
}

TEST_CASE("FrameConn::send fails, without a signal, once the peer is gone") {
    auto [a, b] = socket_pair();
    FrameConn conn(b, 10000, 1 << 20);
    ::close(a);
    CHECK_FALSE(conn.send(dgr::v1::DATA_FRAME_ALIVE));
    dgr::v1::DataEnd big;
    big.set_message(std::string(100, 'x'));
    auto [c, d] = socket_pair();
    FrameConn small(c, 10000, 10);
    CHECK_FALSE(small.send(dgr::v1::DATA_FRAME_END, &big));  // over its own bound: never sent
    char buf[8];
    CHECK(::recv(d, buf, sizeof(buf), MSG_DONTWAIT) < 0);
    ::close(d);
}

namespace {

struct Served {
    std::atomic<int> streams{0};
    std::promise<void> release;
    std::shared_future<void> released{release.get_future().share()};
};

ListenerLimits quick_limits() {
    ListenerLimits limits;
    limits.hello_timeout = std::chrono::milliseconds(300);
    limits.max_streams = 1;
    return limits;
}

}  // namespace

TEST_CASE("Listener closes what never becomes a stream: a partial magic, junk, silence, an oversize HELLO") {
    Listener listener("127.0.0.1:0", quick_limits());
    Served served;
    listener.start(nullptr, [&](std::shared_ptr<FrameConn>) { ++served.streams; });
    const int partial = dial(listener.port());
    write_all(partial, "DG");
    ::shutdown(partial, SHUT_WR);  // FIN after two bytes
    const int junk = dial(listener.port());
    write_all(junk, "GET / HTTP/1.1\r\n\r\n");
    const int silent = dial(listener.port());
    const int big = dial(listener.port());
    write_all(big, magic() + frame(dgr::v1::DATA_FRAME_HELLO, std::string(8192, 'x')));
    CHECK(closed_within(partial, 1000));
    CHECK(closed_within(junk, 1000));
    CHECK(closed_within(big, 1000));
    CHECK(closed_within(silent, 2000));  // after hello_timeout
    CHECK(served.streams == 0);
    for (int fd : {partial, junk, silent, big}) ::close(fd);
    listener.stop(std::chrono::milliseconds(100));
}

TEST_CASE("Listener serves a stream on its own thread and refuses one past max_streams with END") {
    Listener listener("127.0.0.1:0", quick_limits());
    Served served;
    listener.start(nullptr, [&](std::shared_ptr<FrameConn> conn) {
        ++served.streams;
        served.released.wait();
        conn->send(dgr::v1::DATA_FRAME_REPLY);
    });
    const int first = dial(listener.port());
    write_all(first, magic() + hello_bytes("token"));
    for (int i = 0; i < 100 && served.streams == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    REQUIRE(served.streams == 1);
    const int second = dial(listener.port());
    write_all(second, magic() + hello_bytes());
    std::string got;
    CHECK(closed_within(second, 2000, &got));
    REQUIRE(got.size() > 5);
    CHECK(got[4] == (char) dgr::v1::DATA_FRAME_END);
    dgr::v1::DataEnd end;
    REQUIRE(end.ParseFromString(got.substr(5)));
    CHECK(end.code() == (int) StatusCode::RESOURCE_EXHAUSTED);
    CHECK(end.message().find("--max-data-streams") != std::string::npos);
    served.release.set_value();
    got.clear();
    CHECK(closed_within(first, 2000, &got));
    CHECK(got.size() == 5);  // the REPLY its handler sent, then the close
    ::close(first);
    ::close(second);
    listener.stop(std::chrono::milliseconds(500));
}

TEST_CASE("Listener: past max_pending unclassified connections the oldest is closed") {
    ListenerLimits limits = quick_limits();
    limits.hello_timeout = std::chrono::milliseconds(10000);
    limits.max_pending = 2;
    Listener listener("127.0.0.1:0", limits);
    listener.start(nullptr, [](std::shared_ptr<FrameConn>) {});
    const int oldest = dial(listener.port());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const int b = dial(listener.port());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const int c = dial(listener.port());
    CHECK(closed_within(oldest, 1000));
    CHECK_FALSE(closed_within(b, 200));
    CHECK_FALSE(closed_within(c, 50));
    for (int fd : {oldest, b, c}) ::close(fd);
    listener.stop(std::chrono::milliseconds(100));
}

TEST_CASE("Listener refuses an address it cannot use, naming it") {
    CHECK_THROWS_WITH_AS(Listener("nonsense", ListenerLimits{}), doctest::Contains("not HOST:PORT: nonsense"),
                         std::invalid_argument);
}

TEST_CASE("a HELLO names the data-plane version and capabilities, and another version or an unknown capability is refused") {
    const dgr::v1::DataHello mine = make_hello(dgr::v1::DATA_STREAM_LOOP, "t");
    CHECK(mine.version() == kDataVersion);
    CHECK(mine.token() == "t");
    CHECK(mine.capabilities_size() == (int) data_capabilities().size());
    CHECK(check_hello(mine).ok());
    dgr::v1::DataHello old = mine;
    old.clear_version();  // from before the field: version 1
    old.clear_capabilities();
    CHECK(check_hello(old).ok());
    dgr::v1::DataHello newer = mine;
    newer.set_version(kDataVersion + 1);
    auto st = check_hello(newer);
    CHECK(st.error_code() == StatusCode::FAILED_PRECONDITION);
    CHECK(st.error_message().find("data-plane version 2, this worker version 1") != std::string::npos);
    dgr::v1::DataHello odd = mine;
    odd.add_capabilities("teleport");
    st = check_hello(odd);
    CHECK(st.error_code() == StatusCode::FAILED_PRECONDITION);
    CHECK(st.error_message().find("capability 'teleport'") != std::string::npos);
    CHECK(st.error_message().find("cohorts") != std::string::npos);  // what this worker has
}
