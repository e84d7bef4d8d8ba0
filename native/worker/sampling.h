// Token choice at the tail: llama.cpp's own sampler chain (llama_sampler) over the logits the
// engine returned. Each step is seeded from (seed, n_past), so a session re-prefilled on another
// route draws the same tokens it would have drawn on the first.
#pragma once

#include "dgr/v1/shard.pb.h"
#include "llama.h"

#include <cstdint>
#include <vector>

namespace dgr::worker {

class TailSampler {
public:
    // sampling must have passed validate_sampling; returns the token and its log-probability
    // under the full temperature-1 distribution
    int32_t sample(const float * logits, int32_t n_vocab, const dgr::v1::Sampling & sampling, int32_t n_past,
                   float * logprob);

private:
    std::vector<llama_token_data> candidates_;
};

}  // namespace dgr::worker
