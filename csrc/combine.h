// The element-wise combine of the reduction kernels, shared by the CPU loops (reduce_loops.h) and
// the CUDA kernels (reduce.cu) so that both back ends give the same result for every op and type.
#pragma once

#include <cstdint>

#include "reduce.h"

#ifdef __CUDACC__
#define MPIDIST_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MPIDIST_HOST_DEVICE inline
#endif

namespace mpidist {

// Integers are combined as unsigned so that overflow wraps (as in NumPy and torch) without UB.
template <typename A>
struct Wrap {
    using type = A;
};
template <>
struct Wrap<int32_t> {
    using type = uint32_t;
};
template <>
struct Wrap<int64_t> {
    using type = uint64_t;
};
template <>
struct Wrap<int8_t> {
    using type = uint8_t;
};

// `a != a` is the NaN test: a NaN on either side wins, like torch.minimum / torch.maximum. The
// tests are joined with `|`, not `||`, so that the CPU loops get a branch-free select to vectorize.
template <Op op, typename A>
MPIDIST_HOST_DEVICE A combine(A a, A b) {
    using W = typename Wrap<A>::type;
    if constexpr (op == Op::sum) {
        return (A)(W)((W)a + (W)b);
    } else if constexpr (op == Op::prod) {
        return (A)(W)((W)a * (W)b);
    } else if constexpr (op == Op::min) {
        return ((a < b) | (a != a)) ? a : b;
    } else {
        return ((a > b) | (a != a)) ? a : b;
    }
}

}  // namespace mpidist
