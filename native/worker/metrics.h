// Worker metrics: counters and histograms in a prometheus-cpp registry, served over HTTP
// (civetweb) at --metrics-listen as Prometheus text (/metrics) and as JSON for a tracker
// (/metrics.json). Names follow vLLM's and llama-server's: a `dgr:` prefix, `_total` counters,
// `_seconds` histograms, gauges for what is in flight now. Gauges are read at scrape time from
// the live state (never behind a compute); the hot path only increments and observes.
#pragma once

#include "convoy.h"
#include "dgr/shard_engine.h"

#include <grpcpp/grpcpp.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>

class CivetServer;

namespace dgr::worker {

// what the gauges show, read when a scrape comes
struct LiveState {
    std::function<size_t()> sessions;     // sessions holding a slot
    std::function<size_t()> queue_depth;  // forwards in flight (computing or waiting)
    std::function<size_t()> kv_tokens;    // tokens cached over all sessions
    std::function<dgr::CacheStats()> cache;  // prefix reuse: the kept finished sessions
    std::function<ConvoyRule::Estimate()> convoy;  // the head: its sessions batched or apart
    size_t max_sessions = 0;
    size_t kv_capacity = 0;               // n_ctx per session x max_sessions
    // the engine's own memory breakdown for this range (what the estimator predicts)
    uint64_t model_bytes = 0, kv_bytes = 0, compute_bytes = 0;
};

class Metrics {
public:
    explicit Metrics(LiveState live);
    ~Metrics();
    Metrics(const Metrics &) = delete;
    Metrics & operator=(const Metrics &) = delete;

    // one forward computed: its tokens (a prefill chunk, or one decode step), the time it waited
    // for its turn on the engine, the time its turn took, and whether it held a compute slot
    void forward(size_t n_tokens, bool decode, double queue_seconds, double compute_seconds, bool alone);
    // one llama_decode of `width` forwards
    void turn(size_t width);
    // a decode step computed without the rest of its cohort (the gather window ran out)
    void cohort_incomplete() { cohort_incomplete_.Increment(); }
    // a part of a drafted step the tail did not compute: a draft before it was rejected (verify.h)
    void part_skipped() { parts_skipped_.Increment(); }
    // a drafted step the head sent in parts (verify.h)
    void step_in_parts() { steps_in_parts_.Increment(); }
    // a request refused or failed with `code`
    void error(grpc::StatusCode code);

    // serve /metrics and /metrics.json at host:port (port 0: any free one); returns the port.
    // Throws std::runtime_error when it cannot listen.
    int listen(const std::string & address);

    std::string text();  // the Prometheus exposition
    std::string json();  // the same figures as one JSON object

private:
    void refresh();  // the gauges from the live state

    LiveState live_;
    std::shared_ptr<prometheus::Registry> registry_;
    prometheus::Counter & prompt_tokens_;
    prometheus::Counter & generation_tokens_;
    prometheus::Counter & forwards_;
    prometheus::Counter & without_slot_;
    prometheus::Counter & cohort_incomplete_;
    prometheus::Counter & parts_skipped_;
    prometheus::Counter & steps_in_parts_;
    prometheus::Family<prometheus::Counter> & errors_;
    prometheus::Gauge & sessions_;
    prometheus::Gauge & waiting_;
    prometheus::Gauge & kv_usage_;
    prometheus::Gauge & resident_;
    // prefix reuse: gauges of what is kept now, counters advanced to the engine's totals at scrape
    prometheus::Gauge & cached_sessions_;
    prometheus::Gauge & cached_tokens_;
    prometheus::Gauge & cached_bytes_;
    prometheus::Counter & cache_hits_;
    prometheus::Counter & cache_misses_;
    prometheus::Counter & cache_reused_tokens_;
    prometheus::Counter & cache_evictions_;
    // the head's convoy rule (convoy.h): what it measured and chose
    prometheus::Gauge & apart_;
    prometheus::Gauge & link_seconds_;
    prometheus::Gauge & ring_compute_seconds_;
    dgr::CacheStats cache_seen_;  // the totals the counters show
    prometheus::Histogram & forward_latency_;
    prometheus::Histogram & queue_time_;
    prometheus::Histogram & batch_width_;
    std::mutex scrape_;  // one scrape refreshes and serializes at a time
    std::unique_ptr<CivetServer> server_;
    std::string host_;  // as --metrics-listen named it (the stop wakes its listener there)
    int port_ = 0;
    struct Handler;
    std::unique_ptr<Handler> text_handler_, json_handler_;
};

}  // namespace dgr::worker
