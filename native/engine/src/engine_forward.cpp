// A forward and a batch of them through llama_decode: checks, the boundary in and out, the
// rows of a verification one by one where a batch's shape changes them, and the compute pools.
#include "engine.h"

namespace dgr::detail {

ForwardResult LlamaShardEngine::forward(const ForwardRequest & req, DType out_dtype) {
    std::vector<BatchItem> one(1);
    one[0].request = req;
    one[0].out_dtype = out_dtype;
    forward_batch(one);
    if (one[0].error) std::rethrow_exception(one[0].error);
    return std::move(one[0].result);
}

void LlamaShardEngine::use_cpus(const std::vector<int32_t> & cpus) {
    if (!cpus.empty() && (int32_t) cpus.size() != options_.n_threads) {
        throw ShardError(Status::invalid_argument, "use_cpus: " + std::to_string(cpus.size()) + " CPUs for " +
                                                       std::to_string(options_.n_threads) + " compute threads");
    }
    for (int32_t c : cpus) {
        if (c < 0 || c >= CPU_SETSIZE || c >= GGML_MAX_N_THREADS) {
            throw ShardError(Status::invalid_argument, "use_cpus: no CPU " + std::to_string(c));
        }
    }
    std::lock_guard<std::mutex> lock(placement_mutex_);
    want_cpus_ = cpus;
}

std::vector<int32_t> LlamaShardEngine::wanted_cpus() const {
    std::lock_guard<std::mutex> lock(placement_mutex_);
    return want_cpus_;
}

ggml_threadpool * LlamaShardEngine::pool_for(int32_t prio, const std::vector<int32_t> & cpus) {
    auto & pool = pools_[{prio, cpus}];
    if (pool == nullptr) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default(options_.n_threads);
        tpp.poll = (uint32_t) options_.poll;
        tpp.prio = (ggml_sched_priority) prio;
        tpp.paused = options_.sleep_when_idle;
        if (!cpus.empty()) {
            for (int32_t c : cpus) tpp.cpumask[c] = true;
            tpp.strict_cpu = true;  // thread i on the i-th CPU, the calling thread on the last
            tpp.paused = true;      // unpaused, ggml would pin the thread making the pool for good
        }
        const PoolMaker maker(have_process_cpus_ ? &process_cpus_ : nullptr);
        pool.reset(ggml_threadpool_new(&tpp));
    }
    return pool.get();
}

void LlamaShardEngine::attach_pool(const PinnedCaller & pinned) {
    if (attached_ == nullptr) return;  // ggml made no pool: its own threads compute
    const bool on = want_priority_.load() || options_.prio <= 0;
    const int32_t prio = on ? options_.prio : GGML_SCHED_PRIO_NORMAL;
    ggml_threadpool * want = pool_for(prio, pinned.cpus());
    if (want == nullptr) return;  // no such pool: keep the one attached
    if (want != attached_) {
        llama_attach_threadpool(ctx_, want, want);
        if (mtp_) llama_attach_threadpool(mtp_, want, want);
        attached_ = want;
        attached_prio_ = prio;
    }
    if (!on) {  // ggml leaves a normal pool's caller at its own policy, which may be realtime
        sched_param p{};
        pthread_setschedparam(pthread_self(), SCHED_OTHER, &p);
    }
}

void LlamaShardEngine::forward_batch(std::vector<BatchItem> & items) {
    const PinnedCaller pinned(wanted_cpus());
    // a staged boundary (DeepSeek V4) computes some batches item by item:
    // - a verification of several rows goes row by row (forward_rows), as V4 rounds a row by
    //   its batch's shape;
    // - a non-head stage serves exactly one ubatch, and llama.cpp splits a V4 batch of several
    //   sequences into a ubatch per sequence (its caches keep a stream per sequence), so such a
    //   stage computes its sessions one llama_decode each, never aborting
    const auto multi_row_verify = [](const BatchItem & b) { return b.request.verify && b.request.n_tokens > 1; };
    if (staged_boundary_ && ((!desc_.is_head && items.size() > 1) ||
                             std::any_of(items.begin(), items.end(), multi_row_verify))) {
        for (auto & item : items) {
            if (multi_row_verify(item)) {
                forward_rows(item);
                continue;
            }
            std::vector<BatchItem> one(1);
            one[0] = std::move(item);
            forward_batch(one);
            item = std::move(one[0]);
        }
        return;
    }
    const int32_t n_embd = desc_.boundary.n_embd * desc_.boundary.hc;  // one residual row
    std::lock_guard<std::mutex> lock(mutex_);
    const AwakePool awake(*this, pinned);
    // admit each item on its own: a refused one gets its error and leaves its session as it
    // was; the rest compute together
    std::vector<Live> live;
    int32_t total = 0;
    for (auto & item : items) {
        try {
            const ForwardRequest & req = item.request;
            check(req);
            for (const Live & l : live) {
                if (l.item->request.session == req.session) {
                    throw ShardError(Status::invalid_argument,
                                     "session " + std::to_string(req.session) + " twice in one batch");
                }
            }
            if (total + req.n_tokens > options_.n_batch) {
                throw ShardError(Status::capacity, "the batch would exceed n_batch " + std::to_string(options_.n_batch));
            }
            const bool opened = sessions_.count(req.session) == 0;
            Session & s = admit(req);
            if (s.n_past + req.n_tokens > options_.n_ctx) {
                if (opened) drop(req.session);  // a refused forward holds no slot
                throw ShardError(Status::capacity, "session " + std::to_string(req.session) + " at n_past " +
                                                       std::to_string(s.n_past) + " + " + std::to_string(req.n_tokens) +
                                                       " tokens would exceed n_ctx " + std::to_string(options_.n_ctx));
            }
            if (req.tokens != nullptr && req.prefix_hash != 0 && s.n_past > 0 && s.hash_known() &&
                req.prefix_hash != s.hash()) {
                throw ShardError(Status::cache_mismatch,
                                 "prefix hash differs from this shard's (its KV holds another token history)");
            }
            live.push_back({&item, &s, opened, total});
            total += req.n_tokens;
        } catch (...) {
            item.error = std::current_exception();
        }
    }
    if (live.empty()) return;
    // with a cache stream per sequence, llama.cpp computes the sequences of one batch in one
    // ubatch only where their ids run consecutively in it (split_equal's `sequential`); in
    // arrival order, 4 sessions' decode steps took up to 4 graphs: in id order, sessions on
    // neighbouring ids share one (and sessions take the lowest free id, admit)
    std::sort(live.begin(), live.end(), [](const Live & a, const Live & b) { return a.session->seq < b.session->seq; });
    total = 0;
    for (Live & l : live) {
        l.offset = total;
        total += l.item->request.n_tokens;
    }

    // the head and staged-boundary stages carry token ids in the batch (a stage that owns no
    // hash-routed layer never reads them: zeros when no sideband came); other stages carry the
    // boundary in batch.embd
    const bool tokens_in_batch = desc_.is_head || staged_boundary_;
    llama_batch batch = llama_batch_init(total, tokens_in_batch ? 0 : n_embd, 1);
    batch.n_tokens = total;
    if (staged_boundary_ && !desc_.is_head) staging_.resize((size_t) total * n_embd);
    for (const Live & l : live) {
        const ForwardRequest & req = l.item->request;
        if (tokens_in_batch) {
            if (req.tokens != nullptr) {
                std::memcpy(batch.token + l.offset, req.tokens, sizeof(int32_t) * req.n_tokens);
            } else {
                std::fill(batch.token + l.offset, batch.token + l.offset + req.n_tokens, 0);
            }
        }
        if (!desc_.is_head) {
            float * rows = staged_boundary_ ? staging_.data() : batch.embd;
            to_f32(req.boundary, req.boundary_dtype, rows + (size_t) l.offset * n_embd, (int64_t) req.n_tokens * n_embd);
        }
        for (int32_t i = 0; i < req.n_tokens; ++i) {
            const int32_t k = l.offset + i;
            batch.pos[k] = l.session->n_past + i;
            batch.n_seq_id[k] = 1;
            batch.seq_id[k][0] = l.session->seq;
            batch.logits[k] = (!desc_.is_tail || req.logits_all || i == req.n_tokens - 1) ? 1 : 0;
        }
    }
    int32_t rc = 0;
    std::string detail;
    if (staged_boundary_ && !desc_.is_head && llama_dgr_set_boundary(ctx_, staging_.data(), total, n_embd) != 0) {
        rc = -1;
        detail = "boundary rejected: " + take_or("no detail");
    } else {
        rc = llama_decode(ctx_, batch);
        if (rc != 0) detail = "llama_decode returned " + std::to_string(rc) + ": " + take_or("no detail");
    }
    llama_batch_free(batch);
    if (rc != 0) {
        // keep every cache equal to what its coordinator believes: drop anything half-written;
        // a cache that cannot roll back (V4 compressor state) drops the session, whose next
        // forward then asks for a re-prefill
        const Status status = rc == 1 ? Status::capacity : rc == -1 ? Status::invalid_argument : Status::decode_failed;
        for (const Live & l : live) {
            const uint64_t id = l.item->request.session;
            if (l.opened || !llama_memory_seq_rm(llama_get_memory(ctx_), l.session->seq, l.session->n_past, -1)) {
                drop(id);
            }
            l.item->error = std::make_exception_ptr(ShardError(status, detail));
        }
        return;
    }
    if (mtp_) mtp_follow(live);
    const float * embd = desc_.is_tail ? nullptr : llama_get_embeddings(ctx_);
    for (const Live & l : live) {
        const ForwardRequest & req = l.item->request;
        l.session->n_past += req.n_tokens;
        std::vector<uint64_t> & hashes = l.session->hashes;
        if (req.tokens != nullptr && l.session->hash_known()) {
            for (int32_t i = 0; i < req.n_tokens; ++i) hashes.push_back(prefix_hash(hashes.back(), req.tokens + i, 1));
        } else {
            hashes.clear();
        }
        ForwardResult & out = l.item->result;
        out.n_past = l.session->n_past;
        out.prefix_hash = l.session->hash_known() ? l.session->hash() : 0;
        if (desc_.is_tail) {
            const int32_t n_rows = req.logits_all ? req.n_tokens : 1;
            out.is_logits = true;
            out.n_rows = n_rows;
            out.row_width = desc_.n_vocab;
            out.dtype = DType::f32;
            // appended row by row: a resize would zero 196 KB per row (SmolLM2) before the copy
            out.data.clear();
            out.data.reserve((size_t) n_rows * desc_.n_vocab * sizeof(float));
            for (int32_t r = 0; r < n_rows; ++r) {
                const int32_t i = l.offset + (req.logits_all ? r : req.n_tokens - 1);
                const auto * row = (const uint8_t *) llama_get_logits_ith(ctx_, i);
                out.data.insert(out.data.end(), row, row + sizeof(float) * desc_.n_vocab);
            }
        } else {
            out.n_rows = req.n_tokens;
            out.row_width = n_embd;
            out.dtype = l.item->out_dtype;
            const int64_t n = (int64_t) req.n_tokens * n_embd;
            out.data.resize((size_t) n * dtype_size(out.dtype));
            from_f32(embd + (size_t) l.offset * n_embd, out.dtype, out.data.data(), n);
        }
    }
    recount();
}

void LlamaShardEngine::forward_rows(BatchItem & item) {
    const ForwardRequest & req = item.request;
    const size_t row_bytes =
        (size_t) desc_.boundary.n_embd * desc_.boundary.hc * dtype_size(req.boundary_dtype);
    ForwardResult all;
    for (int32_t i = 0; i < req.n_tokens; ++i) {
        std::vector<BatchItem> one(1);
        ForwardRequest & row = one[0].request;
        row = req;
        row.verify = false;
        row.n_tokens = 1;
        row.n_past = req.n_past + i;
        row.tokens = req.tokens != nullptr ? req.tokens + i : nullptr;
        row.boundary = req.boundary != nullptr ? (const uint8_t *) req.boundary + (size_t) i * row_bytes : nullptr;
        row.truncate = req.truncate && i == 0;
        row.prefix_hash = i == 0 ? req.prefix_hash : 0;
        one[0].out_dtype = item.out_dtype;
        forward_batch(one);
        if (one[0].error) {
            if (i > 0) {
                std::lock_guard<std::mutex> lock(mutex_);
                if (sessions_.count(req.session) > 0) drop(req.session);
            }
            item.error = one[0].error;
            return;
        }
        ForwardResult & got = one[0].result;
        if (desc_.is_tail && !req.logits_all) all.data.clear();  // the last row's logits only
        all.data.insert(all.data.end(), got.data.begin(), got.data.end());
        all.n_rows = desc_.is_tail && !req.logits_all ? 1 : all.n_rows + got.n_rows;
        all.row_width = got.row_width;
        all.dtype = got.dtype;
        all.is_logits = got.is_logits;
        all.n_past = got.n_past;
        all.prefix_hash = got.prefix_hash;
    }
    item.result = std::move(all);
}

void LlamaShardEngine::pause_pool() {
    if (attached_ != nullptr && options_.sleep_when_idle) ggml_threadpool_pause(attached_);
}

void LlamaShardEngine::rest_if_idle() {
    if (attached_ != nullptr && sessions_.empty()) ggml_threadpool_pause(attached_);
}

void LlamaShardEngine::check(const ForwardRequest & req) const {
    if (options_.estimate_only) {
        throw ShardError(Status::invalid_argument, "this engine only estimates memory (estimate_only): it cannot run");
    }
    if (req.n_tokens < 1 || req.n_tokens > options_.n_batch) {
        throw ShardError(Status::invalid_argument, "n_tokens " + std::to_string(req.n_tokens) +
                                                       " outside [1, " + std::to_string(options_.n_batch) + "]");
    }
    if (desc_.is_head && req.boundary != nullptr) {
        throw ShardError(Status::invalid_argument, "the head stage takes token ids, not a boundary");
    }
    if (desc_.is_head && req.tokens == nullptr) {
        throw ShardError(Status::invalid_argument, "the head stage needs token ids");
    }
    if (!desc_.is_head && req.boundary == nullptr) {
        throw ShardError(Status::invalid_argument, "stage [" + std::to_string(desc_.layer_first) + ", " +
                                                       std::to_string(desc_.layer_last) + ") needs a boundary input");
    }
    if (!desc_.is_head && desc_.boundary.needs_token_ids && req.tokens == nullptr) {
        throw ShardError(Status::invalid_argument,
                         "stage [" + std::to_string(desc_.layer_first) + ", " + std::to_string(desc_.layer_last) +
                             ") owns hash-routed layers (the first " + std::to_string(desc_.hash_layers) +
                             " route experts by token id) and needs the token-ID sideband");
    }
    if (req.mtp && mtp_ == nullptr) {
        throw ShardError(Status::invalid_argument, "mtp: this shard does not serve the MTP block (opened without load_mtp)");
    }
    if (req.mtp && req.tokens == nullptr) {
        throw ShardError(Status::invalid_argument, "mtp: the MTP block pairs each residual with its token: token ids needed");
    }
    if (req.tokens != nullptr) {
        for (int32_t i = 0; i < req.n_tokens; ++i) {
            if (req.tokens[i] < 0 || req.tokens[i] >= desc_.n_vocab) {
                throw ShardError(Status::invalid_argument, "token id " + std::to_string(req.tokens[i]) +
                                                               " outside the vocabulary of " + std::to_string(desc_.n_vocab));
            }
        }
    }

}

void LlamaShardEngine::to_f32(const void * src, DType dtype, float * dst, int64_t n) {
    switch (dtype) {
        case DType::f32: std::memcpy(dst, src, sizeof(float) * n); break;
        case DType::f16: ggml_fp16_to_fp32_row((const ggml_fp16_t *) src, dst, n); break;
        case DType::bf16: ggml_bf16_to_fp32_row((const ggml_bf16_t *) src, dst, n); break;
    }
}

void LlamaShardEngine::from_f32(const float * src, DType dtype, uint8_t * dst, int64_t n) {
    switch (dtype) {
        case DType::f32: std::memcpy(dst, src, sizeof(float) * n); break;
        case DType::f16: ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) dst, n); break;
        case DType::bf16: ggml_fp32_to_bf16_row_ref(src, (ggml_bf16_t *) dst, n); break;
    }
}

}  // namespace dgr::detail
