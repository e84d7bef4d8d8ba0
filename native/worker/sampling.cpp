#include "sampling.h"

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace dgr::worker {

namespace {
using SamplerPtr = std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)>;

SamplerPtr make_chain(const dgr::v1::Sampling & s, uint32_t seed) {
    SamplerPtr chain(llama_sampler_chain_init(llama_sampler_chain_default_params()), &llama_sampler_free);
    if (s.temperature() <= 0.0f) {
        llama_sampler_chain_add(chain.get(), llama_sampler_init_greedy());
        return chain;
    }
    if (s.top_k() > 0) llama_sampler_chain_add(chain.get(), llama_sampler_init_top_k((int32_t) s.top_k()));
    if (s.top_p() > 0.0f && s.top_p() < 1.0f) llama_sampler_chain_add(chain.get(), llama_sampler_init_top_p(s.top_p(), 1));
    llama_sampler_chain_add(chain.get(), llama_sampler_init_temp(s.temperature()));
    llama_sampler_chain_add(chain.get(), llama_sampler_init_dist(seed));
    return chain;
}

// exp(x) for x <= 0, branch-free and without a libm call, so that the compiler vectorizes the
// loop over a vocabulary (a scalar expf over 49k logits cost 0.3 ms per token at the tail, on the
// route's critical path; CMake compiles this file with -fno-trapping-math, which lets the clamp
// be a vector max). Cephes' polynomial on the range-reduced argument: relative error < 1e-7.
inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float t = x * 1.44269504f + 12582912.0f;  // 1.5 * 2^23: round(x / ln 2) in the low bits
    const float n = t - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t t_bits;
    std::memcpy(&t_bits, &t, sizeof(t_bits));
    const int32_t bits = (t_bits - 0x4B400000 + 127) << 23;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

// log(sum(exp(logits - max))), in lanes the compiler keeps in vector registers
float log_sum_exp_shifted(const float * logits, int32_t n, float max) {
    constexpr int kLanes = 16;
    float acc[kLanes] = {};
    int32_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) acc[k] += exp_nonpositive(logits[i + k] - max);
    }
    float sum = 0.0f;
    for (; i < n; ++i) sum += exp_nonpositive(logits[i] - max);
    for (float a : acc) sum += a;
    return std::log(sum);
}
}  // namespace

int32_t TailSampler::sample(const float * logits, int32_t n_vocab, const dgr::v1::Sampling & sampling, int32_t n_past,
                            float * logprob) {
    candidates_.resize((size_t) n_vocab);
    float max = logits[0];
    for (int32_t i = 0; i < n_vocab; ++i) {
        candidates_[(size_t) i] = llama_token_data{i, logits[i], 0.0f};
        max = std::max(max, logits[i]);
    }
    llama_token_data_array cur = {candidates_.data(), candidates_.size(), -1, false};
    const uint64_t mixed = sampling.seed() ^ ((uint64_t) n_past * 0x9E3779B97F4A7C15ull);
    SamplerPtr chain = make_chain(sampling, (uint32_t) (mixed ^ (mixed >> 32)));
    llama_sampler_apply(chain.get(), &cur);
    const int32_t token = cur.data[cur.selected].id;
    // log-softmax of the pick over the raw logits
    *logprob = logits[token] - max - log_sum_exp_shifted(logits, n_vocab, max);
    return token;
}

}  // namespace dgr::worker
