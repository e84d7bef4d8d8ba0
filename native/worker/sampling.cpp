#include "sampling.h"

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace dgr::worker {

namespace {
using SamplerPtr = std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)>;

// the chain of a sampled (temperature > 0) step; greedy steps take first_argmax instead
SamplerPtr make_chain(const dgr::v1::Sampling & s, uint32_t seed) {
    SamplerPtr chain(llama_sampler_chain_init(llama_sampler_chain_default_params()), &llama_sampler_free);
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

// log(sum(exp(logits - max))), in lanes the compiler keeps in vector registers; cloned for AVX2
// and AVX-512, chosen at load time (ifunc), since the baseline build is SSE2 only: 49k logits
// took 58 us per token at the tail in SSE2, on the route's critical path
__attribute__((target_clones("avx512f", "avx2", "default"))) float log_sum_exp_shifted(const float * logits,
                                                                                         int32_t n, float max) {
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

// the token llama_sampler_init_greedy picks: the first of the largest logits (index 0 when logit
// 0 is NaN, as its strict comparisons go), found without the sampler chain's 49k-entry candidate
// array (filling it and scanning it again cost 70 us per token at the tail, a scalar scan 38):
// each lane keeps its largest logit and where it first came, cloned per ISA as above
__attribute__((target_clones("avx512f", "avx2", "default"))) int32_t first_argmax(const float * logits, int32_t n) {
    if (std::isnan(logits[0])) return 0;
    constexpr int kLanes = 16;
    float best[kLanes];
    int32_t at[kLanes];
    for (int k = 0; k < kLanes; ++k) {
        best[k] = -INFINITY;
        at[k] = -1;  // nothing above -inf yet
    }
    int32_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
            const bool up = logits[i + k] > best[k];
            best[k] = up ? logits[i + k] : best[k];
            at[k] = up ? i + k : at[k];
        }
    }
    int32_t pick = 0;  // where the greedy sampler starts
    for (int k = 0; k < kLanes; ++k) {
        if (at[k] >= 0 && (best[k] > logits[pick] || (best[k] == logits[pick] && at[k] < pick))) pick = at[k];
    }
    for (; i < n; ++i) {
        if (logits[i] > logits[pick]) pick = i;
    }
    return pick;
}
}  // namespace

int32_t TailSampler::sample(const float * logits, int32_t n_vocab, const dgr::v1::Sampling & sampling, int32_t n_past,
                            float * logprob) {
    int32_t token = 0;
    float max = 0.0f;
    if (sampling.temperature() <= 0.0f) {
        // greedy: the chain would hold the greedy sampler alone (make_chain), which picks this
        token = first_argmax(logits, n_vocab);
        max = logits[token];
    } else {
        candidates_.resize((size_t) n_vocab);
        max = logits[0];
        for (int32_t i = 0; i < n_vocab; ++i) {
            candidates_[(size_t) i] = llama_token_data{i, logits[i], 0.0f};
            max = std::max(max, logits[i]);
        }
        llama_token_data_array cur = {candidates_.data(), candidates_.size(), -1, false};
        const uint64_t mixed = sampling.seed() ^ ((uint64_t) n_past * 0x9E3779B97F4A7C15ull);
        SamplerPtr chain = make_chain(sampling, (uint32_t) (mixed ^ (mixed >> 32)));
        llama_sampler_apply(chain.get(), &cur);
        token = cur.data[cur.selected].id;
    }
    // log-softmax of the pick over the raw logits
    *logprob = logits[token] - max - log_sum_exp_shifted(logits, n_vocab, max);
    return token;
}

}  // namespace dgr::worker
