// The CPU/GPU engine behind ShardEngine (include/dgr/shard_engine.h): LlamaShardEngine's
// declaration and what its parts share. Its definitions are split by concern:
// - engine_load.cpp: the GGUF checks and metadata probe, llama.cpp's log capture, loading a range
//   (the constructor), the public free functions and Vocabulary;
// - engine_forward.cpp: a forward and a batch of them through llama_decode, the boundary in and
//   out, the compute threads' pools and placement;
// - engine_sessions.cpp: sessions and their KV: admission, the cache expectation, release, and the
//   finished sessions kept for prefix reuse;
// - engine_mtp.cpp: DeepSeek V4's MTP (nextn) block at the tail: its cache kept in step, drafting.
// Internal to the engine library: nothing outside native/engine/src includes it.
#pragma once

#include "dgr/shard_engine.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"
#include "llama-ext.h"  // llama_get_memory_breakdown (exported, from the pinned tree's src/)
#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <set>
#include <unordered_set>
#include <string>
#include <vector>

namespace dgr::detail {

// architectures whose graphs carry the range hooks, and those with V4's kinds of state
extern const std::set<std::string> kRangeArchs, kStagedBoundaryArchs, kSnapshotStateArchs, kBatchShapedArchs;

// The calling thread's affinity and scheduling policy as they were when the scope began, both
// put back when it ends (the policy only if it changed); move_to() (once) places it meanwhile.
class ThreadPlacement {
public:
    ThreadPlacement() { sched_saved_ = pthread_getschedparam(pthread_self(), &policy_, &param_) == 0; }
    int policy() const { return sched_saved_ ? policy_ : SCHED_OTHER; }
    void move_to(const cpu_set_t & cpus) {
        if (pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) != 0) return;
        moved_ = pthread_setaffinity_np(pthread_self(), sizeof(cpus), &cpus) == 0;
    }
    ~ThreadPlacement() {
        if (moved_) pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
        int policy = 0;
        sched_param param{};
        if (sched_saved_ && pthread_getschedparam(pthread_self(), &policy, &param) == 0 &&
            (policy != policy_ || param.sched_priority != param_.sched_priority)) {
            pthread_setschedparam(pthread_self(), policy_, &param_);
        }
    }
    ThreadPlacement(const ThreadPlacement &) = delete;
    ThreadPlacement & operator=(const ThreadPlacement &) = delete;

private:
    cpu_set_t saved_{};
    bool moved_ = false;
    int policy_ = 0;
    sched_param param_{};
    bool sched_saved_ = false;
};

// The calling thread on the last of `cpus` while it computes as a pool's thread 0 (ggml puts the
// pool's other threads on the others), its own affinity back when the scope ends: the thread is a
// worker's handler, whose other work may run anywhere. No CPUs: the affinity does not change. The
// pool of the scope's forwards is chosen by the same CPUs (cpus()). The thread's scheduling
// policy comes back too: ggml gives a pool's priority to the thread that makes the pool or
// starts its graph, and keeps it there; a worker's main thread that made its realtime pool at
// load went on at SCHED_FIFO, and so did every thread it started after (gRPC's, the metrics
// server's: threads inherit the policy), which on a host with few cores can starve the rest.
class PinnedCaller {
public:
    explicit PinnedCaller(std::vector<int32_t> cpus) : cpus_(std::move(cpus)) {
        if (cpus_.empty()) return;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus_.back(), &one);
        placement_.move_to(one);
    }
    const std::vector<int32_t> & cpus() const { return cpus_; }

private:
    std::vector<int32_t> cpus_;
    ThreadPlacement placement_;
};

// The calling thread while it makes a compute pool: on `cpus` (the process's cores) and at
// SCHED_OTHER, its own placement and policy back when the scope ends. A pool's threads inherit
// both from their maker and take the pool's own only once they first run; made by a handler
// pinned to one core at a realtime priority, a thread waited on that core behind its maker, which
// spun at that priority in the graph's first barrier waiting for it (a `--prio auto` worker
// that printed nothing for minutes on 2 cores).
class PoolMaker {
public:
    explicit PoolMaker(const cpu_set_t * cpus) {
        if (placement_.policy() != SCHED_OTHER) {
            sched_param normal{};
            pthread_setschedparam(pthread_self(), SCHED_OTHER, &normal);
        }
        if (cpus != nullptr) placement_.move_to(*cpus);
    }

private:
    ThreadPlacement placement_;
};

// what the seam needs to know, from the GGUF metadata alone (no tensor data is read)
struct ModelShape {
    std::string arch;
    int32_t n_layer = 0;        // main layers
    int32_t n_blocks = 0;       // main + MTP (nextn) layers
    int32_t hc = 1;             // residual streams (DeepSeek V4 mHC)
    int32_t hash_layers = 0;    // leading layers that route experts by token id
    int32_t mtp_window = 0;     // the MTP layer attends to positions this close (sliding window
                                // attention; 0: to all of them)
};

struct Session {
    llama_seq_id seq = -1;
    uint64_t epoch = 0;
    int32_t n_past = 0;
    uint64_t lineage = 0;  // prefix reuse: what computed its input (ForwardRequest.lineage)
    // prefix hashes of the cached tokens, hashes[i] after i of them (what a truncation to i
    // restores); empty once a forward came without its token ids, when the hash is unknown
    std::vector<uint64_t> hashes{kPrefixHashSeed};
    bool hash_known() const { return !hashes.empty(); }
    uint64_t hash() const { return hashes.back(); }
    // MTP at the tail (load_mtp): the MTP block pairs the token at each position with the final
    // residual (h_nextn) at the position before. Its cache holds positions [0, n) in step with
    // the main cache; the forwards since wait in `tokens` (positions n, n + 1, ...) and `rows`
    // (residuals from position n - 1, a zero row before position 0: rows[i] pairs with tokens[i],
    // the last row is the one a draft starts from). The block catches up on them in one batch
    // when a draft is asked for. A block that attends through a sliding window (DeepSeek V4's)
    // skips the positions that fell out of it, so a session whose drafts do not pay (and are not
    // asked for) costs it nothing; any other catches up once kMtpPending wait.
    struct MtpTrail {
        bool following = false;  // every forward since n_past 0 came with `mtp`
        int32_t n = 0;
        std::vector<int32_t> tokens;
        std::vector<float> rows;
    } mtp;
};

constexpr size_t kMtpPending = 32;
constexpr int32_t kMtpMinKeep = 17;  // the longest verification forward: a token and 16 drafts

// a GPU (discrete or integrated) among ggml's backend devices: what gpu_layers offloads to
bool has_device();
std::string range_archs();
void log_callback(ggml_log_level level, const char * text, void *);
void init_backend_once();
std::string take_last_error();
std::string take_or(const std::string & fallback);
// cheap checks before llama.cpp parses the file: existence, magic, version
void check_gguf_file(const std::string & path);
ModelShape probe_layers(const std::string & path);

// the model's tokenizer, shared by ShardEngine and Vocabulary (any load, vocab_only included)
std::vector<int32_t> vocab_tokenize(const llama_model * model, const std::string & text, bool add_special);
std::string vocab_detokenize(const llama_model * model, const std::vector<int32_t> & tokens);
std::string vocab_chat(const llama_model * model, const std::vector<std::pair<std::string, std::string>> & messages,
                       bool add_assistant);

class LlamaShardEngine final : public ShardEngine {
public:
    explicit LlamaShardEngine(const EngineOptions & options);

    ~LlamaShardEngine() override;

    Description describe() const override { return desc_; }

    size_t session_count() const override { return n_sessions_.load(); }
    size_t kv_tokens() const override { return n_kv_tokens_.load(); }

    bool release_epoch(uint64_t session, uint64_t epoch) override;

    std::vector<uint64_t> sessions() const override;

    std::vector<int32_t> tokenize(const std::string & text, bool add_special) const override;

    std::string detokenize(const std::vector<int32_t> & tokens) const override { return vocab_detokenize(model_, tokens); }

    bool is_eog(int32_t token) const override { return llama_vocab_is_eog(llama_model_get_vocab(model_), token); }

    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant) const override;

    void release(uint64_t session) override;

    CacheStats cache_stats() const override;

    ForwardResult forward(const ForwardRequest & req, DType out_dtype) override;

    void use_priority(bool on) override { want_priority_.store(on); }

    void use_cpus(const std::vector<int32_t> & cpus) override;

    std::vector<int32_t> wanted_cpus() const;

    // the compute pool of the options' size and spin level, its threads at `prio` and, given
    // CPUs, one on each (made at its first use; nullptr where ggml cannot make it)
    ggml_threadpool * pool_for(int32_t prio, const std::vector<int32_t> & cpus);

    // the pool this forward computes with, as use_priority asked and on the CPUs its caller was
    // pinned for (with forward_batch's lock held)
    void attach_pool(const PinnedCaller & pinned);

    void forward_batch(std::vector<BatchItem> & items) override;

    std::vector<int32_t> draft_mtp(uint64_t session, int32_t n_keep, int32_t token, int32_t max_draft) override;

private:
    // a verification on a model whose rows round by their batch (ForwardRequest::verify): each
    // row computes in its own llama_decode, in order, and the results join as one forward's. A
    // row that fails after others went in drops the session (its coordinator expects none of
    // them; the next forward asks for a re-prefill)
    void forward_rows(BatchItem & item);

    struct Live {
        BatchItem * item;
        Session * session;
        bool opened;
        int32_t offset;  // of its first token in the batch
    };

    struct SamplerFree {
        void operator()(llama_sampler * s) const { llama_sampler_free(s); }
    };
    struct BatchExtFree {
        void operator()(llama_batch_ext * b) const { llama_batch_ext_free(b); }
    };

    // the tail's MTP context: llama.cpp's MTP graph over the nextn block, with a cache of its own;
    // the main context outputs every token's final residual (h_nextn) for it
    void open_mtp(llama_context_params cparams, int32_t window);

    // after a successful decode (sessions' n_past not yet advanced): every `mtp` item's tokens
    // and final residuals join its session's trail; a forward without `mtp`, or one the trail
    // does not reach, stops the session's drafting until its next prefill from position 0
    void mtp_follow(const std::vector<Live> & live);

    // the MTP block's cache through position upto - 1, in one decode; false when it failed (the
    // session then drafts no more)
    bool mtp_catch_up(Session & s, int32_t upto);

    // the trail without its oldest pending positions, down to `keep`: the block's cache starts
    // again after the gap
    void mtp_skip(Session & s, size_t keep);

    // one entry of the MTP batch: the token at `pos` with the residual it pairs with
    void mtp_add(llama_seq_id seq, int32_t token, llama_pos pos, const float * row, bool output);

    size_t mtp_width() const { return (size_t) desc_.boundary.n_embd * (size_t) mtp_hc_; }

    // The pool of a forward attached for the scope and, where it sleeps between forwards and polls
    // (`poll` > 0), woken at once: its threads come in while the calling thread validates the
    // requests and builds the graph, so the graph's first barrier does not wait for a thread
    // waking on another core. Paused again when the scope ends, whatever happened. A pool at a
    // raised priority is left asleep: ggml gives the calling thread that priority only when its
    // graph resumes the pool.
    class AwakePool {
    public:
        AwakePool(LlamaShardEngine & engine, const PinnedCaller & pinned) : engine_(engine) {
            engine_.attach_pool(pinned);
            if (engine_.attached_ != nullptr && engine_.options_.sleep_when_idle && engine_.options_.poll > 0 &&
                engine_.attached_prio_ <= GGML_SCHED_PRIO_NORMAL) {
                ggml_threadpool_resume(engine_.attached_);
            }
        }
        ~AwakePool() { engine_.pause_pool(); }
        AwakePool(const AwakePool &) = delete;
        AwakePool & operator=(const AwakePool &) = delete;

    private:
        LlamaShardEngine & engine_;
    };

    void pause_pool();

    // with its last session released, the pool stops polling for a next graph: at `poll` 50 its
    // threads would spin on for 0.1-0.3 s (a core taken from whatever runs next, e.g. a route's
    // stages beside an engine in the same host). The next forward resumes it (ggml's kickoff).
    // With mutex_ held.
    void rest_if_idle();

    // what a forward must satisfy before llama.cpp sees it
    void check(const ForwardRequest & req) const;

    void drop(uint64_t session);

    // release: keep the session for prefix reuse where it can serve one (its token history known),
    // most recent first, within cache_sessions and cache_bytes; else free it
    void keep(uint64_t session);

    uint64_t kept_tokens() const;

    std::list<Session>::iterator evict(std::list<Session>::iterator k);

    // a new session starting from the most recent kept one that holds its first n_past tokens
    Session & adopt(const ForwardRequest & req);

    Session & admit(const ForwardRequest & req);

    static void to_f32(const void * src, DType dtype, float * dst, int64_t n);

    static void from_f32(const float * src, DType dtype, uint8_t * dst, int64_t n);

    EngineOptions options_;
    Description desc_;
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    llama_context * mtp_ = nullptr;  // load_mtp: the MTP block's context (the same weights)
    int32_t mtp_hc_ = 1;             // residual streams of h_nextn
    int32_t mtp_window_ = 0;         // the MTP layer's sliding window (0: it attends to everything)
    int32_t mtp_keep_ = 0;           // positions a session's trail keeps pending (0: all, caught up
                                     // every kMtpPending); the rest are skipped
    std::unique_ptr<llama_batch_ext, BatchExtFree> mtp_batch_;
    std::unique_ptr<llama_sampler, SamplerFree> greedy_;
    struct PoolFree {
        void operator()(ggml_threadpool * p) const { ggml_threadpool_free(p); }
    };
    // the compute pools made so far, by (priority, CPUs): at most one per compute slot and
    // priority the worker used
    std::map<std::pair<int32_t, std::vector<int32_t>>, std::unique_ptr<ggml_threadpool, PoolFree>> pools_;
    cpu_set_t process_cpus_{};              // the cores the process had at load (PoolMaker)
    bool have_process_cpus_ = false;
    ggml_threadpool * attached_ = nullptr;  // the pool the context computes with
    int32_t attached_prio_ = 0;             // its threads' priority
    std::atomic<bool> want_priority_{true};
    mutable std::mutex placement_mutex_;
    std::vector<int32_t> want_cpus_;  // use_cpus: the next forwards' CPUs (empty: the kernel's choice)
    bool staged_boundary_ = false;
    bool positional_ = true;  // the session state drops positions by seq_rm (not V4's compressors)
    std::vector<float> staging_;
    mutable std::mutex mutex_;
    std::map<uint64_t, Session> sessions_;
    std::atomic<size_t> n_sessions_{0};
    std::atomic<size_t> n_kv_tokens_{0};  // the sessions' n_past summed (what their KV holds)

    // with the engine's lock held, after sessions or their n_past changed
    void recount();
    std::list<Session> kept_;  // prefix reuse: released sessions still holding their KV, newest first
    std::atomic<uint64_t> kept_count_{0}, kept_tokens_{0}, hits_{0}, misses_{0}, reused_tokens_{0}, evictions_{0};
    std::vector<llama_seq_id> free_seqs_;
};

}  // namespace dgr::detail
