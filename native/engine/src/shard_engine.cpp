// ShardEngine over patched libllama (see include/dgr/shard_engine.h).
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
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <set>
#include <unordered_set>

namespace dgr {

namespace {

// a GPU (discrete or integrated) among ggml's backend devices: what gpu_layers offloads to
bool has_device() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const auto type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) return true;
    }
    return false;
}

// The calling thread on the last of `cpus` while it computes as a pool's thread 0 (ggml puts the
// pool's other threads on the others), its own affinity back when the scope ends: the thread is a
// worker's handler, whose other work may run anywhere. No CPUs: nothing changes. The pool of the
// scope's forwards is chosen by the same CPUs (cpus()).
class PinnedCaller {
public:
    explicit PinnedCaller(std::vector<int32_t> cpus) : cpus_(std::move(cpus)) {
        if (cpus_.empty() || pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) != 0) return;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus_.back(), &one);
        pinned_ = pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
    }
    const std::vector<int32_t> & cpus() const { return cpus_; }
    ~PinnedCaller() {
        if (pinned_) pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
    }
    PinnedCaller(const PinnedCaller &) = delete;
    PinnedCaller & operator=(const PinnedCaller &) = delete;

private:
    std::vector<int32_t> cpus_;
    cpu_set_t saved_{};
    bool pinned_ = false;
};

const std::set<std::string> kRangeArchs = {"llama", "gemma3", "qwen2", "qwen3", "deepseek2", "deepseek4"};
std::string range_archs() {
    std::string out;
    for (const auto & arch : kRangeArchs) out += (out.empty() ? "" : ", ") + arch;
    return out;
}

// archs whose stages after the head take the residual through llama_dgr_set_boundary (patch 0004)
const std::set<std::string> kStagedBoundaryArchs = {"deepseek4"};
// architectures whose per-layer state beyond the KV cache (DeepSeek V4's compressors) cannot drop
// positions: they roll back only through llama.cpp's recurrent-state snapshots (n_rs_seq)
const std::set<std::string> kSnapshotStateArchs = {"deepseek4"};
// architectures whose rows round by their batch's shape (DeepSeek V4's attention and compressors):
// a suffix computed after a kept prefix does not give a full prefill's bits, so no session is kept
// for prefix reuse (measured on the V4 twin: same tokens, other logits)
const std::set<std::string> kBatchShapedArchs = {"deepseek4"};

// llama.cpp reports load failures through its log; keep the last error for the typed message
std::mutex g_log_mutex;
std::string g_last_error;

void log_callback(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        std::string line = text;
        while (!line.empty() && line.back() == '\n') {
            line.pop_back();
        }
        g_last_error += (g_last_error.empty() ? "" : "; ") + line;
    }
}

void init_backend_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
}

std::string take_last_error() {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::string err = g_last_error;
    g_last_error.clear();
    return err;
}

std::string take_or(const std::string & fallback) {
    std::string err = take_last_error();
    return err.empty() ? fallback : err;
}

// cheap checks before llama.cpp parses the file: existence, magic, version
void check_gguf_file(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        throw ShardError(Status::load_failed, "cannot open model file " + path);
    }
    char head[8] = {0};
    in.read(head, sizeof(head));
    if (in.gcount() < 8) {
        throw ShardError(Status::load_failed, path + ": truncated (shorter than a GGUF header)");
    }
    if (std::memcmp(head, "GGUF", 4) != 0) {
        throw ShardError(Status::load_failed, path + ": not a GGUF file (bad magic)");
    }
}

// the model's tokenizer, shared by ShardEngine and Vocabulary (any load, vocab_only included)
std::vector<int32_t> vocab_tokenize(const llama_model * model, const std::string & text, bool add_special) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> out(text.size() + 16);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, true);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           true);
    }
    if (n < 0) {
        throw ShardError(Status::invalid_argument, "text could not be tokenized");
    }
    out.resize((size_t) n);
    return out;
}

std::string vocab_detokenize(const llama_model * model, const std::vector<int32_t> & tokens) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab) {
            throw ShardError(Status::invalid_argument, "token id " + std::to_string(t) + " outside the vocabulary");
        }
    }
    std::string out(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                                 false, false);
    if (n < 0) {
        out.resize((size_t) -n);
        n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false,
                             false);
    }
    out.resize((size_t) std::max(n, 0));
    return out;
}

std::string vocab_chat(const llama_model * model, const std::vector<std::pair<std::string, std::string>> & messages,
                       bool add_assistant) {
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (tmpl == nullptr) {
        throw ShardError(Status::invalid_argument, "the model carries no chat template");
    }
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto & m : messages) {
        chat.push_back({m.first.c_str(), m.second.c_str()});
        total += m.first.size() + m.second.size();
    }
    std::string out(total * 2 + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize((size_t) n);
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) {
        throw ShardError(Status::invalid_argument, "the model's chat template is not one llama.cpp can apply");
    }
    out.resize((size_t) n);
    return out;
}

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

ModelShape probe_layers(const std::string & path) {
    gguf_init_params params = {/*.no_alloc =*/ true, /*.ctx =*/ nullptr};
    gguf_context * gguf = gguf_init_from_file(path.c_str(), params);
    if (gguf == nullptr) {
        throw ShardError(Status::load_failed, path + ": " + take_or("not a readable GGUF (truncated or corrupt)"));
    }
    const int64_t arch_key = gguf_find_key(gguf, "general.architecture");
    if (arch_key < 0 || gguf_get_kv_type(gguf, arch_key) != GGUF_TYPE_STRING) {
        gguf_free(gguf);
        throw ShardError(Status::load_failed, path + ": no general.architecture");
    }
    const std::string arch = gguf_get_val_str(gguf, arch_key);
    auto get_u32 = [&](const std::string & key) -> int64_t {
        const int64_t id = gguf_find_key(gguf, key.c_str());
        return (id < 0 || gguf_get_kv_type(gguf, id) != GGUF_TYPE_UINT32) ? int64_t(-1) : int64_t(gguf_get_val_u32(gguf, id));
    };
    const int64_t blocks = get_u32(arch + ".block_count");
    const int64_t nextn = std::max<int64_t>(0, get_u32(arch + ".nextn_predict_layers"));
    const int64_t hc = get_u32(arch + ".hyper_connection.count");
    const int64_t hash_layers = get_u32(arch + ".hash_layer_count");
    // llama.cpp's DeepSeek V4 graph makes its MTP layers sliding-window layers (deepseek4.cpp:
    // is_swa_impl for il >= n_layer), whatever their compress ratio
    const int64_t mtp_window = arch == "deepseek4" && nextn > 0 ? get_u32(arch + ".attention.sliding_window") : 0;
    // llama.cpp's vocabulary load asserts (aborting the process) when two tokens share a string;
    // a file like that is refused here with a typed error instead (found by the GGUF fuzzer)
    const int64_t tokens_key = gguf_find_key(gguf, "tokenizer.ggml.tokens");
    if (tokens_key >= 0 && gguf_get_kv_type(gguf, tokens_key) == GGUF_TYPE_ARRAY &&
        gguf_get_arr_type(gguf, tokens_key) == GGUF_TYPE_STRING) {
        std::unordered_set<std::string> seen;
        const size_t n = gguf_get_arr_n(gguf, tokens_key);
        for (size_t i = 0; i < n; ++i) {
            if (!seen.insert(gguf_get_arr_str(gguf, tokens_key, i)).second) {
                gguf_free(gguf);
                throw ShardError(Status::load_failed, path + ": tokenizer.ggml.tokens: token " + std::to_string(i) +
                                                          " repeats an earlier token (a corrupt vocabulary)");
            }
        }
    }
    gguf_free(gguf);
    if (blocks <= 0 || nextn >= blocks) {
        throw ShardError(Status::load_failed, path + ": no usable " + arch + ".block_count");
    }
    ModelShape shape;
    shape.arch = arch;
    shape.n_layer = (int32_t) (blocks - nextn);
    shape.n_blocks = (int32_t) blocks;
    shape.hc = hc > 0 ? (int32_t) hc : 1;
    shape.hash_layers = (int32_t) std::max<int64_t>(0, hash_layers);
    shape.mtp_window = (int32_t) std::max<int64_t>(0, mtp_window);
    return shape;
}

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

class LlamaShardEngine final : public ShardEngine {
public:
    explicit LlamaShardEngine(const EngineOptions & options) : options_(options) {
        init_backend_once();
        if (options.n_threads < 1 || options.n_ctx < 1 || options.n_batch < 1 || options.max_sessions < 1) {
            throw ShardError(Status::invalid_argument,
                             "n_threads, n_ctx, n_batch and max_sessions must be positive");
        }
        check_gguf_file(options.model_path);

        // read the metadata alone first: validate the range and the arch before any weights load
        const ModelShape shape = probe_layers(options.model_path);
        const std::string & arch = shape.arch;
        const int32_t n_layer = shape.n_layer;

        const int32_t first = options.layer_first;
        const int32_t last = options.layer_last < 0 ? n_layer : options.layer_last;
        if (first >= 0 && first < last && last > n_layer && last <= shape.n_blocks) {
            throw ShardError(Status::invalid_range,
                             "layer range [" + std::to_string(first) + ", " + std::to_string(last) +
                                 ") reaches into the MTP block (layers " + std::to_string(n_layer) + ".." +
                                 std::to_string(shape.n_blocks - 1) +
                                 "): MTP layers are no main range; main layers end at " + std::to_string(n_layer) +
                                 " and the tail serves the MTP block with load_mtp (worker --mtp)");
        }
        if (options.load_mtp && shape.n_blocks == n_layer) {
            throw ShardError(Status::invalid_argument, "load_mtp: " + options.model_path +
                                                           " has no MTP (nextn) block (" + arch + ".nextn_predict_layers is 0)");
        }
        if (options.load_mtp && first >= 0 && last != n_layer) {
            throw ShardError(Status::invalid_argument,
                             "load_mtp: only the tail serves the MTP block, and the range [" + std::to_string(first) + ", " +
                                 std::to_string(last) + ") ends before the last main layer (" + std::to_string(n_layer) + ")");
        }
        if (first < 0 || first >= last || last > n_layer) {
            throw ShardError(Status::invalid_range,
                             "layer range [" + std::to_string(first) + ", " + std::to_string(last) +
                                 ") is not inside [0, " + std::to_string(n_layer) + ") with first < last");
        }
        if ((first != 0 || last != n_layer) && !range_supported(arch)) {
            throw ShardError(Status::unsupported_arch,
                             "range ownership is not implemented for arch '" + arch + "' (supported: " + range_archs() + ")");
        }

        // layers asked onto a device that is not there would silently compute on the CPU while the
        // worker reports its build's lane: refuse by name instead (a driver missing, no GPU)
        if (options.gpu_layers != 0 && !has_device()) {
            throw ShardError(Status::invalid_argument,
                             "gpu_layers " + std::to_string(options.gpu_layers) + ": the " + build_info().lane +
                                 " build sees no device on this machine (no GPU, or its driver is missing)");
        }
        llama_model_params mparams = llama_model_default_params();
        mparams.n_gpu_layers = options.gpu_layers < 0 ? 999 : options.gpu_layers;
        mparams.dgr_layer_first = first;
        mparams.dgr_layer_last = last;
        mparams.load_mtp = options.load_mtp;
        // read owned tensors into their own buffers: a mapped (and prefetched) file would page in
        // every layer's weights, owned or not
        mparams.load_mode = LLAMA_LOAD_MODE_NONE;
        mparams.no_alloc = options.estimate_only;
        model_ = llama_model_load_from_file(options.model_path.c_str(), mparams);
        if (model_ == nullptr) {
            throw ShardError(Status::load_failed, options.model_path + ": " + take_or("model load failed"));
        }

        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx = (uint32_t) (options.n_ctx * options.max_sessions);
        cparams.n_batch = (uint32_t) options.n_batch;
        cparams.n_ubatch = (uint32_t) options.n_batch;
        cparams.n_seq_max = (uint32_t) options.max_sessions;
        cparams.n_threads = options.n_threads;
        cparams.n_threads_batch = options.n_threads;
        cparams.no_perf = true;
        desc_.is_tail = last == n_layer;
        // a stage before the tail reads its boundary through the embeddings output
        cparams.embeddings = !desc_.is_tail;
        cparams.pooling_type = LLAMA_POOLING_TYPE_NONE;
        // speculative decoding drops rejected drafts; a state that is not positional (DeepSeek
        // V4's compressors) rolls back through this many snapshots (llama.cpp clamps it to 0 for
        // models whose KV cache needs none)
        cparams.n_rs_seq = (uint32_t) options.rollback;
        ctx_ = llama_init_from_model(model_, cparams);
        if (ctx_ == nullptr) {
            llama_model_free(model_);
            model_ = nullptr;
            throw ShardError(Status::capacity, take_or("cannot create a context of the requested size"));
        }

        // the whole KV cache resident now, not page by page as sessions first reach a cell: the
        // memory a worker reports and holds is what it will use, and a soak's RSS shows growth,
        // not first touches (a no-op for a dry run)
        if (!options.estimate_only) llama_memory_clear(llama_get_memory(ctx_), true);

        if (options.batch_invariant && llama_dgr_set_batch_invariant(ctx_, true) != 0) {
            throw ShardError(Status::load_failed, "batch_invariant: this build's CPU backend has no batch-invariant switch (patch 0007)");
        }
        if (options.load_mtp) open_mtp(cparams, shape.mtp_window);

        // Stages of a route run one after another and share cores with their neighbours; a
        // threadpool that keeps spinning after its graph steals the CPU the next stage needs.
        if (ggml_threadpool * pool = pool_for(options.prio, {})) {
            llama_attach_threadpool(ctx_, pool, pool);
            if (mtp_) llama_attach_threadpool(mtp_, pool, pool);
            attached_ = pool;
            attached_prio_ = options.prio;
        }

        desc_.arch = arch;
        char buf[256];
        llama_model_desc(model_, buf, sizeof(buf));
        desc_.model_desc = buf;
        desc_.n_layer = n_layer;
        desc_.layer_first = first;
        desc_.layer_last = last;
        desc_.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_));
        desc_.n_ctx = options.n_ctx;
        desc_.n_batch = options.n_batch;
        desc_.max_sessions = options.max_sessions;
        // positions a truncation may drop: any, where the cache is positional; the snapshots kept,
        // where it is not (none: the session is dropped and re-prefilled)
        positional_ = !llama_model_is_recurrent(model_) && !llama_model_is_hybrid(model_) &&
                                kSnapshotStateArchs.count(arch) == 0;
        desc_.max_rollback = positional_ ? options.n_ctx : (int32_t) llama_n_rs_seq(ctx_);
        desc_.is_head = first == 0;
        desc_.mtp = mtp_ != nullptr;
        staged_boundary_ = kStagedBoundaryArchs.count(arch) > 0;
        desc_.boundary.hc = staged_boundary_ ? shape.hc : 1;
        desc_.boundary.n_embd = llama_model_n_embd(model_);
        desc_.boundary.needs_token_ids = desc_.is_head || first < shape.hash_layers;
        desc_.hash_layers = shape.hash_layers;
        for (const auto & entry : llama_get_memory_breakdown(ctx_)) {
            desc_.model_buffer_bytes += entry.second.model;
            desc_.kv_bytes += entry.second.context;
            desc_.compute_bytes += entry.second.compute;
        }
        if (mtp_) {  // the same weights; its own cache and compute buffers
            for (const auto & entry : llama_get_memory_breakdown(mtp_)) {
                desc_.kv_bytes += entry.second.context;
                desc_.compute_bytes += entry.second.compute;
            }
        }
        // llama_model_size counts every tensor in the file; a shard holds only its own
        desc_.weight_bytes = desc_.model_buffer_bytes;
        desc_.batch_invariant = options.batch_invariant;
        desc_.cache_sessions =
            kBatchShapedArchs.count(arch) ? 0 : std::clamp(options.cache_sessions, 0, options.max_sessions);
        desc_.cache_bytes = options.cache_bytes;
        desc_.kv_bytes_per_token = desc_.kv_bytes / std::max<uint64_t>(1, (uint64_t) options.n_ctx * options.max_sessions);
        for (int32_t s = options.max_sessions - 1; s >= 0; --s) {
            free_seqs_.push_back(s);
        }
    }

    ~LlamaShardEngine() override {
        if (mtp_) llama_free(mtp_);
        if (ctx_) llama_free(ctx_);
        pools_.clear();
        if (model_) llama_model_free(model_);
    }

    Description describe() const override { return desc_; }

    size_t session_count() const override { return n_sessions_.load(); }
    size_t kv_tokens() const override { return n_kv_tokens_.load(); }

    bool release_epoch(uint64_t session, uint64_t epoch) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = sessions_.find(session);
        if (it == sessions_.end() || it->second.epoch != epoch) return false;
        keep(session);
        rest_if_idle();
        return true;
    }

    std::vector<uint64_t> sessions() const override {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<uint64_t> ids;
        for (const auto & kv : sessions_) ids.push_back(kv.first);
        return ids;
    }

    std::vector<int32_t> tokenize(const std::string & text, bool add_special) const override {
        return vocab_tokenize(model_, text, add_special);
    }

    std::string detokenize(const std::vector<int32_t> & tokens) const override { return vocab_detokenize(model_, tokens); }

    bool is_eog(int32_t token) const override { return llama_vocab_is_eog(llama_model_get_vocab(model_), token); }

    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant) const override {
        return vocab_chat(model_, messages, add_assistant);
    }

    void release(uint64_t session) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = sessions_.find(session);
        if (it == sessions_.end()) {
            throw ShardError(Status::unknown_session, "no session " + std::to_string(session) + " on this shard");
        }
        keep(session);
        rest_if_idle();
    }

    CacheStats cache_stats() const override {
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

    ForwardResult forward(const ForwardRequest & req, DType out_dtype) override {
        std::vector<BatchItem> one(1);
        one[0].request = req;
        one[0].out_dtype = out_dtype;
        forward_batch(one);
        if (one[0].error) std::rethrow_exception(one[0].error);
        return std::move(one[0].result);
    }

    void use_priority(bool on) override { want_priority_.store(on); }

    void use_cpus(const std::vector<int32_t> & cpus) override {
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

    std::vector<int32_t> wanted_cpus() const {
        std::lock_guard<std::mutex> lock(placement_mutex_);
        return want_cpus_;
    }

    // the compute pool of the options' size and spin level, its threads at `prio` and, given
    // CPUs, one on each (made at its first use; nullptr where ggml cannot make it)
    ggml_threadpool * pool_for(int32_t prio, const std::vector<int32_t> & cpus) {
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
            pool.reset(ggml_threadpool_new(&tpp));
        }
        return pool.get();
    }

    // the pool this forward computes with, as use_priority asked and on the CPUs its caller was
    // pinned for (with forward_batch's lock held)
    void attach_pool(const PinnedCaller & pinned) {
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
        if (!on) {  // the calling thread may hold the realtime policy from an earlier graph
            sched_param p{};
            pthread_setschedparam(pthread_self(), SCHED_OTHER, &p);
        }
    }

    void forward_batch(std::vector<BatchItem> & items) override {
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

    std::vector<int32_t> draft_mtp(uint64_t session, int32_t n_keep, int32_t token, int32_t max_draft) override {
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

private:
    // a verification on a model whose rows round by their batch (ForwardRequest::verify): each
    // row computes in its own llama_decode, in order, and the results join as one forward's. A
    // row that fails after others went in drops the session (its coordinator expects none of
    // them; the next forward asks for a re-prefill)
    void forward_rows(BatchItem & item) {
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
    void open_mtp(llama_context_params cparams, int32_t window) {
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

    // after a successful decode (sessions' n_past not yet advanced): every `mtp` item's tokens
    // and final residuals join its session's trail; a forward without `mtp`, or one the trail
    // does not reach, stops the session's drafting until its next prefill from position 0
    void mtp_follow(const std::vector<Live> & live) {
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

    // the MTP block's cache through position upto - 1, in one decode; false when it failed (the
    // session then drafts no more)
    bool mtp_catch_up(Session & s, int32_t upto) {
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

    // the trail without its oldest pending positions, down to `keep`: the block's cache starts
    // again after the gap
    void mtp_skip(Session & s, size_t keep) {
        Session::MtpTrail & t = s.mtp;
        const size_t drop = t.tokens.size() - keep;
        llama_memory_seq_rm(llama_get_memory(mtp_), s.seq, -1, -1);
        t.n += (int32_t) drop;
        t.tokens.erase(t.tokens.begin(), t.tokens.begin() + (long) drop);
        t.rows.erase(t.rows.begin(), t.rows.begin() + (long) (drop * mtp_width()));
    }

    // one entry of the MTP batch: the token at `pos` with the residual it pairs with
    void mtp_add(llama_seq_id seq, int32_t token, llama_pos pos, const float * row, bool output) {
        const int32_t idx = llama_batch_ext_add_token(mtp_batch_.get(), seq, token);
        llama_batch_ext_set_pos(mtp_batch_.get(), idx, &pos);
        llama_batch_ext_set_embd_token(mtp_batch_.get(), idx, llama_embd{row, 1, mtp_width()});
        llama_batch_ext_set_output_logits(mtp_batch_.get(), idx, output);
    }

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

    void pause_pool() {
        if (attached_ != nullptr && options_.sleep_when_idle) ggml_threadpool_pause(attached_);
    }

    // with its last session released, the pool stops polling for a next graph: at `poll` 50 its
    // threads would spin on for 0.1-0.3 s (a core taken from whatever runs next, e.g. a route's
    // stages beside an engine in the same host). The next forward resumes it (ggml's kickoff).
    // With mutex_ held.
    void rest_if_idle() {
        if (attached_ != nullptr && sessions_.empty()) ggml_threadpool_pause(attached_);
    }

    // what a forward must satisfy before llama.cpp sees it
    void check(const ForwardRequest & req) const {
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

    void drop(uint64_t session) {
        auto it = sessions_.find(session);
        llama_memory_seq_rm(llama_get_memory(ctx_), it->second.seq, -1, -1);
        if (mtp_) llama_memory_seq_rm(llama_get_memory(mtp_), it->second.seq, -1, -1);
        free_seqs_.push_back(it->second.seq);
        sessions_.erase(it);
        recount();
    }

    // release: keep the session for prefix reuse where it can serve one (its token history known),
    // most recent first, within cache_sessions and cache_bytes; else free it
    void keep(uint64_t session) {
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

    uint64_t kept_tokens() const {
        uint64_t n = 0;
        for (const Session & k : kept_) n += (uint64_t) k.n_past;
        return n;
    }

    std::list<Session>::iterator evict(std::list<Session>::iterator k) {
        llama_memory_seq_rm(llama_get_memory(ctx_), k->seq, -1, -1);
        free_seqs_.push_back(k->seq);
        evictions_++;
        auto next = kept_.erase(k);
        recount();
        return next;
    }

    // a new session starting from the most recent kept one that holds its first n_past tokens
    Session & adopt(const ForwardRequest & req) {
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

    Session & admit(const ForwardRequest & req) {
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

    static void to_f32(const void * src, DType dtype, float * dst, int64_t n) {
        switch (dtype) {
            case DType::f32: std::memcpy(dst, src, sizeof(float) * n); break;
            case DType::f16: ggml_fp16_to_fp32_row((const ggml_fp16_t *) src, dst, n); break;
            case DType::bf16: ggml_bf16_to_fp32_row((const ggml_bf16_t *) src, dst, n); break;
        }
    }

    static void from_f32(const float * src, DType dtype, uint8_t * dst, int64_t n) {
        switch (dtype) {
            case DType::f32: std::memcpy(dst, src, sizeof(float) * n); break;
            case DType::f16: ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) dst, n); break;
            case DType::bf16: ggml_fp32_to_bf16_row_ref(src, (ggml_bf16_t *) dst, n); break;
        }
    }

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
    void recount() {
        size_t kv = 0;
        for (const auto & kv_session : sessions_) kv += (size_t) kv_session.second.n_past;
        n_sessions_.store(sessions_.size());
        n_kv_tokens_.store(kv);
        kept_count_.store(kept_.size());
        kept_tokens_.store(kept_tokens());
    }
    std::list<Session> kept_;  // prefix reuse: released sessions still holding their KV, newest first
    std::atomic<uint64_t> kept_count_{0}, kept_tokens_{0}, hits_{0}, misses_{0}, reused_tokens_{0}, evictions_{0};
    std::vector<llama_seq_id> free_seqs_;
};

}  // namespace

ShardError::ShardError(Status status, const std::string & message)
    : std::runtime_error(std::string(status_name(status)) + ": " + message), status_(status) {}

const char * status_name(Status status) {
    switch (status) {
        case Status::ok: return "ok";
        case Status::invalid_argument: return "invalid_argument";
        case Status::invalid_range: return "invalid_range";
        case Status::unsupported_arch: return "unsupported_arch";
        case Status::load_failed: return "load_failed";
        case Status::unknown_session: return "unknown_session";
        case Status::cache_mismatch: return "cache_mismatch";
        case Status::capacity: return "capacity";
        case Status::decode_failed: return "decode_failed";
    }
    return "unknown";
}

const char * dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32: return "f32";
        case DType::f16: return "f16";
        case DType::bf16: return "bf16";
    }
    return "unknown";
}

size_t dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

bool range_supported(const std::string & arch) { return kRangeArchs.count(arch) > 0; }

uint64_t prefix_hash(uint64_t h, const int32_t * tokens, size_t n) {
    constexpr uint64_t kFnvPrime = 0x100000001B3ull;
    for (size_t i = 0; i < n; ++i) {
        const uint32_t v = (uint32_t) tokens[i];
        for (int b = 0; b < 4; ++b) {
            h ^= (v >> (8 * b)) & 0xFF;
            h *= kFnvPrime;
        }
    }
    return h;
}

std::unique_ptr<ShardEngine> ShardEngine::open(const EngineOptions & options) {
    return std::make_unique<LlamaShardEngine>(options);
}

Vocabulary::Vocabulary(const std::string & model_path) {
    init_backend_once();
    check_gguf_file(model_path);
    probe_layers(model_path);  // the checks that keep llama.cpp's vocabulary load from aborting
    llama_model_params mparams = llama_model_default_params();
    mparams.vocab_only = true;
    model_ = llama_model_load_from_file(model_path.c_str(), mparams);
    if (model_ == nullptr) {
        throw ShardError(Status::load_failed, model_path + ": " + take_or("vocabulary load failed"));
    }
}

Vocabulary::~Vocabulary() { llama_model_free(model_); }

int32_t Vocabulary::n_vocab() const { return llama_vocab_n_tokens(llama_model_get_vocab(model_)); }

std::vector<int32_t> Vocabulary::tokenize(const std::string & text, bool add_special) const {
    return vocab_tokenize(model_, text, add_special);
}

std::string Vocabulary::detokenize(const std::vector<int32_t> & tokens) const { return vocab_detokenize(model_, tokens); }

bool Vocabulary::is_eog(int32_t token) const { return llama_vocab_is_eog(llama_model_get_vocab(model_), token); }

std::string Vocabulary::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                            bool add_assistant) const {
    return vocab_chat(model_, messages, add_assistant);
}

}  // namespace dgr
