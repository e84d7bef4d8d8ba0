#include "sampling.h"

#include "llama.h"

#include <cmath>
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
}  // namespace

int32_t TailSampler::sample(const float * logits, int32_t n_vocab, const dgr::v1::Sampling & sampling, int32_t n_past,
                            float * logprob) {
    candidates_.resize((size_t) n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) candidates_[(size_t) i] = llama_token_data{i, logits[i], 0.0f};
    llama_token_data_array cur = {candidates_.data(), candidates_.size(), -1, false};
    const uint64_t mixed = sampling.seed() ^ ((uint64_t) n_past * 0x9E3779B97F4A7C15ull);
    SamplerPtr chain = make_chain(sampling, (uint32_t) (mixed ^ (mixed >> 32)));
    llama_sampler_apply(chain.get(), &cur);
    const int32_t token = cur.data[cur.selected].id;
    // log-softmax of the pick over the raw logits
    float max = logits[0];
    for (int32_t i = 1; i < n_vocab; ++i) max = std::max(max, logits[i]);
    float sum = 0.0f;
    for (int32_t i = 0; i < n_vocab; ++i) sum += std::exp(logits[i] - max);
    *logprob = logits[token] - max - std::log(sum);
    return token;
}

}  // namespace dgr::worker
