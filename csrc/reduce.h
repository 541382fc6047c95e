// Fused reduction kernels of mpidist: element-wise reduce, reduce+scale, k-way reduce,
// pack/unpack of byte ranges and half-precision casts, on CPU and (when built with it) CUDA.
//
// Semantics shared by both back ends:
//  - float16 and bfloat16 are loaded, combined in float32 and stored once, rounded to nearest even.
//  - min/max propagate NaN (like torch.minimum / torch.maximum); sum/prod propagate NaN and Inf.
//  - Integer sum/prod wrap around (two's complement), as NumPy and torch do.
//  - reduce_many combines sources in a fixed left-to-right order, one pass, so results are bitwise
//    reproducible and independent of the thread count or launch configuration.
// Errors (unknown dtype/op, unsupported combination) are std::invalid_argument, which pybind11
// turns into ValueError; CUDA failures are std::runtime_error carrying the CUDA error string.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mpidist {

enum class DType { float16, bfloat16, float32, float64, int32, int64, uint8, int8 };
enum class Op { sum, min, max, prod };

DType parse_dtype(const std::string& name);
Op parse_op(const std::string& name);
const char* dtype_name(DType dtype);
std::size_t itemsize(DType dtype);
bool is_floating(DType dtype);

// Throws std::invalid_argument unless `dtype` is a floating type or `factor` is exactly 1:
// integer buffers are never scaled, because truncating an average silently is a wrong result.
void check_scalable(DType dtype, double factor);
// cast() converts between float32, float16 and bfloat16 only.
void check_castable(DType dst, DType src);

namespace cpu {

void reduce(void* dst, const void* src, std::size_t n, DType dtype, Op op);
void reduce_scale(void* dst, const void* src, std::size_t n, DType dtype, Op op, double scale);
void scale(void* dst, std::size_t n, DType dtype, double factor);
void reduce_many(void* dst, const std::vector<const void*>& srcs, std::size_t n, DType dtype, Op op);
// Every dsts[j] = (srcs[0] op ... op srcs[k-1]) * scale in one pass over memory: bitwise what
// reduce_many into dsts[0], then scale (unless scale is 1), then copies give. A destination may
// be a source (the same address), but must not overlap one partially.
void reduce_many_to(const std::vector<void*>& dsts, const std::vector<const void*>& srcs, std::size_t n,
                    DType dtype, Op op, double scale);
void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<std::size_t>& nbytes);
void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<std::size_t>& nbytes);
void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n, double scale);

// Threads used for large buffers: OMP_NUM_THREADS when set, else the processors available to
// this process divided by the MPI ranks on this node, at least 1.
void set_num_threads(int n);
int get_num_threads();
// Name of the instruction set the loops run ("avx512", "avx2" or "baseline"): the widest this
// CPU has, unless set_isa chose another.
const char* isa();
// The instruction sets this CPU can run the loops with, widest first.
std::vector<std::string> runnable_isas();
// Runs the loops compiled for `name` from now on (one of runnable_isas(); std::invalid_argument
// otherwise). For measuring a narrower instruction set on a machine with a wider one.
void set_isa(const std::string& name);

}  // namespace cpu

#ifdef MPIDIST_WITH_CUDA
namespace cuda {

// `stream` is a cudaStream_t as an integer (0: the legacy default stream). `device` is the CUDA
// device the pointers live on; -1 keeps the calling thread's current device.
void reduce(void* dst, const void* src, std::size_t n, DType dtype, Op op, std::uintptr_t stream, int device);
void reduce_scale(void* dst, const void* src, std::size_t n, DType dtype, Op op, double scale,
                  std::uintptr_t stream, int device);
void scale(void* dst, std::size_t n, DType dtype, double factor, std::uintptr_t stream, int device);
void reduce_many(void* dst, const std::vector<const void*>& srcs, std::size_t n, DType dtype, Op op,
                 std::uintptr_t stream, int device);
void reduce_many_to(const std::vector<void*>& dsts, const std::vector<const void*>& srcs, std::size_t n,
                    DType dtype, Op op, double scale, std::uintptr_t stream, int device);
void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<std::size_t>& nbytes,
          std::uintptr_t stream, int device);
void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<std::size_t>& nbytes,
            std::uintptr_t stream, int device);
void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n, double scale,
          std::uintptr_t stream, int device);
// Waits until the work queued on `stream` of `device` has finished (MPI reads and writes device
// memory outside any stream).
void synchronize(std::uintptr_t stream, int device);
// Number of CUDA devices; 0 (never an exception) when there is no driver or no GPU.
int device_count();
// Most sources one reduce_many launch accepts (they travel as kernel parameters).
constexpr std::size_t kMaxSources = 128;

}  // namespace cuda
#endif

}  // namespace mpidist
