// Validation of every ForwardRequest field before the engine sees it (validate.h): each refusal
// is INVALID_ARGUMENT (or FAILED_PRECONDITION) naming the field.
#include "support.h"
#include "validate.h"
#include "wire.h"

#include <cmath>
#include <cstring>
#include <limits>

using namespace dgr::worker;
using grpc::StatusCode;

namespace {

dgr::Description stage(bool head, bool tail) {
    dgr::Description d;
    d.arch = "llama";
    d.n_layer = 30;
    d.layer_first = head ? 0 : 10;
    d.layer_last = tail ? 30 : 20;
    d.n_vocab = 1000;
    d.n_ctx = 2048;
    d.n_batch = 64;
    d.max_sessions = 4;
    d.is_head = head;
    d.is_tail = tail;
    d.boundary.hc = 1;
    d.boundary.n_embd = 8;
    return d;
}

dgr::v1::ForwardRequest head_request(int n_tokens = 3) {
    dgr::v1::ForwardRequest r;
    r.set_session_id(11);
    r.mutable_expect()->set_epoch(1);
    for (int i = 0; i < n_tokens; ++i) r.add_token_ids(100 + i);
    r.set_last_chunk(true);
    return r;
}

dgr::v1::ForwardRequest middle_request(uint32_t n_tokens, dgr::v1::DType dtype = dgr::v1::DTYPE_F32) {
    dgr::v1::ForwardRequest r;
    r.set_session_id(11);
    r.mutable_expect()->set_epoch(1);
    std::vector<float> values(n_tokens * 8, 0.5f);
    encode_boundary(r.mutable_boundary(), dgr::DType::f32, n_tokens, 1, 8, values.data(), values.size() * 4);
    r.mutable_boundary()->set_dtype(dtype);
    r.set_last_chunk(true);
    return r;
}

grpc::Status check(const dgr::v1::ForwardRequest & r, const dgr::Description & d) {
    DecodedForward out;
    return decode_forward(r, d, &out);
}

void refused(const grpc::Status & st, const std::string & names, StatusCode code = StatusCode::INVALID_ARGUMENT) {
    CHECK(st.error_code() == code);
    CHECK_MESSAGE(st.error_message().find(names) != std::string::npos, st.error_message());
}

dgr::v1::RouteSpec route(uint32_t index, int n = 3) {
    dgr::v1::RouteSpec r;
    for (int i = 0; i < n; ++i) r.add_stages("10.0.0." + std::to_string(i + 1) + ":50051");
    r.set_stage_index(index);
    return r;
}

}  // namespace

TEST_CASE("a head request decodes into the engine's request") {
    auto r = head_request();
    r.mutable_expect()->set_n_past(5);
    r.mutable_expect()->set_prefix_hash(77);
    DecodedForward out;
    REQUIRE(decode_forward(r, stage(true, false), &out).ok());
    CHECK(out.engine.session == 11);
    CHECK(out.engine.epoch == 1);
    CHECK(out.engine.n_past == 5);
    CHECK(out.engine.n_tokens == 3);
    CHECK(out.engine.tokens[2] == 102);
    CHECK(out.engine.boundary == nullptr);
    CHECK(out.out_dtype == dgr::DType::f32);
    CHECK(out.engine.lineage == 0);  // no route: never kept
}

TEST_CASE("the head needs token ids and takes no boundary") {
    refused(check(head_request(0), stage(true, false)), "token_ids: the head stage needs token ids");
    auto r = head_request();
    r.mutable_boundary()->set_dtype(dgr::v1::DTYPE_F32);
    refused(check(r, stage(true, false)), "boundary: the head stage takes token ids");
    refused(check(head_request(65), stage(true, false)), "token_ids: 65 ids, at most 64");
}

TEST_CASE("expect.n_past beyond n_ctx and token_interval_ms out of range are refused") {
    auto r = head_request();
    r.mutable_expect()->set_n_past(2049);
    refused(check(r, stage(true, false)), "expect.n_past: 2049 beyond n_ctx 2048");
    r = head_request();
    r.set_token_interval_ms(10001);
    refused(check(r, stage(true, false)), "token_interval_ms: 10001");
}

TEST_CASE("sampling: temperature, top_k and top_p within range, NaN and infinity refused") {
    dgr::v1::Sampling s;
    CHECK(validate_sampling(s, 1000).ok());
    for (float t : {-0.1f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        s.set_temperature(t);
        refused(validate_sampling(s, 1000), "sampling.temperature");
    }
    s.set_temperature(0.7f);
    s.set_top_k(1001);
    refused(validate_sampling(s, 1000), "sampling.top_k: 1001 outside [0, 1000]");
    s.set_top_k(1000);
    CHECK(validate_sampling(s, 1000).ok());
    for (float p : {-0.01f, 1.01f, std::numeric_limits<float>::quiet_NaN()}) {
        s.set_top_p(p);
        refused(validate_sampling(s, 1000), "sampling.top_p");
    }
    auto r = head_request();
    r.mutable_sampling()->set_top_p(2.0f);
    refused(check(r, stage(true, false)), "sampling.top_p");  // decode_forward checks it too
}

TEST_CASE("draft: each source's fields within their bounds") {
    dgr::v1::Draft d;
    CHECK(validate_draft(d).ok());  // off
    d.set_source((dgr::v1::DraftSource) 9);
    refused(validate_draft(d), "draft.source: unknown source 9");
    d.set_source(dgr::v1::DRAFT_SOURCE_LOOKUP);
    d.set_max_draft(0);
    refused(validate_draft(d), "draft.max_draft: 0 outside [1, 16]");
    d.set_max_draft(17);
    refused(validate_draft(d), "draft.max_draft: 17");
    d.set_max_draft(4);
    d.set_ngram_min(1);
    d.set_ngram_max(9);
    refused(validate_draft(d), "draft.ngram_max: 9 outside [1, 8]");
    d.set_ngram_max(2);
    d.set_ngram_min(3);
    refused(validate_draft(d), "draft.ngram_min: 3 outside [1, ngram_max 2]");
    d.set_ngram_min(1);
    CHECK(validate_draft(d).ok());
    d.set_propose(1);
    refused(validate_draft(d), "draft.propose: 1, an MTP field");
    d.set_source(dgr::v1::DRAFT_SOURCE_MTP);
    refused(validate_draft(d), "draft.ngram_min/ngram_max");
    d.set_ngram_min(0);
    d.set_ngram_max(0);
    d.set_propose(5);
    refused(validate_draft(d), "draft.propose: 5 outside [0, max_draft 4]");
    d.set_propose(4);
    CHECK(validate_draft(d).ok());
}

TEST_CASE("n_draft needs that many drafted token ids, at most kMaxDraft") {
    auto r = head_request(3);
    r.set_n_draft(3);  // 3 ids hold the last accepted token and at most 2 drafts
    refused(check(r, stage(true, false)), "n_draft: 3 drafts need that many token ids");
    r.set_n_draft(2);
    CHECK(check(r, stage(true, false)).ok());
    r = head_request(20);
    r.set_n_draft(17);
    refused(check(r, stage(true, false)), "at most 16");
}

TEST_CASE("route: this stage at its place, addresses bounded") {
    const auto head = stage(true, false), middle = stage(false, false), tail = stage(false, true);
    CHECK(validate_route(route(0), head).ok());
    CHECK(validate_route(route(1), middle).ok());
    CHECK(validate_route(route(2), tail).ok());
    refused(validate_route(route(1), head), "route.stage_index: 1 for the stage owning [0, 20), the head");
    refused(validate_route(route(0), middle), "not the head");
    refused(validate_route(route(1), tail), "route.stage_index: 1 of 3 for the stage owning [10, 30), the tail");
    refused(validate_route(route(3), tail), "route.stage_index: 3 outside the 3 stages");
    refused(validate_route(dgr::v1::RouteSpec{}, head), "route.stages: empty");
    auto long_address = route(0);
    long_address.set_stages(1, std::string(256, 'a'));
    refused(validate_route(long_address, head), "longer than 255");
    // a port past 65535 would be dialled modulo 2**16: some other worker's port
    auto wrapped = route(0);
    wrapped.set_stages(1, "127.0.0.1:99999");
    refused(validate_route(wrapped, head),
            "route.stages: 127.0.0.1:99999 is not HOST:PORT with a port in 1..65535, or unix:PATH");
    auto bare = route(0);
    bare.set_stages(2, "worker-3");
    refused(validate_route(bare, head), "route.stages: worker-3 is not HOST:PORT");
}

TEST_CASE("stage: the range and model the route expects of this stage, one expectation per stage or none") {
    const auto middle = stage(false, false);  // [10, 20)
    dgr::v1::StageExpectation e;
    e.set_layer_first(10);
    e.set_layer_last(20);
    CHECK(check_stage(e, middle, "abcd").ok());  // no model named: the range alone
    e.set_model_fingerprint("abcd");
    CHECK(check_stage(e, middle, "abcd").ok());
    refused(check_stage(e, middle, "ffff"),
            "stage changed: the route expects layers [10, 20) of model abcd, this worker serves [10, 20) of model ffff",
            StatusCode::FAILED_PRECONDITION);
    e.set_layer_last(25);  // a worker restarted behind the address with another range
    refused(check_stage(e, middle, "abcd"), "expects layers [10, 25) of model abcd, this worker serves [10, 20)",
            StatusCode::FAILED_PRECONDITION);
    auto r = route(1);
    r.add_expect();
    refused(validate_route(r, middle), "route.expect: 1 expectations for 3 stages (one each, or none)");
    r.add_expect();
    r.add_expect();
    CHECK(validate_route(r, middle).ok());
}

TEST_CASE("route_lineage hashes the stages up to the receiving one") {
    CHECK(route_lineage(route(0)) != 0);
    CHECK(route_lineage(route(1)) != route_lineage(route(0)));
    auto other = route(2);
    other.set_stages(2, "10.9.9.9:1");  // a later stage does not change what computed stage 1's input
    auto r1 = route(1);
    auto o1 = other;
    o1.set_stage_index(1);
    CHECK(route_lineage(r1) == route_lineage(o1));
    auto moved = route(1);
    moved.set_stages(0, "10.9.9.9:1");
    CHECK(route_lineage(moved) != route_lineage(r1));
}

TEST_CASE("cohort: a forward-mode field with an id and a size within max_sessions") {
    auto r = head_request();
    r.mutable_cohort()->set_id(5);
    r.mutable_cohort()->set_size(2);
    refused(check(r, stage(true, false)), "cohort: a forward-mode field");
    *r.mutable_route() = route(0);
    r.mutable_cohort()->set_id(0);
    refused(check(r, stage(true, false)), "cohort.id: 0 names no cohort");
    r.mutable_cohort()->set_id(5);
    r.mutable_cohort()->set_size(5);
    refused(check(r, stage(true, false)), "cohort.size: 5 outside [2, 4]");
    r.mutable_cohort()->set_size(1);
    refused(check(r, stage(true, false)), "cohort.size: 1");
    r.mutable_cohort()->set_size(4);
    CHECK(check(r, stage(true, false)).ok());
}

TEST_CASE("upstream: the stages' time before this one, forward mode after the head, its compute within its time held") {
    auto r = head_request();
    r.mutable_upstream()->set_held_us(100);
    r.mutable_upstream()->set_compute_us(90);
    refused(check(r, stage(true, false)), "upstream: the time at the stages before this one");
    *r.mutable_route() = route(0);
    refused(check(r, stage(true, false)), "on a forward-mode request after the head");
    auto m = middle_request(1);
    *m.mutable_route() = route(1);
    *m.mutable_upstream() = r.upstream();
    CHECK(check(m, stage(false, false)).ok());
    m.mutable_upstream()->set_compute_us(101);
    refused(check(m, stage(false, false)), "upstream.compute_us: 101 exceeds held_us 100");
}

TEST_CASE("expect.reuse: forward mode, with the prefix's n_past and hash") {
    auto r = head_request();
    r.mutable_expect()->set_reuse(true);
    refused(check(r, stage(true, false)), "expect.reuse: prefix reuse is a forward-mode field");
    *r.mutable_route() = route(0);
    refused(check(r, stage(true, false)), "needs the reused prefix's n_past");
    r.mutable_expect()->set_n_past(10);
    refused(check(r, stage(true, false)), "prefix_hash");
    r.mutable_expect()->set_prefix_hash(99);
    DecodedForward out;
    REQUIRE(decode_forward(r, stage(true, false), &out).ok());
    CHECK(out.engine.reuse);
    CHECK(out.engine.lineage == route_lineage(r.route()));
}

TEST_CASE("MTP drafts: forward mode, a tail that serves the block, the token sideband") {
    auto r = middle_request(2);
    r.add_token_ids(1);
    r.add_token_ids(2);
    r.set_n_draft(1);
    r.mutable_draft()->set_source(dgr::v1::DRAFT_SOURCE_MTP);
    r.mutable_draft()->set_max_draft(2);
    refused(check(r, stage(false, true)), "draft: speculative decoding is a forward-mode field");
    *r.mutable_route() = route(2);
    refused(check(r, stage(false, true)), "start it with --mtp", StatusCode::FAILED_PRECONDITION);
    auto mtp_tail = stage(false, true);
    mtp_tail.mtp = true;
    DecodedForward out;
    REQUIRE(decode_forward(r, mtp_tail, &out).ok());
    CHECK(out.engine.mtp);
    CHECK(out.engine.verify);
    CHECK(out.engine.logits_all);
    r.set_chunk_index(1);
    r.set_n_draft(2);  // a later part holds drafts only
    refused(check(r, mtp_tail), "chunk_index: an MTP step travels whole");
}

TEST_CASE("a middle stage's boundary: present, shaped, sized, checksummed, finite") {
    const auto middle = stage(false, false);
    DecodedForward out;
    auto ok = middle_request(3);
    REQUIRE(decode_forward(ok, middle, &out).ok());
    CHECK(out.engine.n_tokens == 3);
    CHECK(out.engine.boundary_dtype == dgr::DType::f32);
    CHECK(out.out_dtype == dgr::DType::f32);

    auto r = middle_request(3);
    r.clear_boundary();
    refused(check(r, middle), "boundary: missing");
    r = middle_request(3);
    r.mutable_boundary()->clear_shape();
    refused(check(r, middle), "boundary.shape: expected [n_tokens, hc, n_embd]");
    r = middle_request(3);
    r.mutable_boundary()->set_shape(2, 9);
    refused(check(r, middle), "does not match this stage's [n_tokens, 1, 8]");
    r = middle_request(3);
    r.mutable_boundary()->set_shape(0, 0);
    refused(check(r, middle), "boundary.shape: n_tokens 0 outside [1, 64]");
    r = middle_request(3);
    r.mutable_boundary()->set_dtype((dgr::v1::DType) 42);
    refused(check(r, middle), "boundary.dtype: unknown dtype 42");
    r = middle_request(3, dgr::v1::DTYPE_F16);
    refused(check(r, middle), "boundary.payload: 96 bytes, shape and dtype say 48");
    r = middle_request(3);
    r.mutable_boundary()->mutable_payload()->at(5) ^= 1;
    refused(check(r, middle), "boundary.crc32: checksum mismatch");
    r = middle_request(3);
    r.add_token_ids(1);
    refused(check(r, middle), "token_ids: sideband length differs");
    r = middle_request(3);
    r.set_boundary_dtype((dgr::v1::DType) 42);
    refused(check(r, middle), "boundary_dtype: unknown dtype 42");
}

TEST_CASE("a boundary holding NaN or infinity is refused, naming the value and its token") {
    const auto middle = stage(false, false);
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        std::vector<float> values(3 * 8, 1.0f);
        values[17] = bad;
        dgr::v1::ForwardRequest r = middle_request(3);
        encode_boundary(r.mutable_boundary(), dgr::DType::f32, 3, 1, 8, values.data(), values.size() * 4);
        refused(check(r, middle), "boundary.payload: value 17 (token 2) is not finite");
    }
    const uint16_t f16[4] = {0x3C00, 0x7C00, 0, 0};    // 1.0, +inf
    const uint16_t bf16[4] = {0x3F80, 0, 0x7FC0, 0};   // 1.0, 0, NaN
    CHECK(first_non_finite(f16, dgr::DType::f16, 4) == 1);
    CHECK(first_non_finite(bf16, dgr::DType::bf16, 4) == 2);
    const uint16_t fine[2] = {0x3C00, 0x7BFF};  // f16's largest finite value
    CHECK(first_non_finite(fine, dgr::DType::f16, 2) == -1);
}

TEST_CASE("the wire's dtype table and CRC-32") {
    CHECK(from_wire(dgr::v1::DTYPE_F32) == dgr::DType::f32);
    CHECK(from_wire(dgr::v1::DTYPE_F16) == dgr::DType::f16);
    CHECK(from_wire(dgr::v1::DTYPE_BF16) == dgr::DType::bf16);
    CHECK_FALSE(from_wire(dgr::v1::DTYPE_UNSPECIFIED).has_value());
    CHECK_FALSE(from_wire(77).has_value());
    for (auto d : {dgr::DType::f32, dgr::DType::f16, dgr::DType::bf16}) CHECK(from_wire(to_wire(d)) == d);
    CHECK(crc32_of("123456789", 9) == 0xCBF43926u);  // the CRC-32 (IEEE) check value
    dgr::v1::Boundary b;
    const float v[2] = {1.0f, 2.0f};
    encode_boundary(&b, dgr::DType::f32, 1, 1, 2, v, sizeof(v));
    CHECK(b.shape_size() == 3);
    CHECK(b.shape(2) == 2);
    CHECK(b.crc32() == crc32_of(v, sizeof(v)));
}
