// Sessions and their KV: admission under the cache expectation, release, and the finished
// sessions kept for prefix reuse (LRU in free slots, adopted by a request of the same prefix).
#include "engine.h"

namespace dgr::detail {

bool LlamaShardEngine::release_epoch(uint64_t session, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(session);
    if (it == sessions_.end() || it->second.epoch != epoch) return false;
    keep(session);
    rest_if_idle();
    return true;
}

std::vector<uint64_t> LlamaShardEngine::sessions() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint64_t> ids;
    for (const auto & kv : sessions_) ids.push_back(kv.first);
    return ids;
}

void LlamaShardEngine::release(uint64_t session) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(session);
    if (it == sessions_.end()) {
        throw ShardError(Status::unknown_session, "no session " + std::to_string(session) + " on this shard");
    }
    keep(session);
    rest_if_idle();
}

CacheStats LlamaShardEngine::cache_stats() const {
    CacheStats c;
    c.sessions = kept_count_.load();
    c.tokens = kept_tokens_.load();
    c.bytes = c.tokens * desc_.kv_bytes_per_token;
    c.hits = hits_.load();
    c.misses = misses_.load();
    c.reused_tokens = reused_tokens_.load();
    c.evictions = evictions_.load();
    return c;
}

void LlamaShardEngine::drop(uint64_t session) {
    auto it = sessions_.find(session);
    llama_memory_seq_rm(llama_get_memory(ctx_), it->second.seq, -1, -1);
    if (mtp_) llama_memory_seq_rm(llama_get_memory(mtp_), it->second.seq, -1, -1);
    free_seqs_.push_back(it->second.seq);
    sessions_.erase(it);
    recount();
}

void LlamaShardEngine::keep(uint64_t session) {
    auto it = sessions_.find(session);
    Session & s = it->second;
    const uint64_t bytes = (uint64_t) s.n_past * desc_.kv_bytes_per_token;
    if (desc_.cache_sessions < 1 || s.lineage == 0 || s.n_past < 1 || !s.hash_known() || (desc_.cache_bytes > 0 && bytes > desc_.cache_bytes)) {
        drop(session);
        return;
    }
    // a kept session whose whole history this one starts with serves nothing this one does not
    // (where the state is positional: elsewhere it alone serves a start at its own end)
    for (auto k = kept_.begin(); k != kept_.end();) {
        const bool covered = positional_ && k->n_past <= s.n_past && k->hash() == s.hashes[(size_t) k->n_past];
        k = covered ? evict(k) : std::next(k);
    }
    if (mtp_) llama_memory_seq_rm(llama_get_memory(mtp_), s.seq, -1, -1);  // the block re-follows from 0
    s.mtp = Session::MtpTrail{};
    kept_.push_front(std::move(s));
    sessions_.erase(it);
    while ((int32_t) kept_.size() > desc_.cache_sessions || (desc_.cache_bytes > 0 && kept_tokens() * desc_.kv_bytes_per_token > desc_.cache_bytes)) {
        evict(std::prev(kept_.end()));
    }
    recount();
}

uint64_t LlamaShardEngine::kept_tokens() const {
    uint64_t n = 0;
    for (const Session & k : kept_) n += (uint64_t) k.n_past;
    return n;
}

std::list<Session>::iterator LlamaShardEngine::evict(std::list<Session>::iterator k) {
    llama_memory_seq_rm(llama_get_memory(ctx_), k->seq, -1, -1);
    free_seqs_.push_back(k->seq);
    evictions_++;
    auto next = kept_.erase(k);
    recount();
    return next;
}

Session & LlamaShardEngine::adopt(const ForwardRequest & req) {
    if (req.n_past < 1 || req.prefix_hash == 0 || req.tokens == nullptr || req.lineage == 0) {
        throw ShardError(Status::invalid_argument, "reuse: needs n_past > 0, its prefix hash, the token ids and a lineage");
    }
    auto k = kept_.begin();
    for (; k != kept_.end(); ++k) {
        if (k->lineage == req.lineage && k->n_past >= req.n_past && (positional_ || k->n_past == req.n_past) &&
            k->hashes[(size_t) req.n_past] == req.prefix_hash) {
            break;
        }
    }
    if (k == kept_.end()) {
        misses_++;
        if (kBatchShapedArchs.count(desc_.arch)) {
            throw ShardError(Status::cache_mismatch, "reuse: " + desc_.arch +
                                                         " rows round by their batch's shape, so this shard keeps no "
                                                         "session for prefix reuse: prefill from n_past 0");
        }
        throw ShardError(Status::cache_mismatch,
                         "reuse: no kept session starts with these " + std::to_string(req.n_past) +
                             " tokens (never held here, evicted, computed over another route, or another history" +
                             std::string(positional_ ? "" : "; this model's state is cut only where a kept session ends") +
                             "): prefill from n_past 0");
    }
    if (k->n_past > req.n_past && !llama_memory_seq_rm(llama_get_memory(ctx_), k->seq, req.n_past, -1)) {
        evict(k);
        misses_++;
        throw ShardError(Status::cache_mismatch, "reuse: the kept session could not be cut to " +
                                                     std::to_string(req.n_past) + " tokens: prefill from n_past 0");
    }
    Session s = std::move(*k);
    kept_.erase(k);
    s.epoch = req.epoch;
    s.n_past = req.n_past;
    s.hashes.resize((size_t) req.n_past + 1);
    hits_++;
    reused_tokens_ += (uint64_t) req.n_past;
    Session & added = sessions_.emplace(req.session, std::move(s)).first->second;
    recount();
    return added;
}

Session & LlamaShardEngine::admit(const ForwardRequest & req) {
    auto it = sessions_.find(req.session);
    if (it == sessions_.end() && req.reuse) return adopt(req);
    if (it == sessions_.end()) {
        if (req.n_past != 0) {
            throw ShardError(Status::unknown_session,
                             "session " + std::to_string(req.session) + " expects n_past " + std::to_string(req.n_past) +
                                 " but this shard holds no cache for it (re-prefill from n_past 0)");
        }
        if (free_seqs_.empty() && !kept_.empty()) evict(std::prev(kept_.end()));  // the oldest kept
        if (free_seqs_.empty()) {
            throw ShardError(Status::capacity, "all " + std::to_string(options_.max_sessions) + " session slots are in use");
        }
        Session s;
        // the lowest free id: the sessions of a batch then mostly hold neighbouring ids
        const auto lowest = std::min_element(free_seqs_.begin(), free_seqs_.end());
        s.seq = *lowest;
        free_seqs_.erase(lowest);
        s.epoch = req.epoch;
        s.lineage = req.lineage;
        llama_memory_seq_rm(llama_get_memory(ctx_), s.seq, -1, -1);
        if (mtp_) llama_memory_seq_rm(llama_get_memory(mtp_), s.seq, -1, -1);
        Session & added = sessions_.emplace(req.session, s).first->second;
        recount();
        return added;
    }
    Session & s = it->second;
    if (req.epoch < s.epoch) {
        throw ShardError(Status::cache_mismatch, "stale epoch " + std::to_string(req.epoch) + " for session " +
                                                     std::to_string(req.session) + " (shard is at epoch " +
                                                     std::to_string(s.epoch) + ")");
    }
    if (req.epoch > s.epoch) {
        if (req.n_past != 0) {
            throw ShardError(Status::cache_mismatch, "epoch " + std::to_string(req.epoch) +
                                                         " must start at n_past 0 (a route change re-prefills)");
        }
        llama_memory_seq_rm(llama_get_memory(ctx_), s.seq, -1, -1);
        if (mtp_) llama_memory_seq_rm(llama_get_memory(mtp_), s.seq, -1, -1);
        s.epoch = req.epoch;
        s.lineage = req.lineage;
        s.n_past = 0;
        s.hashes.assign(1, kPrefixHashSeed);
        s.mtp = Session::MtpTrail{};
        recount();
    }
    if (req.truncate && req.n_past < s.n_past) {
        // speculative decoding: drop the drafts the tail rejected, positions n_past and on
        if (!llama_memory_seq_rm(llama_get_memory(ctx_), s.seq, req.n_past, -1)) {
            const int32_t held = s.n_past;
            drop(req.session);  // half-removed state is no state: the coordinator re-prefills
            throw ShardError(Status::cache_mismatch, "session " + std::to_string(req.session) + " cannot roll back from " +
                                                         std::to_string(held) + " to " + std::to_string(req.n_past) +
                                                         " tokens (this model's state is not positional): re-prefill");
        }
        s.n_past = req.n_past;
        if (s.mtp.n > s.n_past) {
            s.mtp.following = false;  // (the block only ever takes kept positions)
        } else {
            s.mtp.tokens.resize((size_t) (s.n_past - s.mtp.n));
            s.mtp.rows.resize((s.mtp.tokens.size() + 1) * mtp_width());
        }
        if (s.hash_known()) s.hashes.resize((size_t) s.n_past + 1);
        recount();
    }
    if (req.n_past != s.n_past) {
        throw ShardError(Status::cache_mismatch, "session " + std::to_string(req.session) + " expects n_past " +
                                                     std::to_string(req.n_past) + " but the shard holds " +
                                                     std::to_string(s.n_past));
    }
    return s;
}

void LlamaShardEngine::recount() {
    size_t kv = 0;
    for (const auto & kv_session : sessions_) kv += (size_t) kv_session.second.n_past;
    n_sessions_.store(sessions_.size());
    n_kv_tokens_.store(kv);
    kept_count_.store(kept_.size());
    kept_tokens_.store(kept_tokens());
}

}  // namespace dgr::detail
