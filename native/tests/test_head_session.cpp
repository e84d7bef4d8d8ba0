// The head's per-session state machine (head_session.h), driven through a port that records what
// it computes and what it tells the coordinator: no gRPC, no socket.
#include "head_session.h"
#include "clock.h"
#include "forwarding.h"
#include "support.h"

#include <deque>

using namespace dgr::worker;
using grpc::Status;
using grpc::StatusCode;

namespace {

struct RecordingPort final : HeadPort {
    std::vector<dgr::v1::ForwardRequest> forwards;
    std::vector<dgr::v1::ForwardReply> replies;
    std::vector<Cohort> forgone;
    std::deque<Status> fail_next;  // statuses the next forwards return
    bool coordinator_gone = false;
    uint32_t peers = 0;
    std::vector<uint32_t> peers_asked;

    Status forward(const dgr::v1::ForwardRequest & req, uint32_t p) override {
        forwards.push_back(req);
        peers_asked.push_back(p);
        if (fail_next.empty()) return Status::OK;
        Status st = fail_next.front();
        fail_next.pop_front();
        return st;
    }
    bool reply(const dgr::v1::ForwardReply & r) override {
        if (coordinator_gone) return false;
        replies.push_back(r);
        return true;
    }
    uint32_t peers_behind(int64_t) override { return peers; }
    std::vector<std::pair<double, dgr::v1::StepTime>> rounds;  // what the convoy rule was told
    bool sessions_apart = false;
    void observe_round(double round_s, const dgr::v1::StepTime & t) override { rounds.emplace_back(round_s, t); }
    bool apart() override { return sessions_apart; }
    void forgo(const Cohort & c) override { forgone.push_back(c); }
    int parts = 0;
    void in_parts() override { ++parts; }

    std::vector<int32_t> streamed() const {  // every token the coordinator got, in order
        std::vector<int32_t> t;
        for (const auto & r : replies) {
            if (r.has_error()) continue;
            t.push_back((int32_t) r.token().token_id());
            for (const auto & m : r.more_tokens()) t.push_back((int32_t) m.token_id());
        }
        return t;
    }
};

dgr::v1::RouteSpec three_stages() {
    dgr::v1::RouteSpec r;
    for (const char * a : {"h:1", "m:2", "t:3"}) r.add_stages(a);
    return r;
}

dgr::v1::ForwardRequest chunk(std::vector<int32_t> ids, uint32_t n_past, bool last, uint32_t max_tokens = 0) {
    dgr::v1::ForwardRequest r;
    r.set_session_id(7);
    r.mutable_expect()->set_epoch(3);
    r.mutable_expect()->set_n_past(n_past);
    for (int32_t t : ids) r.add_token_ids(t);
    r.set_last_chunk(last);
    r.set_max_tokens(max_tokens);
    *r.mutable_route() = three_stages();
    return r;
}

dgr::v1::ForwardReply token_reply(std::vector<int32_t> tokens, uint32_t n_past, uint64_t hash = 0) {
    dgr::v1::ForwardReply r;
    r.set_session_id(7);
    r.set_epoch(3);
    r.mutable_token()->set_token_id(tokens[0]);
    for (size_t i = 1; i < tokens.size(); ++i) r.add_more_tokens()->set_token_id(tokens[i]);
    r.set_n_past(n_past);
    r.set_prefix_hash(hash);
    return r;
}

struct Head {
    RecordingPort port;
    DraftCosts costs;
    std::unique_ptr<HeadSession> session;
    explicit Head(std::chrono::milliseconds interval = std::chrono::milliseconds(0), int32_t n_ctx = 4096) {
        session = std::make_unique<HeadSession>(7, 3, three_stages(), interval, HeadLimits{n_ctx, 1000, 2}, port, costs);
    }
    HeadSession & operator*() { return *session; }
    HeadSession * operator->() { return session.get(); }
};

void check_error(const dgr::v1::ForwardReply & r, uint32_t stage, const std::string & address, StatusCode code,
                 const std::string & names) {
    REQUIRE(r.has_error());
    CHECK(r.error().stage() == stage);
    CHECK(r.error().address() == address);
    CHECK(r.error().code() == (int32_t) code);
    CHECK_MESSAGE(r.error().message().find(names) != std::string::npos, r.error().message());
}

}  // namespace

TEST_CASE("head: prefill chunks compute in order and the last one starts generating") {
    Head head;
    CHECK(head->state() == HeadSession::State::prefilling);
    CHECK_FALSE(head->on_request(chunk({1, 2, 3}, 0, false)));
    CHECK(head->state() == HeadSession::State::prefilling);
    CHECK_FALSE(head->on_request(chunk({4, 5}, 3, true, 4)));
    CHECK(head->state() == HeadSession::State::generating);
    REQUIRE(head.port.forwards.size() == 2);
    CHECK(head.port.forwards[0].token_ids_size() == 3);
    CHECK(head.port.forwards[1].last_chunk());
    CHECK(head.port.replies.empty());
}

TEST_CASE("head: each token is streamed and the next decode step follows it, until max_tokens") {
    Head head;
    head->on_request(chunk({1, 2, 3}, 0, true, 3));
    head.port.peers = 2;
    CHECK_FALSE(head->on_token(token_reply({10}, 4, 111), 1));
    REQUIRE(head.port.forwards.size() == 2);
    const auto & step = head.port.forwards[1];
    CHECK(step.token_ids_size() == 1);
    CHECK(step.token_ids(0) == 10);
    CHECK(step.expect().n_past() == 4);
    CHECK(step.expect().prefix_hash() == 111);
    CHECK(step.n_draft() == 0);
    CHECK(step.chunk_index() == 0);
    CHECK(step.stop_ids_size() == 0);
    CHECK(head.port.peers_asked[1] == 2);  // the sessions behind it, for its batch
    CHECK_FALSE(head->on_token(token_reply({11}, 5), 0));
    CHECK(head.port.peers_asked[2] == 0);  // no send time: no peers asked for
    CHECK_FALSE(head->on_token(token_reply({12}, 6), 0));  // the third: the last
    CHECK(head->state() == HeadSession::State::finished);
    CHECK(head.port.forwards.size() == 3);  // nothing computed after the last token
    CHECK(head.port.streamed() == std::vector<int32_t>{10, 11, 12});
    CHECK_FALSE(head->on_token(token_reply({13}, 7), 0));  // late: ignored
    CHECK(head.port.streamed().size() == 3);
    CHECK(head->on_closed());
    CHECK(head->state() == HeadSession::State::over);
    CHECK(head->closed());
    CHECK(head->result().ok());
}

TEST_CASE("head: a stop id ends the generation, inside a verified step's tokens too") {
    Head head;
    auto last = chunk({1, 2}, 0, true, 50);
    last.add_stop_ids(99);
    head->on_request(last);
    CHECK_FALSE(head->on_token(token_reply({10}, 3, 5), 0));
    // a verified step of four tokens whose second is the stop id: the rest are not output
    CHECK_FALSE(head->on_token(token_reply({11, 99, 12, 13}, 7, 8), 0));
    CHECK(head->state() == HeadSession::State::finished);
    CHECK(head.port.streamed() == std::vector<int32_t>{10, 11, 99});
    const auto & r = head.port.replies.back();
    CHECK(r.n_past() == 5);        // 7 less the two tokens cut
    CHECK(r.prefix_hash() == 0);   // not the hash of what was kept
    REQUIRE(head.port.forgone.size() == 1);  // its cohort-mates go on without it
}

TEST_CASE("head: max_tokens cuts a verified step's tokens") {
    Head head;
    head->on_request(chunk({1}, 0, true, 2));
    head->on_token(token_reply({5, 6, 7}, 4), 0);
    CHECK(head->state() == HeadSession::State::finished);
    CHECK(head.port.streamed() == std::vector<int32_t>{5, 6});
}

TEST_CASE("head: a chunk after the last one, another session's, or max_tokens 0 is refused as the head's error") {
    SUBCASE("after the last chunk") {
        Head head;
        head->on_request(chunk({1}, 0, true, 5));
        CHECK(head->on_request(chunk({2}, 1, true, 5)));
        check_error(head.port.replies.back(), 0, "h:1", StatusCode::INVALID_ARGUMENT, "the route drives decoding");
        CHECK(head->result().error_code() == StatusCode::INVALID_ARGUMENT);
        CHECK(head->result().error_message().find("stage 0 (h:1)") != std::string::npos);
    }
    SUBCASE("another session") {
        Head head;
        auto r = chunk({1}, 0, true, 5);
        r.set_session_id(8);
        CHECK(head->on_request(r));
        check_error(head.port.replies.back(), 0, "h:1", StatusCode::INVALID_ARGUMENT, "one session and epoch");
        CHECK(head.port.forwards.empty());
    }
    SUBCASE("max_tokens 0") {
        Head head;
        CHECK(head->on_request(chunk({1}, 0, true, 0)));
        check_error(head.port.replies.back(), 0, "h:1", StatusCode::INVALID_ARGUMENT, "max_tokens: at least 1");
    }
    SUBCASE("MTP on the last chunk only") {
        Head head;
        head->on_request(chunk({1}, 0, false));
        auto last = chunk({2}, 1, true, 5);
        last.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_MTP);
        last.mutable_draft()->set_max_draft(2);
        CHECK(head->on_request(last));
        check_error(head.port.replies.back(), 0, "h:1", StatusCode::INVALID_ARGUMENT, "the Draft on every prefill chunk");
    }
}

TEST_CASE("head: a failure at any state is written after the tokens gathered before it") {
    Head head(std::chrono::hours(1));  // coalescing: only the first token goes at once
    head->on_request(chunk({1}, 0, true, 10));
    head->on_token(token_reply({10}, 2), 0);
    head->on_token(token_reply({11}, 3), 0);  // held for the interval
    REQUIRE(head.port.replies.size() == 1);
    dgr::v1::StageError e = stage_error(2, "t:3", Status(StatusCode::RESOURCE_EXHAUSTED, "no slot"));
    CHECK(head->on_failure(e));
    REQUIRE(head.port.replies.size() == 3);
    CHECK(head.port.replies[1].token().token_id() == 11);  // flushed first
    check_error(head.port.replies[2], 2, "t:3", StatusCode::RESOURCE_EXHAUSTED, "no slot");
    CHECK(head->result().error_code() == StatusCode::RESOURCE_EXHAUSTED);
    CHECK(head->on_token(token_reply({12}, 4), 0));  // over: nothing more
    CHECK(head.port.replies.size() == 3);
}

TEST_CASE("head: a failure while prefilling and a forward this stage refuses") {
    Head head;
    head.port.fail_next.push_back(Status(StatusCode::FAILED_PRECONDITION, "cache mismatch"));
    CHECK(head->on_request(chunk({1, 2}, 0, false)));
    check_error(head.port.replies.back(), 0, "h:1", StatusCode::FAILED_PRECONDITION, "cache mismatch");
    CHECK(head->state() == HeadSession::State::over);
}

TEST_CASE("head: coalesced tokens go together, the last at once") {
    Head head(std::chrono::hours(1));
    head->on_request(chunk({1}, 0, true, 4));
    for (int32_t t = 10; t < 14; ++t) head->on_token(token_reply({t}, (uint32_t) t), 0);
    REQUIRE(head.port.replies.size() == 2);
    CHECK(head.port.replies[0].token().token_id() == 10);
    CHECK(head.port.replies[1].token().token_id() == 11);
    CHECK(head.port.replies[1].more_tokens_size() == 2);  // 12, 13 with it
    CHECK(head.port.replies[1].n_past() == 13);
}

TEST_CASE("head: a coordinator that went away ends the session, its cohort-mates told") {
    Head head;
    head->on_request(chunk({1}, 0, true, 10));
    head.port.coordinator_gone = true;
    auto r = token_reply({10}, 2);
    r.mutable_cohort()->set_id(44);
    r.mutable_cohort()->set_size(3);
    CHECK(head->on_token(r, 0));
    CHECK(head->result().error_code() == StatusCode::CANCELLED);
    REQUIRE(head.port.forgone.size() == 1);
    CHECK(head.port.forgone[0].id == 44);
    CHECK(head.port.forwards.size() == 1);  // no step after
}

TEST_CASE("head: the next step gathers with its cohort-mates, and the coordinator never sees the cohort") {
    Head head;
    head->on_request(chunk({1}, 0, true, 10));
    auto r = token_reply({10}, 2);
    r.mutable_cohort()->set_id(44);
    r.mutable_cohort()->set_size(3);
    head->on_token(r, 0);
    CHECK_FALSE(head.port.replies.back().has_cohort());
    REQUIRE(head.port.forwards.back().has_cohort());
    CHECK(head.port.forwards.back().cohort().id() == 44);
    head->on_token(token_reply({11}, 3), 0);  // alone this time
    CHECK_FALSE(head.port.forwards.back().has_cohort());
}

TEST_CASE("head: a token's step time feeds the convoy rule, and apart sessions wait for no peers and join no cohort") {
    Head head;
    head->on_request(chunk({1}, 0, true, 10));
    head.port.peers = 2;
    auto r = token_reply({10}, 2);
    r.mutable_cohort()->set_id(44);
    r.mutable_cohort()->set_size(3);
    r.mutable_stages()->set_held_us(3000);
    r.mutable_stages()->set_compute_us(2500);
    const int64_t sent = steady_ns() - 40 * 1000 * 1000;  // 40 ms ago
    head->on_token(r, sent);
    REQUIRE(head.port.rounds.size() == 1);
    CHECK(head.port.rounds[0].first >= 0.040);
    CHECK(head.port.rounds[0].first < 10.0);
    CHECK(head.port.rounds[0].second.held_us() == 3000);
    CHECK(head.port.rounds[0].second.compute_us() == 2500);
    CHECK_FALSE(head.port.replies.back().has_stages());  // not the coordinator's business
    CHECK(head.port.peers_asked.back() == 2);  // a convoy: waits for the sessions behind it
    CHECK(head.port.forwards.back().cohort().id() == 44);
    head.port.sessions_apart = true;
    r.mutable_token()->set_token_id(11);
    r.set_n_past(3);
    head->on_token(r, sent);
    CHECK(head.port.peers_asked.back() == 0);
    CHECK_FALSE(head.port.forwards.back().has_cohort());
    CHECK(head.port.rounds.size() == 2);
    head->on_token(token_reply({12}, 4), sent);  // no step time came with it: nothing to learn
    CHECK(head.port.rounds.size() == 2);
}

TEST_CASE("head: a step time whose compute exceeds its time held fails the session, named as the tail's") {
    Head head;
    head->on_request(chunk({1}, 0, true, 10));
    auto r = token_reply({10}, 2);
    r.mutable_stages()->set_held_us(10);
    r.mutable_stages()->set_compute_us(11);
    CHECK(head->on_token(r, 1));
    check_error(head.port.replies.back(), 2, "t:3", StatusCode::INVALID_ARGUMENT, "stages.compute_us: 11 exceeds held_us 10");
    CHECK(head.port.rounds.empty());
}

TEST_CASE("head: MTP drafts that came back malformed fail the session, named as the tail's") {
    for (int bad : {0, 1}) {
        Head head;
        auto c = chunk({1}, 0, true, 10);
        c.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_MTP);
        c.mutable_draft()->set_max_draft(2);
        head->on_request(c);
        auto r = token_reply({10}, 2);
        if (bad == 0) {
            for (int i = 0; i < 17; ++i) r.add_drafts(1);
        } else {
            r.add_drafts(1000);  // n_vocab is 1000
        }
        CHECK(head->on_token(r, 0));
        check_error(head.port.replies.back(), 2, "t:3", StatusCode::INVALID_ARGUMENT, bad == 0 ? "at most 16" : "outside the vocabulary");
    }
}

TEST_CASE("head: prompt lookup drafts once its proposals hold, and a rejected draft is not output") {
    Head head;
    auto c = chunk({5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7}, 0, true, 40);
    c.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_LOOKUP);
    c.mutable_draft()->set_max_draft(3);
    c.mutable_draft()->set_ngram_min(1);
    c.mutable_draft()->set_ngram_max(2);
    head->on_request(c);
    // the text goes on repeating: 8 5 6 7 8 ...; each plain step's proposal holds
    const int32_t cycle[4] = {8, 5, 6, 7};
    uint32_t n_past = 11;
    int i = 0;
    for (; i < 12 && head.port.forwards.back().n_draft() == 0; ++i) {
        ++n_past;
        head->on_token(token_reply({cycle[i % 4]}, n_past), 0);
    }
    const auto step = head.port.forwards.back();
    REQUIRE(step.n_draft() > 0);  // drafting began
    CHECK(step.expect().truncate());
    CHECK(step.token_ids(0) == cycle[(i - 1) % 4]);
    CHECK(step.token_ids(1) == cycle[i % 4]);  // the lookup's continuation
    // the tail rejects every draft: one token comes back, plain decode's
    auto r = token_reply({42}, n_past + 1);
    r.set_drafted(step.n_draft());
    r.set_accepted(0);
    const size_t before = head.port.streamed().size();
    head->on_token(r, 0);
    CHECK(head.port.streamed().size() == before + 1);
    CHECK(head.port.streamed().back() == 42);
    CHECK(head.port.forwards.back().token_ids(0) == 42);
    CHECK(head.port.forwards.back().expect().n_past() == n_past + 1);
}

TEST_CASE("head: drafts never run past max_tokens") {
    Head head;
    auto c = chunk({5, 6, 5, 6, 5, 6, 5, 6, 5, 6}, 0, true, 3);
    c.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_LOOKUP);
    c.mutable_draft()->set_max_draft(8);
    c.mutable_draft()->set_ngram_min(1);
    c.mutable_draft()->set_ngram_max(1);
    head->on_request(c);
    head->on_token(token_reply({5}, 11), 0);
    head->on_token(token_reply({6}, 12), 0);
    for (const auto & f : head.port.forwards) CHECK(f.n_draft() <= 1);  // 3 tokens: at most one more after
    head->on_token(token_reply({5}, 13), 0);
    CHECK(head->state() == HeadSession::State::finished);
}

TEST_CASE("head: the route's step costs are kept for its next generation") {
    RecordingPort port;
    DraftCosts costs;
    auto c = chunk({5, 6, 5, 6}, 0, true, 5);
    c.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_LOOKUP);
    c.mutable_draft()->set_max_draft(2);
    c.mutable_draft()->set_ngram_min(1);
    c.mutable_draft()->set_ngram_max(1);
    {
        HeadSession head(7, 3, three_stages(), std::chrono::milliseconds(0), HeadLimits{4096, 1000, 2}, port, costs);
        head.on_request(c);
        for (int32_t t = 0; t < 4; ++t) head.on_token(token_reply({5 + (t % 2)}, (uint32_t) (5 + t)), 0);
    }
    // the route holds a timed plain step now: a fresh session on it starts from that
    const StepCosts kept = costs.get(route_costs_key(three_stages(), dgr::v1::DRAFT_SOURCE_LOOKUP));
    CHECK(kept.t0 > 0.0);
    CHECK(kept.head > 0.0);  // this stage's own compute of a plain step, timed
    CHECK(costs.get(route_costs_key(three_stages(), dgr::v1::DRAFT_SOURCE_MTP)).t0 == 0.0);
}
