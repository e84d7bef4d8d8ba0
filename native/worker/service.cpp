#include "service.h"

#include "drafting.h"
#include "sampling.h"
#include "validate.h"
#include "wire.h"

#include <chrono>
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

// speculative decoding: the key a route's step costs are kept under (DraftCosts): its stages, in
// order, and the draft source
uint64_t route_costs_key(const dgr::v1::RouteSpec & route, int source) {
    std::string key = std::to_string(source);
    for (const std::string & stage : route.stages()) key += "\n" + stage;
    return std::hash<std::string>{}(key);
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
    next.set_chunk_index(req.chunk_index());
    next.set_last_chunk(req.last_chunk());
    next.set_n_draft(req.n_draft());
    if (req.has_draft()) *next.mutable_draft() = req.draft();  // MTP: the tail's block follows
    *next.mutable_sampling() = req.sampling();
    next.set_boundary_dtype(req.boundary_dtype());
    *next.mutable_route() = req.route();
    next.mutable_route()->set_stage_index(req.route().stage_index() + 1);
    return next;
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

// The head's replies to the coordinator in forward mode: tokens gathered into one reply (`token`,
// then `more_tokens`) until token_interval_ms has passed since the last reply went out. The first
// token of a quiet stream and the last of a generation go at once.
class TokenCoalescer {
public:
    using Clock = std::chrono::steady_clock;
    explicit TokenCoalescer(std::chrono::milliseconds interval) : interval_(interval) {}

    // queue a tail reply; true when the gathered reply is due now
    bool add(dgr::v1::ForwardReply && reply, bool last) {
        if (!pending_) {
            reply_ = std::move(reply);
            pending_ = true;
        } else {
            reply_.add_more_tokens()->Swap(reply.mutable_token());
            for (auto & t : *reply.mutable_more_tokens()) reply_.add_more_tokens()->Swap(&t);
            reply_.set_n_past(reply.n_past());
            reply_.set_prefix_hash(reply.prefix_hash());
            reply_.set_drafted(reply_.drafted() + reply.drafted());
            reply_.set_accepted(reply_.accepted() + reply.accepted());
        }
        return last || Clock::now() - sent_ >= interval_;
    }
    bool pending() const { return pending_; }
    dgr::v1::ForwardReply take() {
        pending_ = false;
        sent_ = Clock::now();
        return std::move(reply_);
    }

private:
    std::chrono::milliseconds interval_;
    Clock::time_point sent_{};  // the epoch: the first token is always due
    dgr::v1::ForwardReply reply_;
    bool pending_ = false;
};

ShardService::ShardService(std::unique_ptr<dgr::ShardEngine> engine, ServiceOptions options, PeerOptions peers)
    : engine_(std::move(engine)),
      options_(std::move(options)),
      desc_(engine_->describe()),
      peers_(std::move(peers)),
      slots_(options_.compute_slots_dir, options_.compute_slots, options_.pin_threads),
      batcher_(*engine_, std::min(options_.max_batch, desc_.n_batch), slots_, std::chrono::microseconds(options_.gather_us),
               [this](size_t width) { metrics_.turn(width); }),
      metrics_(LiveState{[this] { return engine_->session_count(); },
                         [this] { return (size_t) std::max(0, in_flight_.load()); },
                         [this] { return engine_->kv_tokens(); }, [this] { return engine_->cache_stats(); },
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

Status ShardService::OpenSession(grpc::ServerContext * ctx, const dgr::v1::OpenSessionRequest *, dgr::v1::OpenSessionReply * reply) {
    if (Status st = authorize(ctx); !st.ok()) return st;
    reply->set_n_ctx((uint32_t) desc_.n_ctx);
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
    // backpressure: a bounded queue, refused beyond it (the session's cache is untouched and the
    // client may retry); the requests admitted compute in arrival order
    InFlight admitted(in_flight_);
    if (admitted.ahead > options_.max_queue) {
        return Status(StatusCode::RESOURCE_EXHAUSTED, "queue full: " + std::to_string(admitted.ahead) +
                                                          " forwards in flight, at most " + std::to_string(options_.max_queue) +
                                                          " may wait; retry later");
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

Status ShardService::forward_head(grpc::ServerContext * ctx, Stream * stream, dgr::v1::ForwardRequest first) {
    using Event = HeadFlow::Event;
    const uint64_t session = first.session_id(), epoch = first.expect().epoch();
    const dgr::v1::RouteSpec route = first.route();
    const std::chrono::milliseconds interval(first.token_interval_ms());
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
    Status result = Status::OK;
    bool done = false, closed = false, generating = false, finished = false;
    uint32_t max_tokens = 0, generated = 0;
    std::set<int32_t> stop;
    dgr::v1::ForwardRequest step;  // the template of decode steps: sampling, dtype, route
    std::unique_ptr<Downstream> down;
    // speculative decoding (Draft on the last prefill chunk): the session's tokens so far, the
    // drafter over them (prompt lookup) or the drafts the tail sends with each token (MTP, with
    // the Draft on every chunk), and when the step in flight left
    std::unique_ptr<PromptLookup> lookup;
    bool mtp = false, chunk_without_mtp = false;
    std::unique_ptr<DraftController> drafts;
    uint64_t costs_key = 0;  // the route and draft source its step costs are kept under (DraftCosts)
    double head_s = 0.0;     // this stage's compute of a plain step (seconds, a moving average)
    std::vector<int32_t> prompt;
    int32_t in_flight_drafts = 0, in_flight_proposed = 0;  // MTP: drafts the tail makes with the step
    bool in_flight_probe = false;
    DraftChoice planned;  // MTP: the drafts the step in flight asked the tail for, chosen a step ahead
    int32_t shadow = -1;  // lookup, after a plain step: the token it would have drafted, or -1
    auto step_sent = std::chrono::steady_clock::now();
    // tokens go to the coordinator coalesced, at most one reply per token_interval_ms: every reply
    // wakes a coordinator whose threads would otherwise take CPU from a stage computing
    TokenCoalescer out(interval);
    auto fail = [&](const dgr::v1::StageError & e) {
        if (out.pending()) stream->Write(out.take());  // what was generated before the failure
        stream->Write(error_reply(session, epoch, e));
        result = Status((StatusCode) e.code(), "stage " + std::to_string(e.stage()) + " (" + e.address() + "): " + e.message());
        done = true;
    };
    auto now_ns = [] {
        return (int64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
            .count();
    };
    auto process = [&](const dgr::v1::ForwardRequest & r, uint32_t peers = 0) {
        if (!desc_.is_tail && !down) {  // opened before the first compute: the handshake overlaps it
            down = peers_.downstream(route.stages(1), 1, [flow](const dgr::v1::StageError & e) {
                flow->push(Event{Event::failure, {}, {}, e});
            });
        }
        if (r.last_chunk()) flow->sent_ns.store(now_ns());  // a token will come back for it
        dgr::v1::ForwardReply reply;
        if (Status st = compute(r, &reply, peers); !st.ok()) return fail(stage_error(0, route.stages(0), st));
        if (desc_.is_tail) {
            if (r.last_chunk()) flow->push(Event{Event::token, {}, std::move(reply), {}});
            return;
        }
        down->write(next_request(r, &reply));  // a broken link is reported by its reader
    };
    flow->handle = [&](Event & ev) {
        // a cancelled or vanished coordinator ends the reader's Read, which queues `closed`
        switch (ev.kind) {
            case Event::request:
                if (Status st = one_session(ev.req, session, epoch); !st.ok()) {
                    fail(stage_error(0, route.stages(0), st));
                } else if (generating || finished) {
                    fail(stage_error(0, route.stages(0),
                                     Status(StatusCode::INVALID_ARGUMENT,
                                            "forward mode: the prefill ended with its last chunk; the route drives decoding")));
                } else {
                    const bool mtp_chunk = ev.req.draft().source() == dgr::v1::DRAFT_SOURCE_MTP;
                    chunk_without_mtp = chunk_without_mtp || !mtp_chunk;
                    if (ev.req.last_chunk() && mtp_chunk && chunk_without_mtp) {
                        fail(stage_error(0, route.stages(0),
                                         Status(StatusCode::INVALID_ARGUMENT,
                                                "draft: MTP drafting needs the Draft on every prefill chunk (the tail's MTP "
                                                "block follows each forward)")));
                        break;
                    }
                    if (ev.req.last_chunk()) {
                        if (ev.req.max_tokens() < 1) {
                            fail(stage_error(0, route.stages(0),
                                             Status(StatusCode::INVALID_ARGUMENT, "max_tokens: at least 1 on the last prefill chunk")));
                            break;
                        }
                        generating = true;
                        max_tokens = ev.req.max_tokens();
                        stop.insert(ev.req.stop_ids().begin(), ev.req.stop_ids().end());
                        step = ev.req;
                        step.clear_token_ids();
                        step.clear_stop_ids();
                        step.clear_draft();
                        step.mutable_expect()->set_reuse(false);  // the session is here now
                        step.set_chunk_index(0);
                        costs_key = route_costs_key(route, ev.req.draft().source());
                        head_s = draft_costs_.get(costs_key).head;
                        if (ev.req.draft().source() == dgr::v1::DRAFT_SOURCE_LOOKUP) {
                            const auto & d = ev.req.draft();
                            lookup = std::make_unique<PromptLookup>((int32_t) d.ngram_min(), (int32_t) d.ngram_max());
                            drafts = std::make_unique<DraftController>((int32_t) d.max_draft(), 1.0, true, draft_costs_.get(costs_key));
                            step.mutable_expect()->set_truncate(true);
                        } else if (mtp_chunk) {
                            mtp = true;
                            drafts = std::make_unique<DraftController>((int32_t) ev.req.draft().max_draft(), 2.0, false,
                                                                       draft_costs_.get(costs_key));
                            *step.mutable_draft() = ev.req.draft();  // every step: the tail's block follows
                            step.mutable_expect()->set_truncate(true);
                        }
                    }
                    prompt.insert(prompt.end(), ev.req.token_ids().begin(), ev.req.token_ids().end());
                    if (lookup) {
                        for (int32_t t : prompt) lookup->add(t);
                        prompt.clear();
                    }
                    in_flight_drafts = -1;  // a prefill: not a decode step to time
                    process(ev.req);
                }
                break;
            case Event::token: {
                const int64_t sent = flow->sent_ns.exchange(0);
                if (!generating) break;
                // MTP: the tail's drafts for the next step (not the coordinator's business)
                std::vector<int32_t> proposed(ev.reply.drafts().begin(), ev.reply.drafts().end());
                ev.reply.clear_drafts();
                if (Status st = check_drafts(proposed); !st.ok()) {
                    fail(stage_error((uint32_t) route.stages_size() - 1, route.stages(route.stages_size() - 1), st));
                    break;
                }
                if (drafts && in_flight_drafts >= 0) {
                    drafts->observe(in_flight_drafts, (int32_t) ev.reply.accepted(),
                                    std::chrono::duration<double>(std::chrono::steady_clock::now() - step_sent).count(),
                                    in_flight_drafts + in_flight_proposed, in_flight_probe);
                }
                // a verified step yields several tokens: keep those up to the last one wanted
                bool last = false;
                int32_t token = ev.reply.token().token_id(), kept = 0;
                const int32_t n_out = 1 + ev.reply.more_tokens_size();
                for (int32_t i = 0; i < n_out && !last; ++i, ++kept) {
                    token = i == 0 ? ev.reply.token().token_id() : ev.reply.more_tokens(i - 1).token_id();
                    if (lookup) {
                        if (i == 0 && shadow >= 0) drafts->shadow(token == shadow);
                        lookup->add(token);
                    }
                    last = ++generated >= max_tokens || stop.count(token) > 0;
                }
                if (kept < n_out) {  // past the last token wanted: not the route's output
                    ev.reply.mutable_more_tokens()->DeleteSubrange(kept - 1, n_out - kept);
                    ev.reply.set_n_past(ev.reply.n_past() - (uint32_t) (n_out - kept));
                    ev.reply.set_prefix_hash(0);
                }
                if (in_flight_drafts > 0) ev.reply.set_drafted((uint32_t) in_flight_drafts);  // sent, if not all checked
                const uint32_t n_past = ev.reply.n_past();
                const uint64_t hash = ev.reply.prefix_hash();
                // the next step gathers with the sessions sampled beside this token (not the
                // coordinator's business)
                const Cohort mates = from_wire(ev.reply.cohort());
                ev.reply.clear_cohort();
                if (out.add(std::move(ev.reply), last) && !stream->Write(out.take())) {
                    result = Status(StatusCode::CANCELLED, "the coordinator went away");
                    done = true;
                    batcher_.forgo(mates);
                    break;
                }
                if (last) {
                    generating = false;  // nothing past the last token: wait for the coordinator to close
                    finished = true;
                    batcher_.forgo(mates);  // its cohort-mates go on without it
                    break;
                }
                step.clear_token_ids();
                step.add_token_ids(token);
                in_flight_drafts = 0;
                in_flight_proposed = 0;
                in_flight_probe = false;
                if (drafts) {
                    // never past max_tokens, nor past this stage's context
                    const int32_t room = std::min<int32_t>((int32_t) (max_tokens - generated) - 1,
                                                           desc_.n_ctx - (int32_t) n_past - 1);
                    const int32_t limit = std::min<int32_t>(room, (int32_t) kMaxDraft);
                    if (lookup) {
                        const DraftChoice c = drafts->next(limit);
                        in_flight_probe = c.probe;
                        // a plain step still proposes one token: it is checked against the token
                        // that comes back instead of being sent
                        const std::vector<int32_t> proposal = lookup->propose(std::max(c.k, 1));
                        shadow = c.k == 0 && !proposal.empty() ? proposal[0] : -1;
                        if (c.k > 0) {
                            for (int32_t d : proposal) step.add_token_ids(d);
                        }
                    } else {
                        // MTP drafts are made a step ahead: this step verifies what was chosen a
                        // step ago (as far as the tail made them), and asks for the next choice
                        for (int32_t i = 0; i < planned.k && i < (int32_t) proposed.size() && i < limit; ++i) {
                            step.add_token_ids(proposed[(size_t) i]);
                        }
                        in_flight_probe = planned.probe && step.token_ids_size() > 1;
                        planned = drafts->next(limit);
                        in_flight_proposed = planned.k;
                        step.mutable_draft()->set_propose((uint32_t) planned.k);
                    }
                    in_flight_drafts = step.token_ids_size() - 1;
                }
                step.set_n_draft((uint32_t) in_flight_drafts);
                if (mates.size > 1) {
                    to_wire(mates, step.mutable_cohort());
                } else {
                    step.clear_cohort();
                }
                step.mutable_expect()->set_n_past(n_past);
                step.mutable_expect()->set_prefix_hash(hash);
                step_sent = std::chrono::steady_clock::now();
                const uint32_t peers = sent != 0 ? peers_behind(flow.get(), sent) : 0;
                const int32_t rows = step.token_ids_size(), per = options_.draft_part_rows;
                // in parts that the stages pipeline (verify.h), where the links take longer than
                // the stages' compute: a part travels while the next is computed. Where the trip
                // is mostly compute (loopback) the stages could only overlap on spare cores, and
                // each part costs every stage a forward more (2 cores, against whole steps: 1.19-
                // 1.23x behind 10 ms links at 1 thread, 1.12x at 2; forced into parts on loopback
                // 0.92x at 1 thread and 0.97x at 2, one A/B each)
                const bool in_parts = lookup && in_flight_drafts > 0 && peers == 0 && mates.size <= 1 &&
                                      route.stages_size() > 1 && per > 0 && rows > per && head_s > 0.0 &&
                                      drafts->costs().t0 > 2.0 * route.stages_size() * head_s;
                if (in_parts) {
                    // balanced, the larger first, each a forward of its own here and on every stage
                    metrics_.step_in_parts();
                    const int32_t n_parts = (rows + per - 1) / per;
                    dgr::v1::ForwardRequest part = step;
                    for (int32_t j = 0, offset = 0; j < n_parts && !done; ++j) {
                        const int32_t size = rows / n_parts + (j < rows % n_parts ? 1 : 0);
                        part.clear_token_ids();
                        part.mutable_token_ids()->Add(step.token_ids().begin() + offset, step.token_ids().begin() + offset + size);
                        part.set_chunk_index((uint32_t) j);
                        part.set_last_chunk(j + 1 == n_parts);
                        part.set_n_draft((uint32_t) (j == 0 ? size - 1 : size));
                        part.mutable_expect()->set_n_past(n_past + (uint32_t) offset);
                        if (j > 0) {  // the part before checked them, and dropped nothing
                            part.mutable_expect()->set_prefix_hash(0);
                            part.mutable_expect()->set_truncate(false);
                        }
                        process(part);
                        offset += size;
                    }
                } else if (lookup && rows == 1) {  // what a plain step costs this stage (the send included)
                    const auto started = std::chrono::steady_clock::now();
                    process(step, peers);
                    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
                    head_s = head_s > 0.0 ? 0.75 * head_s + 0.25 * took : took;
                } else {
                    process(step, peers);
                }
                break;
            }
            case Event::failure: fail(ev.error); break;
            case Event::closed:
                closed = true;
                done = true;
                break;
        }
        return done;
    };
    // the first request goes in before the reader starts: the coordinator sends its chunks back
    // to back, and the second must not overtake the first
    flow->push(Event{Event::request, std::move(first), {}, {}});
    std::thread upstream([&] {
        dgr::v1::ForwardRequest r;
        while (stream->Read(&r)) flow->push(Event{Event::request, std::move(r), {}, {}});
        flow->push(Event{Event::closed, {}, {}, {}});
    });
    flow->wait_over();
    if (drafts) {  // for the route's next generation
        StepCosts costs = drafts->costs();
        costs.head = head_s;
        draft_costs_.put(costs_key, costs);
    }
    if (!closed) ctx->TryCancel();  // ends the reader's Read (the error reply is already written)
    upstream.join();
    down.reset();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = flows_.find(session);
        if (it != flows_.end() && it->second == flow) flows_.erase(it);
    }
    release(session, epoch);
    return result;
}

Status ShardService::check_drafts(const std::vector<int32_t> & drafts) const {
    if (drafts.size() > kMaxDraft) {
        return Status(StatusCode::INVALID_ARGUMENT,
                      "drafts: " + std::to_string(drafts.size()) + " came with a token, at most " + std::to_string(kMaxDraft));
    }
    for (int32_t d : drafts) {
        if (d < 0 || d >= desc_.n_vocab) {
            return Status(StatusCode::INVALID_ARGUMENT,
                          "drafts: token id " + std::to_string(d) + " outside the vocabulary of " + std::to_string(desc_.n_vocab));
        }
    }
    return Status::OK;
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
