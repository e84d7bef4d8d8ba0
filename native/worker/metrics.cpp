#include "metrics.h"

#include <CivetServer.h>
#include <prometheus/text_serializer.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dgr::worker {

namespace {

const char * code_name(grpc::StatusCode code) {
    switch (code) {
        case grpc::StatusCode::OK: return "OK";
        case grpc::StatusCode::CANCELLED: return "CANCELLED";
        case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
        case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
        case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
        case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
        case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
        case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
        case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
        case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
        case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
        case grpc::StatusCode::ABORTED: return "ABORTED";
        case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
        case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
        case grpc::StatusCode::INTERNAL: return "INTERNAL";
        case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
        case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
        default: return "UNKNOWN";
    }
}

// forward latency on a CPU lane runs from under a millisecond (a decode step of a small range) to
// seconds (a long prefill chunk of a large model)
const prometheus::Histogram::BucketBoundaries kSeconds = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                          0.1,    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};

std::string number(double v) {
    if (std::isinf(v)) return v > 0 ? "\"+Inf\"" : "\"-Inf\"";
    if (std::isnan(v)) return "null";
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof(buf), v);  // the shortest form that reads back
    return std::string(buf, res.ptr);
}

std::string quoted(const std::string & s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
    }
    return out + "\"";
}

std::string metric_json(const prometheus::MetricFamily & family, const prometheus::ClientMetric & m) {
    switch (family.type) {
        case prometheus::MetricType::Counter: return number(m.counter.value);
        case prometheus::MetricType::Gauge: return number(m.gauge.value);
        case prometheus::MetricType::Histogram: {
            std::string out = "{\"count\": " + std::to_string(m.histogram.sample_count) +
                              ", \"sum\": " + number(m.histogram.sample_sum) + ", \"buckets\": [";
            for (size_t i = 0; i < m.histogram.bucket.size(); ++i) {
                const auto & b = m.histogram.bucket[i];
                out += (i ? ", [" : "[") + number(b.upper_bound) + ", " + std::to_string(b.cumulative_count) + "]";
            }
            return out + "]}";
        }
        default: return "null";
    }
}

}  // namespace

struct Metrics::Handler : public CivetHandler {
    Handler(Metrics & metrics, bool as_json) : metrics_(metrics), json_(as_json) {}
    bool handleGet(CivetServer *, struct mg_connection * conn) override {
        // civetweb hands a handler every path under its own too (/metrics.jsonx, /metrics/x):
        // only the path itself is served, the rest is 404
        const mg_request_info * request = mg_get_request_info(conn);
        if (request == nullptr || request->local_uri == nullptr ||
            std::string(request->local_uri) != (json_ ? "/metrics.json" : "/metrics")) {
            return false;
        }
        const std::string body = json_ ? metrics_.json() : metrics_.text();
        const char * type = json_ ? "application/json" : "text/plain; version=0.0.4; charset=utf-8";
        mg_printf(conn, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", type,
                  body.size());
        mg_write(conn, body.data(), body.size());
        return true;
    }
    Metrics & metrics_;
    bool json_;
};

namespace {

// one unlabelled series of a new family in `registry`
prometheus::Counter & counter(prometheus::Registry & registry, const std::string & name, const std::string & help) {
    return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}
prometheus::Gauge & gauge(prometheus::Registry & registry, const std::string & name, const std::string & help) {
    return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}
prometheus::Histogram & histogram(prometheus::Registry & registry, const std::string & name, const std::string & help,
                                  const prometheus::Histogram::BucketBoundaries & buckets) {
    return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({}, buckets);
}

}  // namespace

Metrics::Metrics(LiveState live)
    : live_(std::move(live)),
      registry_(std::make_shared<prometheus::Registry>()),
      prompt_tokens_(counter(*registry_, "dgr:prompt_tokens_total", "Tokens this stage computed in prefill forwards")),
      generation_tokens_(counter(*registry_, "dgr:generation_tokens_total",
                 "Tokens this stage computed in decode steps")),
      forwards_(counter(*registry_, "dgr:forwards_total", "Forwards this stage computed")),
      without_slot_(counter(*registry_, "dgr:forwards_without_slot_total",
                 "Forwards computed without a compute slot (every one held past the wait), at normal priority")),
      cohort_incomplete_(counter(*registry_, "dgr:cohort_gather_timeouts_total",
                 "Decode steps computed when the gather window ran out before the rest of their cohort arrived")),
      parts_skipped_(counter(*registry_, "dgr:draft_parts_skipped_total",
                 "Parts of drafted decode steps the tail did not compute: a draft before them was rejected")),
      steps_in_parts_(counter(*registry_, "dgr:draft_steps_in_parts_total",
                 "Drafted decode steps this head sent in parts that the stages pipeline")),
      errors_(prometheus::BuildCounter()
                  .Name("dgr:request_errors_total")
                  .Help("Requests refused or failed, by gRPC status code")
                  .Register(*registry_)),
      sessions_(gauge(*registry_, "dgr:num_sessions_running",
                 "Sessions holding a slot (and a KV cache) on this stage")),
      waiting_(gauge(*registry_, "dgr:num_requests_waiting",
                 "Forwards in flight on this stage: computing or waiting for their turn")),
      kv_usage_(gauge(*registry_, "dgr:kv_cache_usage_perc", "Fraction of the stage's KV cache in use (1 = full)")),
      resident_(gauge(*registry_, "process_resident_memory_bytes",
                 "Resident memory of the worker process, measured (as Prometheus' process collectors name it)")),
      cached_sessions_(gauge(*registry_, "dgr:prefix_cache_sessions",
                 "Finished sessions this stage keeps for prefix reuse (worker --prefix-cache-sessions)")),
      cached_tokens_(gauge(*registry_, "dgr:prefix_cache_tokens", "Tokens the kept sessions hold")),
      cached_bytes_(gauge(*registry_, "dgr:prefix_cache_bytes",
                 "KV the kept sessions hold (worker --prefix-cache-bytes bounds it)")),
      cache_hits_(counter(*registry_, "dgr:prefix_cache_hits_total",
                 "Sessions that started from a kept one (prefix reuse)")),
      cache_misses_(counter(*registry_, "dgr:prefix_cache_misses_total",
                 "Sessions that asked to start from a kept one and found none")),
      cache_reused_tokens_(counter(*registry_, "dgr:prefix_cache_reused_tokens_total",
                 "Prompt tokens prefix reuse did not compute")),
      cache_evictions_(counter(*registry_, "dgr:prefix_cache_evictions_total", "Kept sessions dropped for room (LRU)")),
      apart_(gauge(*registry_, "dgr:head_sessions_apart",
                 "The head: 1 while its sessions' decode steps travel apart (the links take much more than the "
                 "stages' compute), 0 while they travel as a convoy")),
      link_seconds_(gauge(*registry_, "dgr:head_route_link_seconds",
                 "The head: the links' part of a decode step's round trip (the least over recent steps)")),
      ring_compute_seconds_(gauge(*registry_, "dgr:head_route_compute_seconds",
                 "The head: the stages' compute of a decode step, summed around the route (median of recent steps)")),
      forward_latency_(histogram(*registry_, "dgr:forward_latency_seconds",
                 "Time a forward's turn on the engine took", kSeconds)),
      queue_time_(histogram(*registry_, "dgr:request_queue_time_seconds",
                 "Time a forward waited for its turn on the engine", kSeconds)),
      batch_width_(histogram(*registry_, "dgr:batch_width",
                 "Forwards computed in each llama_decode of this stage (sessions' decode steps batched)",
                 prometheus::Histogram::BucketBoundaries{1, 2, 3, 4, 6, 8, 12, 16, 32, 64})) {
    prometheus::BuildGauge()
        .Name("dgr:max_sessions")
        .Help("Session slots this stage serves")
        .Register(*registry_)
        .Add({})
        .Set((double) live_.max_sessions);
    auto & memory = prometheus::BuildGauge()
                        .Name("dgr:memory_bytes")
                        .Help("The engine's buffers for this range by part (weights, KV cache, compute)")
                        .Register(*registry_);
    memory.Add({{"part", "model"}}).Set((double) live_.model_bytes);
    memory.Add({{"part", "kv"}}).Set((double) live_.kv_bytes);
    memory.Add({{"part", "compute"}}).Set((double) live_.compute_bytes);
}

namespace {

// A connection to host:port, closed at once (nothing is sent); a wildcard host is this machine.
void poke(std::string host, int port) {
    if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
    if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
    if (host == "::") host = "::1";
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
    for (addrinfo * a = found; a; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        close(fd);
        if (connected) break;
    }
    freeaddrinfo(found);
}

}  // namespace

Metrics::~Metrics() {
    if (!server_) return;
    // civetweb 1.15 (Debian 12's) sees that it is asked to stop only when its listener's poll
    // returns, which without a connection is after up to 2 s (SOCKET_TIMEOUT_QUANTUM; civetweb
    // issue 1163, fixed in 1.16): every worker with --metrics-listen took 2 s to exit. A
    // connection to the port while close() waits wakes the poll, and the stop is seen at once.
    std::atomic<bool> closed{false};
    std::thread waker([&] {
        while (!closed.load()) {
            poke(host_, port_);
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    });
    server_->close();
    closed = true;
    waker.join();
}

void Metrics::forward(size_t n_tokens, bool decode, double queue_seconds, double compute_seconds, bool alone) {
    (decode ? generation_tokens_ : prompt_tokens_).Increment((double) n_tokens);
    forwards_.Increment();
    if (!alone) without_slot_.Increment();
    queue_time_.Observe(queue_seconds);
    forward_latency_.Observe(compute_seconds);
}

void Metrics::turn(size_t width) { batch_width_.Observe((double) width); }

void Metrics::error(grpc::StatusCode code) { errors_.Add({{"code", code_name(code)}}).Increment(); }

void Metrics::refresh() {
    sessions_.Set((double) live_.sessions());
    waiting_.Set((double) live_.queue_depth());
    kv_usage_.Set(live_.kv_capacity ? (double) live_.kv_tokens() / (double) live_.kv_capacity : 0.0);
    if (live_.cache) {
        const dgr::CacheStats c = live_.cache();
        cached_sessions_.Set((double) c.sessions);
        cached_tokens_.Set((double) c.tokens);
        cached_bytes_.Set((double) c.bytes);
        cache_hits_.Increment((double) (c.hits - cache_seen_.hits));
        cache_misses_.Increment((double) (c.misses - cache_seen_.misses));
        cache_reused_tokens_.Increment((double) (c.reused_tokens - cache_seen_.reused_tokens));
        cache_evictions_.Increment((double) (c.evictions - cache_seen_.evictions));
        cache_seen_ = c;
    }
    if (live_.convoy) {
        const ConvoyRule::Estimate e = live_.convoy();
        apart_.Set(e.apart ? 1.0 : 0.0);
        link_seconds_.Set(e.link_s);
        ring_compute_seconds_.Set(e.compute_s);
    }
    // /proc/self/statm: size and resident, in pages
    std::ifstream statm("/proc/self/statm");
    uint64_t size = 0, resident = 0;
    if (statm >> size >> resident) resident_.Set((double) resident * (double) sysconf(_SC_PAGESIZE));
}

std::string Metrics::text() {
    std::lock_guard<std::mutex> lock(scrape_);
    refresh();
    return prometheus::TextSerializer().Serialize(registry_->Collect());
}

std::string Metrics::json() {
    std::lock_guard<std::mutex> lock(scrape_);
    refresh();
    std::string out = "{";
    bool first = true;
    for (const auto & family : registry_->Collect()) {
        out += (first ? "" : ", ") + quoted(family.name) + ": ";
        first = false;
        const bool labelled = !family.metric.empty() && !family.metric[0].label.empty();
        if (!labelled) {
            out += family.metric.empty() ? "0" : metric_json(family, family.metric[0]);
            continue;
        }
        out += "{";  // one label (the status code): {"INVALID_ARGUMENT": 2, ...}
        for (size_t i = 0; i < family.metric.size(); ++i) {
            const auto & m = family.metric[i];
            out += (i ? ", " : "") + quoted(m.label.empty() ? "" : m.label[0].value) + ": " + metric_json(family, m);
        }
        out += "}";
    }
    return out + "}";
}

int Metrics::listen(const std::string & address) {
    const std::vector<std::string> options = {"listening_ports", address, "num_threads", "2"};
    try {
        server_ = std::make_unique<CivetServer>(options);
    } catch (const CivetException & e) {
        throw std::runtime_error("--metrics-listen " + address + ": cannot listen (" + e.what() + ")");
    }
    text_handler_ = std::make_unique<Handler>(*this, false);
    json_handler_ = std::make_unique<Handler>(*this, true);
    server_->addHandler("/metrics.json", *json_handler_);
    server_->addHandler("/metrics", *text_handler_);
    const std::vector<int> ports = server_->getListeningPorts();
    if (ports.empty()) throw std::runtime_error("--metrics-listen " + address + ": no listening port");
    const size_t colon = address.rfind(':');
    host_ = colon == std::string::npos ? std::string() : address.substr(0, colon);
    port_ = ports[0];
    return ports[0];
}

}  // namespace dgr::worker
