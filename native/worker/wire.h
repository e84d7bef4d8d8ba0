// The one mapping between dgr.v1 wire types and the engine's, and the wire's checksums. (The
// prefix hash of a cache expectation is the engine's: dgr::prefix_hash.)
#pragma once

#include "dgr/shard_engine.h"
#include "dgr/v1/shard.pb.h"

#include <cstdint>
#include <optional>

namespace dgr::worker {

// dgr.v1.DType -> engine dtype; nullopt for DTYPE_UNSPECIFIED and unknown values
std::optional<dgr::DType> from_wire(int dtype);
dgr::v1::DType to_wire(dgr::DType dtype);

uint32_t crc32_of(const void * data, size_t size);

// a [rows, hc, n_embd] residual (or [1, 1, n_vocab] logits) as a wire Boundary with its CRC
void encode_boundary(dgr::v1::Boundary * out, dgr::DType dtype, uint32_t rows, uint32_t hc, uint32_t width,
                     const void * data, size_t size);

}  // namespace dgr::worker
