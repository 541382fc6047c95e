// CUDA back end of the fused reduction kernels: same names and semantics as the CPU ones.
//
// Grid-stride kernels on the caller's stream. When every pointer is 16-byte aligned a thread moves
// 16 bytes per load (the scalar tail is done by the first threads of the same launch); otherwise
// every element is loaded on its own. A failed launch or CUDA call throws std::runtime_error with
// the CUDA error string.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "combine.h"
#include "reduce.h"

namespace mpidist {
namespace cuda {
namespace {

void check(cudaError_t err, const char* what) {
    if (err != cudaSuccess)
        throw std::runtime_error(std::string("mpidist CUDA error in ") + what + ": " + cudaGetErrorName(err) + ": " +
                                 cudaGetErrorString(err));
}

// Makes `device` current for the duration of a call, then restores the caller's device.
class DeviceGuard {
   public:
    explicit DeviceGuard(int device) {
        if (device < 0) return;
        check(cudaGetDevice(&previous_), "cudaGetDevice");
        if (previous_ == device) {
            previous_ = -1;
            return;
        }
        check(cudaSetDevice(device), "cudaSetDevice");
    }
    ~DeviceGuard() {
        if (previous_ >= 0) cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

   private:
    int previous_ = -1;
};

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

struct Half {
    uint16_t bits;
};
struct BFloat16 {
    uint16_t bits;
};

// ---- load / combine / store (float32 accumulation for the half types) -------------------------

template <typename T>
struct Elem {
    using Acc = T;
    __device__ static Acc load(T v) { return v; }
    __device__ static T store(Acc a) { return a; }
};

template <>
struct Elem<Half> {
    using Acc = float;
    __device__ static Acc load(Half v) { return __half2float(__ushort_as_half(v.bits)); }
    __device__ static Half store(Acc a) { return Half{__half_as_ushort(__float2half_rn(a))}; }
};

template <>
struct Elem<BFloat16> {
    using Acc = float;
    __device__ static Acc load(BFloat16 v) { return __uint_as_float(uint32_t(v.bits) << 16); }
    __device__ static BFloat16 store(Acc a) { return BFloat16{__bfloat16_as_ushort(__float2bfloat16_rn(a))}; }
};

// ---- vector packs ----------------------------------------------------------------------------

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

// Elements per 16-byte load.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 65535;

unsigned blocks_for(std::size_t items) {
    return (unsigned)std::max<std::size_t>(1, std::min(kMaxBlocks, (items + kThreads - 1) / kThreads));
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ std::size_t thread_index() { return (std::size_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ std::size_t thread_count() { return (std::size_t)gridDim.x * blockDim.x; }

// ---- kernels ---------------------------------------------------------------------------------

// dst = (a op b) * factor for V elements per load; elements past the last full pack are done
// one each by the first threads.
template <typename T, Op op, bool kScaled, int V>
__global__ void combine_kernel(T* dst, const T* a, const T* b, std::size_t n, typename Elem<T>::Acc factor) {
    using E = Elem<T>;
    using P = Pack<T, V>;
    const std::size_t packs = n / V;
    for (std::size_t i = thread_index(); i < packs; i += thread_count()) {
        const P x = reinterpret_cast<const P*>(a)[i];
        const P y = reinterpret_cast<const P*>(b)[i];
        P out;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            auto r = combine<op>(E::load(x.v[k]), E::load(y.v[k]));
            if constexpr (kScaled) r = r * factor;
            out.v[k] = E::store(r);
        }
        reinterpret_cast<P*>(dst)[i] = out;
    }
    const std::size_t tail = packs * V + thread_index();
    if (tail < n) {
        auto r = combine<op>(E::load(a[tail]), E::load(b[tail]));
        if constexpr (kScaled) r = r * factor;
        dst[tail] = E::store(r);
    }
}

// Up to kMaxSources source pointers travel as a kernel parameter.
struct Sources {
    const void* ptr[kMaxSources];
};

// Each thread reads all sources of its elements before writing, so dst may be one of them.
template <typename T, Op op, int V>
__global__ void reduce_many_kernel(T* dst, Sources srcs, int k, std::size_t n) {
    using E = Elem<T>;
    using P = Pack<T, V>;
    using Acc = typename E::Acc;
    const std::size_t packs = n / V;
    for (std::size_t i = thread_index(); i < packs; i += thread_count()) {
        const P first = reinterpret_cast<const P*>(srcs.ptr[0])[i];
        Acc acc[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = E::load(first.v[e]);
        for (int j = 1; j < k; ++j) {
            const P next = reinterpret_cast<const P*>(srcs.ptr[j])[i];
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = combine<op>(acc[e], E::load(next.v[e]));
        }
        P out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = E::store(acc[e]);
        reinterpret_cast<P*>(dst)[i] = out;
    }
    const std::size_t tail = packs * V + thread_index();
    if (tail < n) {
        Acc acc = E::load(static_cast<const T*>(srcs.ptr[0])[tail]);
        for (int j = 1; j < k; ++j) acc = combine<op>(acc, E::load(static_cast<const T*>(srcs.ptr[j])[tail]));
        dst[tail] = E::store(acc);
    }
}

template <typename T, int V>
__global__ void scale_kernel(T* data, std::size_t n, typename Elem<T>::Acc factor) {
    using E = Elem<T>;
    using P = Pack<T, V>;
    const std::size_t packs = n / V;
    for (std::size_t i = thread_index(); i < packs; i += thread_count()) {
        P x = reinterpret_cast<P*>(data)[i];
#pragma unroll
        for (int k = 0; k < V; ++k) x.v[k] = E::store(E::load(x.v[k]) * factor);
        reinterpret_cast<P*>(data)[i] = x;
    }
    const std::size_t tail = packs * V + thread_index();
    if (tail < n) data[tail] = E::store(E::load(data[tail]) * factor);
}

// Conversions go through float32, where the factor is applied before the single rounding.
template <typename D, typename S, int V>
__global__ void cast_kernel(D* dst, const S* src, std::size_t n, float factor) {
    using PD = Pack<D, V>;
    using PS = Pack<S, V>;
    const std::size_t packs = n / V;
    for (std::size_t i = thread_index(); i < packs; i += thread_count()) {
        const PS x = reinterpret_cast<const PS*>(src)[i];
        PD out;
#pragma unroll
        for (int k = 0; k < V; ++k) out.v[k] = Elem<D>::store((float)Elem<S>::load(x.v[k]) * factor);
        reinterpret_cast<PD*>(dst)[i] = out;
    }
    const std::size_t tail = packs * V + thread_index();
    if (tail < n) dst[tail] = Elem<D>::store((float)Elem<S>::load(src[tail]) * factor);
}

// Byte ranges copied by one launch (blockIdx.y picks the range). copy_ranges cuts long ranges into
// pieces of kPieceBytes, so that one launch's blocks share the work evenly however uneven the
// ranges are; a multiple of 16, so that a piece keeps its range's alignment.
constexpr int kBatch = 64;
constexpr std::size_t kPieceBytes = std::size_t(1) << 20;

struct Ranges {
    char* dst[kBatch];
    const char* src[kBatch];
    std::size_t len[kBatch];
};

// Copies len bytes in words of W: the bytes before dst's first W-aligned byte and after its last
// whole word go one by one. The caller has checked that src and dst agree modulo sizeof(W).
template <typename W>
__device__ __forceinline__ void copy_words(char* dst, const char* src, std::size_t len) {
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(dst) % sizeof(W);
    const std::size_t to_alignment = misalignment ? sizeof(W) - misalignment : 0;
    const std::size_t head = to_alignment < len ? to_alignment : len;
    const std::size_t words = (len - head) / sizeof(W);
    W* d = reinterpret_cast<W*>(dst + head);
    const W* s = reinterpret_cast<const W*>(src + head);
    // Four loads in flight per thread before their stores: narrow words need them to keep the
    // memory busy.
    const std::size_t stride = thread_count();
    std::size_t w = thread_index();
    for (; w + 3 * stride < words; w += 4 * stride) {
        const W w0 = s[w], w1 = s[w + stride], w2 = s[w + 2 * stride], w3 = s[w + 3 * stride];
        d[w] = w0;
        d[w + stride] = w1;
        d[w + 2 * stride] = w2;
        d[w + 3 * stride] = w3;
    }
    for (; w < words; w += stride) d[w] = s[w];
    const std::size_t body_end = head + words * sizeof(W);
    const std::size_t i = thread_index();  // head and tail are shorter than one word: one pass
    if (i < head) dst[i] = src[i];
    if (i < len - body_end) dst[body_end + i] = src[body_end + i];
}

// The widest word that src and dst agree on: tensors packed back to back are rarely 16-byte
// aligned, but float32 ones always agree modulo 4, and byte-wise copies run at a tenth of the
// memory's bandwidth.
__global__ void copy_ranges_kernel(Ranges ranges) {
    char* dst = ranges.dst[blockIdx.y];
    const char* src = ranges.src[blockIdx.y];
    const std::size_t len = ranges.len[blockIdx.y];
    const std::uintptr_t differ = reinterpret_cast<std::uintptr_t>(dst) ^ reinterpret_cast<std::uintptr_t>(src);
    if ((differ & 15) == 0) copy_words<uint4>(dst, src, len);
    else if ((differ & 7) == 0) copy_words<uint2>(dst, src, len);
    else if ((differ & 3) == 0) copy_words<uint32_t>(dst, src, len);
    else if ((differ & 1) == 0) copy_words<uint16_t>(dst, src, len);
    else copy_words<char>(dst, src, len);
}

// ---- host-side dispatch ----------------------------------------------------------------------

template <typename T>
constexpr bool kFloating = std::is_floating_point<T>::value || std::is_same<T, Half>::value ||
                           std::is_same<T, BFloat16>::value;

// The types cast() converts between (check_castable has vetted the dtypes).
template <typename T>
constexpr bool kCastable = std::is_same<T, float>::value || std::is_same<T, Half>::value ||
                           std::is_same<T, BFloat16>::value;

template <typename F>
void with_dtype(DType dtype, F&& f) {
    switch (dtype) {
        case DType::float16: return f(Half{});
        case DType::bfloat16: return f(BFloat16{});
        case DType::float32: return f(float{});
        case DType::float64: return f(double{});
        case DType::int32: return f(int32_t{});
        case DType::int64: return f(int64_t{});
        case DType::uint8: return f(uint8_t{});
        case DType::int8: return f(int8_t{});
    }
}

template <typename F>
void with_op(Op op, F&& f) {
    switch (op) {
        case Op::sum: return f(std::integral_constant<Op, Op::sum>{});
        case Op::min: return f(std::integral_constant<Op, Op::min>{});
        case Op::max: return f(std::integral_constant<Op, Op::max>{});
        case Op::prod: return f(std::integral_constant<Op, Op::prod>{});
    }
}

template <typename T, Op op, bool kScaled>
void launch_combine(T* dst, const T* a, const T* b, std::size_t n, double factor, cudaStream_t stream) {
    using Acc = typename Elem<T>::Acc;
    if (aligned16(dst) && aligned16(a) && aligned16(b)) {
        constexpr int V = kVec<T>;
        combine_kernel<T, op, kScaled, V><<<blocks_for(std::max<std::size_t>(n / V, 1)), kThreads, 0, stream>>>(
            dst, a, b, n, (Acc)factor);
    } else {
        combine_kernel<T, op, kScaled, 1><<<blocks_for(n), kThreads, 0, stream>>>(dst, a, b, n, (Acc)factor);
    }
    check(cudaGetLastError(), "reduce kernel launch");
}

void reduce_any(void* dst, const void* src, std::size_t n, DType dtype, Op op, bool scaled, double factor,
                std::uintptr_t stream, int device) {
    if (n == 0) return;
    DeviceGuard guard(device);
    with_dtype(dtype, [&](auto tag) {
        using T = decltype(tag);
        with_op(op, [&](auto op_tag) {
            constexpr Op o = decltype(op_tag)::value;
            T* d = static_cast<T*>(dst);
            if constexpr (kFloating<T>) {
                if (scaled) return launch_combine<T, o, true>(d, d, static_cast<const T*>(src), n, factor, as_stream(stream));
            }
            launch_combine<T, o, false>(d, d, static_cast<const T*>(src), n, 1.0, as_stream(stream));
        });
    });
}

void copy_ranges(char* const* dsts, const char* const* srcs, const std::size_t* lens, std::size_t count,
                 std::uintptr_t stream, int device) {
    DeviceGuard guard(device);
    Ranges batch;
    int filled = 0;
    std::size_t longest = 0;
    auto flush = [&]() {
        if (filled == 0) return;
        dim3 grid(blocks_for(longest / 16 + 1), filled);
        copy_ranges_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(batch);
        check(cudaGetLastError(), "pack/unpack kernel launch");
        filled = 0;
        longest = 0;
    };
    for (std::size_t i = 0; i < count; ++i) {
        for (std::size_t offset = 0; offset < lens[i]; offset += kPieceBytes) {
            batch.dst[filled] = dsts[i] + offset;
            batch.src[filled] = srcs[i] + offset;
            batch.len[filled] = std::min(kPieceBytes, lens[i] - offset);
            longest = std::max(longest, batch.len[filled]);
            if (++filled == kBatch) flush();
        }
    }
    flush();
}

}  // namespace

void reduce(void* dst, const void* src, std::size_t n, DType dtype, Op op, std::uintptr_t stream, int device) {
    reduce_any(dst, src, n, dtype, op, false, 1.0, stream, device);
}

void reduce_scale(void* dst, const void* src, std::size_t n, DType dtype, Op op, double factor,
                  std::uintptr_t stream, int device) {
    check_scalable(dtype, factor);
    reduce_any(dst, src, n, dtype, op, factor != 1.0, factor, stream, device);
}

void scale(void* dst, std::size_t n, DType dtype, double factor, std::uintptr_t stream, int device) {
    if (!is_floating(dtype))
        throw std::invalid_argument(std::string("scale needs a floating dtype, got ") + dtype_name(dtype));
    if (n == 0) return;
    DeviceGuard guard(device);
    with_dtype(dtype, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (kFloating<T>) {
            using Acc = typename Elem<T>::Acc;
            T* d = static_cast<T*>(dst);
            if (aligned16(d)) {
                constexpr int V = kVec<T>;
                scale_kernel<T, V><<<blocks_for(std::max<std::size_t>(n / V, 1)), kThreads, 0, as_stream(stream)>>>(
                    d, n, (Acc)factor);
            } else {
                scale_kernel<T, 1><<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(d, n, (Acc)factor);
            }
            check(cudaGetLastError(), "scale kernel launch");
        }
    });
}

void reduce_many(void* dst, const std::vector<const void*>& srcs, std::size_t n, DType dtype, Op op,
                 std::uintptr_t stream, int device) {
    if (srcs.empty()) throw std::invalid_argument("reduce_many needs at least one source");
    if (srcs.size() > kMaxSources)
        throw std::invalid_argument("CUDA reduce_many takes at most " + std::to_string(kMaxSources) +
                                    " sources per call, got " + std::to_string(srcs.size()));
    if (n == 0) return;
    DeviceGuard guard(device);
    Sources params{};
    bool vector = aligned16(dst);
    for (std::size_t j = 0; j < srcs.size(); ++j) {
        params.ptr[j] = srcs[j];
        vector = vector && aligned16(srcs[j]);
    }
    const int k = (int)srcs.size();
    with_dtype(dtype, [&](auto tag) {
        using T = decltype(tag);
        with_op(op, [&](auto op_tag) {
            constexpr Op o = decltype(op_tag)::value;
            T* d = static_cast<T*>(dst);
            if (vector) {
                constexpr int V = kVec<T>;
                reduce_many_kernel<T, o, V><<<blocks_for(std::max<std::size_t>(n / V, 1)), kThreads, 0,
                                              as_stream(stream)>>>(d, params, k, n);
            } else {
                reduce_many_kernel<T, o, 1><<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(d, params, k, n);
            }
            check(cudaGetLastError(), "reduce_many kernel launch");
        });
    });
}

// Three launches in stream order (reduce, scale, copies): on a GPU the result is not reused from a
// cache between them, and the order makes any exact aliasing of a destination and a source safe.
void reduce_many_to(const std::vector<void*>& dsts, const std::vector<const void*>& srcs, std::size_t n,
                    DType dtype, Op op, double factor, std::uintptr_t stream, int device) {
    if (dsts.empty()) throw std::invalid_argument("reduce_many_to needs at least one destination");
    check_scalable(dtype, factor);
    reduce_many(dsts[0], srcs, n, dtype, op, stream, device);
    if (n == 0) return;
    if (factor != 1.0) scale(dsts[0], n, dtype, factor, stream, device);
    std::vector<char*> to;
    std::vector<const char*> from;
    std::vector<std::size_t> lens;
    for (std::size_t j = 1; j < dsts.size(); ++j) {
        if (dsts[j] == dsts[0]) continue;
        to.push_back(static_cast<char*>(dsts[j]));
        from.push_back(static_cast<const char*>(dsts[0]));
        lens.push_back(n * itemsize(dtype));
    }
    copy_ranges(to.data(), from.data(), lens.data(), to.size(), stream, device);
}

void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<std::size_t>& nbytes,
          std::uintptr_t stream, int device) {
    if (srcs.size() != nbytes.size()) throw std::invalid_argument("pack: sources and byte counts differ in number");
    std::vector<char*> to(srcs.size());
    std::vector<const char*> from(srcs.size());
    std::size_t offset = 0;
    for (std::size_t i = 0; i < srcs.size(); ++i) {
        to[i] = static_cast<char*>(dst) + offset;
        from[i] = static_cast<const char*>(srcs[i]);
        offset += nbytes[i];
    }
    copy_ranges(to.data(), from.data(), nbytes.data(), srcs.size(), stream, device);
}

void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<std::size_t>& nbytes,
            std::uintptr_t stream, int device) {
    if (dsts.size() != nbytes.size()) throw std::invalid_argument("unpack: destinations and byte counts differ in number");
    std::vector<char*> to(dsts.size());
    std::vector<const char*> from(dsts.size());
    std::size_t offset = 0;
    for (std::size_t i = 0; i < dsts.size(); ++i) {
        to[i] = static_cast<char*>(dsts[i]);
        from[i] = static_cast<const char*>(src) + offset;
        offset += nbytes[i];
    }
    copy_ranges(to.data(), from.data(), nbytes.data(), dsts.size(), stream, device);
}

void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n, double factor,
          std::uintptr_t stream, int device) {
    check_castable(dst_dtype, src_dtype);
    if (n == 0) return;
    DeviceGuard guard(device);
    with_dtype(dst_dtype, [&](auto dst_tag) {
        using D = decltype(dst_tag);
        with_dtype(src_dtype, [&](auto src_tag) {
            using S = decltype(src_tag);
            if constexpr (kCastable<D> && kCastable<S>) {
                constexpr int V = 16 / (sizeof(D) > sizeof(S) ? sizeof(D) : sizeof(S));
                D* d = static_cast<D*>(dst);
                const S* s = static_cast<const S*>(src);
                const bool vector = reinterpret_cast<std::uintptr_t>(d) % (sizeof(D) * V) == 0 &&
                                    reinterpret_cast<std::uintptr_t>(s) % (sizeof(S) * V) == 0;
                if (vector)
                    cast_kernel<D, S, V><<<blocks_for(std::max<std::size_t>(n / V, 1)), kThreads, 0,
                                           as_stream(stream)>>>(d, s, n, (float)factor);
                else
                    cast_kernel<D, S, 1><<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(d, s, n, (float)factor);
                check(cudaGetLastError(), "cast kernel launch");
            }
        });
    });
}

void synchronize(std::uintptr_t stream, int device) {
    DeviceGuard guard(device);
    check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

int device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no driver / no device" error
        return 0;
    }
    return count;
}

}  // namespace cuda
}  // namespace mpidist
