#include "validate.h"

#include "datalink.h"
#include "wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dgr::worker {

using grpc::Status;
using grpc::StatusCode;

namespace {
Status invalid(const std::string & what) { return Status(StatusCode::INVALID_ARGUMENT, what); }
constexpr size_t kMaxAddress = 255;
constexpr uint32_t kMaxTokenIntervalMs = 10000;
}  // namespace

Status validate_draft(const dgr::v1::Draft & d) {
    switch (d.source()) {
        case dgr::v1::DRAFT_SOURCE_UNSPECIFIED: return Status::OK;
        case dgr::v1::DRAFT_SOURCE_LOOKUP:
        case dgr::v1::DRAFT_SOURCE_MTP: break;
        default: return invalid("draft.source: unknown source " + std::to_string(d.source()));
    }
    if (d.max_draft() < 1 || d.max_draft() > kMaxDraft) {
        return invalid("draft.max_draft: " + std::to_string(d.max_draft()) + " outside [1, " + std::to_string(kMaxDraft) + "]");
    }
    if (d.source() == dgr::v1::DRAFT_SOURCE_MTP) {
        if (d.ngram_min() != 0 || d.ngram_max() != 0) {
            return invalid("draft.ngram_min/ngram_max: prompt-lookup lengths (" + std::to_string(d.ngram_min()) + ", " +
                           std::to_string(d.ngram_max()) + "), 0 with MTP drafts");
        }
        if (d.propose() > d.max_draft()) {
            return invalid("draft.propose: " + std::to_string(d.propose()) + " outside [0, max_draft " +
                           std::to_string(d.max_draft()) + "]");
        }
        return Status::OK;
    }
    if (d.propose() != 0) {
        return invalid("draft.propose: " + std::to_string(d.propose()) + ", an MTP field; 0 with prompt lookup");
    }
    if (d.ngram_max() < 1 || d.ngram_max() > kMaxNgram) {
        return invalid("draft.ngram_max: " + std::to_string(d.ngram_max()) + " outside [1, " + std::to_string(kMaxNgram) + "]");
    }
    if (d.ngram_min() < 1 || d.ngram_min() > d.ngram_max()) {
        return invalid("draft.ngram_min: " + std::to_string(d.ngram_min()) + " outside [1, ngram_max " +
                       std::to_string(d.ngram_max()) + "]");
    }
    return Status::OK;
}

int64_t first_non_finite(const void * data, dgr::DType dtype, int64_t n) {
    // an all-ones exponent is infinity or NaN in every one of these formats
    if (dtype == dgr::DType::f32) {
        const auto * p = (const uint8_t *) data;
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits;
            std::memcpy(&bits, p + 4 * i, 4);
            if ((bits & 0x7F800000u) == 0x7F800000u) return i;
        }
        return -1;
    }
    const uint16_t mask = dtype == dgr::DType::f16 ? 0x7C00 : 0x7F80;
    const auto * p = (const uint8_t *) data;
    for (int64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);
        if ((bits & mask) == mask) return i;
    }
    return -1;
}

Status validate_sampling(const dgr::v1::Sampling & s, int32_t n_vocab) {
    if (!std::isfinite(s.temperature()) || s.temperature() < 0.0f) {
        return invalid("sampling.temperature: " + std::to_string(s.temperature()) + " is not a finite value >= 0");
    }
    if (s.top_k() > (uint32_t) n_vocab) {
        return invalid("sampling.top_k: " + std::to_string(s.top_k()) + " outside [0, " + std::to_string(n_vocab) +
                       "] (0 turns it off)");
    }
    if (!std::isfinite(s.top_p()) || s.top_p() < 0.0f || s.top_p() > 1.0f) {
        return invalid("sampling.top_p: " + std::to_string(s.top_p()) + " outside [0, 1] (0 or 1 turn it off)");
    }
    return Status::OK;
}

Status validate_step_time(const dgr::v1::StepTime & t, const std::string & field) {
    if (t.compute_us() > t.held_us()) {
        return invalid(field + ".compute_us: " + std::to_string(t.compute_us()) + " exceeds held_us " +
                       std::to_string(t.held_us()) + " (a step's compute is part of its time held)");
    }
    return Status::OK;
}

Status validate_route(const dgr::v1::RouteSpec & route, const dgr::Description & desc) {
    const int n = route.stages_size();
    if (n < 1) return invalid("route.stages: empty");
    for (const auto & address : route.stages()) {
        if (address.empty() || address.size() > kMaxAddress) {
            return invalid("route.stages: an address is empty or longer than " + std::to_string(kMaxAddress));
        }
        if (!peer_address(address)) {
            return invalid("route.stages: " + address + " is not HOST:PORT with a port in 1..65535, or unix:PATH");
        }
    }
    const uint32_t i = route.stage_index();
    if (i >= (uint32_t) n) {
        return invalid("route.stage_index: " + std::to_string(i) + " outside the " + std::to_string(n) + " stages");
    }
    if (route.expect_size() != 0 && route.expect_size() != n) {
        return invalid("route.expect: " + std::to_string(route.expect_size()) + " expectations for " + std::to_string(n) +
                       " stages (one each, or none)");
    }
    const std::string range = "[" + std::to_string(desc.layer_first) + ", " + std::to_string(desc.layer_last) + ")";
    if (desc.is_head != (i == 0)) {
        return invalid("route.stage_index: " + std::to_string(i) + " for the stage owning " + range +
                       (desc.is_head ? ", the head" : ", not the head"));
    }
    if (desc.is_tail != (i + 1 == (uint32_t) n)) {
        return invalid("route.stage_index: " + std::to_string(i) + " of " + std::to_string(n) + " for the stage owning " +
                       range + (desc.is_tail ? ", the tail" : ", not the tail"));
    }
    return Status::OK;
}

Status check_stage(const dgr::v1::StageExpectation & e, const dgr::Description & desc, const std::string & fingerprint) {
    auto range = [](uint32_t first, uint32_t last) {
        return "[" + std::to_string(first) + ", " + std::to_string(last) + ")";
    };
    const bool same_range = e.layer_first() == (uint32_t) desc.layer_first && e.layer_last() == (uint32_t) desc.layer_last;
    const bool same_model = e.model_fingerprint().empty() || e.model_fingerprint() == fingerprint;
    if (same_range && same_model) return Status::OK;
    return Status(StatusCode::FAILED_PRECONDITION,
                  "stage changed: the route expects layers " + range(e.layer_first(), e.layer_last()) +
                      (e.model_fingerprint().empty() ? "" : " of model " + e.model_fingerprint().substr(0, 16)) +
                      ", this worker serves " + range((uint32_t) desc.layer_first, (uint32_t) desc.layer_last) +
                      " of model " + fingerprint.substr(0, 16) +
                      " (restarted behind the same address?): reopen the route");
}

uint64_t route_lineage(const dgr::v1::RouteSpec & route) {
    uint64_t h = dgr::kPrefixHashSeed;
    for (uint32_t i = 0; i <= route.stage_index() && i < (uint32_t) route.stages_size(); ++i) {
        for (unsigned char c : route.stages((int) i) + "\n") {
            h ^= c;
            h *= 0x100000001B3ull;
        }
    }
    return h == 0 ? 1 : h;
}

namespace {

// the fields every request is checked for, whatever stage takes it
Status check_fields(const dgr::v1::ForwardRequest & req, const dgr::Description & desc) {
    const auto & exp = req.expect();
    const int n_tok_ids = req.token_ids_size();
    if (req.boundary_dtype() != dgr::v1::DTYPE_UNSPECIFIED && !from_wire(req.boundary_dtype())) {
        return invalid("boundary_dtype: unknown dtype " + std::to_string(req.boundary_dtype()));
    }
    if (exp.n_past() > (uint32_t) desc.n_ctx) {
        return invalid("expect.n_past: " + std::to_string(exp.n_past()) + " beyond n_ctx " + std::to_string(desc.n_ctx));
    }
    if (req.token_interval_ms() > kMaxTokenIntervalMs) {
        return invalid("token_interval_ms: " + std::to_string(req.token_interval_ms()) + " above " +
                       std::to_string(kMaxTokenIntervalMs));
    }
    if (Status st = validate_sampling(req.sampling(), desc.n_vocab); !st.ok()) return st;
    if (Status st = validate_draft(req.draft()); !st.ok()) return st;
    const bool later_part = is_step_part(req) && req.chunk_index() > 0;  // drafts only
    if (req.n_draft() > kMaxDraft || (later_part ? (int64_t) req.n_draft() != n_tok_ids
                                                 : (int64_t) req.n_draft() >= (int64_t) std::max(n_tok_ids, 1))) {
        return invalid("n_draft: " + std::to_string(req.n_draft()) + " drafts need that many token ids" +
                       (later_part ? std::string(" (a later part of a drafted step holds drafts only)")
                                   : std::string(" after the last accepted one")) +
                       " (" + std::to_string(n_tok_ids) + " came), at most " + std::to_string(kMaxDraft));
    }
    if (is_step_part(req) && req.draft().source() == dgr::v1::DRAFT_SOURCE_MTP) {
        return invalid("chunk_index: an MTP step travels whole (the tail's block follows each whole step)");
    }
    if (req.has_route()) {
        if (Status st = validate_route(req.route(), desc); !st.ok()) return st;
    }
    if (req.has_cohort()) {
        const auto & c = req.cohort();
        if (!req.has_route()) return invalid("cohort: a forward-mode field, on a request without route");
        if (c.id() == 0) return invalid("cohort.id: 0 names no cohort");
        if (c.size() < 2 || c.size() > (uint32_t) desc.max_sessions) {
            return invalid("cohort.size: " + std::to_string(c.size()) + " outside [2, " + std::to_string(desc.max_sessions) +
                           "] (this stage's max_sessions)");
        }
    }
    if (req.has_upstream()) {
        const auto & t = req.upstream();
        if (!req.has_route() || req.route().stage_index() == 0) {
            return invalid("upstream: the time at the stages before this one, on a forward-mode request after the head");
        }
        if (Status st = validate_step_time(t, "upstream"); !st.ok()) return st;
    }
    if (n_tok_ids > desc.n_batch) {
        return invalid("token_ids: " + std::to_string(n_tok_ids) + " ids, at most " + std::to_string(desc.n_batch) +
                       " per message");
    }
    if (exp.reuse()) {
        if (!req.has_route()) return invalid("expect.reuse: prefix reuse is a forward-mode field, on a request without route");
        if (exp.n_past() < 1 || exp.prefix_hash() == 0 || n_tok_ids < 1) {
            return invalid("expect.reuse: needs the reused prefix's n_past (> 0) and prefix_hash, and the token ids after it");
        }
    }
    return Status::OK;
}

// a stage after the head: its boundary, checked against this stage's shape, size, checksum and
// for values that are not finite
Status decode_boundary(const dgr::v1::ForwardRequest & req, const dgr::Description & desc, DecodedForward * out) {
    const int n_tok_ids = req.token_ids_size();
    if (!req.has_boundary()) return invalid("boundary: missing for a stage after the head");
    const auto & b = req.boundary();
    if (b.shape_size() != 3) return invalid("boundary.shape: expected [n_tokens, hc, n_embd]");
    const uint64_t n = b.shape(0), hc = b.shape(1), n_embd = b.shape(2);
    if (hc != (uint64_t) desc.boundary.hc || n_embd != (uint64_t) desc.boundary.n_embd) {
        return invalid("boundary.shape: [" + std::to_string(n) + ", " + std::to_string(hc) + ", " + std::to_string(n_embd) +
                       "] does not match this stage's [n_tokens, " + std::to_string(desc.boundary.hc) + ", " +
                       std::to_string(desc.boundary.n_embd) + "]");
    }
    if (n < 1 || n > (uint64_t) desc.n_batch) {
        return invalid("boundary.shape: n_tokens " + std::to_string(n) + " outside [1, " + std::to_string(desc.n_batch) + "]");
    }
    const std::optional<dgr::DType> wire = from_wire(b.dtype());
    if (!wire) return invalid("boundary.dtype: unknown dtype " + std::to_string(b.dtype()));
    const uint64_t want = n * hc * n_embd * dgr::dtype_size(*wire);
    if (b.payload().size() != want) {
        return invalid("boundary.payload: " + std::to_string(b.payload().size()) + " bytes, shape and dtype say " +
                       std::to_string(want));
    }
    if (crc32_of(b.payload().data(), b.payload().size()) != b.crc32()) {
        return invalid("boundary.crc32: checksum mismatch (corrupted in transit)");
    }
    if (const int64_t bad = first_non_finite(b.payload().data(), *wire, (int64_t) (n * hc * n_embd)); bad >= 0) {
        return invalid("boundary.payload: value " + std::to_string(bad) + " (token " + std::to_string(bad / (hc * n_embd)) +
                       ") is not finite");
    }
    if (n_tok_ids != 0 && (uint64_t) n_tok_ids != n) {
        return invalid("token_ids: sideband length differs from the boundary's n_tokens");
    }
    dgr::ForwardRequest & fr = out->engine;
    fr.boundary = b.payload().data();
    fr.boundary_dtype = *wire;
    fr.n_tokens = (int32_t) n;
    if (n_tok_ids > 0) fr.tokens = out->tokens.data();  // the sideband for hash-routed layers
    // the coordinator's choice of output dtype; else the dtype this stage was sent
    out->out_dtype = from_wire(req.boundary_dtype()).value_or(*wire);
    return Status::OK;
}

}  // namespace

Status decode_forward(const dgr::v1::ForwardRequest & req, const dgr::Description & desc, DecodedForward * out) {
    if (Status st = check_fields(req, desc); !st.ok()) return st;
    const auto & exp = req.expect();
    const int n_tok_ids = req.token_ids_size();
    dgr::ForwardRequest & fr = out->engine;
    fr.session = req.session_id();
    fr.epoch = exp.epoch();
    fr.n_past = (int32_t) exp.n_past();
    fr.truncate = exp.truncate();
    fr.reuse = exp.reuse();
    if (req.has_route()) fr.lineage = route_lineage(req.route());
    fr.logits_all = req.n_draft() > 0;  // the tail verifies every drafted position
    fr.verify = req.n_draft() > 0;
    if (req.draft().source() == dgr::v1::DRAFT_SOURCE_MTP) {
        if (!req.has_route()) return invalid("draft: speculative decoding is a forward-mode field, on a request without route");
        if (desc.is_tail && !desc.mtp) {
            return Status(StatusCode::FAILED_PRECONDITION,
                          "draft.source: MTP drafts come from the tail's MTP block, and this tail does not serve it "
                          "(start it with --mtp)");
        }
        if (desc.is_tail && n_tok_ids < 1) {
            return invalid("token_ids: the tail's MTP block pairs each residual with its token: the sideband is needed");
        }
        fr.mtp = desc.is_tail;  // the tail's MTP cache follows every forward of the session
    }
    out->tokens.assign(req.token_ids().begin(), req.token_ids().end());
    if (!desc.is_head) return decode_boundary(req, desc, out);
    if (n_tok_ids < 1) return invalid("token_ids: the head stage needs token ids");
    if (req.has_boundary()) return invalid("boundary: the head stage takes token ids");
    fr.tokens = out->tokens.data();
    fr.n_tokens = n_tok_ids;
    out->out_dtype = from_wire(req.boundary_dtype()).value_or(dgr::DType::f32);
    return Status::OK;
}

}  // namespace dgr::worker
