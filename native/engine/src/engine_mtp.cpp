// DeepSeek V4's MTP (nextn) block at the tail: its cache kept in step with the session's, and
// drafting with it.
#include "engine.h"

namespace dgr::detail {

std::vector<int32_t> LlamaShardEngine::draft_mtp(uint64_t session, int32_t n_keep, int32_t token, int32_t max_draft) {
    const PinnedCaller pinned(wanted_cpus());
    std::lock_guard<std::mutex> lock(mutex_);
    if (mtp_ == nullptr) {
        throw ShardError(Status::invalid_argument, "draft_mtp: this shard does not serve the MTP block (opened without load_mtp)");
    }
    auto it = sessions_.find(session);
    if (it == sessions_.end()) {
        throw ShardError(Status::unknown_session, "no session " + std::to_string(session) + " on this shard");
    }
    Session & s = it->second;
    if (n_keep < 1 || n_keep > s.n_past) {
        throw ShardError(Status::invalid_argument, "draft_mtp: n_keep " + std::to_string(n_keep) + " outside [1, " +
                                                       std::to_string(s.n_past) + "] (the session's tokens)");
    }
    if (token < 0 || token >= desc_.n_vocab) {
        throw ShardError(Status::invalid_argument, "draft_mtp: token id " + std::to_string(token) +
                                                       " outside the vocabulary of " + std::to_string(desc_.n_vocab));
    }
    // drafts take the block's positions n_keep, n_keep + 1, ...: never past the context
    max_draft = std::min(max_draft, options_.n_ctx - n_keep);
    Session::MtpTrail & t = s.mtp;
    if (max_draft < 1 || !t.following || n_keep < t.n) return {};
    const size_t width = mtp_width();
    // the positions past n_keep were rejected: the block never sees them
    t.tokens.resize((size_t) (n_keep - t.n));
    t.rows.resize((t.tokens.size() + 1) * width);
    // the first draft attends to the window before n_keep, and to nothing older
    if (mtp_window_ > 0 && t.tokens.size() > (size_t) mtp_window_) mtp_skip(s, (size_t) mtp_window_);
    const AwakePool awake(*this, pinned);
    if (!mtp_catch_up(s, n_keep)) {
        throw ShardError(Status::decode_failed, "MTP block: catching up to " + std::to_string(n_keep) + " tokens failed: " +
                                                    take_or("no detail"));
    }
    llama_memory_t mem = llama_get_memory(mtp_);
    llama_memory_seq_rm(mem, s.seq, n_keep, -1);  // earlier drafts
    std::vector<float> cur(t.rows.end() - (long) width, t.rows.end());
    std::vector<int32_t> out;
    int32_t tok = token;
    for (int32_t i = 0; i < max_draft; ++i) {
        // the token at position n_keep + i with the residual before it predicts the next one
        llama_batch_ext_clear(mtp_batch_.get());
        mtp_add(s.seq, tok, n_keep + i, cur.data(), true);
        const int32_t rc = llama_process(mtp_, LLAMA_PROCESS_TYPE_DECODE, mtp_batch_.get());
        if (rc != 0) {
            llama_memory_seq_rm(mem, s.seq, n_keep, -1);
            throw ShardError(Status::decode_failed, "MTP draft: llama_process returned " + std::to_string(rc) + ": " +
                                                        take_or("no detail"));
        }
        tok = llama_sampler_sample(greedy_.get(), mtp_, -1);
        out.push_back(tok);
        const float * next = llama_get_embeddings_nextn_ith(mtp_, 0);
        std::copy(next, next + width, cur.begin());
    }
    return out;
}

void LlamaShardEngine::open_mtp(llama_context_params cparams, int32_t window) {
    // the window, and a verification forward more: a draft after it, at the first position
    // it may keep, still finds its whole window
    mtp_window_ = window;
    mtp_keep_ = window > 0 ? window + kMtpMinKeep : 0;
    if (llama_model_n_layer_nextn(model_) < 1) {
        throw ShardError(Status::load_failed, options_.model_path + ": the MTP (nextn) block did not load");
    }
    cparams.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    cparams.embeddings = false;
    cparams.n_rs_seq = 0;  // positional: rejected drafts go by seq_rm
    mtp_ = llama_init_from_model(model_, cparams);
    if (mtp_ == nullptr) {
        throw ShardError(Status::capacity, take_or("cannot create the MTP context"));
    }
    if (options_.batch_invariant) llama_dgr_set_batch_invariant(mtp_, true);
    llama_set_embeddings_nextn(ctx_, true, /*masked=*/false);
    llama_set_embeddings_nextn(mtp_, true, /*masked=*/true);
    if (!options_.estimate_only) llama_memory_clear(llama_get_memory(mtp_), true);
    mtp_hc_ = llama_model_n_embd_out(model_) / llama_model_n_embd(model_);
    mtp_batch_.reset(llama_batch_ext_init(mtp_));
    greedy_.reset(llama_sampler_init_greedy());
}

void LlamaShardEngine::mtp_follow(const std::vector<Live> & live) {
    const size_t width = mtp_width();
    for (const Live & l : live) {
        const ForwardRequest & req = l.item->request;
        Session::MtpTrail & t = l.session->mtp;
        const int32_t a = l.session->n_past;
        if (req.mtp && a == 0) {
            t = Session::MtpTrail{true, 0, {}, std::vector<float>(width, 0.0f)};
        } else if (!req.mtp || !t.following || t.n + (int32_t) t.tokens.size() != a) {
            t.following = false;
            continue;
        }
        t.tokens.insert(t.tokens.end(), req.tokens, req.tokens + req.n_tokens);
        for (int32_t i = 0; i < req.n_tokens; ++i) {
            const float * row = llama_get_embeddings_nextn_ith(ctx_, l.offset + i);
            t.rows.insert(t.rows.end(), row, row + width);
        }
        if (mtp_keep_ > 0 && t.tokens.size() > (size_t) mtp_keep_) {
            // a block that attends through a sliding window never needs the positions that
            // fell out of it: they are skipped, never computed (while drafts are not asked
            // for, the block costs nothing). Its cache starts again after the gap (a position
            // writes its own key and value alone; outputs are read only at drafts, whose
            // window the pending positions cover).
            mtp_skip(*l.session, (size_t) mtp_keep_);
        } else if (mtp_keep_ == 0 && t.tokens.size() >= kMtpPending) {
            // drafts this forward verifies may be rejected: the block takes only what is kept
            mtp_catch_up(*l.session, req.logits_all ? a : a + req.n_tokens);
        }
    }
}

bool LlamaShardEngine::mtp_catch_up(Session & s, int32_t upto) {
    Session::MtpTrail & t = s.mtp;
    const int32_t m = upto - t.n;
    if (m <= 0) return true;
    const size_t width = mtp_width();
    llama_memory_t mem = llama_get_memory(mtp_);
    llama_memory_seq_rm(mem, s.seq, t.n, -1);  // drafts made past it
    llama_batch_ext_clear(mtp_batch_.get());
    for (int32_t i = 0; i < m; ++i) mtp_add(s.seq, t.tokens[(size_t) i], t.n + i, t.rows.data() + (size_t) i * width, false);
    const int32_t rc = llama_process(mtp_, LLAMA_PROCESS_TYPE_DECODE, mtp_batch_.get());
    if (rc != 0) {
        llama_memory_seq_rm(mem, s.seq, t.n, -1);
        t.following = false;
        return false;
    }
    t.n = upto;
    t.tokens.erase(t.tokens.begin(), t.tokens.begin() + m);
    t.rows.erase(t.rows.begin(), t.rows.begin() + (long) ((size_t) m * width));
    return true;
}

void LlamaShardEngine::mtp_skip(Session & s, size_t keep) {
    Session::MtpTrail & t = s.mtp;
    const size_t drop = t.tokens.size() - keep;
    llama_memory_seq_rm(llama_get_memory(mtp_), s.seq, -1, -1);
    t.n += (int32_t) drop;
    t.tokens.erase(t.tokens.begin(), t.tokens.begin() + (long) drop);
    t.rows.erase(t.rows.begin(), t.rows.begin() + (long) (drop * mtp_width()));
}

void LlamaShardEngine::mtp_add(llama_seq_id seq, int32_t token, llama_pos pos, const float * row, bool output) {
    const int32_t idx = llama_batch_ext_add_token(mtp_batch_.get(), seq, token);
    llama_batch_ext_set_pos(mtp_batch_.get(), idx, &pos);
    llama_batch_ext_set_embd_token(mtp_batch_.get(), idx, llama_embd{row, 1, mtp_width()});
    llama_batch_ext_set_output_logits(mtp_batch_.get(), idx, output);
}

}  // namespace dgr::detail
