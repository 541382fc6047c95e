// CPU kernels of int8 with a float32 scale per chunk (quantize.h): each chunk is a unit of work,
// run by the loops of quantize_loops.h compiled for the instruction set the reduction loops run
// (reduce.h's cpu::isa), with OpenMP threads over the chunks of large buckets.
#include "quantize.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpidist {
namespace cpu {
namespace {

struct Int8Loops {
    float (*quantize_f32)(const float*, float*, std::size_t, std::size_t, std::int8_t*);
    float (*quantize_f64)(const double*, double*, std::size_t, std::size_t, std::int8_t*);
    float (*sum_f32)(const std::uint8_t*, std::size_t, std::size_t, std::size_t, std::size_t, float*, float*,
                     std::size_t, std::int8_t*);
    float (*sum_f64)(const std::uint8_t*, std::size_t, std::size_t, std::size_t, std::size_t, double*, double*,
                     std::size_t, std::int8_t*);
    void (*dequantize_f32)(const std::int8_t*, float, float*, std::size_t);
    void (*dequantize_f64)(const std::int8_t*, float, double*, std::size_t);
};

namespace baseline {
#include "quantize_loops.h"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
#define MPIDIST_HAVE_X86_INT8_LOOPS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "quantize_loops.h"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#include "quantize_loops.h"
}  // namespace avx512
#pragma GCC pop_options
#endif

// The copy of the loops for the instruction set the reduction loops run (set_isa included).
const Int8Loops& loops() {
#ifdef MPIDIST_HAVE_X86_INT8_LOOPS
    const std::string chosen = isa();
    if (chosen == "avx512") return avx512::kInt8Loops;
    if (chosen == "avx2") return avx2::kInt8Loops;
#endif
    return baseline::kInt8Loops;
}

// Below this many elements in all, one thread is faster than waking a team.
constexpr std::size_t kParallelElements = std::size_t(1) << 16;

template <typename Unit>
void for_each_unit(std::size_t units, std::size_t elements, Unit unit) {
    const int threads = elements >= kParallelElements ? get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long u = 0; u < (long)units; ++u) unit((std::size_t)u);
}

// Where chunk c of part `row` lies: its first element within the part, its length, and how many
// of its elements are inside the bucket of n (none past the bucket's end).
struct ChunkSpan {
    std::size_t begin, len, valid;
};

ChunkSpan span(std::size_t row, std::size_t c, std::size_t part, std::size_t chunk, std::size_t n) {
    const std::size_t begin = c * chunk, end = std::min(begin + chunk, part);
    const std::size_t inside = n > row * part ? std::min(part, n - row * part) : 0;
    return {begin, end - begin, std::min(end, std::max(begin, inside)) - begin};
}

template <typename T, typename Quantize>
void quantize(Quantize unit_loop, const T* grad, T* residual, std::size_t n, std::size_t rows, std::size_t part,
              std::size_t chunk, std::uint8_t* payload) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    for_each_unit(rows * chunks, n, [&](std::size_t unit) {
        const std::size_t row = unit / chunks, c = unit % chunks;
        const ChunkSpan at = span(row, c, part, chunk, n);
        std::uint8_t* out = payload + row * row_bytes;
        const std::size_t offset = row * part + at.begin;
        const float scale = unit_loop(grad + offset, residual + offset, at.valid, at.len,
                                      reinterpret_cast<std::int8_t*>(out + at.begin));
        std::memcpy(out + part + 4 * c, &scale, sizeof scale);
    });
}

template <typename T, typename Sum>
void sum_requantize(Sum unit_loop, const std::uint8_t* received, std::size_t rows, std::size_t part,
                    std::size_t chunk, T* residual, std::size_t residual_len, std::uint8_t* out) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    const int threads = rows * part >= kParallelElements ? get_num_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> total(chunk);
#pragma omp for schedule(static)
        for (long u = 0; u < (long)chunks; ++u) {
            const std::size_t c = (std::size_t)u;
            const ChunkSpan at = span(0, c, part, chunk, part);
            const std::size_t own = std::min(at.len, std::max(at.begin, residual_len) - at.begin);
            const float scale =
                unit_loop(received + at.begin, rows, row_bytes, part + 4 * c - at.begin, at.len, total.data(),
                          residual + at.begin, own, reinterpret_cast<std::int8_t*>(out + at.begin));
            std::memcpy(out + part + 4 * c, &scale, sizeof scale);
        }
    }
}

template <typename T, typename Dequantize>
void dequantize(Dequantize unit_loop, const std::uint8_t* payload, std::size_t rows, std::size_t part,
                std::size_t chunk, T* flat, std::size_t n) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    for_each_unit(rows * chunks, n, [&](std::size_t unit) {
        const std::size_t row = unit / chunks, c = unit % chunks;
        const ChunkSpan at = span(row, c, part, chunk, n);
        const std::uint8_t* from = payload + row * row_bytes;
        float scale;
        std::memcpy(&scale, from + part + 4 * c, sizeof scale);
        unit_loop(reinterpret_cast<const std::int8_t*>(from + at.begin), scale, flat + row * part + at.begin,
                  at.valid);
    });
}

void check(DType dtype, std::size_t part, std::size_t chunk) {
    if (part == 0 || chunk == 0) throw std::invalid_argument("int8 kernels need part >= 1 and chunk >= 1");
    if (dtype != DType::float32 && dtype != DType::float64)
        throw std::invalid_argument(std::string("int8 kernels compute in float32 or float64, not ") +
                                    dtype_name(dtype));
}

}  // namespace

std::size_t int8_row_bytes(std::size_t part, std::size_t chunk) { return part + 4 * ((part + chunk - 1) / chunk); }

void int8_quantize(DType dtype, const void* grad, void* residual, std::size_t n, std::size_t rows, std::size_t part,
                   std::size_t chunk, std::uint8_t* payload) {
    check(dtype, part, chunk);
    if (rows * part < n) throw std::invalid_argument("int8_quantize: rows x part is smaller than the bucket");
    if (dtype == DType::float32)
        quantize(loops().quantize_f32, static_cast<const float*>(grad), static_cast<float*>(residual), n, rows, part,
                 chunk, payload);
    else
        quantize(loops().quantize_f64, static_cast<const double*>(grad), static_cast<double*>(residual), n, rows,
                 part, chunk, payload);
}

void int8_sum_requantize(DType dtype, const std::uint8_t* received, std::size_t rows, std::size_t part,
                         std::size_t chunk, void* residual, std::size_t residual_len, std::uint8_t* out) {
    check(dtype, part, chunk);
    if (residual_len > part) throw std::invalid_argument("int8_sum_requantize: the residual is longer than a part");
    if (dtype == DType::float32)
        sum_requantize(loops().sum_f32, received, rows, part, chunk, static_cast<float*>(residual), residual_len, out);
    else
        sum_requantize(loops().sum_f64, received, rows, part, chunk, static_cast<double*>(residual), residual_len,
                       out);
}

void int8_dequantize(DType dtype, const std::uint8_t* payload, std::size_t rows, std::size_t part, std::size_t chunk,
                     void* flat, std::size_t n) {
    check(dtype, part, chunk);
    if (rows * part < n) throw std::invalid_argument("int8_dequantize: rows x part is smaller than the bucket");
    if (dtype == DType::float32)
        dequantize(loops().dequantize_f32, payload, rows, part, chunk, static_cast<float*>(flat), n);
    else
        dequantize(loops().dequantize_f64, payload, rows, part, chunk, static_cast<double*>(flat), n);
}

}  // namespace cpu
}  // namespace mpidist
