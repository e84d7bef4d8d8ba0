// libFuzzer harness over the range-ownership load: the input's first byte picks a layer range,
// the rest is written out as a GGUF file and opened by ShardEngine::open, which loads only the
// owned layers through the patched llama.cpp (patches 0001+) and creates a context over them, then
// as a vocabulary-only load (dgr::Vocabulary, the client tokenizer). A
// file it cannot serve must be refused with a ShardError; anything else (a crash, an abort, an
// exception of another type, a sanitizer report) is a finding. Seeds: small random-weight models
// of the architectures range ownership supports, whole and truncated.
#include "dgr/shard_engine.h"

#include "llama.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

void quiet(ggml_log_level, const char *, void *) {}

std::string g_path;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    const char * dir = std::getenv("TMPDIR");
    g_path = std::string(dir ? dir : "/tmp") + "/dgr-fuzz-gguf-" + std::to_string(getpid()) + ".gguf";
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 1) return -1;
    // the range: whole model, a head, a middle, a tail, or nonsense the engine must refuse
    static const int32_t kRanges[][2] = {{0, -1}, {0, 1}, {1, 2}, {1, -1}, {2, 1}, {-1, 3}, {0, 1000}};
    const auto & range = kRanges[data[0] % (sizeof(kRanges) / sizeof(kRanges[0]))];
    FILE * f = std::fopen(g_path.c_str(), "wb");
    if (f == nullptr) return 0;
    std::fwrite(data + 1, 1, size - 1, f);
    std::fclose(f);
    dgr::EngineOptions o;
    o.model_path = g_path;
    o.layer_first = range[0];
    o.layer_last = range[1];
    o.n_threads = 1;
    o.n_ctx = 16;
    o.n_batch = 8;
    o.max_sessions = 1;
    try {
        auto engine = dgr::ShardEngine::open(o);
        (void) engine->describe();
    } catch (const dgr::ShardError &) {
        // refused with a typed error: what a worker reports and exits on
    }
    try {
        dgr::Vocabulary vocab(g_path);  // the tokenizer a client loads from the same kind of file
        (void) vocab.detokenize(vocab.tokenize("fuzz", true));
    } catch (const dgr::ShardError &) {
    }
    std::remove(g_path.c_str());
    return 0;
}
