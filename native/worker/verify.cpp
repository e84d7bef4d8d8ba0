#include "verify.h"

#include "sampling.h"
#include "validate.h"
#include "wire.h"

#include <string>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

namespace {

Status invalid(const std::string & what) { return Status(StatusCode::INVALID_ARGUMENT, what); }

}  // namespace

Status StepCheck::before(const dgr::v1::ForwardRequest & req, Next * next, dgr::v1::ForwardReply * reply) {
    *next = Next::compute;
    ready_ = false;
    if (!is_step_part(req) || req.chunk_index() == 0) {
        if (open_ && !decided_) {
            return invalid("chunk_index: the drafted step after n_past " + std::to_string(n_past0_) +
                           " ended without its last part (part " + std::to_string(next_part_) + " expected)");
        }
        return Status::OK;  // a new step: take() starts it
    }
    if (!open_) {
        return invalid("chunk_index: part " + std::to_string(req.chunk_index()) + " of a drafted step whose part 0 did not come");
    }
    if (req.chunk_index() != next_part_) {
        return invalid("chunk_index: part " + std::to_string(req.chunk_index()) + " of the drafted step after n_past " +
                       std::to_string(n_past0_) + ", part " + std::to_string(next_part_) + " expected");
    }
    if (decided_) {  // decided at an earlier part: this one is past the rejected draft
        ++next_part_;
        *next = Next::skip;
        if (req.last_chunk()) open_ = false;
        return Status::OK;
    }
    if (req.expect().n_past() != n_past0_ + tokens_.size()) {
        return invalid("expect.n_past: " + std::to_string(req.expect().n_past()) + " for part " +
                       std::to_string(req.chunk_index()) + " of the drafted step after n_past " + std::to_string(n_past0_) +
                       ", which holds " + std::to_string(tokens_.size()) + " tokens before it");
    }
    if (tokens_.size() - 1 + req.n_draft() > kMaxDraft) {
        return invalid("n_draft: " + std::to_string(tokens_.size() - 1 + req.n_draft()) + " drafts in one step, at most " +
                       std::to_string(kMaxDraft));
    }
    ++next_part_;  // this part is in order (a refused one leaves the count as it was)
    if (req.token_ids(0) != pending_) {  // the first draft of this part is rejected already
        reply->set_session_id(req.session_id());
        reply->set_epoch(req.expect().epoch());
        finish(reply);
        if (req.last_chunk()) open_ = false;
        *next = Next::decided;
        ready_ = true;
        return Status::OK;
    }
    ++accepted_;
    pending_ = -1;
    return Status::OK;
}

void StepCheck::take(const dgr::v1::ForwardRequest & req, const dgr::ForwardResult & res, dgr::v1::ForwardReply * reply) {
    thread_local TailSampler sampler;
    auto add = [&](int32_t row, int32_t position) {
        const float * logits = (const float *) res.data.data() + (size_t) row * (size_t) res.row_width;
        float logprob = 0.0f;
        const int32_t token = sampler.sample(logits, res.row_width, req.sampling(), position, &logprob);
        auto * tok = out_.has_token() ? out_.add_more_tokens() : out_.mutable_token();
        tok->set_token_id(token);
        tok->set_logprob(logprob);
        if (req.sampling().want_logits()) {
            encode_boundary(tok->mutable_logits(), dgr::DType::f32, 1, 1, (uint32_t) res.row_width, logits,
                            sizeof(float) * (size_t) res.row_width);
        }
        return token;
    };
    const bool part = is_step_part(req);
    if (!part || req.chunk_index() == 0) {  // a new step
        open_ = part;
        decided_ = false;
        next_part_ = 1;
        tokens_.clear();
        accepted_ = 0;
        pending_ = -1;
        out_.Clear();
    }
    if (req.n_draft() == 0) {  // a prefill chunk or a plain step: the last row, what it is for
        add(res.n_rows - 1, res.n_past);
        reply->mutable_token()->Swap(out_.mutable_token());
        ready_ = req.last_chunk();
        return;
    }
    // every row of a drafted step (logits_all): row r follows token_ids[r]; the rows before the
    // last accepted token's (none from the head) are context, not verified
    const int32_t n = req.token_ids_size();
    const int32_t first = part && req.chunk_index() > 0 ? 0 : n - 1 - (int32_t) req.n_draft();
    if (!part || req.chunk_index() == 0) {
        n_past0_ = req.expect().n_past() + (uint32_t) first;
        hash0_ = req.expect().prefix_hash();
        if (hash0_ != 0) hash0_ = dgr::prefix_hash(hash0_, req.token_ids().data(), (size_t) first);
    }
    const bool last_part = !part || req.last_chunk();
    const size_t before = tokens_.size();
    tokens_.insert(tokens_.end(), req.token_ids().begin() + first, req.token_ids().end());
    for (int32_t r = first; r < n; ++r) {
        // n_past plain decode had after this row's token
        const int32_t token = add(r, (int32_t) (n_past0_ + before + (size_t) (r - first) + 1));
        if (r == n - 1) {
            if (last_part) break;  // the step's last row: its sample is the token after the last draft
            pending_ = token;      // compared with the next part's first draft
            ready_ = false;
            return;
        }
        if (token != req.token_ids(r + 1)) break;  // rejected: this sample is plain decode's token here
        ++accepted_;
    }
    finish(reply);
    if (last_part) open_ = false;
    ready_ = true;
}

void StepCheck::finish(dgr::v1::ForwardReply * reply) {
    decided_ = true;
    reply->mutable_token()->Swap(out_.mutable_token());
    reply->mutable_more_tokens()->Swap(out_.mutable_more_tokens());
    // the session now holds the last accepted token and the accepted drafts; the rejected ones go
    // at the next forward of every stage (CacheExpectation.truncate)
    reply->set_n_past(n_past0_ + 1 + (uint32_t) accepted_);
    reply->set_prefix_hash(hash0_ != 0 ? dgr::prefix_hash(hash0_, tokens_.data(), (size_t) (1 + accepted_)) : 0);
    reply->set_drafted((uint32_t) (tokens_.size() - 1));
    reply->set_accepted((uint32_t) accepted_);
}

}  // namespace dgr::worker
