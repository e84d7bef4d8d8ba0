// DGR ShardEngine: one contiguous layer range of one GGUF model, over patched libllama.
//
// A shard owns main layers [layer_first, layer_last). The head stage (layer_first == 0) takes
// token ids; every other stage takes the residual boundary leaving the previous stage. A stage
// before the tail emits the residual leaving its last layer; the tail emits logits.
//
// A forward that is refused (bad input, no room in n_ctx, decode failure) leaves every session as
// it was: a session the refused forward would have opened holds no slot afterwards.
//
// Sessions map to llama sequence ids. A session's KV cache is local to the shard and belongs to
// one epoch: every forward states its cache expectation (epoch, n_past and, where token ids
// travel, the prefix hash of the session's tokens), checked and advanced atomically with the
// forward, and a mismatch is a typed error (Status::cache_mismatch), never a wrong answer. A new epoch starts at n_past == 0
// and drops the session's old cache (a route change is a cache miss, never KV migration).
//
// All failures are dgr::ShardError with a Status and a message naming what was wrong; the engine
// validates inputs before llama.cpp sees them, so bad input never aborts the process.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct llama_model;

namespace dgr {

enum class Status : int32_t {
    ok = 0,
    invalid_argument = 1,   // malformed request: shape, dtype, missing tokens or boundary
    invalid_range = 2,      // layer range outside [0, n_layer) or empty
    unsupported_arch = 3,   // range ownership not implemented for this architecture
    load_failed = 4,        // the GGUF could not be loaded (missing, truncated, corrupt)
    unknown_session = 5,    // no such session on this shard
    cache_mismatch = 6,     // stale epoch or n_past that disagrees with the shard's cache
    capacity = 7,           // no free session slot or context space
    decode_failed = 8,      // llama_decode refused the batch
};

const char * status_name(Status status);

class ShardError : public std::runtime_error {
public:
    ShardError(Status status, const std::string & message);
    Status status() const { return status_; }

private:
    Status status_;
};

enum class DType : int32_t { f32 = 0, f16 = 1, bf16 = 2 };

const char * dtype_name(DType dtype);
size_t dtype_size(DType dtype);

struct EngineOptions {
    std::string model_path;
    int32_t layer_first = 0;
    int32_t layer_last = -1;    // < 0: through the last main layer
    int32_t n_threads = 2;
    int32_t n_ctx = 2048;       // per session
    int32_t n_batch = 512;      // most tokens one forward may carry
    int32_t max_sessions = 4;
    int32_t poll = 0;           // threadpool spin level between graphs (0: sleep, 100: spin); a
                                // spinning pool steals the cores the next stage computes on
    bool sleep_when_idle = false;  // compute threads sleep after every forward, whatever `poll`
                                   // (an idle stage takes no CPU from the stage computing beside
                                   // it), and the calling thread takes `prio` at each forward;
                                   // with `poll` > 0 and normal priority, the pool wakes as each
                                   // forward starts and polls while the graph is built, so the
                                   // graph does not wait for a sleeping thread to come in
    int32_t prio = 0;           // compute threads' scheduling priority, as llama.cpp's --prio:
                                // 0 normal, 1 medium, 2 high, 3 realtime (SCHED_FIFO; needs
                                // CAP_SYS_NICE, else ggml warns and keeps normal)
    int32_t gpu_layers = 0;     // owned layers offloaded to the lane's device (CUDA, Vulkan, ...):
                                // 0 none (the CPU lane has no device), -1 all
    int32_t rollback = 16;      // speculative decoding: positions one truncation may drop in a
                                // model whose state is not positional (DeepSeek V4), through
                                // that many state snapshots per session (llama.cpp n_rs_seq)
    bool load_mtp = false;      // the tail also serves the MTP (nextn) block, with its own cache,
                                // and drafts with it (draft_mtp); only a range ending at the
                                // last main layer of a model that has the block
    bool estimate_only = false; // llama.cpp's dry run: describe() reports the memory the range
                                // would take (weights, KV, compute) without allocating it;
                                // forward() is refused
    bool batch_invariant = true;    // batch-invariant CPU kernels (patch 0007): a sequence's values
                                    // do not depend on the batch it computes in, so a batched step
                                    // equals its solo step and a suffix prefilled after a reused
                                    // prefix equals a full prefill, bit for bit (flash attention
                                    // tiled for every row count, a row's KV never split across
                                    // threads). false: ggml's stock batch-shaped choice
    int32_t cache_sessions = 0; // prefix reuse: finished (released) sessions whose KV stays kept,
                                // least recently used first out, in slots no live session holds
                                // (a new session takes the oldest kept one's slot when none is
                                // free); at most max_sessions; 0: none kept
    uint64_t cache_bytes = 0;   // and at most this much KV among the kept sessions (0: no bound
                                // but cache_sessions; the KV buffer is allocated whole at open,
                                // so keeping sessions never grows memory)
};

struct BoundarySpec {
    int32_t hc = 1;             // residual streams per token (DeepSeek V4 mHC: 4)
    int32_t n_embd = 0;
    bool needs_token_ids = false;
};

struct Description {
    std::string arch;
    std::string model_desc;
    int32_t n_layer = 0;
    int32_t layer_first = 0;
    int32_t layer_last = 0;
    int32_t n_vocab = 0;
    int32_t n_ctx = 0;
    int32_t n_batch = 0;
    int32_t max_sessions = 0;
    int32_t max_rollback = 0;   // positions a truncation may drop (n_ctx where the cache is
                                // positional; the snapshots kept where not; 0: none)
    bool is_head = false;
    bool is_tail = false;
    bool mtp = false;           // the tail drafts with the MTP block (load_mtp)
    BoundarySpec boundary;
    int32_t hash_layers = 0;    // leading layers that route experts by token id (DeepSeek V4)
    uint64_t weight_bytes = 0;  // tensor bytes this shard loaded
    uint64_t model_buffer_bytes = 0;    // buffers holding those weights (llama.cpp's breakdown)
    uint64_t kv_bytes = 0;              // KV cache and other per-layer state of the context
    uint64_t compute_bytes = 0;         // compute buffers reserved for the largest batch
    bool batch_invariant = false;       // the options' batch_invariant, as in effect
    int32_t cache_sessions = 0;         // prefix reuse bounds (EngineOptions)
    uint64_t cache_bytes = 0;
    uint64_t kv_bytes_per_token = 0;    // KV one cached token takes (kv_bytes over the cells)
};

// Prefix reuse (EngineOptions.cache_sessions): what the kept finished sessions hold and did.
// Read without waiting behind a forward.
struct CacheStats {
    uint64_t sessions = 0;      // kept now
    uint64_t tokens = 0;        // their tokens
    uint64_t bytes = 0;         // their KV (tokens * kv_bytes_per_token)
    uint64_t hits = 0;          // sessions that started from a kept one
    uint64_t misses = 0;        // asked to (ForwardRequest.reuse) and found none
    uint64_t reused_tokens = 0; // tokens those hits did not prefill
    uint64_t evictions = 0;     // kept sessions dropped for room (slots, cache_sessions, cache_bytes)
};

// FNV-1a 64 over little-endian int32 token ids, continuing from `h` (start: kPrefixHashSeed):
// the prefix hash of a cache expectation (dgr_route.codec.prefix_hash is the coordinator's twin)
constexpr uint64_t kPrefixHashSeed = 0xCBF29CE484222325ull;
uint64_t prefix_hash(uint64_t h, const int32_t * tokens, size_t n);

struct ForwardRequest {
    uint64_t session = 0;
    uint64_t epoch = 0;
    int32_t n_past = 0;                 // cache expectation: tokens already in this session
    uint64_t prefix_hash = 0;           // cache expectation: prefix hash of those tokens (0: not
                                        // checked; checked only while the shard knows it)
    int32_t n_tokens = 0;
    const int32_t * tokens = nullptr;   // head: n_tokens ids; later stages: the token-ID sideband
                                        // (required where boundary.needs_token_ids)
    const void * boundary = nullptr;    // other stages: n_tokens * hc * n_embd values
    DType boundary_dtype = DType::f32;
    bool logits_all = false;            // tail: logits for every token (else the last only)
    bool truncate = false;              // the session may hold more than n_past tokens (drafts a
                                        // verification rejected): drop those first. A model whose
                                        // state cannot roll back drops the session (cache_mismatch)
    bool mtp = false;                   // a tail with the MTP block: keep the block's cache in step
                                        // with this forward (needs the token ids), so that
                                        // draft_mtp can draft after it
    bool reuse = false;                 // prefix reuse: a session this shard does not hold starts
                                        // from a kept finished one (cache_sessions) whose first
                                        // n_past tokens have prefix_hash, cut to those n_past
                                        // (where the state is positional; elsewhere only a kept
                                        // session of exactly n_past tokens), and the kept one is
                                        // gone. None such: cache_mismatch, nothing taken. Needs
                                        // n_past > 0, prefix_hash, the token ids and a lineage
    uint64_t lineage = 0;               // prefix reuse: what computed this stage's input (a worker
                                        // hashes the route's stages up to this one), set when the
                                        // session opens: a released session is kept only with a
                                        // lineage, and reused only by a request of the same one
                                        // (0: never kept; a warm-up's or a relay's session)
    bool verify = false;                // its tokens after the first are drafts to verify. Where
                                        // a row's result depends on the batch it computes in
                                        // (DeepSeek V4: attention and compressors take the
                                        // batch's shape), each row computes in its own
                                        // llama_decode, as plain decode computed it, so that
                                        // greedy verification keeps plain decode's tokens bit for
                                        // bit; elsewhere the rows compute together (same bits)
};

struct ForwardResult {
    // non-tail: the boundary, n_tokens * hc * n_embd values of `dtype`
    // tail: logits, n_rows * n_vocab float32 values
    std::vector<uint8_t> data;
    DType dtype = DType::f32;
    int32_t n_rows = 0;
    int32_t row_width = 0;
    bool is_logits = false;
    int32_t n_past = 0;                 // tokens in the session after this forward
    uint64_t prefix_hash = 0;           // of the session's tokens after it (0: unknown, no token
                                        // ids came with some forward of this epoch)
};

// One forward of a batch: the request, its output dtype, and after forward_batch either its result
// or its error (a ShardError).
struct BatchItem {
    ForwardRequest request;
    DType out_dtype = DType::f32;
    ForwardResult result;
    std::exception_ptr error;
};

class ShardEngine {
public:
    static std::unique_ptr<ShardEngine> open(const EngineOptions & options);
    virtual ~ShardEngine() = default;

    virtual Description describe() const = 0;
    virtual ForwardResult forward(const ForwardRequest & request, DType out_dtype = DType::f32) = 0;
    // Several sessions' forwards in one llama_decode, one sequence each (as llama-server batches
    // its slots). Each item is checked and admitted on its own: a refused one gets its error and
    // its session is untouched, the others compute together; a failed decode fails them all and
    // rolls each back. Sessions must differ, and the tokens together fit n_batch.
    virtual void forward_batch(std::vector<BatchItem> & items) = 0;
    // Whether the next forwards compute at the options' `prio` (true, the default) or at normal
    // priority, every compute thread of theirs included. ggml's barriers spin and equal-priority
    // realtime threads do not take turns: two graphs' realtime threads sharing too few cores can
    // stall each other for good, so a caller that could not make sure its graph computes alone
    // (a worker that got no compute slot) computes at normal priority. A no-op at prio 0.
    virtual void use_priority(bool on) = 0;
    // The CPUs the next forwards compute on, one per compute thread (the calling thread takes the
    // last while it computes, and gets its own affinity back after), or none: the kernel places
    // the threads. A woken compute thread is often placed on the core of the thread that woke it,
    // where the two spin at ggml's barriers in turns while another core idles: on 2 cores, a route
    // of 2-thread stages behind 10 ms links lost a third of its speed to it. A worker pins each
    // forward to the cores of the compute slot it holds (slots.h). Throws invalid_argument for a
    // count other than n_threads or a CPU out of range.
    virtual void use_cpus(const std::vector<int32_t> & cpus) = 0;
    // MTP drafting at the tail (load_mtp), after a forward with `mtp` set: the session keeps its
    // first n_keep tokens (the rest were drafts its verification rejected) and `token` follows
    // them. Returns up to max_draft greedy drafts of the tokens after `token`, from the MTP block
    // chained on its own output as llama.cpp's MTP drafting does: fewer where n_ctx ends, none
    // where the block's cache is not in step with the session (a forward came without `mtp`).
    // Drafts are proposals: what the route outputs is decided by verifying them.
    virtual std::vector<int32_t> draft_mtp(uint64_t session, int32_t n_keep, int32_t token, int32_t max_draft) = 0;
    // Frees the session's cache (unknown_session where there is none); with cache_sessions, a
    // session whose token history is known (prefix hashes) is kept for prefix reuse instead,
    // holding a slot no live session needs. An engine left without
    // sessions (here or by release_epoch) lets its compute threads sleep: between forwards they
    // poll for the next graph (`poll`), which at 50 would go on taking a core for 0.1-0.3 s after
    // the last one; the next forward wakes them.
    virtual void release(uint64_t session) = 0;
    // release the session only while it is at `epoch` (a stream of an older epoch ending after a
    // route change must not drop the newer cache); returns whether it released
    virtual bool release_epoch(uint64_t session, uint64_t epoch) = 0;
    virtual std::vector<uint64_t> sessions() const = 0;
    // prefix reuse: what the kept sessions hold (EngineOptions.cache_sessions)
    virtual CacheStats cache_stats() const = 0;
    // sessions holding a slot; never waits behind a forward in progress
    virtual size_t session_count() const = 0;
    // tokens the sessions' caches hold, summed (KV in use); never waits behind a forward
    virtual size_t kv_tokens() const = 0;

    // the model's tokenizer (every stage loads the vocabulary)
    virtual std::vector<int32_t> tokenize(const std::string & text, bool add_special) const = 0;
    virtual std::string detokenize(const std::vector<int32_t> & tokens) const = 0;
    virtual bool is_eog(int32_t token) const = 0;
    // the model's chat template applied to (role, content) messages (llama.cpp's built-in
    // template matcher); throws invalid_argument when the model has no usable template
    virtual std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                            bool add_assistant) const = 0;
};

// The model's tokenizer alone, for clients that serve no layers: a vocab_only load (metadata and
// vocabulary, no weights). Same tokenizer, detokenizer and chat template as ShardEngine's; the
// file gets the same checks first, so a corrupt vocabulary is load_failed, never an abort.
class Vocabulary {
public:
    explicit Vocabulary(const std::string & model_path);  // throws ShardError (load_failed)
    ~Vocabulary();
    Vocabulary(const Vocabulary &) = delete;
    Vocabulary & operator=(const Vocabulary &) = delete;

    int32_t n_vocab() const;
    std::vector<int32_t> tokenize(const std::string & text, bool add_special) const;
    std::string detokenize(const std::vector<int32_t> & tokens) const;  // invalid_argument outside the vocabulary
    bool is_eog(int32_t token) const;
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant) const;

private:
    llama_model * model_ = nullptr;
};

// Architectures whose graphs carry the range hooks (patch 0002); the full range works for all.
bool range_supported(const std::string & arch);

// What this binary was built from, compiled in at configure time (as llama.cpp's build-info):
// a worker reports it in Describe whatever directory it was started from.
struct BuildInfo {
    const char * llama_commit;        // the pinned llama.cpp commit (native/llama.cpp/manifest.json)
    const char * patch_stack_sha256;  // sha256 over the numbered patches, names and bytes, in order
    const char * lane;                // the compile lane: cpu, cuda, ...
    uint32_t schema_version;          // the dgr.v1 wire schema
};

const BuildInfo & build_info();

}  // namespace dgr
