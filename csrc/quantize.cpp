// CPU kernels of int8 with a float32 scale per chunk (quantize.h): each chunk is a unit of work,
// quantized in two passes over its values (the largest magnitude, then the levels), with OpenMP
// threads over the chunks of large buckets.
#include "quantize.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace mpidist {
namespace cpu {
namespace {

// Independent accumulators, so that the compiler keeps the largest-magnitude pass in vector
// registers: a maximum is exact in any order, so the lanes change nothing in the result.
constexpr std::size_t kLanes = 16;
// Below this many elements in all, one thread is faster than waking a team.
constexpr std::size_t kParallelElements = std::size_t(1) << 16;

// x rounded to the nearest whole number, ties to even, for |x| <= 127: adding and subtracting
// 1.5 * 2^(mantissa bits) leaves the rounded value in the default rounding mode, and vectorizes
// where std::nearbyint is a library call.
inline float round_even(float x) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return (x + magic) - magic;
}
inline double round_even(double x) {
    const double magic = 6755399441055744.0;  // 1.5 * 2^52
    return (x + magic) - magic;
}

// The largest |value(i)| for i < len; NaN when a value is NaN or infinite (v - v is 0 only for
// finite v).
template <typename T, typename Value>
T largest_magnitude(std::size_t len, Value value) {
    T largest[kLanes] = {}, poison[kLanes] = {};
    std::size_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
        for (std::size_t lane = 0; lane < kLanes; ++lane) {
            const T v = value(i + lane);
            const T magnitude = std::fabs(v);
            largest[lane] = magnitude > largest[lane] ? magnitude : largest[lane];
            poison[lane] += v - v;
        }
    }
    for (; i < len; ++i) {
        const T v = value(i);
        largest[0] = std::fabs(v) > largest[0] ? std::fabs(v) : largest[0];
        poison[0] += v - v;
    }
    T result = 0, bad = 0;
    for (std::size_t lane = 0; lane < kLanes; ++lane) {
        result = largest[lane] > result ? largest[lane] : result;
        bad += poison[lane];
    }
    return bad == 0 ? result : std::numeric_limits<T>::quiet_NaN();
}

// Quantizes value(i) for i < len into levels[i], calls sent(i, level * scale) for each, and
// returns the chunk's scale (the padding past len, zero, changes neither the scale nor a level).
template <typename T, typename Value, typename Sent>
float quantize_chunk(std::size_t len, Value value, std::int8_t* levels, Sent sent) {
    const T largest = largest_magnitude<T>(len, value);
    const float scale = static_cast<float>(largest / T(127));
    if (std::isnan(scale)) {
        for (std::size_t i = 0; i < len; ++i) {
            levels[i] = 0;
            sent(i, T(0) * T(scale));
        }
        return scale;
    }
    const T divisor = scale > 0 ? T(scale) : T(1);
    const T step = T(scale);
    for (std::size_t i = 0; i < len; ++i) {
        // Clamping before rounding is the same as after: the bounds are whole numbers.
        const T level = round_even(std::min(std::max(value(i) / divisor, T(-127)), T(127)));
        levels[i] = static_cast<std::int8_t>(level);
        sent(i, level * step);
    }
    return scale;
}

// Elements of part `row` inside the bucket: part elements, fewer for the last, none past it.
std::size_t part_length(std::size_t row, std::size_t part, std::size_t n) {
    return n > row * part ? std::min(part, n - row * part) : 0;
}

float scale_at(const std::uint8_t* row, std::size_t part, std::size_t c) {
    float scale;
    std::memcpy(&scale, row + part + 4 * c, sizeof scale);
    return scale;
}

void check(std::size_t part, std::size_t chunk) {
    if (part == 0 || chunk == 0) throw std::invalid_argument("int8 kernels need part >= 1 and chunk >= 1");
}

template <typename Unit>
void for_each_unit(std::size_t units, std::size_t elements, Unit unit) {
    const int threads = elements >= kParallelElements ? get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long u = 0; u < (long)units; ++u) unit((std::size_t)u);
}

template <typename T>
void quantize(const T* grad, T* residual, std::size_t n, std::size_t rows, std::size_t part, std::size_t chunk,
              std::uint8_t* payload) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    for_each_unit(rows * chunks, n, [&](std::size_t unit) {
        const std::size_t row = unit / chunks, c = unit % chunks;
        const std::size_t begin = c * chunk, end = std::min(begin + chunk, part);
        const std::size_t valid = std::min(end, std::max(begin, part_length(row, part, n))) - begin;
        const T* g = grad + row * part + begin;
        T* r = residual + row * part + begin;
        std::uint8_t* out = payload + row * row_bytes;
        auto levels = reinterpret_cast<std::int8_t*>(out + begin);
        const float scale = quantize_chunk<T>(valid, [&](std::size_t i) { return g[i] + r[i]; }, levels,
                                              [&](std::size_t i, T sent) { r[i] = (g[i] + r[i]) - sent; });
        std::memset(levels + valid, 0, end - begin - valid);
        std::memcpy(out + part + 4 * c, &scale, sizeof scale);
    });
}

template <typename T>
void sum_requantize(const std::uint8_t* received, std::size_t rows, std::size_t part, std::size_t chunk,
                    T* residual, std::size_t residual_len, std::uint8_t* out) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    const int threads = rows * part >= kParallelElements ? get_num_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<T> total(chunk);
#pragma omp for schedule(static)
        for (long u = 0; u < (long)chunks; ++u) {
            const std::size_t c = (std::size_t)u, begin = c * chunk, len = std::min(begin + chunk, part) - begin;
            std::fill(total.begin(), total.begin() + len, T(0));
            for (std::size_t row = 0; row < rows; ++row) {  // in rank order
                const std::uint8_t* from = received + row * row_bytes;
                const auto levels = reinterpret_cast<const std::int8_t*>(from + begin);
                const T scale = T(scale_at(from, part, c));
                for (std::size_t i = 0; i < len; ++i) total[i] += T(levels[i]) * scale;
            }
            const std::size_t own = std::min(len, std::max(begin, residual_len) - begin);
            const float scale = quantize_chunk<T>(len, [&](std::size_t i) { return total[i]; },
                                                  reinterpret_cast<std::int8_t*>(out + begin),
                                                  [&](std::size_t i, T sent) {
                                                      if (i < own) residual[begin + i] += total[i] - sent;
                                                  });
            std::memcpy(out + part + 4 * c, &scale, sizeof scale);
        }
    }
}

template <typename T>
void dequantize(const std::uint8_t* payload, std::size_t rows, std::size_t part, std::size_t chunk, T* flat,
                std::size_t n) {
    const std::size_t chunks = (part + chunk - 1) / chunk, row_bytes = int8_row_bytes(part, chunk);
    for_each_unit(rows * chunks, n, [&](std::size_t unit) {
        const std::size_t row = unit / chunks, c = unit % chunks;
        const std::size_t begin = c * chunk, end = std::min(begin + chunk, part);
        const std::size_t valid = std::min(end, std::max(begin, part_length(row, part, n))) - begin;
        const std::uint8_t* from = payload + row * row_bytes;
        const auto levels = reinterpret_cast<const std::int8_t*>(from + begin);
        const T scale = T(scale_at(from, part, c));
        T* to = flat + row * part + begin;
        for (std::size_t i = 0; i < valid; ++i) to[i] = T(levels[i]) * scale;
    });
}

void check_dtype(DType dtype) {
    if (dtype != DType::float32 && dtype != DType::float64)
        throw std::invalid_argument(std::string("int8 kernels compute in float32 or float64, not ") +
                                    dtype_name(dtype));
}

}  // namespace

std::size_t int8_row_bytes(std::size_t part, std::size_t chunk) { return part + 4 * ((part + chunk - 1) / chunk); }

void int8_quantize(DType dtype, const void* grad, void* residual, std::size_t n, std::size_t rows, std::size_t part,
                   std::size_t chunk, std::uint8_t* payload) {
    check(part, chunk);
    check_dtype(dtype);
    if (rows * part < n) throw std::invalid_argument("int8_quantize: rows x part is smaller than the bucket");
    if (dtype == DType::float32)
        quantize(static_cast<const float*>(grad), static_cast<float*>(residual), n, rows, part, chunk, payload);
    else
        quantize(static_cast<const double*>(grad), static_cast<double*>(residual), n, rows, part, chunk, payload);
}

void int8_sum_requantize(DType dtype, const std::uint8_t* received, std::size_t rows, std::size_t part,
                         std::size_t chunk, void* residual, std::size_t residual_len, std::uint8_t* out) {
    check(part, chunk);
    check_dtype(dtype);
    if (residual_len > part) throw std::invalid_argument("int8_sum_requantize: the residual is longer than a part");
    if (dtype == DType::float32)
        sum_requantize(received, rows, part, chunk, static_cast<float*>(residual), residual_len, out);
    else
        sum_requantize(received, rows, part, chunk, static_cast<double*>(residual), residual_len, out);
}

void int8_dequantize(DType dtype, const std::uint8_t* payload, std::size_t rows, std::size_t part, std::size_t chunk,
                     void* flat, std::size_t n) {
    check(part, chunk);
    check_dtype(dtype);
    if (rows * part < n) throw std::invalid_argument("int8_dequantize: rows x part is smaller than the bucket");
    if (dtype == DType::float32)
        dequantize(payload, rows, part, chunk, static_cast<float*>(flat), n);
    else
        dequantize(payload, rows, part, chunk, static_cast<double*>(flat), n);
}

}  // namespace cpu
}  // namespace mpidist
