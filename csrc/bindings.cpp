// Python bindings of the mpidist._C extension.
//
// Buffers travel as raw addresses (Python ints), dtypes and ops as names; mpidist/kernels.py is
// the typed face that turns arrays into these. Every kernel releases the GIL while it runs so that
// communication threads keep going. Bad names raise ValueError naming the culprit.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "counters.h"
#include "quantize.h"
#include "reduce.h"

namespace py = pybind11;
using mpidist::DType;
using mpidist::Op;

namespace {

void* address(std::uintptr_t ptr, std::size_t bytes, const char* what) {
    if (ptr == 0 && bytes != 0) throw std::invalid_argument(std::string("null pointer passed as ") + what);
    return reinterpret_cast<void*>(ptr);
}

// The checked arguments of one node all-reduce (node_steps.h's Allreduce).
mpidist::node::Allreduce node_call(const std::vector<std::uintptr_t>& slots, const std::vector<std::uintptr_t>& counters,
                                   int local_rank, std::uint64_t round, const std::vector<mpidist::node::Segment>& segments,
                                   DType dtype, const std::string& op, double scale, bool results_in_slots,
                                   bool one_shot, int step, int until, std::uintptr_t signature = 0) {
    if (slots.size() != counters.size() || slots.empty())
        throw std::invalid_argument("node_allreduce: one slot and one counter per local rank, got " +
                                    std::to_string(slots.size()) + " slots and " + std::to_string(counters.size()) +
                                    " counters");
    if (local_rank < 0 || static_cast<std::size_t>(local_rank) >= slots.size())
        throw std::invalid_argument("node_allreduce: local rank " + std::to_string(local_rank) + " of " +
                                    std::to_string(slots.size()));
    if (step < 0 || step > mpidist::node::allreduce_round_count(one_shot))
        throw std::invalid_argument("node_allreduce: no step " + std::to_string(step));
    if (until != -1 && (until <= step || until > mpidist::node::allreduce_round_count(one_shot)))
        throw std::invalid_argument("node_allreduce: cannot stop before step " + std::to_string(until) +
                                    " when starting at step " + std::to_string(step));
    mpidist::check_scalable(dtype, scale);
    const std::size_t item = mpidist::itemsize(dtype);
    std::size_t bytes = 0;
    for (const auto& segment : segments) {
        if (segment.nbytes % item)
            throw std::invalid_argument("node_allreduce: a segment of " + std::to_string(segment.nbytes) +
                                        " bytes is not whole elements");
        address(segment.address, segment.nbytes, "an all-reduce segment");
        bytes += segment.nbytes;
    }
    if (signature && !one_shot) throw std::invalid_argument("node_allreduce: only a one-shot compares signatures");
    const std::size_t room = signature ? mpidist::node::kSignatureBytes : 0;
    for (auto p : slots) address(p, room + bytes, "a node window slot");
    return {slots, counters, local_rank, round, segments, bytes / item, dtype, mpidist::parse_op(op), scale,
            results_in_slots, one_shot, reinterpret_cast<const void*>(signature)};
}

std::vector<const void*> const_addresses(const std::vector<std::uintptr_t>& ptrs, std::size_t bytes, const char* what) {
    std::vector<const void*> out;
    out.reserve(ptrs.size());
    for (auto p : ptrs) out.push_back(address(p, bytes, what));
    return out;
}

std::vector<void*> addresses(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& nbytes) {
    std::vector<void*> out;
    out.reserve(ptrs.size());
    for (std::size_t i = 0; i < ptrs.size(); ++i)
        out.push_back(address(ptrs[i], i < nbytes.size() ? nbytes[i] : 0, "a pack/unpack buffer"));
    return out;
}

std::vector<const void*> const_addresses(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& nbytes) {
    std::vector<const void*> out;
    out.reserve(ptrs.size());
    for (std::size_t i = 0; i < ptrs.size(); ++i)
        out.push_back(address(ptrs[i], i < nbytes.size() ? nbytes[i] : 0, "a pack/unpack buffer"));
    return out;
}

std::size_t total(const std::vector<std::size_t>& nbytes) {
    std::size_t sum = 0;
    for (auto b : nbytes) sum += b;
    return sum;
}

// The one-shot slots of one node window (the small-message fast path and the call check): its
// flags and the two halves of its slots, given once when the slots are made, so that each
// node_one_shot call passes only what changes (node_allreduce converts its lists at every call,
// which a message of a few bytes feels).
struct NodeOneShotSlots {
    NodeOneShotSlots(const std::vector<std::uintptr_t>& counters, int local_rank, const std::vector<std::uintptr_t>& first,
                     const std::vector<std::uintptr_t>& second, std::size_t capacity)
        : capacity(capacity) {
        if (first.size() != second.size())
            throw std::invalid_argument("NodeOneShotSlots: the two halves have " + std::to_string(first.size()) +
                                        " and " + std::to_string(second.size()) + " slots");
        for (const auto* slots : {&first, &second})
            for (auto p : *slots) address(p, capacity, "a node window slot");
        halves[0] = node_call(first, counters, local_rank, 0, {{0, 0}}, DType::float32, "sum", 1.0, false, true, 0, -1);
        halves[1] = node_call(second, counters, local_rank, 0, {{0, 0}}, DType::float32, "sum", 1.0, false, true, 0, -1);
    }

    mpidist::node::Allreduce halves[2];  // the call of each half, the arguments that change set per call
    std::size_t capacity;
};

// The one-shot all-reduce (node_steps.h) in half 0 or 1 of `slots`.
int node_one_shot(NodeOneShotSlots& slots, int half, std::uint64_t round, std::uintptr_t buffer, std::size_t count,
                  const std::string& dtype, const std::string& op, double scale, std::uintptr_t signature, int step,
                  double patience, int until) {
    const int rounds = mpidist::node::allreduce_round_count(true);
    if (half != 0 && half != 1) throw std::invalid_argument("node_one_shot: no half " + std::to_string(half));
    if (step < 0 || step > rounds) throw std::invalid_argument("node_one_shot: no step " + std::to_string(step));
    if (until != -1 && (until <= step || until > rounds))
        throw std::invalid_argument("node_one_shot: cannot stop before step " + std::to_string(until) +
                                    " when starting at step " + std::to_string(step));
    mpidist::node::Allreduce& call = slots.halves[half];
    const DType t = mpidist::parse_dtype(dtype);
    mpidist::check_scalable(t, scale);
    const std::size_t bytes = count * mpidist::itemsize(t);
    const std::size_t room = signature ? mpidist::node::kSignatureBytes : 0;
    if (room + bytes > slots.capacity)
        throw std::invalid_argument("node_one_shot: " + std::to_string(room + bytes) + " bytes do not fit slots of " +
                                    std::to_string(slots.capacity));
    call.round = round;
    call.buffer[0] = {reinterpret_cast<std::uintptr_t>(address(buffer, bytes, "an all-reduce buffer")), bytes};
    call.count = count;
    call.dtype = t;
    call.op = mpidist::parse_op(op);
    call.scale = scale;
    call.signature = reinterpret_cast<const void*>(signature);
    py::gil_scoped_release unlocked;
    return mpidist::node::host_allreduce(call, step, patience, until);
}

// Each back end provides the kernels as static functions with a trailing `Launch` (nothing on
// CPU; stream and device on CUDA), so both share one set of argument conversions.
struct CpuBackend {
    struct Launch {};
    static void reduce(void* d, const void* s, std::size_t n, DType t, Op o, Launch) { mpidist::cpu::reduce(d, s, n, t, o); }
    static void reduce_scale(void* d, const void* s, std::size_t n, DType t, Op o, double f, Launch) {
        mpidist::cpu::reduce_scale(d, s, n, t, o, f);
    }
    static void scale(void* d, std::size_t n, DType t, double f, Launch) { mpidist::cpu::scale(d, n, t, f); }
    static void reduce_many(void* d, const std::vector<const void*>& s, std::size_t n, DType t, Op o, Launch) {
        mpidist::cpu::reduce_many(d, s, n, t, o);
    }
    static void reduce_many_to(const std::vector<void*>& d, const std::vector<const void*>& s, std::size_t n, DType t,
                               Op o, double f, Launch) {
        mpidist::cpu::reduce_many_to(d, s, n, t, o, f);
    }
    static void pack(void* d, const std::vector<const void*>& s, const std::vector<std::size_t>& b, Launch) {
        mpidist::cpu::pack(d, s, b);
    }
    static void unpack(const void* s, const std::vector<void*>& d, const std::vector<std::size_t>& b, Launch) {
        mpidist::cpu::unpack(s, d, b);
    }
    static void cast(void* d, DType dt, const void* s, DType st, std::size_t n, double f, Launch) {
        mpidist::cpu::cast(d, dt, s, st, n, f);
    }
};

#ifdef MPIDIST_WITH_CUDA
struct CudaBackend {
    struct Launch {
        std::uintptr_t stream;
        int device;
    };
    static void reduce(void* d, const void* s, std::size_t n, DType t, Op o, Launch l) {
        mpidist::cuda::reduce(d, s, n, t, o, l.stream, l.device);
    }
    static void reduce_scale(void* d, const void* s, std::size_t n, DType t, Op o, double f, Launch l) {
        mpidist::cuda::reduce_scale(d, s, n, t, o, f, l.stream, l.device);
    }
    static void scale(void* d, std::size_t n, DType t, double f, Launch l) { mpidist::cuda::scale(d, n, t, f, l.stream, l.device); }
    static void reduce_many(void* d, const std::vector<const void*>& s, std::size_t n, DType t, Op o, Launch l) {
        mpidist::cuda::reduce_many(d, s, n, t, o, l.stream, l.device);
    }
    static void reduce_many_to(const std::vector<void*>& d, const std::vector<const void*>& s, std::size_t n, DType t,
                               Op o, double f, Launch l) {
        mpidist::cuda::reduce_many_to(d, s, n, t, o, f, l.stream, l.device);
    }
    static void pack(void* d, const std::vector<const void*>& s, const std::vector<std::size_t>& b, Launch l) {
        mpidist::cuda::pack(d, s, b, l.stream, l.device);
    }
    static void unpack(const void* s, const std::vector<void*>& d, const std::vector<std::size_t>& b, Launch l) {
        mpidist::cuda::unpack(s, d, b, l.stream, l.device);
    }
    static void cast(void* d, DType dt, const void* s, DType st, std::size_t n, double f, Launch l) {
        mpidist::cuda::cast(d, dt, s, st, n, f, l.stream, l.device);
    }
};
#endif

// The Python signature of each kernel, plus the launch arguments of the back end.
// A are the C++ types of the launch arguments, extra their py::arg descriptions.
template <typename Backend, typename... A, typename... Extra>
void bind_kernels(py::module_& m, const std::string& prefix, Extra... extra) {
    using Launch = typename Backend::Launch;
    m.def((prefix + "reduce").c_str(),
          [](std::uintptr_t dst, std::uintptr_t src, std::size_t n, const std::string& dtype,
                   const std::string& op, A... args) {
              const DType t = mpidist::parse_dtype(dtype);
              const Op o = mpidist::parse_op(op);
              const std::size_t bytes = n * mpidist::itemsize(t);
              void* d = address(dst, bytes, "dst");
              const void* s = address(src, bytes, "src");
              py::gil_scoped_release release;
              Backend::reduce(d, s, n, t, o, Launch{args...});
          },
          "dst = dst op src, element-wise, in place.", py::arg("dst"), py::arg("src"), py::arg("n"),
          py::arg("dtype"), py::arg("op"), extra...);
    m.def((prefix + "reduce_scale").c_str(),
          [](std::uintptr_t dst, std::uintptr_t src, std::size_t n, const std::string& dtype,
                   const std::string& op, double factor, A... args) {
              const DType t = mpidist::parse_dtype(dtype);
              const Op o = mpidist::parse_op(op);
              mpidist::check_scalable(t, factor);
              const std::size_t bytes = n * mpidist::itemsize(t);
              void* d = address(dst, bytes, "dst");
              const void* s = address(src, bytes, "src");
              py::gil_scoped_release release;
              Backend::reduce_scale(d, s, n, t, o, factor, Launch{args...});
          },
          "dst = (dst op src) * scale in one pass; integer dtypes accept only scale == 1.", py::arg("dst"),
          py::arg("src"), py::arg("n"), py::arg("dtype"), py::arg("op"), py::arg("scale"), extra...);
    m.def((prefix + "scale").c_str(),
          [](std::uintptr_t dst, std::size_t n, const std::string& dtype, double factor,
                   A... args) {
              const DType t = mpidist::parse_dtype(dtype);
              if (!mpidist::is_floating(t))
                  throw std::invalid_argument("scale needs a floating dtype, got " + dtype);
              void* d = address(dst, n * mpidist::itemsize(t), "dst");
              py::gil_scoped_release release;
              Backend::scale(d, n, t, factor, Launch{args...});
          },
          "dst *= factor (floating dtypes).", py::arg("dst"), py::arg("n"), py::arg("dtype"), py::arg("factor"),
          extra...);
    m.def((prefix + "reduce_many").c_str(),
          [](std::uintptr_t dst, const std::vector<std::uintptr_t>& srcs, std::size_t n,
                   const std::string& dtype, const std::string& op, A... args) {
              const DType t = mpidist::parse_dtype(dtype);
              const Op o = mpidist::parse_op(op);
              if (srcs.empty()) throw std::invalid_argument("reduce_many needs at least one source");
              const std::size_t bytes = n * mpidist::itemsize(t);
              void* d = address(dst, bytes, "dst");
              const std::vector<const void*> s = const_addresses(srcs, bytes, "a source");
              py::gil_scoped_release release;
              Backend::reduce_many(d, s, n, t, o, Launch{args...});
          },
          "dst = srcs[0] op srcs[1] op ... in one pass, left to right; dst may be one of srcs.",
          py::arg("dst"), py::arg("srcs"), py::arg("n"), py::arg("dtype"), py::arg("op"), extra...);
    m.def((prefix + "reduce_many_to").c_str(),
          [](const std::vector<std::uintptr_t>& dsts, const std::vector<std::uintptr_t>& srcs, std::size_t n,
                   const std::string& dtype, const std::string& op, double factor, A... args) {
              const DType t = mpidist::parse_dtype(dtype);
              const Op o = mpidist::parse_op(op);
              mpidist::check_scalable(t, factor);
              if (srcs.empty()) throw std::invalid_argument("reduce_many_to needs at least one source");
              if (dsts.empty()) throw std::invalid_argument("reduce_many_to needs at least one destination");
              const std::size_t bytes = n * mpidist::itemsize(t);
              std::vector<void*> d;
              for (auto p : dsts) d.push_back(address(p, bytes, "a destination"));
              const std::vector<const void*> s = const_addresses(srcs, bytes, "a source");
              py::gil_scoped_release release;
              Backend::reduce_many_to(d, s, n, t, o, factor, Launch{args...});
          },
          "Every dsts[j] = (srcs[0] op srcs[1] op ...) * scale in one pass (bitwise reduce_many, then "
          "scale, then copies); a destination may be a source, never overlap one partially.",
          py::arg("dsts"), py::arg("srcs"), py::arg("n"), py::arg("dtype"), py::arg("op"), py::arg("scale") = 1.0,
          extra...);
    m.def((prefix + "pack").c_str(),
          [](std::uintptr_t dst, const std::vector<std::uintptr_t>& srcs, const std::vector<std::size_t>& nbytes,
                   A... args) {
              if (srcs.size() != nbytes.size())
                  throw std::invalid_argument("pack got " + std::to_string(srcs.size()) + " sources but " +
                                              std::to_string(nbytes.size()) + " byte counts");
              void* d = address(dst, total(nbytes), "dst");
              const std::vector<const void*> s = const_addresses(srcs, nbytes);
              py::gil_scoped_release release;
              Backend::pack(d, s, nbytes, Launch{args...});
          },
          "Copy srcs[i] (nbytes[i] bytes each) back to back into dst.", py::arg("dst"), py::arg("srcs"),
          py::arg("nbytes"), extra...);
    m.def((prefix + "unpack").c_str(),
          [](std::uintptr_t src, const std::vector<std::uintptr_t>& dsts, const std::vector<std::size_t>& nbytes,
                   A... args) {
              if (dsts.size() != nbytes.size())
                  throw std::invalid_argument("unpack got " + std::to_string(dsts.size()) + " destinations but " +
                                              std::to_string(nbytes.size()) + " byte counts");
              const void* s = address(src, total(nbytes), "src");
              const std::vector<void*> d = addresses(dsts, nbytes);
              py::gil_scoped_release release;
              Backend::unpack(s, d, nbytes, Launch{args...});
          },
          "Copy consecutive ranges of src (nbytes[i] bytes each) into dsts[i].", py::arg("src"), py::arg("dsts"),
          py::arg("nbytes"), extra...);
    m.def((prefix + "cast").c_str(),
          [](std::uintptr_t dst, const std::string& dst_dtype, std::uintptr_t src, const std::string& src_dtype,
                   std::size_t n, double factor, A... args) {
              const DType dt = mpidist::parse_dtype(dst_dtype);
              const DType st = mpidist::parse_dtype(src_dtype);
              mpidist::check_castable(dt, st);
              void* d = address(dst, n * mpidist::itemsize(dt), "dst");
              const void* s = address(src, n * mpidist::itemsize(st), "src");
              py::gil_scoped_release release;
              Backend::cast(d, dt, s, st, n, factor, Launch{args...});
          },
          "dst = round(src * scale) between float32, float16 and bfloat16 (scale applied in float32, "
          "round to nearest even).",
          py::arg("dst"), py::arg("dst_dtype"), py::arg("src"), py::arg("src_dtype"), py::arg("n"),
          py::arg("scale") = 1.0, extra...);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "mpidist fused reduction kernels (CPU, and CUDA when built with it)";
#ifdef MPIDIST_WITH_CUDA
    m.attr("built_with_cuda") = true;
#else
    m.attr("built_with_cuda") = false;
#endif
    bind_kernels<CpuBackend>(m, "");
    m.def("int8_quantize",
          [](const std::string& dtype, std::uintptr_t grad, std::uintptr_t residual, std::size_t n, std::size_t rows,
             std::size_t part, std::size_t chunk, std::uintptr_t payload) {
              const DType t = mpidist::parse_dtype(dtype);
              const std::size_t bytes = n * mpidist::itemsize(t);
              const void* g = address(grad, bytes, "grad");
              void* r = address(residual, bytes, "residual");
              auto p = static_cast<std::uint8_t*>(address(payload, rows, "payload"));
              py::gil_scoped_release release;
              mpidist::cpu::int8_quantize(t, g, r, n, rows, part, chunk, p);
          },
          "Payload rows (int8 values, then float32 scales per chunk) of grad + residual; residual = what "
          "was not sent.",
          py::arg("dtype"), py::arg("grad"), py::arg("residual"), py::arg("n"), py::arg("rows"), py::arg("part"),
          py::arg("chunk"), py::arg("payload"));
    m.def("int8_sum_requantize",
          [](const std::string& dtype, std::uintptr_t received, std::size_t rows, std::size_t part, std::size_t chunk,
             std::uintptr_t residual, std::size_t residual_len, std::uintptr_t out) {
              const DType t = mpidist::parse_dtype(dtype);
              auto in = static_cast<const std::uint8_t*>(address(received, rows, "received"));
              void* r = address(residual, residual_len, "residual");
              auto o = static_cast<std::uint8_t*>(address(out, part, "out"));
              py::gil_scoped_release release;
              mpidist::cpu::int8_sum_requantize(t, in, rows, part, chunk, r, residual_len, o);
          },
          "The received payload rows summed in row order, quantized into out; residual += the sum minus "
          "what out holds.",
          py::arg("dtype"), py::arg("received"), py::arg("rows"), py::arg("part"), py::arg("chunk"),
          py::arg("residual"), py::arg("residual_len"), py::arg("out"));
    m.def("int8_dequantize",
          [](const std::string& dtype, std::uintptr_t payload, std::size_t rows, std::size_t part, std::size_t chunk,
             std::uintptr_t flat, std::size_t n) {
              const DType t = mpidist::parse_dtype(dtype);
              auto p = static_cast<const std::uint8_t*>(address(payload, rows, "payload"));
              void* f = address(flat, n, "flat");
              py::gil_scoped_release release;
              mpidist::cpu::int8_dequantize(t, p, rows, part, chunk, f, n);
          },
          "flat = the payload rows' values times their scales.", py::arg("dtype"), py::arg("payload"),
          py::arg("rows"), py::arg("part"), py::arg("chunk"), py::arg("flat"), py::arg("n"));
    m.def("int8_row_bytes", &mpidist::cpu::int8_row_bytes, py::arg("part"), py::arg("chunk"),
          "Bytes of one int8 payload row: part values and a float32 scale per chunk.");
    m.def("set_num_threads", &mpidist::cpu::set_num_threads, py::arg("n"),
          "Threads the CPU kernels use once a call touches 65,536 elements or more (over all its arrays).");
    m.def("get_num_threads", &mpidist::cpu::get_num_threads);
    m.def("store_counter", &mpidist::store_counter, py::arg("address"), py::arg("value"),
          "Publish a progress counter in shared memory (after a full fence).");
    m.def("counters_reached", &mpidist::counters_reached, py::arg("addresses"), py::arg("value"),
          "Whether every progress counter at these addresses has reached value.");
    // Two faces of the one node all-reduce (csrc/node_steps.h): a buffer (the node window's
    // calls, small messages among them, which a list of segments would slow down) and the
    // gradient buckets' segments laid end to end.
    m.def("node_allreduce",
          [](const std::vector<std::uintptr_t>& slots, const std::vector<std::uintptr_t>& counters, int local_rank,
             std::uint64_t round, std::uintptr_t buffer, std::size_t count, const std::string& dtype,
             const std::string& op, double scale, int step, double patience, int until) {
              const DType t = mpidist::parse_dtype(dtype);
              const std::vector<mpidist::node::Segment> segments{{buffer, count * mpidist::itemsize(t)}};
              const auto call = node_call(slots, counters, local_rank, round, segments, t, op, scale, false, false,
                                          step, until);
              py::gil_scoped_release unlocked;
              return mpidist::node::host_allreduce(call, step, patience, until);
          },
          py::arg("slots"), py::arg("counters"), py::arg("local_rank"), py::arg("round"), py::arg("buffer"),
          py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("scale"), py::arg("step"), py::arg("patience"),
          py::arg("until") = -1,
          "The sliced all-reduce on one node through the node window in host memory (csrc/node_steps.h), "
          "from `step` on: -1 once the result is in place, else the step whose round a local rank has not "
          "reached within `patience` seconds (wait for round + step, then call again from it), or "
          "`until` when given (>= 0), before which it stops. node_one_shot is its one-shot.");
    py::class_<NodeOneShotSlots>(m, "NodeOneShotSlots",
                                 "A node window's flags and the two halves of its one-shot slots, each slot of "
                                 "`capacity` bytes, for node_one_shot.")
        .def(py::init<const std::vector<std::uintptr_t>&, int, const std::vector<std::uintptr_t>&,
                      const std::vector<std::uintptr_t>&, std::size_t>(),
             py::arg("counters"), py::arg("local_rank"), py::arg("first"), py::arg("second"), py::arg("capacity"));
    m.def("node_one_shot", &node_one_shot, py::arg("slots"), py::arg("half"), py::arg("round"), py::arg("buffer"),
          py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("scale"), py::arg("signature"), py::arg("step"),
          py::arg("patience"), py::arg("until") = -1,
          "The one-shot all-reduce on one node (csrc/node_steps.h) in `half` (0 or 1) of a NodeOneShotSlots, "
          "its steps and return values as node_allreduce's. With a `signature` (the address of "
          "node_signature_bytes bytes; 0: none) it compares the ranks' first, and returns "
          "node_signatures_differ, having reduced nothing, where they differ.");
    m.attr("node_signature_bytes") = mpidist::node::kSignatureBytes;
    m.attr("node_signatures_differ") = mpidist::node::kSignaturesDiffer;
    m.def("node_bucket_allreduce",
          [](const std::vector<std::uintptr_t>& slots, const std::vector<std::uintptr_t>& counters, int local_rank,
             std::uint64_t round, const std::vector<std::pair<std::uintptr_t, std::size_t>>& segments,
             const std::string& dtype, const std::string& op, double scale, bool results_in_slots, int step,
             double patience, int until) {
              std::vector<mpidist::node::Segment> buffer;
              for (const auto& [pointer, nbytes] : segments) buffer.push_back({pointer, nbytes});
              const auto call = node_call(slots, counters, local_rank, round, buffer, mpidist::parse_dtype(dtype), op,
                                          scale, results_in_slots, false, step, until);
              py::gil_scoped_release unlocked;
              return mpidist::node::host_allreduce(call, step, patience, until);
          },
          py::arg("slots"), py::arg("counters"), py::arg("local_rank"), py::arg("round"), py::arg("segments"),
          py::arg("dtype"), py::arg("op"), py::arg("scale"), py::arg("results_in_slots"), py::arg("step"),
          py::arg("patience"), py::arg("until") = -1,
          "node_allreduce's sliced steps over the (address, bytes) segments laid end to end (a gradient "
          "bucket); with results_in_slots every slot ends with the whole result and the segments are only read.");
    m.def("node_allreduce_rounds", &mpidist::node::allreduce_round_count, py::arg("one_shot"),
          "The node window rounds one node_allreduce call takes.");
    m.def("cpu_isa", &mpidist::cpu::isa, "Instruction set the CPU loops run: the widest this CPU has, or set_cpu_isa's.");
    m.def("cpu_isas", &mpidist::cpu::runnable_isas, "Instruction sets this CPU can run the loops with, widest first.");
    m.def("set_cpu_isa", &mpidist::cpu::set_isa, py::arg("name"),
          "Run the CPU loops compiled for this instruction set (one of cpu_isas()).");
#ifdef MPIDIST_WITH_CUDA
    bind_kernels<CudaBackend, std::uintptr_t, int>(m, "cuda_", py::arg("stream") = std::uintptr_t(0), py::arg("device") = -1);
    m.def("cuda_synchronize", &mpidist::cuda::synchronize, py::arg("stream") = std::uintptr_t(0),
          py::arg("device") = -1, py::call_guard<py::gil_scoped_release>(),
          "Wait for the work queued on a stream (0: the legacy default stream) of a device.");
    m.def("cuda_device_count", &mpidist::cuda::device_count,
          "Number of CUDA devices; 0 when there is no driver or GPU.");
    m.attr("cuda_max_sources") = mpidist::cuda::kMaxSources;
#endif
}
