// Token choice at the tail (sampling.h) and verification of drafted steps (verify.h).
#include "sampling.h"
#include "support.h"
#include "verify.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>

using namespace dgr::worker;

namespace {

std::vector<float> random_logits(int32_t n, uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> v((size_t) n);
    for (auto & x : v) x = dist(gen);
    return v;
}

double log_softmax(const std::vector<float> & logits, int32_t token) {
    double max = *std::max_element(logits.begin(), logits.end()), sum = 0.0;
    for (float x : logits) sum += std::exp((double) x - max);
    return logits[(size_t) token] - max - std::log(sum);
}

dgr::v1::Sampling sampled(float temperature, uint32_t top_k, float top_p, uint64_t seed) {
    dgr::v1::Sampling s;
    s.set_temperature(temperature);
    s.set_top_k(top_k);
    s.set_top_p(top_p);
    s.set_seed(seed);
    return s;
}

}  // namespace

TEST_CASE("greedy picks the first largest logit and its log-softmax, at every vocabulary size") {
    TailSampler sampler;
    for (int32_t n : {1, 15, 16, 17, 1000, 49152}) {
        auto logits = random_logits(n, (uint32_t) n);
        const int32_t want = (int32_t) (std::max_element(logits.begin(), logits.end()) - logits.begin());
        float lp = 0.0f;
        CHECK(sampler.sample(logits.data(), n, dgr::v1::Sampling{}, 0, &lp) == want);
        CHECK(lp == doctest::Approx(log_softmax(logits, want)).epsilon(1e-5));
        CHECK(lp <= 0.0f);
    }
    std::vector<float> ties(100, 1.0f);
    ties[40] = ties[70] = 5.0f;  // the first of equal maxima, as llama.cpp's greedy sampler
    float lp = 0.0f;
    CHECK(sampler.sample(ties.data(), 100, dgr::v1::Sampling{}, 0, &lp) == 40);
    CHECK(lp == doctest::Approx(log_softmax(ties, 40)).epsilon(1e-5));
}

TEST_CASE("a sampled step is a function of (seed, n_past): the same draws on any tail") {
    const auto logits = random_logits(5000, 1);
    const auto s = sampled(1.0f, 0, 1.0f, 1234);
    TailSampler a, b;
    std::vector<int32_t> first, again;
    std::set<int32_t> distinct;
    for (int32_t pos = 0; pos < 64; ++pos) {
        float lp = 0.0f;
        first.push_back(a.sample(logits.data(), 5000, s, pos, &lp));
        distinct.insert(first.back());
    }
    for (int32_t pos = 0; pos < 64; ++pos) {
        float lp = 0.0f;
        again.push_back(b.sample(logits.data(), 5000, s, pos, &lp));
    }
    CHECK(first == again);
    CHECK(distinct.size() > 10);  // positions draw differently
    std::vector<int32_t> other;
    for (int32_t pos = 0; pos < 64; ++pos) {
        float lp = 0.0f;
        other.push_back(a.sample(logits.data(), 5000, sampled(1.0f, 0, 1.0f, 99), pos, &lp));
    }
    CHECK(other != first);  // another seed, other draws
}

TEST_CASE("top_k = 1 and a tiny top_p are greedy, and top_k keeps draws among the k largest") {
    const auto logits = random_logits(2000, 7);
    const int32_t best = (int32_t) (std::max_element(logits.begin(), logits.end()) - logits.begin());
    std::vector<int32_t> order(2000);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return logits[(size_t) x] > logits[(size_t) y]; });
    const std::set<int32_t> top5(order.begin(), order.begin() + 5);
    TailSampler sampler;
    for (int32_t pos = 0; pos < 50; ++pos) {
        float lp = 0.0f;
        CHECK(sampler.sample(logits.data(), 2000, sampled(2.0f, 1, 1.0f, 5), pos, &lp) == best);
        CHECK(sampler.sample(logits.data(), 2000, sampled(2.0f, 0, 1e-6f, 5), pos, &lp) == best);
        const int32_t t = sampler.sample(logits.data(), 2000, sampled(5.0f, 5, 1.0f, 5), pos, &lp);
        CHECK(top5.count(t) == 1);
        // the log-probability is under the full temperature-1 distribution, whatever the chain
        CHECK(lp == doctest::Approx(log_softmax(logits, t)).epsilon(1e-4));
    }
}

TEST_CASE("a low temperature concentrates the draws on the largest logit") {
    auto logits = random_logits(300, 3);
    const int32_t best = (int32_t) (std::max_element(logits.begin(), logits.end()) - logits.begin());
    TailSampler sampler;
    int hits = 0;
    for (int32_t pos = 0; pos < 100; ++pos) {
        float lp = 0.0f;
        hits += sampler.sample(logits.data(), 300, sampled(0.01f, 0, 1.0f, 11), pos, &lp) == best;
    }
    CHECK(hits >= 99);
}

namespace {

// a tail's result: `rows` rows of logits, each row's largest logit at `argmax[r]`
dgr::ForwardResult rows_choosing(const std::vector<int32_t> & argmax, int32_t n_vocab, int32_t n_past) {
    dgr::ForwardResult res;
    res.n_rows = (int32_t) argmax.size();
    res.row_width = n_vocab;
    res.is_logits = true;
    res.n_past = n_past;
    std::vector<float> v(argmax.size() * (size_t) n_vocab, 0.0f);
    for (size_t r = 0; r < argmax.size(); ++r) v[r * (size_t) n_vocab + (size_t) argmax[r]] = 10.0f;
    res.data.resize(v.size() * sizeof(float));
    std::memcpy(res.data.data(), v.data(), res.data.size());
    return res;
}

dgr::v1::ForwardRequest drafted_step(const std::vector<int32_t> & ids, uint32_t n_past, uint32_t part = 0,
                                     bool last = true, uint32_t n_draft = 0) {
    dgr::v1::ForwardRequest r;
    r.set_session_id(1);
    r.mutable_expect()->set_n_past(n_past);
    for (int32_t t : ids) r.add_token_ids(t);
    r.set_n_draft(n_draft ? n_draft : (part == 0 ? (uint32_t) ids.size() - 1 : (uint32_t) ids.size()));
    r.set_chunk_index(part);
    r.set_last_chunk(last);
    r.mutable_route()->add_stages("a:1");
    return r;
}

std::vector<int32_t> tokens_of(const dgr::v1::ForwardReply & reply) {
    std::vector<int32_t> t{(int32_t) reply.token().token_id()};
    for (const auto & m : reply.more_tokens()) t.push_back((int32_t) m.token_id());
    return t;
}

}  // namespace

TEST_CASE("StepCheck: a whole drafted step keeps the drafts plain decode would have produced") {
    StepCheck check;
    dgr::v1::ForwardReply reply;
    StepCheck::Next next{};
    // last accepted 5, drafts 6 7 8; plain decode gives 6 after 5, 7 after 6, 9 after 7
    const auto req = drafted_step({5, 6, 7, 8}, 10);
    REQUIRE(check.before(req, &next, &reply).ok());
    CHECK(next == StepCheck::Next::compute);
    check.take(req, rows_choosing({6, 7, 9, 3}, 20, 14), &reply);
    CHECK(check.ready());
    CHECK(tokens_of(reply) == std::vector<int32_t>{6, 7, 9});
    CHECK(reply.drafted() == 3);
    CHECK(reply.accepted() == 2);
    CHECK(reply.n_past() == 13);  // 10 + the last accepted token + 2 drafts
}

TEST_CASE("StepCheck: every draft accepted yields the token after the last one") {
    StepCheck check;
    dgr::v1::ForwardReply reply;
    StepCheck::Next next{};
    const auto req = drafted_step({5, 6, 7}, 0);
    REQUIRE(check.before(req, &next, &reply).ok());
    check.take(req, rows_choosing({6, 7, 8}, 20, 3), &reply);
    CHECK(tokens_of(reply) == std::vector<int32_t>{6, 7, 8});
    CHECK(reply.accepted() == 2);
    CHECK(reply.n_past() == 3);
}

TEST_CASE("StepCheck: a step in parts is decided at the first disagreeing draft, later parts skipped") {
    StepCheck check;
    dgr::v1::ForwardReply reply;
    StepCheck::Next next{};
    const auto part0 = drafted_step({5, 6}, 10, 0, false);  // last accepted 5, draft 6
    REQUIRE(check.before(part0, &next, &reply).ok());
    check.take(part0, rows_choosing({6, 7}, 20, 12), &reply);
    CHECK_FALSE(check.ready());  // plain decode gives 7 after 6: compared with part 1's first draft
    const auto part1 = drafted_step({8, 9}, 12, 1, false);
    REQUIRE(check.before(part1, &next, &reply).ok());
    CHECK(next == StepCheck::Next::decided);  // 8 is not 7: decided before computing part 1
    CHECK(check.ready());
    CHECK(tokens_of(reply) == std::vector<int32_t>{6, 7});
    CHECK(reply.accepted() == 1);
    const auto part2 = drafted_step({1}, 14, 2, true);
    REQUIRE(check.before(part2, &next, &reply).ok());
    CHECK(next == StepCheck::Next::skip);
    // the next step begins afresh
    const auto plain = drafted_step({7}, 12, 0, true, 0);
    dgr::v1::ForwardRequest p = plain;
    p.set_n_draft(0);
    REQUIRE(check.before(p, &next, &reply).ok());
    CHECK(next == StepCheck::Next::compute);
}

TEST_CASE("StepCheck refuses parts out of order, a part without part 0, and a step left unfinished") {
    StepCheck check;
    dgr::v1::ForwardReply reply;
    StepCheck::Next next{};
    auto st = check.before(drafted_step({8}, 12, 1, true), &next, &reply);
    CHECK(st.error_message().find("whose part 0 did not come") != std::string::npos);
    const auto part0 = drafted_step({5, 6}, 10, 0, false);
    REQUIRE(check.before(part0, &next, &reply).ok());
    check.take(part0, rows_choosing({6, 7}, 20, 12), &reply);
    st = check.before(drafted_step({7}, 12, 2, true), &next, &reply);
    CHECK(st.error_message().find("part 2 of the drafted step after n_past 10, part 1 expected") != std::string::npos);
    st = check.before(drafted_step({7}, 13, 1, true), &next, &reply);
    CHECK(st.error_message().find("expect.n_past: 13 for part 1") != std::string::npos);
    st = check.before(drafted_step({5, 6}, 10, 0, true), &next, &reply);
    CHECK(st.error_message().find("ended without its last part (part 1 expected)") != std::string::npos);
}
