#include "wire.h"

#include <zlib.h>

namespace dgr::worker {

namespace {
struct DTypePair {
    dgr::v1::DType wire;
    dgr::DType engine;
};
constexpr DTypePair kDTypes[] = {
    {dgr::v1::DTYPE_F32, dgr::DType::f32},
    {dgr::v1::DTYPE_F16, dgr::DType::f16},
    {dgr::v1::DTYPE_BF16, dgr::DType::bf16},
};
}  // namespace

std::optional<dgr::DType> from_wire(int dtype) {
    for (const auto & p : kDTypes) {
        if (p.wire == dtype) return p.engine;
    }
    return std::nullopt;
}

dgr::v1::DType to_wire(dgr::DType dtype) {
    for (const auto & p : kDTypes) {
        if (p.engine == dtype) return p.wire;
    }
    return dgr::v1::DTYPE_UNSPECIFIED;
}

uint32_t crc32_of(const void * data, size_t size) {
    return (uint32_t) crc32(0L, (const Bytef *) data, (uInt) size);
}

void encode_boundary(dgr::v1::Boundary * out, dgr::DType dtype, uint32_t rows, uint32_t hc, uint32_t width,
                     const void * data, size_t size) {
    out->set_dtype(to_wire(dtype));
    out->clear_shape();
    out->add_shape(rows);
    out->add_shape(hc);
    out->add_shape(width);
    out->set_payload(data, size);
    out->set_crc32(crc32_of(data, size));
}

}  // namespace dgr::worker
