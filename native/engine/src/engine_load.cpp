// Loading a range: the GGUF checks and metadata probe before llama.cpp parses anything, llama.cpp's
// log captured for typed errors, the constructor, and the public free functions and Vocabulary.
#include "engine.h"

namespace dgr::detail {

const std::set<std::string> kRangeArchs = {"llama", "gemma3", "qwen2", "qwen3", "deepseek2", "deepseek4"};
// archs whose stages after the head take the residual through llama_dgr_set_boundary (patch 0004)
const std::set<std::string> kStagedBoundaryArchs = {"deepseek4"};
// architectures whose per-layer state beyond the KV cache (DeepSeek V4's compressors) cannot drop
// positions: they roll back only through llama.cpp's recurrent-state snapshots (n_rs_seq)
const std::set<std::string> kSnapshotStateArchs = {"deepseek4"};
// architectures whose rows round by their batch's shape (DeepSeek V4's attention and compressors):
// a suffix computed after a kept prefix does not give a full prefill's bits, so no session is kept
// for prefix reuse (measured on the V4 twin: same tokens, other logits)
const std::set<std::string> kBatchShapedArchs = {"deepseek4"};

// a GPU (discrete or integrated) among ggml's backend devices: what gpu_layers offloads to
bool has_device() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const auto type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) return true;
    }
    return false;
}

std::string range_archs() {
    std::string out;
    for (const auto & arch : kRangeArchs) out += (out.empty() ? "" : ", ") + arch;
    return out;
}

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
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
        throw ShardError(Status::load_failed, path + " is a directory, not a GGUF file");
    }
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

LlamaShardEngine::LlamaShardEngine(const EngineOptions & options) : options_(options) {
    init_backend_once();
    if (options.n_threads < 1 || options.n_ctx < 1 || options.n_batch < 1 || options.max_sessions < 1) {
        throw ShardError(Status::invalid_argument,
                         "n_threads, n_ctx, n_batch and max_sessions must be positive");
    }
    // one llama context holds every session's KV: n_ctx x max_sessions cells, a 32-bit count.
    // The product wrapped before (2**24 x 256 = 2**32 became 0, which llama.cpp takes as "the
    // model's training context"), and the engine reported contexts it did not have.
    const int64_t cells = (int64_t) options.n_ctx * options.max_sessions;
    if (cells > INT32_MAX) {
        throw ShardError(Status::invalid_argument,
                         "n_ctx " + std::to_string(options.n_ctx) + " x max_sessions " +
                             std::to_string(options.max_sessions) + " = " + std::to_string(cells) +
                             " KV cells: more than one llama.cpp context holds (2**31 - 1)");
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
    cparams.n_ctx = (uint32_t) cells;
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
    if ((int64_t) llama_n_ctx(ctx_) < cells) {  // what every session's n_ctx promises
        const uint32_t got = llama_n_ctx(ctx_);
        llama_free(ctx_);
        ctx_ = nullptr;
        llama_model_free(model_);
        model_ = nullptr;
        throw ShardError(Status::capacity, "asked for " + std::to_string(cells) + " KV cells, llama.cpp made " +
                                               std::to_string(got));
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
    have_process_cpus_ = sched_getaffinity(0, sizeof(process_cpus_), &process_cpus_) == 0;
    {
        const PinnedCaller loader({});  // the pool's priority is its threads', not the loader's
        if (ggml_threadpool * pool = pool_for(options.prio, {})) {
            llama_attach_threadpool(ctx_, pool, pool);
            if (mtp_) llama_attach_threadpool(mtp_, pool, pool);
            attached_ = pool;
            attached_prio_ = options.prio;
        }
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

LlamaShardEngine::~LlamaShardEngine() {
    if (mtp_) llama_free(mtp_);
    if (ctx_) llama_free(ctx_);
    pools_.clear();
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> LlamaShardEngine::tokenize(const std::string & text, bool add_special) const {
    return vocab_tokenize(model_, text, add_special);
}

std::string LlamaShardEngine::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                bool add_assistant) const {
    return vocab_chat(model_, messages, add_assistant);
}

}  // namespace dgr::detail

namespace dgr {

using detail::LlamaShardEngine;
using namespace detail;


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
