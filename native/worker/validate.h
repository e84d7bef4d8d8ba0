// Validation of everything that reaches a worker over the wire, before the engine sees it. Each
// check names the field and what was wrong; a failure is INVALID_ARGUMENT on that stream only.
#pragma once

#include "dgr/shard_engine.h"
#include "dgr/v1/shard.pb.h"

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dgr::worker {

// A ForwardRequest decoded into what ShardEngine::forward takes. `engine` points into `tokens`
// and into the request's boundary payload: the request must outlive it.
struct DecodedForward {
    dgr::ForwardRequest engine;
    std::vector<int32_t> tokens;
    dgr::DType out_dtype = dgr::DType::f32;  // the boundary this stage emits (tails: unused)
};

grpc::Status decode_forward(const dgr::v1::ForwardRequest & req, const dgr::Description & desc, DecodedForward * out);

// temperature finite and >= 0; top_k in [0, n_vocab]; top_p finite in [0, 1]
grpc::Status validate_sampling(const dgr::v1::Sampling & s, int32_t n_vocab);

// speculative decoding: drafts per step and prompt-lookup n-gram lengths
constexpr uint32_t kMaxDraft = 16;
constexpr uint32_t kMaxNgram = 8;

// off; prompt lookup with max_draft in [1, kMaxDraft], 1 <= ngram_min <= ngram_max <= kMaxNgram
// and propose 0; or MTP with max_draft in [1, kMaxDraft], propose in [0, max_draft] and no n-gram
// lengths
grpc::Status validate_draft(const dgr::v1::Draft & d);

// a part of a drafted decode step that travels in parts, not the whole step (verify.h). Only in
// forward mode: a relay-mode request is always a whole step, whatever its chunk fields say
inline bool is_step_part(const dgr::v1::ForwardRequest & req) {
    return req.has_route() && req.n_draft() > 0 && (req.chunk_index() > 0 || !req.last_chunk());
}

// forward mode: a StepTime (`field` names it in the error) whose compute lies within its time held
grpc::Status validate_step_time(const dgr::v1::StepTime & t, const std::string & field);

// forward mode: a route that names this stage at its place ([first, last) decides head and tail)
grpc::Status validate_route(const dgr::v1::RouteSpec & route, const dgr::Description & desc);

// the stage the request expects (ForwardRequest.stage, when present) is this one: its layer range
// and, when the expectation names one, its model; FAILED_PRECONDITION naming both if not
grpc::Status check_stage(const dgr::v1::StageExpectation & e, const dgr::Description & desc,
                         const std::string & fingerprint);

// prefix reuse: FNV-1a 64 over the addresses of the route's stages up to the receiving one, what
// computed this stage's input (never 0): a kept session serves only requests of the same lineage
uint64_t route_lineage(const dgr::v1::RouteSpec & route);

// the first value in a boundary payload that is not finite (NaN or infinity), or -1
int64_t first_non_finite(const void * data, dgr::DType dtype, int64_t n);

}  // namespace dgr::worker
