// Random-weight GGUFs (see include/dgr/random_model.h).
#include "dgr/random_model.h"

#include "dgr/shard_engine.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace dgr {

namespace {

struct FillParams {
    uint64_t seed;
    float stdev;
    int64_t n_expert;
};

uint64_t fnv1a(const char * s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; ++s) {
        h = (h ^ (uint8_t) *s) * 0x100000001b3ull;
    }
    return h;
}

// one stream per tensor (seed ^ name hash), independent of creation order; Box-Muller over the
// generator's raw bits so the values do not depend on the standard library's distributions
class Normal {
public:
    Normal(uint64_t seed, float stdev) : gen_(seed), stdev_(stdev) {}
    float next() {
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        const double u1 = ((gen_() >> 11) + 1) * 0x1.0p-53;
        const double u2 = (gen_() >> 11) * 0x1.0p-53;
        const double r = std::sqrt(-2.0 * std::log(u1)) * stdev_;
        spare_ = (float) (r * std::sin(2.0 * M_PI * u2));
        has_spare_ = true;
        return (float) (r * std::cos(2.0 * M_PI * u2));
    }
    uint64_t bits() { return gen_(); }

private:
    std::mt19937_64 gen_;
    double stdev_;
    float spare_ = 0;
    bool has_spare_ = false;
};

void fill_tensor(ggml_tensor * t, void * userdata) {
    const FillParams & p = *static_cast<const FillParams *>(userdata);
    Normal rng(p.seed ^ fnv1a(t->name), p.stdev);
    const int64_t n = ggml_nelements(t);
    switch (t->type) {
        case GGML_TYPE_F32: {
            std::vector<float> v((size_t) n);
            for (auto & x : v) x = rng.next();
            ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
            break;
        }
        case GGML_TYPE_F16: {
            std::vector<ggml_fp16_t> v((size_t) n);
            for (auto & x : v) x = ggml_fp32_to_fp16(rng.next());
            ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
            break;
        }
        case GGML_TYPE_I32: {
            // rows of distinct expert ids (a partial Fisher-Yates shuffle per row)
            const int64_t row = t->ne[0];
            std::vector<int32_t> v((size_t) n);
            std::vector<int32_t> perm((size_t) p.n_expert);
            for (int64_t r = 0; r < n / row; ++r) {
                for (int64_t e = 0; e < p.n_expert; ++e) perm[(size_t) e] = (int32_t) e;
                for (int64_t i = 0; i < row; ++i) {
                    const int64_t j = i + (int64_t) (rng.bits() % (uint64_t) (p.n_expert - i));
                    std::swap(perm[(size_t) i], perm[(size_t) j]);
                    v[(size_t) (r * row + i)] = perm[(size_t) i];
                }
            }
            ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
            break;
        }
        default:
            // the loader only creates the types named in the spec; anything else is a bug here
            GGML_ABORT("random_model: unexpected tensor type %s for %s", ggml_type_name(t->type), t->name);
    }
}


ggml_type parse_type(const std::string & name, const std::string & tensor) {
    if (name == "f32") return GGML_TYPE_F32;
    if (name == "f16") return GGML_TYPE_F16;
    if (name == "i32") return GGML_TYPE_I32;
    throw ShardError(Status::invalid_argument, "tensor " + tensor + ": storage type '" + name + "' is not f32, f16 or i32");
}


// llama.cpp narrates every tensor it creates; keep its errors only, for the duration of one call
class QuietLog {
public:
    QuietLog() {
        llama_log_get(&callback_, &user_data_);
        llama_log_set(
            [](ggml_log_level level, const char * text, void *) {
                if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
            },
            nullptr);
    }
    ~QuietLog() { llama_log_set(callback_, user_data_); }

private:
    ggml_log_callback callback_ = nullptr;
    void * user_data_ = nullptr;
};

}  // namespace

void generate_random_model(const RandomModelSpec & spec) {
    llama_backend_init();
    QuietLog quiet;
    gguf_init_params gparams = {/*.no_alloc =*/ true, /*.ctx =*/ nullptr};
    std::unique_ptr<gguf_context, decltype(&gguf_free)> meta(gguf_init_from_file(spec.metadata_path.c_str(), gparams),
                                                             gguf_free);
    if (!meta) {
        throw ShardError(Status::load_failed, spec.metadata_path + ": not a readable GGUF");
    }
    if (gguf_get_n_tensors(meta.get()) != 0) {
        throw ShardError(Status::invalid_argument, spec.metadata_path + ": metadata GGUF must hold no tensors");
    }
    const int64_t arch_key = gguf_find_key(meta.get(), "general.architecture");
    if (arch_key < 0) {
        throw ShardError(Status::invalid_argument, spec.metadata_path + ": no general.architecture");
    }
    const std::string arch = gguf_get_val_str(meta.get(), arch_key);
    const int64_t experts_key = gguf_find_key(meta.get(), (arch + ".expert_count").c_str());
    FillParams fill{spec.seed, spec.stdev, experts_key < 0 ? 0 : (int64_t) gguf_get_val_u32(meta.get(), experts_key)};

    // the loader reads only a tensor's type from the metadata (shapes come from the arch)
    for (const auto & [name, type] : spec.tensor_types) {
        ggml_tensor t;
        std::memset(&t, 0, sizeof(t));
        t.type = parse_type(type, name);
        t.ne[0] = ggml_blck_size(t.type);
        t.ne[1] = t.ne[2] = t.ne[3] = 1;
        if (name.size() >= sizeof(t.name)) {
            throw ShardError(Status::invalid_argument, "tensor name too long: " + name);
        }
        std::strncpy(t.name, name.c_str(), sizeof(t.name) - 1);
        if (t.type == GGML_TYPE_I32 && fill.n_expert <= 0) {
            throw ShardError(Status::invalid_argument, "i32 expert-id tensor " + name + " needs " + arch + ".expert_count");
        }
        gguf_add_tensor(meta.get(), &t);
    }

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.load_mtp = true;  // a twin carries the MTP block like the real model
    llama_model * model = llama_model_init_from_user(meta.get(), fill_tensor, &fill, mparams);
    if (model == nullptr) {
        throw ShardError(Status::load_failed, "llama.cpp could not build a " + arch + " model from " + spec.metadata_path);
    }
    llama_model_save_to_file(model, spec.out_path.c_str());
    llama_model_free(model);
}

}  // namespace dgr
