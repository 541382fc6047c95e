// Element loops of the int8 kernels (quantize.h), written so that GCC vectorizes them.
//
// No include guard on purpose: quantize.cpp includes this file once per instruction set, each time
// inside its own namespace and `#pragma GCC target` region, as reduce.cpp does with
// reduce_loops.h, and picks the copy of the instruction set the reduction loops run. It relies on
// quantize.cpp for <algorithm>, <cmath>, <cstdint>, <cstring>, <limits> and the Int8Loops table.

// x rounded to the nearest whole number, ties to even, for |x| <= 127: adding and subtracting
// 1.5 * 2^(mantissa bits) leaves the rounded value in the default rounding mode, and vectorizes
// where std::nearbyint is a library call.
static inline float round_even(float x) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return (x + magic) - magic;
}
static inline double round_even(double x) {
    const double magic = 6755399441055744.0;  // 1.5 * 2^52
    return (x + magic) - magic;
}

// Quantizes values[0, len) into levels, leaves in values what was not sent (each value less
// its level times the scale) and returns the scale.
template <typename T>
static inline float quantize_values(T* __restrict values, std::size_t len, std::int8_t* __restrict levels) {
    // The largest magnitude; `poison` stays 0 unless a value is NaN or infinite (v - v is 0 only
    // for finite v). A maximum, and a sum of zeros and NaNs, come out the same in any order: so
    // the loop may run in vector lanes.
    T largest = 0, poison = 0;
#pragma omp simd reduction(max : largest) reduction(+ : poison)
    for (std::size_t i = 0; i < len; ++i) {
        largest = std::max(largest, std::fabs(values[i]));
        poison += values[i] - values[i];
    }
    if (poison != 0) {
        for (std::size_t i = 0; i < len; ++i) {
            levels[i] = 0;
            values[i] = std::numeric_limits<T>::quiet_NaN();
        }
        return std::numeric_limits<float>::quiet_NaN();
    }
    const float scale = static_cast<float>(largest / T(127));
    const T divisor = scale > 0 ? T(scale) : T(1);
    const T step = T(scale);
    for (std::size_t i = 0; i < len; ++i) {
        // Clamping before rounding is the same as after: the bounds are whole numbers.
        const T level = round_even(std::min(std::max(values[i] / divisor, T(-127)), T(127)));
        levels[i] = static_cast<std::int8_t>(level);
        values[i] = values[i] - level * step;
    }
    return scale;
}

// One chunk of a part: quantizes grad + residual (`valid` elements, then zeros up to `len`) into
// levels and leaves in residual what was not sent; returns the scale.
template <typename T>
static float quantize_unit(const T* __restrict grad, T* __restrict residual, std::size_t valid, std::size_t len,
                           std::int8_t* __restrict levels) {
    for (std::size_t i = 0; i < valid; ++i) residual[i] = grad[i] + residual[i];
    const float scale = quantize_values(residual, valid, levels);
    std::memset(levels + valid, 0, len - valid);
    return scale;
}

// One chunk of the owned part's sum: total = the received rows' levels times their scales,
// summed in row order from 0 (the rows start `stride` bytes apart, their scales at `scales`
// bytes past their levels); quantizes it into levels and adds its error to the first `own`
// elements of residual; returns the scale. `total` holds len elements of scratch.
template <typename T>
static float sum_unit(const std::uint8_t* received, std::size_t rows, std::size_t stride, std::size_t scales,
                      std::size_t len, T* __restrict total, T* __restrict residual, std::size_t own,
                      std::int8_t* __restrict levels) {
    std::fill(total, total + len, T(0));
    for (std::size_t row = 0; row < rows; ++row) {  // in rank order
        const std::int8_t* __restrict from = reinterpret_cast<const std::int8_t*>(received + row * stride);
        float row_scale;
        std::memcpy(&row_scale, received + row * stride + scales, sizeof row_scale);
        const T scale = T(row_scale);
        for (std::size_t i = 0; i < len; ++i) total[i] += T(from[i]) * scale;
    }
    const float scale = quantize_values(total, len, levels);
    for (std::size_t i = 0; i < own; ++i) residual[i] += total[i];
    return scale;
}

// One chunk of a part: to = levels times the scale.
template <typename T>
static void dequantize_unit(const std::int8_t* __restrict levels, float scale, T* __restrict to, std::size_t valid) {
    const T step = T(scale);
    for (std::size_t i = 0; i < valid; ++i) to[i] = T(levels[i]) * step;
}

static const Int8Loops kInt8Loops = {
    &quantize_unit<float>, &quantize_unit<double>, &sum_unit<float>, &sum_unit<double>,
    &dequantize_unit<float>, &dequantize_unit<double>,
};
