#include "head_session.h"

#include "clock.h"
#include "forwarding.h"
#include "validate.h"

#include <algorithm>
#include <functional>
#include <string>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

namespace {

// MTP drafts that came back with a token: at most kMaxDraft, inside the vocabulary
Status check_drafts(const std::vector<int32_t> & drafts, int32_t n_vocab) {
    if (drafts.size() > kMaxDraft) {
        return Status(StatusCode::INVALID_ARGUMENT,
                      "drafts: " + std::to_string(drafts.size()) + " came with a token, at most " + std::to_string(kMaxDraft));
    }
    for (int32_t d : drafts) {
        if (d < 0 || d >= n_vocab) {
            return Status(StatusCode::INVALID_ARGUMENT,
                          "drafts: token id " + std::to_string(d) + " outside the vocabulary of " + std::to_string(n_vocab));
        }
    }
    return Status::OK;
}

Status invalid(const std::string & what) { return Status(StatusCode::INVALID_ARGUMENT, what); }

}  // namespace

uint64_t route_costs_key(const dgr::v1::RouteSpec & route, int source) {
    std::string key = std::to_string(source);
    for (const std::string & stage : route.stages()) key += "\n" + stage;
    return std::hash<std::string>{}(key);
}

// speculative decoding (the Draft on the last prefill chunk): the drafter over the session's
// tokens (prompt lookup) or the drafts the tail sends with each token (MTP), the controller that
// picks each step's draft count, and what the step in flight carried
struct HeadSession::Drafting {
    std::unique_ptr<PromptLookup> lookup;  // prompt lookup; null: MTP
    std::unique_ptr<DraftController> controller;
    uint64_t costs_key = 0;  // the route and draft source its step costs are kept under
    double head_s = 0.0;     // this stage's compute of a plain step (seconds, a moving average)
    int32_t in_flight = -1;  // drafts in the step in flight (-1: a prefill, not a step to time)
    int32_t in_flight_proposed = 0;  // MTP: drafts the tail makes with the step
    bool in_flight_probe = false;
    DraftChoice planned;   // MTP: the drafts the step in flight asked the tail for
    int32_t shadow = -1;   // lookup, after a plain step: the token it would have drafted, or -1
    std::chrono::steady_clock::time_point step_sent{};
};

HeadSession::HeadSession(uint64_t session, uint64_t epoch, dgr::v1::RouteSpec route, std::chrono::milliseconds token_interval,
                         HeadLimits limits, HeadPort & port, DraftCosts & costs)
    : session_(session), epoch_(epoch), route_(std::move(route)), limits_(limits), port_(port), costs_(costs),
      out_(token_interval) {}

HeadSession::~HeadSession() {
    if (!drafting_ || !drafting_->controller) return;
    StepCosts costs = drafting_->controller->costs();
    costs.head = drafting_->head_s;
    costs_.put(drafting_->costs_key, costs);
}

bool HeadSession::fail(const dgr::v1::StageError & e) {
    if (state_ == State::over) return true;
    if (out_.pending()) port_.reply(out_.take());  // what was generated before the failure
    dgr::v1::ForwardReply r;
    r.set_session_id(session_);
    r.set_epoch(epoch_);
    *r.mutable_error() = e;
    port_.reply(r);
    result_ = Status((StatusCode) e.code(), "stage " + std::to_string(e.stage()) + " (" + e.address() + "): " + e.message());
    state_ = State::over;
    return true;
}

bool HeadSession::fail_here(const Status & status) { return fail(stage_error(0, route_.stages(0), status)); }

bool HeadSession::fail_at_tail(const Status & status) {
    const int tail = route_.stages_size() - 1;
    return fail(stage_error((uint32_t) tail, route_.stages(tail), status));
}

bool HeadSession::on_failure(const dgr::v1::StageError & error) { return fail(error); }

bool HeadSession::on_closed() {
    closed_ = true;
    state_ = State::over;
    return true;
}

void HeadSession::send(const dgr::v1::ForwardRequest & req, uint32_t peers) {
    if (Status st = port_.forward(req, peers); !st.ok()) fail_here(st);
}

bool HeadSession::on_request(const dgr::v1::ForwardRequest & req) {
    if (state_ == State::over) return true;
    if (!req.has_route() || req.session_id() != session_ || req.expect().epoch() != epoch_) {
        return fail_here(invalid("route: a forward-mode stream carries one session and epoch, every request with its route"));
    }
    if (state_ != State::prefilling) {
        return fail_here(invalid("forward mode: the prefill ended with its last chunk; the route drives decoding"));
    }
    const bool mtp_chunk = req.draft().source() == dgr::v1::DRAFT_SOURCE_MTP;
    chunk_without_mtp_ = chunk_without_mtp_ || !mtp_chunk;
    if (req.last_chunk() && mtp_chunk && chunk_without_mtp_) {
        return fail_here(invalid("draft: MTP drafting needs the Draft on every prefill chunk (the tail's MTP block "
                                 "follows each forward)"));
    }
    if (req.last_chunk()) {
        if (req.max_tokens() < 1) return fail_here(invalid("max_tokens: at least 1 on the last prefill chunk"));
        start(req);
    }
    prompt_.insert(prompt_.end(), req.token_ids().begin(), req.token_ids().end());
    if (drafting_ && drafting_->lookup) {
        for (int32_t t : prompt_) drafting_->lookup->add(t);
        prompt_.clear();
    }
    if (drafting_) drafting_->in_flight = -1;  // a prefill: not a decode step to time
    send(req, 0);
    return state_ == State::over;
}

void HeadSession::start(const dgr::v1::ForwardRequest & last) {
    state_ = State::generating;
    stop_ = StopRule(last.max_tokens(), std::set<int32_t>(last.stop_ids().begin(), last.stop_ids().end()));
    step_ = last;
    step_.clear_token_ids();
    step_.clear_stop_ids();
    step_.clear_draft();
    step_.mutable_expect()->set_reuse(false);  // the session is here now
    step_.set_chunk_index(0);
    const auto & d = last.draft();
    if (d.source() == dgr::v1::DRAFT_SOURCE_UNSPECIFIED) return;
    drafting_ = std::make_unique<Drafting>();
    drafting_->costs_key = route_costs_key(route_, d.source());
    const StepCosts known = costs_.get(drafting_->costs_key);
    drafting_->head_s = known.head;
    if (d.source() == dgr::v1::DRAFT_SOURCE_LOOKUP) {
        drafting_->lookup = std::make_unique<PromptLookup>((int32_t) d.ngram_min(), (int32_t) d.ngram_max());
        drafting_->controller = std::make_unique<DraftController>((int32_t) d.max_draft(), 1.0, true, known);
    } else {
        drafting_->controller = std::make_unique<DraftController>((int32_t) d.max_draft(), 2.0, false, known);
        *step_.mutable_draft() = d;  // every step: the tail's block follows
    }
    step_.mutable_expect()->set_truncate(true);
}

int32_t HeadSession::keep_wanted(dgr::v1::ForwardReply & reply, bool * last) {
    // a verified step yields several tokens: keep those up to the last one wanted
    *last = false;
    int32_t token = reply.token().token_id(), kept = 0;
    const int32_t n_out = 1 + reply.more_tokens_size();
    PromptLookup * lookup = drafting_ ? drafting_->lookup.get() : nullptr;
    for (int32_t i = 0; i < n_out && !*last; ++i, ++kept) {
        token = i == 0 ? reply.token().token_id() : reply.more_tokens(i - 1).token_id();
        if (lookup) {
            if (i == 0 && drafting_->shadow >= 0) drafting_->controller->shadow(token == drafting_->shadow);
            lookup->add(token);
        }
        *last = stop_.take(token);
    }
    if (kept < n_out) {  // past the last token wanted: not the route's output
        reply.mutable_more_tokens()->DeleteSubrange(kept - 1, n_out - kept);
        reply.set_n_past(reply.n_past() - (uint32_t) (n_out - kept));
        reply.set_prefix_hash(0);
    }
    return token;
}

bool HeadSession::on_token(dgr::v1::ForwardReply reply, int64_t sent_ns) {
    if (state_ == State::over) return true;
    if (state_ != State::generating) return false;  // a prefill's, or one past the last token
    // MTP: the tail's drafts for the next step (not the coordinator's business)
    std::vector<int32_t> proposed(reply.drafts().begin(), reply.drafts().end());
    reply.clear_drafts();
    if (Status st = check_drafts(proposed, limits_.n_vocab); !st.ok()) return fail_at_tail(st);
    Drafting * dr = drafting_.get();
    if (reply.has_stages()) {
        const auto & t = reply.stages();
        if (Status st = validate_step_time(t, "stages"); !st.ok()) return fail_at_tail(st);
        // a plain step's round (a drafted one's time depends on its drafts)
        if (sent_ns != 0 && (!dr || dr->in_flight == 0)) port_.observe_round((double) (steady_ns() - sent_ns) * 1e-9, t);
        reply.clear_stages();  // the coordinator's tokens carry no step times
    }
    if (dr && dr->in_flight >= 0) {
        dr->controller->observe(dr->in_flight, (int32_t) reply.accepted(),
                                std::chrono::duration<double>(std::chrono::steady_clock::now() - dr->step_sent).count(),
                                dr->in_flight + dr->in_flight_proposed, dr->in_flight_probe);
    }
    bool last = false;
    const int32_t token = keep_wanted(reply, &last);
    if (dr && dr->in_flight > 0) reply.set_drafted((uint32_t) dr->in_flight);  // sent, if not all checked
    // the next step gathers with the sessions sampled beside this token (not the coordinator's)
    const Cohort mates{reply.cohort().id(), reply.cohort().size()};
    reply.clear_cohort();
    const uint32_t n_past = reply.n_past();
    const uint64_t hash = reply.prefix_hash();
    if (out_.add(std::move(reply), last) && !port_.reply(out_.take())) {
        result_ = Status(StatusCode::CANCELLED, "the coordinator went away");
        state_ = State::over;
        port_.forgo(mates);
        return true;
    }
    if (last) {  // nothing past the last token: wait for the coordinator to close
        state_ = State::finished;
        port_.forgo(mates);  // its cohort-mates go on without it
        return false;
    }
    plan_step(token, n_past, hash, proposed);
    if (port_.apart()) {
        send_step(0, Cohort{});
    } else {
        send_step(sent_ns != 0 ? port_.peers_behind(sent_ns) : 0, mates);
    }
    return state_ == State::over;
}

void HeadSession::plan_step(int32_t token, uint32_t n_past, uint64_t hash, const std::vector<int32_t> & proposed) {
    step_.clear_token_ids();
    step_.add_token_ids(token);
    Drafting * dr = drafting_.get();
    if (dr) {
        dr->in_flight = 0;
        dr->in_flight_proposed = 0;
        dr->in_flight_probe = false;
        // never past max_tokens, nor past this stage's context
        const int32_t room = std::min<int32_t>((int32_t) stop_.left() - 1, limits_.n_ctx - (int32_t) n_past - 1);
        const int32_t limit = std::min<int32_t>(room, (int32_t) kMaxDraft);
        if (dr->lookup) {
            const DraftChoice c = dr->controller->next(limit);
            dr->in_flight_probe = c.probe;
            // a plain step still proposes one token: it is checked against the token that comes
            // back instead of being sent
            const std::vector<int32_t> proposal = dr->lookup->propose(std::max(c.k, 1));
            dr->shadow = c.k == 0 && !proposal.empty() ? proposal[0] : -1;
            if (c.k > 0) {
                for (int32_t d : proposal) step_.add_token_ids(d);
            }
        } else {
            // MTP drafts are made a step ahead: this step verifies what was chosen a step ago (as
            // far as the tail made them), and asks for the next choice
            for (int32_t i = 0; i < dr->planned.k && i < (int32_t) proposed.size() && i < limit; ++i) {
                step_.add_token_ids(proposed[(size_t) i]);
            }
            dr->in_flight_probe = dr->planned.probe && step_.token_ids_size() > 1;
            dr->planned = dr->controller->next(limit);
            dr->in_flight_proposed = dr->planned.k;
            step_.mutable_draft()->set_propose((uint32_t) dr->planned.k);
        }
        dr->in_flight = step_.token_ids_size() - 1;
    }
    step_.set_n_draft((uint32_t) (dr ? dr->in_flight : 0));
    step_.mutable_expect()->set_n_past(n_past);
    step_.mutable_expect()->set_prefix_hash(hash);
}

void HeadSession::send_step(uint32_t peers, const Cohort & mates) {
    if (mates.size > 1) {
        step_.mutable_cohort()->set_id(mates.id);
        step_.mutable_cohort()->set_size(mates.size);
    } else {
        step_.clear_cohort();
    }
    Drafting * dr = drafting_.get();
    if (dr) dr->step_sent = std::chrono::steady_clock::now();
    const int32_t rows = step_.token_ids_size(), per = limits_.draft_part_rows;
    // in parts that the stages pipeline (verify.h), where the links take longer than the stages'
    // compute: a part travels while the next is computed. Where the trip is mostly compute
    // (loopback) the stages could only overlap on spare cores, and each part costs every stage a
    // forward more (2 cores, against whole steps: 1.19-1.23x behind 10 ms links at 1 thread, 1.12x
    // at 2; forced into parts on loopback 0.92x at 1 thread and 0.97x at 2, one A/B each)
    const bool in_parts = dr && dr->lookup && dr->in_flight > 0 && peers == 0 && mates.size <= 1 &&
                          route_.stages_size() > 1 && per > 0 && rows > per && dr->head_s > 0.0 &&
                          dr->controller->costs().t0 > 2.0 * route_.stages_size() * dr->head_s;
    if (in_parts) return send_in_parts();
    if (dr && dr->lookup && rows == 1) {  // what a plain step costs this stage (the send included)
        const auto started = std::chrono::steady_clock::now();
        send(step_, peers);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        dr->head_s = dr->head_s > 0.0 ? 0.75 * dr->head_s + 0.25 * took : took;
        return;
    }
    send(step_, peers);
}

void HeadSession::send_in_parts() {
    // balanced, the larger first, each a forward of its own here and on every stage
    port_.in_parts();
    const int32_t rows = step_.token_ids_size(), per = limits_.draft_part_rows;
    const int32_t n_parts = (rows + per - 1) / per;
    const uint32_t n_past = step_.expect().n_past();
    dgr::v1::ForwardRequest part = step_;
    for (int32_t j = 0, offset = 0; j < n_parts && state_ != State::over; ++j) {
        const int32_t size = rows / n_parts + (j < rows % n_parts ? 1 : 0);
        part.clear_token_ids();
        part.mutable_token_ids()->Add(step_.token_ids().begin() + offset, step_.token_ids().begin() + offset + size);
        part.set_chunk_index((uint32_t) j);
        part.set_last_chunk(j + 1 == n_parts);
        part.set_n_draft((uint32_t) (j == 0 ? size - 1 : size));
        part.mutable_expect()->set_n_past(n_past + (uint32_t) offset);
        if (j > 0) {  // the part before checked them, and dropped nothing
            part.mutable_expect()->set_prefix_hash(0);
            part.mutable_expect()->set_truncate(false);
        }
        send(part, 0);
        offset += size;
    }
}

bool HeadSession::Coalescer::add(dgr::v1::ForwardReply && reply, bool last) {
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
    return last || !sent_ || std::chrono::steady_clock::now() - *sent_ >= interval_;
}

dgr::v1::ForwardReply HeadSession::Coalescer::take() {
    pending_ = false;
    sent_ = std::chrono::steady_clock::now();
    return std::move(reply_);
}

}  // namespace dgr::worker
