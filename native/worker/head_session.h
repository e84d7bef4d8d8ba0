// The head's side of one forward-mode session: a state machine over the events of the session
// (the coordinator's prefill chunks, tokens back from the tail, a failure down the route, the
// coordinator closing its stream), with no gRPC and no socket of its own. What it drives is a
// HeadPort: this stage's compute and the link onward, the coordinator's stream, and what the head
// knows of its other sessions. ShardService::forward_head is the adapter between a gRPC stream and
// it; the unit tests drive it with a port of their own.
//
//   prefilling --last chunk--> generating --last token--> finished --closed--> over
//        \______________________ any failure, or the coordinator gone ______/
//
// - prefilling: chunks are computed in order; the last one carries max_tokens, stop ids and the
//   Draft, and the route decodes from there (a chunk after it is refused).
// - generating: each token back from the tail is kept up to max_tokens or a stop id (stop()
//   decides both, once), streamed to the coordinator coalesced (token_interval_ms), and the next
//   decode step leaves: plain, with prompt-lookup drafts, or verifying the tail's MTP drafts, and
//   where the links cost more than the stages' compute a drafted step travels in parts
//   (verify.h). A plain step's round trip, with the stages' time for it that came back with its
//   token, tells the head's convoy rule whether its sessions travel batched or apart (convoy.h).
// - finished: nothing more is computed; the session waits for the coordinator to close.
// - over: the result says how the coordinator's stream ends; every failure has been written to it
//   as a StageError, after the tokens generated before it.
#pragma once

#include "batcher.h"
#include "drafting.h"
#include "dgr/v1/shard.pb.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <vector>

namespace dgr::worker {

class HeadPort {
public:
    virtual ~HeadPort() = default;
    // compute `req` at this stage and pass its output on (to the next stage; a head that is also
    // the tail delivers the token back as an event); `peers` as Batcher::run. Not OK: the session
    // fails with it, named as the head's error
    virtual grpc::Status forward(const dgr::v1::ForwardRequest & req, uint32_t peers) = 0;
    // a reply to the coordinator; false: it went away
    virtual bool reply(const dgr::v1::ForwardReply & reply) = 0;
    // sessions of this head whose steps left after `sent_ns` (steady clock), within the batcher's
    // gather window: their tokens come back that soon after this one's
    virtual uint32_t peers_behind(int64_t sent_ns) = 0;
    // a decode step's round trip (seconds, its leaving to its token back) and the stages' time for
    // it, summed around the ring: what the convoy rule learns from (convoy.h)
    virtual void observe_round(double round_s, const dgr::v1::StepTime & stages) = 0;
    // this head's sessions travel apart: a step waits for no peers and joins no cohort
    virtual bool apart() = 0;
    // a cohort member that will not come (Batcher::forgo)
    virtual void forgo(const Cohort & cohort) = 0;
    // a drafted step leaves in parts (counted: dgr:draft_steps_in_parts_total)
    virtual void in_parts() = 0;
};

struct HeadLimits {
    int32_t n_ctx = 0;           // the head's context: drafts never run past it
    int32_t n_vocab = 0;         // MTP drafts that came back lie inside it
    int32_t draft_part_rows = 2;  // ServiceOptions::draft_part_rows
};

// speculative decoding: the key a route's step costs are kept under (DraftCosts): its stages, in
// order, and the draft source
uint64_t route_costs_key(const dgr::v1::RouteSpec & route, int source);

// The token that ended a generation, if any: max_tokens reached or a stop id generated.
class StopRule {
public:
    StopRule() = default;
    StopRule(uint32_t max_tokens, std::set<int32_t> stop_ids) : max_(max_tokens), stop_(std::move(stop_ids)) {}
    bool take(int32_t token) { return ++generated_ >= max_ || stop_.count(token) > 0; }  // true: the last
    uint32_t left() const { return max_ > generated_ ? max_ - generated_ : 0; }

private:
    uint32_t max_ = 0, generated_ = 0;
    std::set<int32_t> stop_;
};

class HeadSession {
public:
    enum class State { prefilling, generating, finished, over };

    HeadSession(uint64_t session, uint64_t epoch, dgr::v1::RouteSpec route, std::chrono::milliseconds token_interval,
                HeadLimits limits, HeadPort & port, DraftCosts & costs);
    ~HeadSession();  // what the steps cost goes to `costs`, for the route's next generation
    HeadSession(const HeadSession &) = delete;
    HeadSession & operator=(const HeadSession &) = delete;

    // The events, one at a time; each returns whether the session is over.
    bool on_request(const dgr::v1::ForwardRequest & req);
    // a token (and what came with it) back from the tail for the step that left at `sent_ns`
    // (0: not known)
    bool on_token(dgr::v1::ForwardReply reply, int64_t sent_ns);
    bool on_failure(const dgr::v1::StageError & error);
    bool on_closed();

    State state() const { return state_; }
    // how the coordinator's stream ends (OK until a failure)
    const grpc::Status & result() const { return result_; }
    // the coordinator closed its stream (else whoever reads it must be stopped)
    bool closed() const { return closed_; }

private:
    struct Drafting;  // speculative decoding's state, where the last chunk asked for it

    void start(const dgr::v1::ForwardRequest & last_chunk);
    // the tokens of a reply up to the last one wanted; returns that token, *last when it ends
    // the generation (the reply is trimmed to it)
    int32_t keep_wanted(dgr::v1::ForwardReply & reply, bool * last);
    // the next decode step after `token` into step_ (drafts planned), the session then holding
    // n_past tokens of prefix hash `hash`; `proposed`: MTP drafts that came with the token
    void plan_step(int32_t token, uint32_t n_past, uint64_t hash, const std::vector<int32_t> & proposed);
    void send_step(uint32_t peers, const Cohort & mates);
    void send_in_parts();
    void send(const dgr::v1::ForwardRequest & req, uint32_t peers);
    bool fail(const dgr::v1::StageError & error);
    bool fail_here(const grpc::Status & status);  // a failure of this stage (the head)
    bool fail_at_tail(const grpc::Status & status);  // what came back from the tail is wrong

    const uint64_t session_, epoch_;
    const dgr::v1::RouteSpec route_;
    const HeadLimits limits_;
    HeadPort & port_;
    DraftCosts & costs_;
    State state_ = State::prefilling;
    grpc::Status result_;
    bool closed_ = false;
    StopRule stop_;
    dgr::v1::ForwardRequest step_;  // the template of decode steps: sampling, dtype, route
    std::vector<int32_t> prompt_;   // the prompt's tokens, until a drafter takes them
    bool chunk_without_mtp_ = false;
    std::unique_ptr<Drafting> drafting_;

    // the coordinator's replies: tokens gathered until token_interval has passed since the last
    // reply went out; the first token of a quiet stream and the last of a generation go at once
    class Coalescer {
    public:
        explicit Coalescer(std::chrono::milliseconds interval) : interval_(interval) {}
        bool add(dgr::v1::ForwardReply && reply, bool last);  // true: the gathered reply is due
        bool pending() const { return pending_; }
        dgr::v1::ForwardReply take();

    private:
        std::chrono::milliseconds interval_;
        // when the last reply went out; none yet: the first is due at once (not "interval since the
        // clock's epoch", which on a steady clock is the host's boot and may be less than interval ago)
        std::optional<std::chrono::steady_clock::time_point> sent_;
        dgr::v1::ForwardReply reply_;
        bool pending_ = false;
    } out_;
};

}  // namespace dgr::worker
