// Element loops of the CPU kernels, written so that GCC vectorizes them.
//
// No include guard on purpose: reduce.cpp includes this file once per instruction set, each time
// inside its own namespace and `#pragma GCC target` region, and picks one copy at run time. So
// this file includes nothing itself and relies on reduce.cpp for <cstdint>, <cstring>,
// <type_traits>, <immintrin.h>, combine.h (the element combine, shared with the CUDA kernels) and
// the Half / BFloat16 storage types. MPIDIST_LOOPS_F16C is
// defined for copies compiled with F16C, which then convert float16 with those instructions, and
// MPIDIST_LOOPS_AVX2 / MPIDIST_LOOPS_AVX512 for the AVX2 and AVX-512 copies, which add register
// loops for the half types.

// ---- float16 / bfloat16 <-> float32 with integer bit operations (branch-free, vectorizable) ----

static inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

// Exact: every float16 (subnormals, Inf, NaN) is representable in float32. Subnormals are
// normalised by a float subtraction of two normal numbers, so a flush-to-zero mode cannot bite.
// (The selects only vectorize because setup.py passes -fno-trapping-math: otherwise GCC may not
// execute the subtraction for elements that do not need it.)
static inline float half_to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
    const uint32_t exp = o & shifted_exp;
    o += (127u - 15u) << 23;
    const uint32_t inf_nan = o + ((128u - 16u) << 23);
    const float subnormal = bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23);
    o = exp == shifted_exp ? inf_nan : o;
    o = exp == 0 ? float_to_bits(subnormal) : o;
    return bits_to_float(o | ((uint32_t(h) & 0x8000u) << 16));
}

// Round to nearest, ties to even; overflow gives Inf, NaN stays NaN (quiet), sign is kept.
static inline uint16_t float_to_half(float f) {
    const uint32_t bits = float_to_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    const uint32_t mag = bits ^ sign;
    const uint32_t f16_overflow = (127u + 16u) << 23;  // 65536.0f: rounds to Inf
    const uint32_t f32_inf = 255u << 23;
    const uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    // Results below the float16 normal range: adding 0.5 lets the FPU do the RNE shift.
    const bool small = mag < (113u << 23);
    const uint32_t sub = float_to_bits(bits_to_float(mag) + bits_to_float(denorm_magic_bits)) - denorm_magic_bits;
    // Normal results: rebias the exponent and round the 13 dropped mantissa bits to even.
    const uint32_t normal = (mag + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
    uint32_t o = small ? sub : normal;
    o = mag >= f16_overflow ? (mag > f32_inf ? 0x7e00u : 0x7c00u) : o;
    return (uint16_t)(o | (sign >> 16));
}

static inline float bfloat16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

static inline uint16_t float_to_bfloat16(float f) {
    const uint32_t bits = float_to_bits(f);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(nan ? ((bits >> 16) | 0x40u) : rounded);
}

// ---- load / combine / store per storage type --------------------------------------------------

// Element-wise load/store, plus block converters to and from the accumulator type. kBlocked types
// run their kernels as convert-block / compute / convert-back, because their block converters
// beat the element converters (hardware F16C instructions, which GCC does not vectorize itself).
template <typename T, typename Acc = T>
struct ElemBase {
    static constexpr bool kBlocked = false;
    static inline void load_n(const T* src, Acc* out, size_t m);
    static inline void store_n(const Acc* in, T* dst, size_t m);
};

template <typename T>
struct Elem : ElemBase<T> {
    using Acc = T;
    static inline Acc load(T v) { return v; }
    static inline T store(Acc a) { return a; }
};

template <>
struct Elem<BFloat16> : ElemBase<BFloat16, float> {
    using Acc = float;
    static inline Acc load(BFloat16 v) { return bfloat16_to_float(v.bits); }
    static inline BFloat16 store(Acc a) { return BFloat16{float_to_bfloat16(a)}; }
};

template <>
struct Elem<Half> : ElemBase<Half, float> {
    using Acc = float;
    static inline Acc load(Half v) { return half_to_float(v.bits); }
    static inline Half store(Acc a) { return Half{float_to_half(a)}; }
#ifdef MPIDIST_LOOPS_F16C
    static constexpr bool kBlocked = true;
    static inline void load_n(const Half* src, float* out, size_t m) {
        size_t i = 0;
        for (; i + 8 <= m; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
        for (; i < m; ++i) out[i] = load(src[i]);
    }
    static inline void store_n(const float* in, Half* dst, size_t m) {
        size_t i = 0;
        for (; i + 8 <= m; i += 8)
            _mm_storeu_si128((__m128i*)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < m; ++i) dst[i] = store(in[i]);
    }
#endif
};

template <typename T, typename Acc>
inline void ElemBase<T, Acc>::load_n(const T* src, Acc* out, size_t m) {
#pragma omp simd
    for (size_t i = 0; i < m; ++i) out[i] = Elem<T>::load(src[i]);
}

template <typename T, typename Acc>
inline void ElemBase<T, Acc>::store_n(const Acc* in, T* dst, size_t m) {
#pragma omp simd
    for (size_t i = 0; i < m; ++i) dst[i] = Elem<T>::store(in[i]);
}

// ---- register loops for the half types (AVX2 and AVX-512), conversions in registers --------
//
// GCC vectorizes the bfloat16 element converters above with zero-extending widens and narrowing
// moves, and the float16 block path stages 8-element F16C conversions through L1 arrays; both
// leave the half-type kernels compute-bound where the data is in cache (on AVX2 at 0.6-0.95x of
// torch's own ops). These loops handle one integer register of half-type elements per step (16
// with AVX2, 32 with AVX-512), with every conversion in registers, and round exactly as the
// element code (every non-NaN result is bitwise the same; a NaN result is a quiet NaN, but which
// input NaN's sign and payload it carries when both inputs are NaN follows the operand order of
// the vector instruction, which GCC may also commute in the element loops; float16 NaN results
// keep the F16C payload everywhere):
//  - bfloat16: as 32-bit lanes, `x << 16` are the even-indexed values as float32 and
//    `x & 0xffff0000` the odd-indexed ones, so both halves are combined lane by lane with no
//    permutes. Rounding is the same integer RNE as float_to_bfloat16, NaN lanes (found with an
//    unordered compare) get the quiet bit instead, and the two rounded halves are merged back
//    with one 16-bit blend.
//  - float16: F16C vcvtph2ps / vcvtps2ph (round to nearest even).
// The last n % step elements go through a zero-padded buffer of one step, so the tail runs the
// same vector code as the body.
//
// Per instruction set, `Vec` holds the float32 register operations and Wide<T> the loads,
// stores and conversions of a half type; the loops below them are written once.
#if defined(MPIDIST_LOOPS_AVX512) || defined(MPIDIST_LOOPS_AVX2)
#define MPIDIST_LOOPS_WIDE 1

template <typename T>
struct Wide {
    static constexpr bool kAvailable = false;
    static constexpr bool kRegisterCasts = false;
};

#ifdef MPIDIST_LOOPS_AVX512
struct Vec {
    using F = __m512;
    static constexpr size_t kLanes = 16;
    static inline F set1(float x) { return _mm512_set1_ps(x); }
    static inline F load(const float* p) { return _mm512_loadu_ps(p); }
    static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    template <Op op>
    static inline F combine(F a, F b) {
        if constexpr (op == Op::sum) {
            return _mm512_add_ps(a, b);
        } else if constexpr (op == Op::prod) {
            return _mm512_mul_ps(a, b);
        } else {
            // Same selection as combine(): a wins when it is smaller (larger) or NaN.
            constexpr int kPredicate = op == Op::min ? _CMP_LT_OQ : _CMP_GT_OQ;
            const __mmask16 pick = _mm512_cmp_ps_mask(a, b, kPredicate) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            return _mm512_mask_blend_ps(pick, b, a);
        }
    }
};

template <>
struct Wide<BFloat16> {
    static constexpr bool kAvailable = true;
    // float32 <-> bfloat16 casts stay on the element loops here, measured at 1.04-1.35x torch.
    static constexpr bool kRegisterCasts = false;
    static constexpr size_t kStep = 32;
    struct Pair {
        __m512 even, odd;
    };
    static inline Pair widen(__m512i x) {
        return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)))};
    }
    static inline Pair load(const BFloat16* p) { return widen(_mm512_loadu_si512((const void*)p)); }
    // float32 -> 32-bit lanes whose upper 16 bits are the bfloat16 (float_to_bfloat16, vectorized).
    static inline __m512i round(__m512 r) {
        const __m512i bits = _mm512_castps_si512(r);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
        const __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
        return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
    }
    static inline void store(BFloat16* p, Pair v) {
        _mm512_storeu_si512((void*)p,
                            _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(round(v.even), 16), round(v.odd)));
    }
};

template <>
struct Wide<Half> {
    static constexpr bool kAvailable = true;
    static constexpr bool kRegisterCasts = true;
    static constexpr size_t kStep = 32;
    struct Pair {
        __m512 even, odd;  // elements 0-15 and 16-31 (the names only match Wide<BFloat16>)
    };
    static inline Pair load(const Half* p) {
        const __m512i x = _mm512_loadu_si512((const void*)p);
        return {_mm512_cvtph_ps(_mm512_castsi512_si256(x)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1))};
    }
    static inline void store(Half* p, Pair v) {
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        _mm512_storeu_si512((void*)p, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(v.even, kRound)),
                                                          _mm512_cvtps_ph(v.odd, kRound), 1));
    }
    // Elements in order: the first and second 16 (the same as load/store).
    static inline Pair load_linear(const Half* p) { return load(p); }
    static inline void store_linear(Half* p, Pair v) { store(p, v); }
};
#else  // AVX2
struct Vec {
    using F = __m256;
    static constexpr size_t kLanes = 8;
    static inline F set1(float x) { return _mm256_set1_ps(x); }
    static inline F load(const float* p) { return _mm256_loadu_ps(p); }
    static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    template <Op op>
    static inline F combine(F a, F b) {
        if constexpr (op == Op::sum) {
            return _mm256_add_ps(a, b);
        } else if constexpr (op == Op::prod) {
            return _mm256_mul_ps(a, b);
        } else {
            // Same selection as combine(): a wins when it is smaller (larger) or NaN.
            constexpr int kPredicate = op == Op::min ? _CMP_LT_OQ : _CMP_GT_OQ;
            const __m256 pick = _mm256_or_ps(_mm256_cmp_ps(a, b, kPredicate), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            return _mm256_blendv_ps(b, a, pick);
        }
    }
};

template <>
struct Wide<BFloat16> {
    static constexpr bool kAvailable = true;
    // GCC's element loops cast float32 -> bfloat16 at 0.6-0.8x torch here.
    static constexpr bool kRegisterCasts = true;
    static constexpr size_t kStep = 16;
    struct Pair {
        __m256 even, odd;
    };
    static inline Pair load(const BFloat16* p) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)p);
        return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
                _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)))};
    }
    // float32 -> 32-bit lanes whose upper 16 bits are the bfloat16 (float_to_bfloat16, vectorized).
    static inline __m256i round(__m256 r) {
        const __m256i bits = _mm256_castps_si256(r);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
        return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
    }
    static inline void store(BFloat16* p, Pair v) {
        // vpblendw repeats its 8-bit pattern in both 128-bit halves: odd words from round(odd).
        _mm256_storeu_si256((__m256i*)p, _mm256_blend_epi16(_mm256_srli_epi32(round(v.even), 16), round(v.odd), 0xaa));
    }
    // Elements in order: 0-7 and 8-15, for the casts.
    static inline Pair load_linear(const BFloat16* p) {
        const __m256i low = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
        const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)));
        return {_mm256_castsi256_ps(_mm256_slli_epi32(low, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(high, 16))};
    }
    static inline void store_linear(BFloat16* p, Pair v) {
        // packus interleaves the two registers per 128-bit half (0-3, 8-11, 4-7, 12-15): the
        // 64-bit permute puts them back in order.
        const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(round(v.even), 16), _mm256_srli_epi32(round(v.odd), 16));
        _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xd8));
    }
};

template <>
struct Wide<Half> {
    static constexpr bool kAvailable = true;
    static constexpr bool kRegisterCasts = true;
    static constexpr size_t kStep = 16;
    struct Pair {
        __m256 even, odd;  // elements 0-7 and 8-15 (the names only match Wide<BFloat16>)
    };
    static inline Pair load(const Half* p) {
        return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
    }
    static inline void store(Half* p, Pair v) {
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v.even, kRound));
        _mm_storeu_si128((__m128i*)(p + 8), _mm256_cvtps_ph(v.odd, kRound));
    }
    static inline Pair load_linear(const Half* p) { return load(p); }
    static inline void store_linear(Half* p, Pair v) { store(p, v); }
};
#endif

// A tail of `left` < kStep elements as a whole zero-padded step.
template <typename T>
struct PaddedStep {
    T data[Wide<T>::kStep] = {};
    PaddedStep() = default;
    PaddedStep(const T* src, size_t left) { std::memcpy(data, src, left * sizeof(T)); }
    void copy_to(T* dst, size_t left) const { std::memcpy(dst, data, left * sizeof(T)); }
};

template <typename T>
struct WideLoops {
    using W = Wide<T>;
    using Pair = typename W::Pair;
    using F = Vec::F;
    static constexpr size_t kStep = W::kStep;

    template <Op op, bool kScaled>
    static inline Pair step2(Pair x, Pair y, F factor) {
        Pair r{Vec::combine<op>(x.even, y.even), Vec::combine<op>(x.odd, y.odd)};
        if constexpr (kScaled) r = Pair{Vec::mul(r.even, factor), Vec::mul(r.odd, factor)};
        return r;
    }

    // dst = (a op b) [* factor]; dst may be a or b.
    template <Op op, bool kScaled>
    static void combine_into(T* dst, const T* a, const T* b, size_t n, float factor) {
        const F f = Vec::set1(factor);
        size_t i = 0;
        for (; i + 2 * kStep <= n; i += 2 * kStep) {
            const Pair x0 = W::load(a + i), y0 = W::load(b + i);
            const Pair x1 = W::load(a + i + kStep), y1 = W::load(b + i + kStep);
            W::store(dst + i, step2<op, kScaled>(x0, y0, f));
            W::store(dst + i + kStep, step2<op, kScaled>(x1, y1, f));
        }
        for (; i + kStep <= n; i += kStep) W::store(dst + i, step2<op, kScaled>(W::load(a + i), W::load(b + i), f));
        if (i < n) {
            const PaddedStep<T> x(a + i, n - i), y(b + i, n - i);
            PaddedStep<T> r;
            W::store(r.data, step2<op, kScaled>(W::load(x.data), W::load(y.data), f));
            r.copy_to(dst + i, n - i);
        }
    }

    // data *= factor in float32 registers, rounded once (the staged block loop spends most of
    // its time staging: 0.67-0.71x torch's float16 mul_ at 4-16 MiB with AVX-512).
    static inline Pair scaled(Pair x, F f) { return Pair{Vec::mul(x.even, f), Vec::mul(x.odd, f)}; }
    static void scale(T* data, size_t n, float factor) {
        const F f = Vec::set1(factor);
        size_t i = 0;
        for (; i + kStep <= n; i += kStep) W::store(data + i, scaled(W::load(data + i), f));
        if (i < n) {
            PaddedStep<T> x(data + i, n - i);
            W::store(x.data, scaled(W::load(x.data), f));
            x.copy_to(data + i, n - i);
        }
    }

    // dst = s[0] op s[1] op ... op s[K-1], left to right in float32 registers, rounded once.
    template <Op op, int K>
    static inline Pair fold_step(const T* const* s, size_t i) {
        const F one = Vec::set1(1.0f);
        Pair r = W::load(s[0] + i);
        for (int j = 1; j < K; ++j) r = step2<op, false>(r, W::load(s[j] + i), one);
        return r;
    }
    template <Op op, int K>
    static void fused(T* dst, const T* const* srcs, size_t n) {
        const T* s[K];
        for (int j = 0; j < K; ++j) s[j] = srcs[j];
        size_t i = 0;
        for (; i + kStep <= n; i += kStep) W::store(dst + i, fold_step<op, K>(s, i));
        if (i < n) {
            PaddedStep<T> tails[K];
            const T* t[K];
            for (int j = 0; j < K; ++j) {
                tails[j] = PaddedStep<T>(s[j] + i, n - i);
                t[j] = tails[j].data;
            }
            PaddedStep<T> r;
            W::store(r.data, fold_step<op, K>(t, 0));
            r.copy_to(dst + i, n - i);
        }
    }

    // 3 to 8 sources; false when there are more (the caller then folds them in blocks).
    template <Op op>
    static bool fused_any(T* dst, const T* const* s, size_t k, size_t n) {
        switch (k) {
            case 3: fused<op, 3>(dst, s, n); return true;
            case 4: fused<op, 4>(dst, s, n); return true;
            case 5: fused<op, 5>(dst, s, n); return true;
            case 6: fused<op, 6>(dst, s, n); return true;
            case 7: fused<op, 7>(dst, s, n); return true;
            case 8: fused<op, 8>(dst, s, n); return true;
            default: return false;
        }
    }

    // float32 <-> T in registers, `factor` applied in float32 before the one rounding (the
    // staged block loop spends most of its time on the staging). A factor of 1 skips the
    // multiplications: casts are memory-bound only once the data leaves the caches.
    template <bool kScaled>
    static inline Pair load_floats(const float* src, F f) {
        const Pair x{Vec::load(src), Vec::load(src + Vec::kLanes)};
        return kScaled ? scaled(x, f) : x;
    }
    template <bool kScaled>
    static void from_float_loop(T* dst, const float* src, size_t n, F f) {
        size_t i = 0;
        for (; i + kStep <= n; i += kStep) W::store_linear(dst + i, load_floats<kScaled>(src + i, f));
        if (i < n) {
            float padded[kStep] = {};
            std::memcpy(padded, src + i, (n - i) * sizeof(float));
            PaddedStep<T> r;
            W::store_linear(r.data, load_floats<kScaled>(padded, f));
            r.copy_to(dst + i, n - i);
        }
    }
    static void from_float(T* dst, const float* src, size_t n, float factor) {
        if (factor == 1.0f) return from_float_loop<false>(dst, src, n, Vec::set1(factor));
        from_float_loop<true>(dst, src, n, Vec::set1(factor));
    }

    template <bool kScaled>
    static inline void store_floats(float* dst, Pair v, F f) {
        if constexpr (kScaled) v = scaled(v, f);
        Vec::store(dst, v.even);
        Vec::store(dst + Vec::kLanes, v.odd);
    }
    template <bool kScaled>
    static void to_float_loop(float* dst, const T* src, size_t n, F f) {
        size_t i = 0;
        for (; i + kStep <= n; i += kStep) store_floats<kScaled>(dst + i, W::load_linear(src + i), f);
        if (i < n) {
            const PaddedStep<T> x(src + i, n - i);
            float padded[kStep];
            store_floats<kScaled>(padded, W::load_linear(x.data), f);
            std::memcpy(dst + i, padded, (n - i) * sizeof(float));
        }
    }
    static void to_float(float* dst, const T* src, size_t n, float factor) {
        if (factor == 1.0f) return to_float_loop<false>(dst, src, n, Vec::set1(factor));
        to_float_loop<true>(dst, src, n, Vec::set1(factor));
    }
};
#endif

// ---- kernels over one contiguous range ------------------------------------------------------

// Elements per block where kernels stage data in accumulators: a few blocks stay in L1.
constexpr size_t kBlock = 1024;

template <typename T>
struct Kernels {
    using E = Elem<T>;
    using Acc = typename E::Acc;
    static constexpr bool kInteger = std::is_integral<T>::value;

    // dst may be a or b (element-wise, so exact aliasing is safe).
    template <Op op, bool kScaled>
    static void combine_into(T* dst, const T* a, const T* b, size_t n, Acc factor) {
#ifdef MPIDIST_LOOPS_WIDE
        if constexpr (Wide<T>::kAvailable) return WideLoops<T>::template combine_into<op, kScaled>(dst, a, b, n, factor);
#endif
        if constexpr (E::kBlocked) {
            Acc x[kBlock], y[kBlock];
            for (size_t base = 0; base < n; base += kBlock) {
                const size_t m = n - base < kBlock ? n - base : kBlock;
                E::load_n(a + base, x, m);
                E::load_n(b + base, y, m);
#pragma omp simd
                for (size_t i = 0; i < m; ++i) {
                    Acc r = combine<op>(x[i], y[i]);
                    if constexpr (kScaled) r = r * factor;
                    x[i] = r;
                }
                E::store_n(x, dst + base, m);
            }
        } else {
#pragma omp simd
            for (size_t i = 0; i < n; ++i) {
                Acc r = combine<op>(E::load(a[i]), E::load(b[i]));
                if constexpr (kScaled) r = r * factor;
                dst[i] = E::store(r);
            }
        }
    }

    template <bool kScaled>
    static void combine_op(Op op, T* dst, const T* a, const T* b, size_t n, Acc factor) {
        switch (op) {
            case Op::sum: return combine_into<Op::sum, kScaled>(dst, a, b, n, factor);
            case Op::min: return combine_into<Op::min, kScaled>(dst, a, b, n, factor);
            case Op::max: return combine_into<Op::max, kScaled>(dst, a, b, n, factor);
            case Op::prod: return combine_into<Op::prod, kScaled>(dst, a, b, n, factor);
        }
    }

    static void reduce(Op op, void* dst, const void* src, size_t n, bool scaled, double factor) {
        T* d = (T*)dst;
        if (scaled && !kInteger)
            combine_op<true>(op, d, d, (const T*)src, n, (Acc)factor);
        else
            combine_op<false>(op, d, d, (const T*)src, n, (Acc)1);
    }

    // r = s[0] op s[1] op ... op s[K-1] for each element, in registers, into dst (which may be
    // one of the sources: each element's sources are loaded before it is stored).
    template <Op op, int K>
    static void fused(T* dst, const T* const* srcs, size_t n) {
        const T* s[K];
        for (int j = 0; j < K; ++j) s[j] = srcs[j];
#pragma omp simd
        for (size_t i = 0; i < n; ++i) {
            Acc r = E::load(s[0][i]);
            for (int j = 1; j < K; ++j) r = combine<op>(r, E::load(s[j][i]));
            dst[i] = E::store(r);
        }
    }

    // acc = acc op s[0] op ... op s[K-1], for up to four sources per pass over the block.
    template <Op op, int K>
    static void fold_group(Acc* acc, const T* const* s, size_t offset, size_t m) {
#pragma omp simd
        for (size_t i = 0; i < m; ++i) {
            Acc r = acc[i];
            for (int j = 0; j < K; ++j) r = combine<op>(r, E::load(s[j][offset + i]));
            acc[i] = r;
        }
    }

    template <Op op>
    static void fold(Acc* acc, const T* const* s, size_t count, size_t offset, Acc* scratch, size_t m) {
        if constexpr (E::kBlocked) {
            for (size_t j = 0; j < count; ++j) {
                E::load_n(s[j] + offset, scratch, m);
#pragma omp simd
                for (size_t i = 0; i < m; ++i) acc[i] = combine<op>(acc[i], scratch[i]);
            }
        } else {
            for (size_t j = 0; j < count; j += 4) {
                switch (count - j < 4 ? count - j : 4) {
                    case 1: fold_group<op, 1>(acc, s + j, offset, m); break;
                    case 2: fold_group<op, 2>(acc, s + j, offset, m); break;
                    case 3: fold_group<op, 3>(acc, s + j, offset, m); break;
                    default: fold_group<op, 4>(acc, s + j, offset, m); break;
                }
            }
        }
    }

    // Many sources: a float32 (or T) accumulator block in L1, folded source group by source group
    // in order, then stored once. dst may alias any source: a block is read before it is written.
    template <Op op>
    static void reduce_many_op(T* dst, const T* const* srcs, size_t k, size_t n) {
#ifdef MPIDIST_LOOPS_WIDE
        // Few sources: all of them streamed at once, accumulated in registers.
        if constexpr (Wide<T>::kAvailable) {
            if (WideLoops<T>::template fused_any<op>(dst, srcs, k, n)) return;
        }
#endif
        if constexpr (!E::kBlocked) {
            if (k == 3) return fused<op, 3>(dst, srcs, n);
            if (k == 4) return fused<op, 4>(dst, srcs, n);
        }
        Acc acc[kBlock], scratch[kBlock];
        for (size_t base = 0; base < n; base += kBlock) {
            const size_t m = n - base < kBlock ? n - base : kBlock;
            E::load_n(srcs[0] + base, acc, m);
            fold<op>(acc, srcs + 1, k - 1, base, scratch, m);
            E::store_n(acc, dst + base, m);
        }
    }

    // k >= 2; k == 1 is a copy and handled by the caller. Two sources need no accumulator block.
    static void reduce_many(Op op, void* dst, const void* const* srcs, size_t k, size_t n) {
        const T* const* s = (const T* const*)srcs;
        if (k == 2) return combine_op<false>(op, (T*)dst, s[0], s[1], n, (Acc)1);
        switch (op) {
            case Op::sum: return reduce_many_op<Op::sum>((T*)dst, s, k, n);
            case Op::min: return reduce_many_op<Op::min>((T*)dst, s, k, n);
            case Op::max: return reduce_many_op<Op::max>((T*)dst, s, k, n);
            case Op::prod: return reduce_many_op<Op::prod>((T*)dst, s, k, n);
        }
    }

    static void scale(void* data, size_t n, double factor) {
        T* d = (T*)data;
        const Acc f = (Acc)factor;
#ifdef MPIDIST_LOOPS_WIDE
        if constexpr (Wide<T>::kAvailable) return WideLoops<T>::scale(d, n, (float)factor);
#endif
        if constexpr (E::kBlocked) {
            Acc x[kBlock];
            for (size_t base = 0; base < n; base += kBlock) {
                const size_t m = n - base < kBlock ? n - base : kBlock;
                E::load_n(d + base, x, m);
#pragma omp simd
                for (size_t i = 0; i < m; ++i) x[i] = x[i] * f;
                E::store_n(x, d + base, m);
            }
        } else {
#pragma omp simd
            for (size_t i = 0; i < n; ++i) d[i] = E::store(E::load(d[i]) * f);
        }
    }

    // Float conversions go through float32, where `factor` is applied before the single rounding.
    template <typename S>
    static void cast_from(void* dst, const void* src, size_t n, float factor) {
        T* d = (T*)dst;
        const S* s = (const S*)src;
#ifdef MPIDIST_LOOPS_WIDE
        if constexpr (std::is_same<S, float>::value && Wide<T>::kRegisterCasts)
            return WideLoops<T>::from_float(d, s, n, factor);
        if constexpr (std::is_same<T, float>::value && Wide<S>::kRegisterCasts)
            return WideLoops<S>::to_float(d, s, n, factor);
#endif
        if constexpr (E::kBlocked || Elem<S>::kBlocked) {
            float x[kBlock];
            for (size_t base = 0; base < n; base += kBlock) {
                const size_t m = n - base < kBlock ? n - base : kBlock;
                Elem<S>::load_n(s + base, x, m);
#pragma omp simd
                for (size_t i = 0; i < m; ++i) x[i] = x[i] * factor;
                E::store_n(x, d + base, m);
            }
        } else {
#pragma omp simd
            for (size_t i = 0; i < n; ++i) d[i] = E::store((float)Elem<S>::load(s[i]) * factor);
        }
    }
};

// ---- dtype dispatch: the entry points reduce.cpp calls through a table -------------------------

static void reduce_any(void* dst, const void* src, size_t n, DType dtype, Op op, bool scaled, double factor) {
    switch (dtype) {
        case DType::float16: return Kernels<Half>::reduce(op, dst, src, n, scaled, factor);
        case DType::bfloat16: return Kernels<BFloat16>::reduce(op, dst, src, n, scaled, factor);
        case DType::float32: return Kernels<float>::reduce(op, dst, src, n, scaled, factor);
        case DType::float64: return Kernels<double>::reduce(op, dst, src, n, scaled, factor);
        case DType::int32: return Kernels<int32_t>::reduce(op, dst, src, n, scaled, factor);
        case DType::int64: return Kernels<int64_t>::reduce(op, dst, src, n, scaled, factor);
        case DType::uint8: return Kernels<uint8_t>::reduce(op, dst, src, n, scaled, factor);
        case DType::int8: return Kernels<int8_t>::reduce(op, dst, src, n, scaled, factor);
    }
}

static void reduce_many_any(void* dst, const void* const* srcs, size_t k, size_t n, DType dtype, Op op) {
    switch (dtype) {
        case DType::float16: return Kernels<Half>::reduce_many(op, dst, srcs, k, n);
        case DType::bfloat16: return Kernels<BFloat16>::reduce_many(op, dst, srcs, k, n);
        case DType::float32: return Kernels<float>::reduce_many(op, dst, srcs, k, n);
        case DType::float64: return Kernels<double>::reduce_many(op, dst, srcs, k, n);
        case DType::int32: return Kernels<int32_t>::reduce_many(op, dst, srcs, k, n);
        case DType::int64: return Kernels<int64_t>::reduce_many(op, dst, srcs, k, n);
        case DType::uint8: return Kernels<uint8_t>::reduce_many(op, dst, srcs, k, n);
        case DType::int8: return Kernels<int8_t>::reduce_many(op, dst, srcs, k, n);
    }
}

// Only floating dtypes reach here (check_scalable).
static void scale_any(void* data, size_t n, DType dtype, double factor) {
    switch (dtype) {
        case DType::float16: return Kernels<Half>::scale(data, n, factor);
        case DType::bfloat16: return Kernels<BFloat16>::scale(data, n, factor);
        case DType::float32: return Kernels<float>::scale(data, n, factor);
        case DType::float64: return Kernels<double>::scale(data, n, factor);
        default: return;
    }
}

template <typename S>
static void cast_to_any(void* dst, DType dst_dtype, const void* src, size_t n, float factor) {
    switch (dst_dtype) {
        case DType::float16: return Kernels<Half>::cast_from<S>(dst, src, n, factor);
        case DType::bfloat16: return Kernels<BFloat16>::cast_from<S>(dst, src, n, factor);
        case DType::float32: return Kernels<float>::cast_from<S>(dst, src, n, factor);
        default: return;
    }
}

// Only float32 / float16 / bfloat16 reach here (check_castable).
static void cast_any(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n, double factor) {
    switch (src_dtype) {
        case DType::float16: return cast_to_any<Half>(dst, dst_dtype, src, n, (float)factor);
        case DType::bfloat16: return cast_to_any<BFloat16>(dst, dst_dtype, src, n, (float)factor);
        case DType::float32: return cast_to_any<float>(dst, dst_dtype, src, n, (float)factor);
        default: return;
    }
}

static const LoopTable kLoops = {reduce_any, reduce_many_any, scale_any, cast_any};
