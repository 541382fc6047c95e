// Int8 with one float32 scale per chunk: the CPU kernels of the int8 gradient compressor
// (mpidist/parallel/int8_parts.py), each one pass over memory where the compressor's torch
// operations make about ten.
//
// A bucket of n elements is cut into `rows` parts of `part` elements (the last ones shorter, or
// empty), each part into chunks of `chunk` elements. A part travels as one payload row of
// int8_row_bytes(part, chunk) bytes: its `part` int8 values (zero past the bucket's end), then
// its chunks' float32 scales, unaligned.
//
// A chunk of values v is quantized as: scale = float(max |v| / 127); level = v / d rounded to
// nearest even and clamped to [-127, 127], where d is the scale (1 when the scale is 0); what it
// sends is level * scale. T (float or double) is the dtype of every step, each step rounded once
// (no fused multiply-add), so the results are bit for bit those of the torch operations, on any
// thread count. A chunk holding a NaN or an infinity gets the scale NaN and levels 0: its values
// come out NaN wherever they are summed, as an uncompressed all-reduce's would.
#pragma once

#include <cstddef>
#include <cstdint>

#include "reduce.h"

namespace mpidist {
namespace cpu {

std::size_t int8_row_bytes(std::size_t part, std::size_t chunk);

// Quantizes v = grad + residual into `rows` payload rows and leaves residual = v - sent.
void int8_quantize(DType dtype, const void* grad, void* residual, std::size_t n, std::size_t rows,
                   std::size_t part, std::size_t chunk, std::uint8_t* payload);

// One part's sum: total = the `rows` received payload rows' values times their scales, summed in
// row order starting from 0; writes total's quantized row to `out` and adds total - sent to the
// first `residual_len` (<= part) elements of `residual`.
void int8_sum_requantize(DType dtype, const std::uint8_t* received, std::size_t rows, std::size_t part,
                         std::size_t chunk, void* residual, std::size_t residual_len, std::uint8_t* out);

// flat[r * part + j] = row r's value j times its scale, for every element inside the bucket's n.
void int8_dequantize(DType dtype, const std::uint8_t* payload, std::size_t rows, std::size_t part,
                     std::size_t chunk, void* flat, std::size_t n);

}  // namespace cpu
}  // namespace mpidist
