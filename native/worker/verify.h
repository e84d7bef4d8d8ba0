// Verification at the tail (speculative decoding). A drafted decode step is the last accepted
// token and its drafts; the tail samples every row as plain decode samples it at that position
// (seeded by position, sampling.h), so a draft is accepted exactly when plain decode would have
// produced it, and the first row that disagrees gives the token plain decode produces there.
//
// In forward mode a drafted step may travel in parts (chunk_index 0, 1, ..., the last with
// last_chunk; part 0 holds the last accepted token and at least one draft, the others drafts
// only), which the stages pipeline: while the next stage computes part 0 the head computes part 1.
// The tail samples each part as it arrives, and the step is decided at the first draft that a
// sample disagrees with, which may come before the last part: the tail replies at once and does
// not compute the parts after it (the other stages' rejected positions go at the next step's
// truncate, as after any rejection).
#pragma once

#include "dgr/shard_engine.h"
#include "dgr/v1/shard.pb.h"
#include "validate.h"

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <vector>

namespace dgr::worker {

class StepCheck {
public:
    enum class Next {
        compute,  // compute the request, then take() its rows
        skip,     // a part of a step already decided: neither compute nor reply
        decided,  // a later part whose first draft the sample before it disagrees with: the
                  // reply is complete, do not compute the part
    };
    // before computing `req` (validated): what to do with it. A later part that does not follow
    // the parts before it (its index, its n_past, the step's draft limit) is INVALID_ARGUMENT.
    grpc::Status before(const dgr::v1::ForwardRequest & req, Next * next, dgr::v1::ForwardReply * reply);
    // the logits of `req` (every row of a drafted step, else the last): its tokens into `reply`,
    // complete once the step is decided (ready() says whether it goes back now)
    void take(const dgr::v1::ForwardRequest & req, const dgr::ForwardResult & res, dgr::v1::ForwardReply * reply);
    // whether the reply of the request just handled goes back (in forward mode, from the tail to
    // the head): a prefill's last chunk, a plain or whole drafted step, the part that decided a step
    bool ready() const { return ready_; }

private:
    // `reply` gets the step's outcome: the tokens sampled so far, n_past and prefix hash of the
    // kept history, drafted and accepted
    void finish(dgr::v1::ForwardReply * reply);

    bool ready_ = false;
    bool open_ = false;     // a step in parts is under way (its part 0 came)
    bool decided_ = false;  // ... and is decided: its later parts are skipped
    uint32_t next_part_ = 0;
    uint32_t n_past0_ = 0;         // the session's tokens before the step
    uint64_t hash0_ = 0;           // their prefix hash (0: not checked)
    std::vector<int32_t> tokens_;  // the step's token ids so far: the last accepted, then drafts
    int32_t accepted_ = 0;
    int32_t pending_ = -1;  // the sample of the last row so far: the token plain decode produces
                            // after tokens_, to compare with the next part's first draft
    dgr::v1::ForwardReply out_;  // the tokens sampled so far
};

}  // namespace dgr::worker
