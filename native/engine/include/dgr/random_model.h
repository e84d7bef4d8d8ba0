// Random-weight GGUFs through llama.cpp's own loader and saver (llama_model_init_from_user +
// llama_model_save_to_file): the architecture's real tensor set and shapes, deterministic weights.
// DGR uses it for twins of models whose weights cannot be had here (DeepSeek V4).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace dgr {

struct RandomModelSpec {
    std::string metadata_path;  // a GGUF holding the architecture's key/values and no tensors
    std::string out_path;
    uint64_t seed = 0;
    float stdev = 0.1f;
    // storage type per tensor name ("f16", "i32"); every other tensor is f32. An i32 tensor holds
    // expert ids: each row gets distinct ids in [0, n_expert) (hash-routing tables).
    std::map<std::string, std::string> tensor_types;
};

// Throws ShardError(load_failed) when llama.cpp cannot build the model from the metadata.
void generate_random_model(const RandomModelSpec & spec);

}  // namespace dgr
