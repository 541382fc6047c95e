// CPU back end of the fused reduction kernels: OpenMP threads over contiguous chunks, each chunk
// run by vectorized loops compiled for AVX-512, AVX2 (with F16C/FMA) and baseline x86-64, chosen
// once at load time, so the module runs on any x86-64 and uses wide vectors where the CPU has them.
#include "reduce.h"

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "combine.h"

namespace mpidist {

DType parse_dtype(const std::string& name) {
    static const struct {
        const char* name;
        DType dtype;
    } table[] = {{"float16", DType::float16}, {"bfloat16", DType::bfloat16}, {"float32", DType::float32},
                 {"float64", DType::float64}, {"int32", DType::int32},       {"int64", DType::int64},
                 {"uint8", DType::uint8},     {"int8", DType::int8}};
    for (const auto& entry : table)
        if (name == entry.name) return entry.dtype;
    throw std::invalid_argument("unsupported dtype '" + name +
                                "'; supported: float16, bfloat16, float32, float64, int32, int64, uint8, int8");
}

Op parse_op(const std::string& name) {
    if (name == "sum") return Op::sum;
    if (name == "min") return Op::min;
    if (name == "max") return Op::max;
    if (name == "prod") return Op::prod;
    throw std::invalid_argument("unknown reduction op '" + name + "'; valid ops: sum, min, max, prod");
}

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::float16: return "float16";
        case DType::bfloat16: return "bfloat16";
        case DType::float32: return "float32";
        case DType::float64: return "float64";
        case DType::int32: return "int32";
        case DType::int64: return "int64";
        case DType::uint8: return "uint8";
        case DType::int8: return "int8";
    }
    return "?";
}

std::size_t itemsize(DType dtype) {
    switch (dtype) {
        case DType::float16:
        case DType::bfloat16: return 2;
        case DType::float32:
        case DType::int32: return 4;
        case DType::float64:
        case DType::int64: return 8;
        case DType::uint8:
        case DType::int8: return 1;
    }
    return 0;
}

bool is_floating(DType dtype) {
    return dtype == DType::float16 || dtype == DType::bfloat16 || dtype == DType::float32 || dtype == DType::float64;
}

void check_scalable(DType dtype, double factor) {
    if (!is_floating(dtype) && factor != 1.0)
        throw std::invalid_argument(std::string("cannot scale ") + dtype_name(dtype) +
                                    " data by a factor other than 1 (integer results would be truncated)");
}

void check_castable(DType dst, DType src) {
    auto ok = [](DType d) { return d == DType::float32 || d == DType::float16 || d == DType::bfloat16; };
    if (!ok(dst) || !ok(src))
        throw std::invalid_argument(std::string("cast supports float32, float16 and bfloat16, not ") +
                                    dtype_name(src) + " -> " + dtype_name(dst));
}

namespace cpu {
namespace {

// Storage of the half types; the loops convert them with bit operations.
struct Half {
    uint16_t bits;
};
struct BFloat16 {
    uint16_t bits;
};

struct LoopTable {
    void (*reduce)(void* dst, const void* src, size_t n, DType dtype, Op op, bool scaled, double factor);
    void (*reduce_many)(void* dst, const void* const* srcs, size_t k, size_t n, DType dtype, Op op);
    void (*scale)(void* data, size_t n, DType dtype, double factor);
    void (*cast)(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n, double factor);
};

namespace baseline {
#include "reduce_loops.h"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
#define MPIDIST_HAVE_X86_LOOPS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MPIDIST_LOOPS_F16C 1
#define MPIDIST_LOOPS_AVX2 1
namespace avx2 {
#include "reduce_loops.h"
}  // namespace avx2
#undef MPIDIST_LOOPS_AVX2
#undef MPIDIST_LOOPS_WIDE
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports false -Wmaybe-uninitialized warnings from inside some AVX-512 intrinsics
// (their _mm512_undefined_* placeholders) once they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define MPIDIST_LOOPS_AVX512 1
namespace avx512 {
#include "reduce_loops.h"
}  // namespace avx512
#undef MPIDIST_LOOPS_AVX512
#undef MPIDIST_LOOPS_WIDE
#pragma GCC diagnostic pop
#pragma GCC pop_options
#undef MPIDIST_LOOPS_F16C
#endif

struct Selected {
    const LoopTable* loops;
    const char* isa;
};

// The loops compiled into this module that this CPU can run, widest first.
std::vector<Selected> runnable_loops() {
    std::vector<Selected> runnable;
#ifdef MPIDIST_HAVE_X86_LOOPS
    __builtin_cpu_init();
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        runnable.push_back({&avx512::kLoops, "avx512"});
    if (avx2) runnable.push_back({&avx2::kLoops, "avx2"});
#endif
    runnable.push_back({&baseline::kLoops, "baseline"});
    return runnable;
}

const std::vector<Selected>& runnable() {
    static const std::vector<Selected> loops = runnable_loops();
    return loops;
}

// The widest runnable loops unless set_isa chose others (to measure a narrower instruction set
// on a machine that has a wider one).
std::atomic<const Selected*> g_selected{nullptr};

const Selected& selected() {
    const Selected* chosen = g_selected.load(std::memory_order_acquire);
    return chosen ? *chosen : runnable().front();
}

// Below this many bytes copied (pack, unpack) one thread is faster than waking a team.
constexpr size_t kParallelBytes = size_t(1) << 20;
// The element kernels use a team once they touch this many elements over all the arrays they
// read and write: a reduce of 21,846 elements and more, a scale or cast of 32,768 (torch's grain
// size). The half types' kernels are compute-bound where the data is in cache, so a second thread
// nearly halves their time there (a 256 KiB float16 reduce on one thread ran at 0.53x torch's add
// on two, with AVX2, when the threshold was 1 MiB per array).
constexpr size_t kParallelElements = size_t(1) << 16;

std::atomic<int> g_num_threads{0};

int env_int(const char* name) {
    const char* value = std::getenv(name);
    if (!value || !*value) return 0;
    char* end = nullptr;
    long parsed = std::strtol(value, &end, 10);
    return (end && *end == '\0' && parsed > 0 && parsed < (1 << 20)) ? (int)parsed : 0;
}

int default_num_threads() {
    if (env_int("OMP_NUM_THREADS") > 0) return std::max(1, omp_get_max_threads());
    // Ranks sharing this node share its cores; oversubscribing them slows every rank.
    int ranks_here = 1;
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
        if (int value = env_int(name)) {
            ranks_here = value;
            break;
        }
    }
    return std::max(1, omp_get_num_procs() / ranks_here);
}

// Runs body(begin, end) over [0, n) elements: one contiguous, cache-line aligned chunk per thread.
// Every element's result depends only on that element, so the split never changes the result.
// `streams` is how many arrays of n elements (of elem_bytes each) the kernel reads or writes.
template <typename Body>
void parallel_chunks(size_t n, size_t elem_bytes, size_t streams, Body body) {
    const int threads = n * streams >= kParallelElements ? get_num_threads() : 1;
    if (threads <= 1) {
        body(size_t(0), n);
        return;
    }
    const size_t align = std::max<size_t>(1, 64 / elem_bytes);
#pragma omp parallel num_threads(threads)
    {
        const size_t team = (size_t)omp_get_num_threads();
        const size_t id = (size_t)omp_get_thread_num();
        const size_t per = ((n + team - 1) / team + align - 1) / align * align;
        const size_t begin = std::min(n, id * per);
        const size_t end = std::min(n, begin + per);
        if (begin < end) body(begin, end);
    }
}

char* bytes(void* p) { return static_cast<char*>(p); }
const char* bytes(const void* p) { return static_cast<const char*>(p); }

// Copies many byte ranges; ranges are cut into pieces so that threads share big ones.
void copy_ranges(const std::vector<char*>& dsts, const std::vector<const char*>& srcs,
                 const std::vector<size_t>& nbytes) {
    size_t total = 0;
    for (size_t len : nbytes) total += len;
    const int threads = total >= kParallelBytes ? get_num_threads() : 1;
    if (threads <= 1) {
        for (size_t i = 0; i < nbytes.size(); ++i)
            if (nbytes[i]) std::memcpy(dsts[i], srcs[i], nbytes[i]);
        return;
    }
    const size_t piece = std::max<size_t>(size_t(64) << 10, total / (size_t(threads) * 4));
    struct Piece {
        char* dst;
        const char* src;
        size_t len;
    };
    std::vector<Piece> pieces;
    pieces.reserve(total / piece + nbytes.size() + 1);
    for (size_t i = 0; i < nbytes.size(); ++i)
        for (size_t off = 0; off < nbytes[i]; off += piece)
            pieces.push_back({dsts[i] + off, srcs[i] + off, std::min(piece, nbytes[i] - off)});
    const long count = (long)pieces.size();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long i = 0; i < count; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].len);
}

void check_lengths(size_t ptrs, size_t lens) {
    if (ptrs != lens)
        throw std::invalid_argument("pack/unpack got " + std::to_string(ptrs) + " buffers but " +
                                    std::to_string(lens) + " byte counts");
}

}  // namespace

const char* isa() { return selected().isa; }

std::vector<std::string> runnable_isas() {
    std::vector<std::string> names;
    for (const Selected& loops : runnable()) names.push_back(loops.isa);
    return names;
}

void set_isa(const std::string& name) {
    for (const Selected& loops : runnable()) {
        if (name == loops.isa) {
            g_selected.store(&loops, std::memory_order_release);
            return;
        }
    }
    std::string listed;
    for (const std::string& isa : runnable_isas()) listed += (listed.empty() ? "" : ", ") + isa;
    throw std::invalid_argument("instruction set '" + name + "' is not one this CPU runs; it runs: " + listed);
}

void set_num_threads(int n) {
    if (n < 1) throw std::invalid_argument("number of threads must be >= 1, got " + std::to_string(n));
    g_num_threads.store(n);
}

int get_num_threads() {
    int n = g_num_threads.load();
    if (n == 0) {
        int expected = 0;
        g_num_threads.compare_exchange_strong(expected, default_num_threads());
        n = g_num_threads.load();
    }
    return n;
}

void reduce(void* dst, const void* src, size_t n, DType dtype, Op op) {
    if (n == 0) return;
    const LoopTable* loops = selected().loops;
    const size_t size = itemsize(dtype);
    parallel_chunks(n, size, 3, [&](size_t begin, size_t end) {
        loops->reduce(bytes(dst) + begin * size, bytes(src) + begin * size, end - begin, dtype, op, false, 1.0);
    });
}

void reduce_scale(void* dst, const void* src, size_t n, DType dtype, Op op, double factor) {
    check_scalable(dtype, factor);
    if (n == 0) return;
    const LoopTable* loops = selected().loops;
    const size_t size = itemsize(dtype);
    parallel_chunks(n, size, 3, [&](size_t begin, size_t end) {
        loops->reduce(bytes(dst) + begin * size, bytes(src) + begin * size, end - begin, dtype, op, true, factor);
    });
}

void scale(void* dst, size_t n, DType dtype, double factor) {
    if (!is_floating(dtype))
        throw std::invalid_argument(std::string("scale needs a floating dtype, got ") + dtype_name(dtype));
    if (n == 0) return;
    const LoopTable* loops = selected().loops;
    const size_t size = itemsize(dtype);
    parallel_chunks(n, size, 2, [&](size_t begin, size_t end) {
        loops->scale(bytes(dst) + begin * size, end - begin, dtype, factor);
    });
}

void reduce_many(void* dst, const std::vector<const void*>& srcs, size_t n, DType dtype, Op op) {
    if (srcs.empty()) throw std::invalid_argument("reduce_many needs at least one source");
    if (n == 0) return;
    const size_t size = itemsize(dtype);
    if (srcs.size() == 1) {
        if (srcs[0] != dst) copy_ranges({bytes(dst)}, {bytes(srcs[0])}, {n * size});
        return;
    }
    const LoopTable* loops = selected().loops;
    const size_t k = srcs.size();
    parallel_chunks(n, size, k + 1, [&](size_t begin, size_t end) {
        std::vector<const void*> shifted(k);
        for (size_t j = 0; j < k; ++j) shifted[j] = bytes(srcs[j]) + begin * size;
        loops->reduce_many(bytes(dst) + begin * size, shifted.data(), k, end - begin, dtype, op);
    });
}

// Elements are reduced, scaled and copied in blocks of this many bytes per operand, so that a
// block's result is still in L1 when it is scaled and copied (a 6 MB float32 slice of two ranks,
// scaled and published to one more address: 0.24 ms against 0.30 ms for the same three steps
// over 256 KiB pieces in L2; 4 and 16 KiB blocks measured level with 8).
constexpr size_t kBlockBytes = 8 << 10;

void reduce_many_to(const std::vector<void*>& dsts, const std::vector<const void*>& srcs, size_t n, DType dtype,
                    Op op, double factor) {
    if (srcs.empty()) throw std::invalid_argument("reduce_many_to needs at least one source");
    if (dsts.empty()) throw std::invalid_argument("reduce_many_to needs at least one destination");
    check_scalable(dtype, factor);
    if (n == 0) return;
    const LoopTable* loops = selected().loops;
    const size_t size = itemsize(dtype), k = srcs.size(), block = std::max<size_t>(1, kBlockBytes / size);
    parallel_chunks(n, size, k + dsts.size(), [&](size_t begin, size_t end) {
        std::vector<const void*> shifted(k);
        for (size_t low = begin; low < end; low += block) {
            const size_t count = std::min(block, end - low), offset = low * size;
            char* first = bytes(dsts[0]) + offset;
            for (size_t j = 0; j < k; ++j) shifted[j] = bytes(srcs[j]) + offset;
            // Every source's block is read here, before any destination's block is written
            // (a destination may be a source).
            if (k > 1)
                loops->reduce_many(first, shifted.data(), k, count, dtype, op);
            else if (shifted[0] != first)
                std::memcpy(first, shifted[0], count * size);
            if (factor != 1.0) loops->scale(first, count, dtype, factor);
            for (size_t j = 1; j < dsts.size(); ++j) {
                char* other = bytes(dsts[j]) + offset;
                if (other != first) std::memcpy(other, first, count * size);
            }
        }
    });
}

void pack(void* dst, const std::vector<const void*>& srcs, const std::vector<size_t>& nbytes) {
    check_lengths(srcs.size(), nbytes.size());
    std::vector<char*> to(srcs.size());
    std::vector<const char*> from(srcs.size());
    size_t offset = 0;
    for (size_t i = 0; i < srcs.size(); ++i) {
        to[i] = bytes(dst) + offset;
        from[i] = bytes(srcs[i]);
        offset += nbytes[i];
    }
    copy_ranges(to, from, nbytes);
}

void unpack(const void* src, const std::vector<void*>& dsts, const std::vector<size_t>& nbytes) {
    check_lengths(dsts.size(), nbytes.size());
    std::vector<char*> to(dsts.size());
    std::vector<const char*> from(dsts.size());
    size_t offset = 0;
    for (size_t i = 0; i < dsts.size(); ++i) {
        to[i] = bytes(dsts[i]);
        from[i] = bytes(src) + offset;
        offset += nbytes[i];
    }
    copy_ranges(to, from, nbytes);
}

void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n, double factor) {
    check_castable(dst_dtype, src_dtype);
    if (n == 0) return;
    const LoopTable* loops = selected().loops;
    const size_t dsize = itemsize(dst_dtype), ssize = itemsize(src_dtype);
    parallel_chunks(n, std::max(dsize, ssize), 2, [&](size_t begin, size_t end) {
        loops->cast(bytes(dst) + begin * dsize, dst_dtype, bytes(src) + begin * ssize, src_dtype, end - begin, factor);
    });
}

}  // namespace cpu
}  // namespace mpidist
