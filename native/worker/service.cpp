#include "service.h"

#include "head_session.h"
#include "clock.h"

#include "drafting.h"
#include "sampling.h"
#include "validate.h"
#include "wire.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <thread>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

namespace {

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

// a forward admitted to this stage's queue, for as long as it waits or computes
struct InFlight {
    explicit InFlight(std::atomic<int> & n) : n_(n), ahead(n_++) {}
    ~InFlight() { n_--; }
    InFlight(const InFlight &) = delete;
    InFlight & operator=(const InFlight &) = delete;
    std::atomic<int> & n_;
    const int ahead;
};

// the request the next stage computes: this stage's output, the same expectation and sideband
dgr::v1::ForwardRequest next_request(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply) {
    dgr::v1::ForwardRequest next;
    next.set_session_id(req.session_id());
    *next.mutable_expect() = req.expect();
    *next.mutable_token_ids() = req.token_ids();
    next.mutable_boundary()->Swap(reply->mutable_boundary());
    if (reply->has_cohort()) next.mutable_cohort()->Swap(reply->mutable_cohort());
    if (reply->has_stages()) next.mutable_upstream()->Swap(reply->mutable_stages());
    next.set_chunk_index(req.chunk_index());
    next.set_last_chunk(req.last_chunk());
    next.set_n_draft(req.n_draft());
    if (req.has_draft()) *next.mutable_draft() = req.draft();  // MTP: the tail's block follows
    *next.mutable_sampling() = req.sampling();
    next.set_boundary_dtype(req.boundary_dtype());
    *next.mutable_route() = req.route();
    const uint32_t to = req.route().stage_index() + 1;
    next.mutable_route()->set_stage_index(to);
    if (to < (uint32_t) req.route().expect_size()) *next.mutable_stage() = req.route().expect((int) to);
    return next;
}

// forward mode: the time the stages up to this one spent on `req`, this one's added to what the
// stages before it held (microseconds, saturating)
void add_step_time(const dgr::v1::ForwardRequest & req, int64_t held_ns, double compute_s, dgr::v1::ForwardReply * reply) {
    auto sum = [](uint32_t before, double seconds) {
        const double us = (double) before + std::max(0.0, seconds) * 1e6;
        return (uint32_t) std::min<double>(us, (double) UINT32_MAX);
    };
    auto * t = reply->mutable_stages();
    t->set_held_us(sum(req.upstream().held_us(), (double) held_ns * 1e-9));
    t->set_compute_us(std::min(t->held_us(), sum(req.upstream().compute_us(), compute_s)));
}

// a cohort as the batcher takes it, and onto the wire (absent when it is none)
Cohort from_wire(const dgr::v1::Cohort & c) { return Cohort{c.id(), c.size()}; }

void to_wire(const Cohort & c, dgr::v1::Cohort * out) {
    out->set_id(c.id);
    out->set_size(c.size);
}

// the last reply of a forward-mode stream whose route failed at `e.stage`
dgr::v1::ForwardReply error_reply(uint64_t session, uint64_t epoch, const dgr::v1::StageError & e) {
    dgr::v1::ForwardReply r;
    r.set_session_id(session);
    r.set_epoch(epoch);
    *r.mutable_error() = e;
    return r;
}

// a credential a caller presented (or not) against the one this worker needs: the gRPC
// authorization header, or a data stream's HELLO token; compared in time independent of where
// they differ
Status credential(bool present, const std::string & got, const std::string & want) {
    if (!present) return Status(StatusCode::UNAUTHENTICATED, "missing authorization: this worker needs a bearer token");
    unsigned char diff = got.size() == want.size() ? 0 : 1;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) diff |= (unsigned char) (got[i] ^ want[i]);
    if (diff != 0) return Status(StatusCode::UNAUTHENTICATED, "wrong bearer token");
    return Status::OK;
}

Status one_session(const dgr::v1::ForwardRequest & req, uint64_t session, uint64_t epoch) {
    if (!req.has_route() || req.session_id() != session || req.expect().epoch() != epoch) {
        return Status(StatusCode::INVALID_ARGUMENT,
                      "route: a forward-mode stream carries one session and epoch, every request with its route");
    }
    return Status::OK;
}

}  // namespace

// A forward-mode session at the head. Its events (the coordinator's requests, tokens back from
// the tail, a failure down the route) are handled one at a time, in arrival order, by the thread
// that delivers one while none is being handled: a token arriving from the tail computes the
// next decode step on the thread that read it, with no hand-off to another thread (a wake-up on
// the token's critical path). The session's own thread waits until the flow is over.
struct HeadFlow {
    struct Event {
        enum Kind { request, token, failure, closed } kind = closed;
        dgr::v1::ForwardRequest req;
        dgr::v1::ForwardReply reply;
        dgr::v1::StageError error;
    };
    uint64_t session = 0, epoch = 0;
    // when the step whose token the flow awaits left the head (steady clock, ns; 0: none)
    std::atomic<int64_t> sent_ns{0};
    std::function<bool(Event &)> handle;  // true: the flow is over; set before the first push

    void push(Event e) {
        std::unique_lock<std::mutex> lock(m_);
        if (over_) return;  // late: a token or failure after the end
        events_.push_back(std::move(e));
        if (busy_) return;  // the thread handling an event takes this one next
        busy_ = true;
        while (!events_.empty() && !over_) {
            Event ev = std::move(events_.front());
            events_.pop_front();
            lock.unlock();
            const bool over = handle(ev);
            lock.lock();
            over_ = over_ || over;
        }
        busy_ = false;
        if (over_) cv_.notify_all();
    }
    // until an event ended the flow and its handler returned
    void wait_over() {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [this] { return over_ && !busy_; });
    }

private:
    std::mutex m_;
    std::condition_variable cv_;
    std::deque<Event> events_;
    bool busy_ = false, over_ = false;
};

ShardService::ShardService(std::unique_ptr<dgr::ShardEngine> engine, ServiceOptions options, PeerOptions peers)
    : engine_(std::move(engine)),
      options_(std::move(options)),
      desc_(engine_->describe()),
      peers_(std::move(peers)),
      slots_(options_.compute_slots_dir, options_.compute_slots, options_.pin_threads),
      batcher_(*engine_, std::min(options_.max_batch, desc_.n_batch), slots_, std::chrono::microseconds(options_.gather_us),
               [this](size_t width) { metrics_.turn(width); }),
      convoy_(options_.convoy_auto),
      metrics_(LiveState{[this] { return engine_->session_count(); },
                         [this] { return (size_t) std::max(0, in_flight_.load()); },
                         [this] { return engine_->kv_tokens(); }, [this] { return engine_->cache_stats(); },
                         [this] { return convoy_.latest(); },
                         (size_t) desc_.max_sessions,
                         (size_t) desc_.n_ctx * (size_t) desc_.max_sessions, desc_.model_buffer_bytes, desc_.kv_bytes,
                         desc_.compute_bytes}) {}

ShardService::~ShardService() = default;

Status ShardService::authorize(grpc::ServerContext * ctx) const {
    if (options_.token.empty()) return Status::OK;
    const auto & md = ctx->client_metadata();
    auto it = md.find("authorization");
    const bool present = it != md.end();
    Status st = credential(present, present ? std::string(it->second.data(), it->second.size()) : std::string(),
                           "Bearer " + options_.token);
    if (!st.ok()) metrics_.error(st.error_code());
    return st;
}

Status ShardService::check_token(const std::string & token) const {
    if (options_.token.empty()) return Status::OK;
    return credential(!token.empty(), token, options_.token);
}

Status ShardService::Describe(grpc::ServerContext * ctx, const dgr::v1::DescribeRequest *, dgr::v1::DescribeReply * reply) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    auto * c = reply->mutable_compatibility();
    c->set_model_fingerprint(options_.fingerprint);
    const dgr::BuildInfo & build = dgr::build_info();  // compiled in: where it started does not matter
    c->set_llama_cpp_commit(build.llama_commit);
    c->set_patch_stack_sha256(build.patch_stack_sha256);
    c->set_schema_version(build.schema_version);
    c->set_lane(build.lane);
    c->set_arch(desc_.arch);
    c->set_n_layer((uint32_t) desc_.n_layer);
    c->set_recipe(options_.recipe);
    reply->set_model_name(options_.model_name);
    reply->set_layer_first((uint32_t) desc_.layer_first);
    reply->set_layer_last((uint32_t) desc_.layer_last);
    auto * b = reply->mutable_boundary();
    b->set_hc((uint32_t) desc_.boundary.hc);
    b->set_n_embd((uint32_t) desc_.boundary.n_embd);
    b->set_needs_token_ids(desc_.boundary.needs_token_ids);
    for (auto d : {dgr::DType::f32, dgr::DType::f16, dgr::DType::bf16}) b->add_dtypes(to_wire(d));
    reply->set_n_ctx((uint32_t) desc_.n_ctx);
    reply->set_max_sessions((uint32_t) desc_.max_sessions);
    reply->set_max_tokens_per_message((uint32_t) desc_.n_batch);
    reply->set_max_message_bytes(options_.max_message_bytes);
    reply->set_max_rollback((uint32_t) desc_.max_rollback);
    reply->set_mtp(desc_.mtp);
    reply->set_prefix_cache_sessions((uint32_t) desc_.cache_sessions);
    reply->set_prefix_cache_bytes(desc_.cache_bytes);
    reply->set_batch_invariant(desc_.batch_invariant);
    return Status::OK;
}

Status ShardService::Health(grpc::ServerContext * ctx, const dgr::v1::HealthRequest *, dgr::v1::HealthReply * reply) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    const size_t sessions = engine_->session_count();  // never waits behind a compute
    reply->set_ready(true);
    reply->set_draining(draining_.load());
    reply->set_sessions((uint32_t) sessions);
    reply->set_capacity((uint32_t) std::max<int64_t>(0, desc_.max_sessions - (int64_t) sessions));
    reply->set_queue_depth((uint32_t) std::max(0, in_flight_.load()));
    reply->set_widest_batch((uint32_t) batcher_.widest());
    reply->set_cached_sessions((uint32_t) engine_->cache_stats().sessions);
    return Status::OK;
}

Status ShardService::CloseSession(grpc::ServerContext * ctx, const dgr::v1::CloseSessionRequest * req, dgr::v1::CloseSessionReply *) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    try {
        engine_->release(req->session_id());
    } catch (const dgr::ShardError & e) {
        return from_shard_error(e);
    }
    return Status::OK;
}

void ShardService::release(uint64_t session, uint64_t epoch) { engine_->release_epoch(session, epoch); }

Status ShardService::compute(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply, uint32_t peers,
                             StepCheck * check) {
    std::optional<StepCheck> whole;  // no stream's check: each request is a whole step
    Status st = compute_one(req, reply, peers, check != nullptr ? *check : whole.emplace());
    if (!st.ok()) metrics_.error(st.error_code());
    return st;
}

Status ShardService::compute_one(const dgr::v1::ForwardRequest & req, dgr::v1::ForwardReply * reply, uint32_t peers,
                                 StepCheck & check) {
    const int64_t arrived_ns = steady_ns();
    // backpressure: a bounded queue, refused beyond it (the session's cache is untouched and the
    // client may retry); the requests admitted compute in arrival order
    InFlight admitted(in_flight_);
    if (admitted.ahead > options_.max_queue) {
        return Status(StatusCode::RESOURCE_EXHAUSTED, "queue full: " + std::to_string(admitted.ahead) +
                                                          " forwards in flight, at most " + std::to_string(options_.max_queue) +
                                                          " may wait; retry later");
    }
    if (req.has_stage()) {
        if (Status st = check_stage(req.stage(), desc_, options_.fingerprint); !st.ok()) return st;
    }
    DecodedForward d;
    if (Status st = decode_forward(req, desc_, &d); !st.ok()) return st;
    if (desc_.is_tail) {  // a part of a drafted step that a draft before it already decided
        StepCheck::Next next = StepCheck::Next::compute;
        if (Status st = check.before(req, &next, reply); !st.ok()) return st;
        if (next != StepCheck::Next::compute) {
            metrics_.part_skipped();
            return Status::OK;
        }
    }
    // the cache expectation (epoch, n_past, prefix hash) is checked by the engine, atomically
    // with the forward
    d.engine.prefix_hash = req.expect().prefix_hash();
    const dgr::ForwardRequest & fr = d.engine;
    dgr::BatchItem item;
    item.request = fr;
    item.out_dtype = desc_.is_tail ? dgr::DType::f32 : d.out_dtype;
    // forward mode: where this stage's output goes (the next stage, or from the tail the head),
    // so that the steps computed together and bound for the same stage leave as one cohort
    uint64_t next_key = 0;
    if (req.has_route()) {
        const auto & stages = req.route().stages();
        const uint64_t next = desc_.is_tail ? 0 : (uint64_t) req.route().stage_index() + 1;
        if (next < (uint64_t) stages.size()) next_key = std::hash<std::string>{}(stages[(int) next]);
    }
    const Batcher::Timing timing = batcher_.run(item, from_wire(req.cohort()), next_key, peers);
    if (!timing.gathered_all) metrics_.cohort_incomplete();
    if (!item.error) metrics_.forward((size_t) fr.n_tokens, fr.n_tokens == 1 && fr.n_past > 0, timing.queue_seconds, timing.compute_seconds, timing.alone);
    try {
        if (item.error) std::rethrow_exception(item.error);
    } catch (const dgr::ShardError & e) {
        return from_shard_error(e);
    } catch (const std::exception & e) {
        return Status(StatusCode::INTERNAL, std::string("engine: ") + e.what());
    }
    const dgr::ForwardResult & res = item.result;
    reply->set_session_id(fr.session);
    reply->set_n_past((uint32_t) res.n_past);
    reply->set_prefix_hash(res.prefix_hash);
    reply->set_epoch(fr.epoch);
    if (req.has_route() && timing.cohort.size > 1) to_wire(timing.cohort, reply->mutable_cohort());
    if (res.is_logits) {
        check.take(req, res, reply);
        if (fr.mtp && req.last_chunk() && req.draft().propose() > 0) {
            // MTP: drafts of the tokens after the last one sampled, for the head's next step
            const int32_t last = reply->more_tokens_size() > 0 ? reply->more_tokens(reply->more_tokens_size() - 1).token_id()
                                                               : reply->token().token_id();
            try {
                const ComputeSlots::Hold slot = slots_.acquire();  // a compute like any other
                slot.place(*engine_);
                for (int32_t d : engine_->draft_mtp(fr.session, (int32_t) reply->n_past(), last, (int32_t) req.draft().propose())) {
                    reply->add_drafts(d);
                }
            } catch (const dgr::ShardError & e) {
                return from_shard_error(e);
            }
        }
    } else {
        encode_boundary(reply->mutable_boundary(), res.dtype, (uint32_t) res.n_rows, (uint32_t) desc_.boundary.hc,
                        (uint32_t) desc_.boundary.n_embd, res.data.data(), res.data.size());
    }
    if (req.has_route()) add_step_time(req, steady_ns() - arrived_ns, timing.compute_seconds, reply);
    return Status::OK;
}

Status ShardService::Forward(grpc::ServerContext * ctx, Stream * stream) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    if (draining_.load()) return Status(StatusCode::UNAVAILABLE, "draining: not accepting new streams");
    dgr::v1::ForwardRequest req;
    if (!stream->Read(&req)) return Status::OK;
    if (!req.has_route()) return relay(ctx, stream, std::move(req));
    if (Status st = validate_route(req.route(), desc_); !st.ok()) return st;
    if (desc_.is_head) return forward_head(ctx, stream, std::move(req));
    GrpcUpstream up(stream);
    return forward_stage(up, std::move(req));
}

Status ShardService::relay(grpc::ServerContext * ctx, Stream * stream, dgr::v1::ForwardRequest req) {
    // a stream that ends abnormally (deadline, cancellation, a dead client) frees the sessions
    // it carried: nobody will continue them, and their KV slots are scarce
    std::map<uint64_t, uint64_t> seen;  // session -> epoch
    auto abandon = [&](Status st) {
        for (const auto & [session, epoch] : seen) release(session, epoch);
        return st;
    };
    do {
        if (ctx->IsCancelled()) return abandon(Status(StatusCode::CANCELLED, "cancelled by the client"));
        if (req.has_route()) {
            return Status(StatusCode::INVALID_ARGUMENT, "route: a relay-mode stream cannot switch to forward mode");
        }
        uint64_t & epoch = seen[req.session_id()];
        epoch = std::max(epoch, req.expect().epoch());
        dgr::v1::ForwardReply reply;
        if (Status st = compute(req, &reply); !st.ok()) return st;  // the cache is as it was
        if (!stream->Write(reply)) return abandon(Status(StatusCode::CANCELLED, "client went away"));
    } while (stream->Read(&req));
    if (ctx->IsCancelled()) return abandon(Status(StatusCode::CANCELLED, "cancelled or past its deadline"));
    return Status::OK;
}

// a stage after the head: compute, pass the output on (or, at the tail, return the token to the
// head); a failure further down comes back through the link and goes on upstream
Status ShardService::forward_stage(Upstream & stream, dgr::v1::ForwardRequest req) {
    const uint64_t session = req.session_id(), epoch = req.expect().epoch();
    const dgr::v1::RouteSpec route = req.route();
    const uint32_t me = route.stage_index();
    std::mutex up_mutex;
    std::atomic<bool> failed{false};
    auto report_up = [&](const dgr::v1::StageError & e) {
        if (failed.exchange(true)) return;
        std::lock_guard<std::mutex> lock(up_mutex);
        stream.write(error_reply(session, epoch, e));
    };
    Status result = Status::OK;
    {
        std::unique_ptr<Downstream> down;
        std::unique_ptr<TokenReturn> loop;
        StepCheck check;  // the tail: drafted steps, whole or in parts
        do {
            if (failed.load()) continue;  // broken further down: drain until the sender closes
            if (Status st = one_session(req, session, epoch); !st.ok()) {
                result = st;
                break;
            }
            // the session's link opens before the first compute: its handshake overlaps it
            if (!desc_.is_tail && !down) {
                down = peers_.downstream(route.stages(me + 1), me + 1, report_up);
            } else if (desc_.is_tail && !loop) {
                loop = peers_.token_return(route.stages(0), report_up);
            }
            dgr::v1::ForwardReply reply;
            if (Status st = compute(req, &reply, 0, &check); !st.ok()) {
                result = st;  // the stage before names this one with it
                break;
            }
            if (!desc_.is_tail) {
                down->write(next_request(req, &reply));  // a broken link is reported by its reader
            } else if (check.ready()) {
                if (!loop->write(reply)) {
                    report_up(stage_error(0, route.stages(0),
                                          Status(StatusCode::UNAVAILABLE, "the tail could not return its token to the head")));
                }
            }
        } while (stream.read(&req));
    }  // links closed before the session goes
    release(session, epoch);
    return result;
}

// The head's port (head_session.h) over the coordinator's gRPC stream: computes here and opens
// the link to stage 1 with the first forward (its handshake overlaps that compute); a head that is
// also the tail hands its token back to the flow as an event
class ShardService::HeadStream final : public HeadPort {
public:
    HeadStream(ShardService & service, Stream * stream, const std::shared_ptr<HeadFlow> & flow,
               const dgr::v1::RouteSpec & route)
        : service_(service), stream_(stream), flow_(flow), route_(route), convoy_(service.convoy_.of(route_costs_key(route, 0))) {}

    Status forward(const dgr::v1::ForwardRequest & r, uint32_t peers) override {
        if (!service_.desc_.is_tail && !down_) {
            down_ = service_.peers_.downstream(route_.stages(1), 1, [flow = flow_](const dgr::v1::StageError & e) {
                flow->push(HeadFlow::Event{HeadFlow::Event::failure, {}, {}, e});
            });
        }
        if (r.last_chunk()) flow_->sent_ns.store(steady_ns());  // a token will come back for it
        dgr::v1::ForwardReply reply;
        if (Status st = service_.compute(r, &reply, peers); !st.ok()) return st;
        if (service_.desc_.is_tail) {
            if (r.last_chunk()) flow_->push(HeadFlow::Event{HeadFlow::Event::token, {}, std::move(reply), {}});
        } else {
            down_->write(next_request(r, &reply));  // a broken link is reported by its reader
        }
        return Status::OK;
    }
    bool reply(const dgr::v1::ForwardReply & r) override { return stream_->Write(r); }
    uint32_t peers_behind(int64_t sent_ns) override { return service_.peers_behind(flow_.get(), sent_ns); }
    void observe_round(double round_s, const dgr::v1::StepTime & stages) override {
        convoy_->observe(round_s, stages.held_us() * 1e-6, stages.compute_us() * 1e-6);
    }
    bool apart() override { return convoy_->apart(); }
    void forgo(const Cohort & cohort) override { service_.batcher_.forgo(cohort); }
    void in_parts() override { service_.metrics_.step_in_parts(); }
    void close_link() { down_.reset(); }

private:
    ShardService & service_;
    Stream * stream_;
    std::shared_ptr<HeadFlow> flow_;
    const dgr::v1::RouteSpec & route_;
    const std::shared_ptr<ConvoyRule> convoy_;  // its route's
    std::unique_ptr<Downstream> down_;
};

Status ShardService::forward_head(grpc::ServerContext * ctx, Stream * stream, dgr::v1::ForwardRequest first) {
    using Event = HeadFlow::Event;
    const uint64_t session = first.session_id(), epoch = first.expect().epoch();
    const dgr::v1::RouteSpec route = first.route();
    auto flow = std::make_shared<HeadFlow>();
    flow->session = session;
    flow->epoch = epoch;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = flows_.find(session);
        if (it != flows_.end() && it->second->epoch >= epoch) {
            return Status(StatusCode::FAILED_PRECONDITION, "session " + std::to_string(session) +
                                                               " already streams in forward mode at epoch " +
                                                               std::to_string(it->second->epoch));
        }
        flows_[session] = flow;
    }
    HeadStream port(*this, stream, flow, route);
    Status result;
    {
        HeadSession head(session, epoch, route, std::chrono::milliseconds(first.token_interval_ms()),
                         HeadLimits{desc_.n_ctx, desc_.n_vocab, options_.draft_part_rows}, port, draft_costs_);
        flow->handle = [&](Event & ev) {
            switch (ev.kind) {
                case Event::request: return head.on_request(ev.req);
                case Event::token: return head.on_token(std::move(ev.reply), flow->sent_ns.exchange(0));
                case Event::failure: return head.on_failure(ev.error);
                case Event::closed: return head.on_closed();  // the coordinator closed, or vanished
            }
            return true;
        };
        // the first request goes in before the reader starts: the coordinator sends its chunks
        // back to back, and the second must not overtake the first
        flow->push(Event{Event::request, std::move(first), {}, {}});
        std::thread upstream([&] {
            dgr::v1::ForwardRequest r;
            while (stream->Read(&r)) flow->push(Event{Event::request, std::move(r), {}, {}});
            flow->push(Event{Event::closed, {}, {}, {}});
        });
        flow->wait_over();
        result = head.result();
        if (!head.closed()) ctx->TryCancel();  // ends the reader's Read (the error reply is already written)
        upstream.join();
    }  // the route's step costs kept for its next generation
    port.close_link();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = flows_.find(session);
        if (it != flows_.end() && it->second == flow) flows_.erase(it);
    }
    release(session, epoch);
    return result;
}

uint32_t ShardService::peers_behind(const HeadFlow * me, int64_t sent_ns) {
    const int64_t window = (int64_t) options_.gather_us * 1000;
    if (window <= 0) return 0;
    uint32_t n = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto & [session, f] : flows_) {
        const int64_t s = f.get() == me ? 0 : f->sent_ns.load();
        n += s > sent_ns && s - sent_ns <= window ? 1 : 0;
    }
    return n;
}

Status ShardService::Loop(grpc::ServerContext * ctx, grpc::ServerReader<dgr::v1::ForwardReply> * reader, dgr::v1::LoopReply *) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    return loop_tokens([reader](dgr::v1::ForwardReply * msg) { return reader->Read(msg); });
}

Status ShardService::loop_tokens(const std::function<bool(dgr::v1::ForwardReply *)> & read) {
    dgr::v1::ForwardReply msg;
    while (read(&msg)) {
        std::shared_ptr<HeadFlow> flow;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = flows_.find(msg.session_id());
            if (it != flows_.end()) flow = it->second;
        }
        if (!flow) {
            return Status(StatusCode::FAILED_PRECONDITION,
                          "no forward-mode session " + std::to_string(msg.session_id()) + " at this head");
        }
        if (!msg.has_token()) return Status(StatusCode::INVALID_ARGUMENT, "Loop carries sampled tokens only");
        if (msg.epoch() != flow->epoch) continue;  // a token of an older epoch of this session
        flow->push(HeadFlow::Event{HeadFlow::Event::token, {}, std::move(msg), {}});
    }
    return Status::OK;
}

// A data stream (datalink.h): HELLO, then as Forward (forward mode, a stage after the head) or as
// Loop (the head), then END with the status the call would have ended with.
void ShardService::serve_data(const std::shared_ptr<FrameConn> & conn) {
    DataUpstream up(*conn);
    Status st = serve_data_stream(up);
    if (st.ok() && !up.failure().ok()) st = up.failure();  // the stream broke: say why
    if (!st.ok()) metrics_.error(st.error_code());
    dgr::v1::DataEnd end;
    end.set_code((int32_t) st.error_code());
    end.set_message(st.error_message());
    conn->send(dgr::v1::DATA_FRAME_END, &end);
    conn->shutdown_write();
}

Status ShardService::serve_data_stream(DataUpstream & up) {
    dgr::v1::DataHello hello;
    bool ended = false;
    if (Status st = up.conn().receive_message(dgr::v1::DATA_FRAME_HELLO, &hello, &ended); !st.ok() || ended) {
        return ended ? Status(StatusCode::INVALID_ARGUMENT, "data stream: closed before its HELLO") : st;
    }
    if (Status st = check_token(hello.token()); !st.ok()) return st;
    if (Status st = check_hello(hello); !st.ok()) return st;
    if (draining_.load()) return Status(StatusCode::UNAVAILABLE, "draining: not accepting new streams");
    switch (hello.stream()) {
        case dgr::v1::DATA_STREAM_FORWARD: {
            dgr::v1::ForwardRequest req;
            if (!up.read(&req)) return Status::OK;
            if (!req.has_route()) return Status(StatusCode::INVALID_ARGUMENT, "route: a data stream carries forward mode only");
            if (Status st = validate_route(req.route(), desc_); !st.ok()) return st;
            if (desc_.is_head) {
                return Status(StatusCode::INVALID_ARGUMENT,
                              "route: the head takes its stream from the coordinator, over gRPC");
            }
            return forward_stage(up, std::move(req));
        }
        case dgr::v1::DATA_STREAM_LOOP:
            return loop_tokens([&up](dgr::v1::ForwardReply * msg) { return up.read_reply(msg); });
        default:
            return Status(StatusCode::INVALID_ARGUMENT,
                          "data stream: HELLO names stream " + std::to_string((int) hello.stream()) + ", not FORWARD or LOOP");
    }
}

}  // namespace dgr::worker
