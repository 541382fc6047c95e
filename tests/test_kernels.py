"""Fused reduction kernels (mpidist.kernels / mpidist._C) against NumPy and torch references.

Tolerances come from the dtype's unit roundoff u (2**-24 float32, 2**-53 float64, 2**-11 float16,
2**-8 bfloat16):
  - reduce / min / max and single casts: one IEEE operation on exactly upcast inputs, rounded once
    (float64 math, then torch's round-to-nearest-even cast). Halves are combined in float32, and
    float32 has >= 2p+2 bits of the half types' p, so rounding twice equals rounding once: all
    compared bitwise.
  - reduce_scale: two operations, so |got - ref| <= 2u|ref| (halves: u_half|ref| + 2u_f32|ref|).
  - reduce_many: bitwise against the documented model (float32 accumulation left to right, one
    rounding), and against float64 within u|ref| + (k-1) u_acc sum|x_i|.
  - reduce_many_to: bitwise against the same model followed by scale's rounding (the product in
    float32, float64 for float64, rounded once).
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tolerances import UNIT_ROUNDOFF

from mpidist import _C, kernels
from mpidist.errors import InvalidArgumentError, MpidistError, UnsupportedDtypeError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8")
FLOATS = ("float16", "bfloat16", "float32", "float64")
HALVES = ("float16", "bfloat16")
# The last size spans several of the kernels' 8 KiB blocks in every dtype and is split over a team
# of threads (from 65,536 elements read and written, csrc/reduce.cpp), with a tail past both.
SIZES = (0, 1, 7, 1023, (1 << 16) + 3)
# Smallest positive subnormal: absolute slack where results underflow.
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149, "float64": 5e-324}
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ISAS = kernels.cpu_isas()  # this CPU's instruction sets, the default first


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs a test with the loops of each instruction set this CPU can run (each has its own
    register code for the half types), then goes back to the default."""
    kernels.set_cpu_isa(request.param)
    yield request.param
    kernels.set_cpu_isa(ISAS[0])


def tdtype(name):
    return getattr(torch, name)


def make(dtype, n, op="sum", seed=0):
    """Random data that suits `op`: products stay in range, integers exercise wrap-around."""
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        if op == "prod":
            x = torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.5
            x = x * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
        else:
            x = torch.randn(n, generator=g, dtype=torch.float64) * 100
        out = x.to(tdtype(dtype))
    elif dtype == "uint8":
        out = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    else:
        info = torch.iinfo(tdtype(dtype))
        lo, hi = max(info.min, -(1 << 40)), min(info.max, 1 << 40)
        out = torch.randint(lo, hi, (n,), generator=g, dtype=tdtype(dtype))
    return out


def as_f64(t):
    return t.cpu().to(torch.float64).numpy()


def bits(t):
    return t.cpu().contiguous().view(BITS[t.element_size()])


def assert_bitwise(got, ref):
    """Equal bit patterns, except that any NaN matches any NaN."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    got_c, ref_c = got.cpu(), ref.cpu()
    if got.is_floating_point():
        nan_got, nan_ref = torch.isnan(got_c), torch.isnan(ref_c)
        assert torch.equal(nan_got, nan_ref), "NaN positions differ"
        keep = ~nan_got
        got_c, ref_c = got_c[keep], ref_c[keep]
    diff = (bits(got_c) != bits(ref_c)).nonzero()
    assert diff.numel() == 0, (
        f"{diff.numel()} elements differ, first at {diff[0].item()}: "
        f"got {got_c[diff[0]].item()!r}, want {ref_c[diff[0]].item()!r}")


def assert_close(got, ref64, dtype, rel, abs_=None):
    """|got - ref64| <= rel * |ref64| + abs_, elementwise; NaN matches NaN."""
    g, r = as_f64(got), np.asarray(ref64, dtype=np.float64)
    nan = np.isnan(r)
    assert np.array_equal(np.isnan(g), nan)
    g, r = g[~nan], r[~nan]
    inf = np.isinf(r)
    assert np.array_equal(g[inf], r[inf])
    g, r = g[~inf], r[~inf]
    slack = rel * np.abs(r) + (TINY[dtype] if abs_ is None else abs_)
    bad = np.nonzero(np.abs(g - r) > slack)[0]
    assert bad.size == 0, f"{bad.size} elements off, first at {bad[0]}: got {g[bad[0]]!r}, want {r[bad[0]]!r}"


NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def reference(a, b, op):
    """a op b: float64 math rounded once for floats; same-dtype (wrapping) NumPy for integers."""
    if a.is_floating_point():
        with np.errstate(invalid="ignore"):  # Inf * 0 and Inf - Inf are meant to give NaN
            return torch.from_numpy(NP_OPS[op](as_f64(a), as_f64(b))).to(a.dtype)
    return torch.from_numpy(NP_OPS[op](a.numpy(), b.numpy()))


# ---- reduce ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("isa")
def test_reduce_matches_reference_bitwise(dtype, op, n):
    dst, src = make(dtype, n, op, seed=1), make(dtype, n, op, seed=2)
    want = reference(dst, src, op)
    kernels.reduce(dst, src, op)
    assert_bitwise(dst, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_misaligned_slices(dtype):
    n = 4099
    dst_base, src_base = make(dtype, n + 1, seed=3), make(dtype, n + 2, seed=4)
    dst, src = dst_base[1:], src_base[2:]  # one and two elements past the allocation's alignment
    before = dst_base[0].clone()
    want = reference(dst, src, "sum")
    kernels.reduce(dst, src, "sum")
    assert_bitwise(dst, want)
    assert_bitwise(dst_base[:1], before.reshape(1))


def test_reduce_numpy_arrays_and_aliasing():
    a = np.arange(1000, dtype=np.float32)
    kernels.reduce(a, a, "sum")  # dst is src
    np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float32) * 2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.usefixtures("isa")
def test_nan_and_inf_propagate(dtype, op):
    special = [np.nan, np.inf, -np.inf, 1.0, np.nan, np.inf, 0.0, -2.0]
    other = [1.0, 2.0, -np.inf, np.nan, np.nan, np.inf, np.inf, -np.inf]
    dst = torch.tensor(special, dtype=torch.float64).to(tdtype(dtype))
    src = torch.tensor(other, dtype=torch.float64).to(tdtype(dtype))
    want = reference(dst, src, op)
    # torch agrees on min/max: NaN on either side gives NaN.
    if op in ("min", "max"):
        torch_ref = (torch.minimum if op == "min" else torch.maximum)(dst, src)
        assert_bitwise(want, torch_ref)
    kernels.reduce(dst, src, op)
    assert_bitwise(dst, want)


@pytest.mark.parametrize("dtype,one_plus_tie", [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
@pytest.mark.usefixtures("isa")
def test_half_sum_rounds_ties_to_even(dtype, one_plus_tie):
    # 1 + half an ulp is a tie: even is 1.0; (1 + ulp) + half an ulp rounds up to 1 + 2 ulp.
    ulp = 2 * one_plus_tie
    dst = torch.tensor([1.0, 1.0 + ulp, -1.0, 3.0], dtype=torch.float64).to(tdtype(dtype))
    src = torch.tensor([one_plus_tie, one_plus_tie, -one_plus_tie, 0.0], dtype=torch.float64).to(tdtype(dtype))
    kernels.reduce(dst, src, "sum")
    want = torch.tensor([1.0, 1.0 + 2 * ulp, -1.0, 3.0], dtype=torch.float64).to(tdtype(dtype))
    assert_bitwise(dst, want)


# ---- reduce_scale and scale ------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.usefixtures("isa")
def test_reduce_scale_matches_float64(dtype, op, n):
    factor = 1.0 / 3.0
    dst, src = make(dtype, n, op, seed=5), make(dtype, n, op, seed=6)
    want = NP_OPS[op](as_f64(dst), as_f64(src)) * factor
    kernels.reduce_scale(dst, src, op, factor)
    acc_u = UNIT_ROUNDOFF["float64" if dtype == "float64" else "float32"]
    assert_close(dst, want, dtype, rel=UNIT_ROUNDOFF[dtype] + 2 * acc_u)


@pytest.mark.parametrize("dtype", ("int32", "int64", "uint8", "int8"))
def test_reduce_scale_integers_only_by_one(dtype):
    dst, src = make(dtype, 100, seed=7), make(dtype, 100, seed=8)
    want = reference(dst, src, "sum")
    kernels.reduce_scale(dst, src, "sum", 1)
    assert_bitwise(dst, want)
    with pytest.raises(UnsupportedDtypeError, match="truncated"):
        kernels.reduce_scale(dst, src, "sum", 0.5)
    with pytest.raises(UnsupportedDtypeError):
        kernels.scale(dst, 0.5)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.usefixtures("isa")
def test_half_scale_specials_and_misaligned_match_torch(dtype):
    # An odd count at an odd element offset (not 64-byte aligned), with NaN, infinities, signed
    # zeros, subnormals and values that overflow or round at the halfway point once scaled:
    # bitwise torch's float32 multiply rounded once to nearest even.
    torch_dtype = getattr(torch, dtype)
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 6e-8, 1e-40, 65504.0,
                           3e38, 1.0009765625, -2.5, 1.5], dtype=torch.float32)
    base = torch.cat([values, torch.randn(70001, generator=torch.Generator().manual_seed(3)) * 100])
    storage = base.to(torch_dtype)
    x = storage[1:-2]  # odd length
    for factor in (0.5, 3.0, 1e-3, -7.25):
        want = (x.float() * torch.tensor(factor, dtype=torch.float32)).to(torch_dtype)
        got = torch.empty(x.numel() + 1, dtype=torch_dtype)[1:].copy_(x)  # at an odd address
        kernels.scale(got, factor)
        assert_bitwise(got, want)


@pytest.mark.parametrize("n", (0, 7, (1 << 20) + 3))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.usefixtures("isa")
def test_scale_rounds_once(dtype, n):
    x = make(dtype, n, seed=9)
    want = torch.from_numpy(as_f64(x) * 0.1).to(x.dtype) if dtype != "float64" else x * 0.1
    kernels.scale(x, 0.1)
    if dtype == "float64":
        assert_bitwise(x, want)
    else:
        # 0.1 is rounded to float32 before multiplying: one extra u_f32.
        assert_close(x, as_f64(want), dtype, rel=UNIT_ROUNDOFF[dtype] + 2 * UNIT_ROUNDOFF["float32"])


# ---- reduce_many -----------------------------------------------------------------------------

def model_reduce_many(srcs, op):
    """The documented semantics: accumulate left to right (float32 for halves), round once."""
    dtype = srcs[0].dtype
    if dtype in (torch.float16, torch.bfloat16):
        acc = srcs[0].to(torch.float32).numpy()
        for s in srcs[1:]:
            acc = NP_OPS[op](acc, s.to(torch.float32).numpy())
        return torch.from_numpy(acc).to(dtype)
    acc = srcs[0].numpy()
    for s in srcs[1:]:
        acc = NP_OPS[op](acc, s.numpy())
    return torch.from_numpy(np.ascontiguousarray(acc))


@pytest.mark.parametrize("k", (1, 2, 3, 4, 6))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("isa")
def test_reduce_many(dtype, op, n, k):
    srcs = [make(dtype, n, op, seed=20 + j) for j in range(k)]
    want = model_reduce_many(srcs, op)
    dst = torch.empty_like(srcs[0])
    kernels.reduce_many(dst, srcs, op)
    assert_bitwise(dst, want)
    if dtype in FLOATS and op in ("sum", "prod") and n:
        exact = as_f64(srcs[0])
        for s in srcs[1:]:
            exact = NP_OPS[op](exact, as_f64(s))
        acc_u = UNIT_ROUNDOFF["float64" if dtype == "float64" else "float32"]
        if op == "sum":
            magnitude = sum(np.abs(as_f64(s)) for s in srcs)
            assert_close(dst, exact, dtype, rel=UNIT_ROUNDOFF[dtype], abs_=(k - 1) * acc_u * magnitude + TINY[dtype])
        else:
            assert_close(dst, exact, dtype, rel=UNIT_ROUNDOFF[dtype] + (k - 1) * 1.01 * acc_u)


@pytest.mark.parametrize("position", (0, 2))
def test_reduce_many_dst_aliases_a_source(position):
    srcs = [make("bfloat16", 5000, seed=40 + j) for j in range(3)]
    want = model_reduce_many(srcs, "sum")
    kernels.reduce_many(srcs[position], srcs, "sum")
    assert_bitwise(srcs[position], want)


@pytest.fixture
def kernel_threads():
    """Restores the kernels' thread count after a test that changes it."""
    before = kernels.get_num_threads()
    yield
    kernels.set_num_threads(before)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
def test_reduce_many_is_deterministic_across_thread_counts(dtype, kernel_threads):
    n = (1 << 21) + 5
    srcs = [make(dtype, n, seed=50 + j) for j in range(6)]
    results = []
    for threads in (1, 2, 3, 1):
        kernels.set_num_threads(threads)
        dst = torch.empty_like(srcs[0])
        kernels.reduce_many(dst, srcs, "sum")
        results.append(dst)
    for other in results[1:]:
        assert torch.equal(bits(results[0]), bits(other))


# ---- reduce_many_to --------------------------------------------------------------------------

def model_scale(x, factor):
    """scale's documented rounding: the product in float32 (float64 for float64), rounded once."""
    if x.dtype == torch.float64:
        return x * factor
    return (x.to(torch.float32) * torch.tensor(factor, dtype=torch.float32)).to(x.dtype)


# 5003 elements span several of the kernel's 8 KiB blocks; (1 << 19) + 3 runs on several threads.
@pytest.mark.parametrize("k", (1, 2, 3))
@pytest.mark.parametrize("n", (0, 7, 5003, (1 << 19) + 3))
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("isa")
def test_reduce_many_to(dtype, op, n, k):
    srcs = [make(dtype, n, op, seed=100 + j) for j in range(k)]
    factor = 1.0 / 3.0 if dtype in FLOATS else 1.0
    want = model_reduce_many(srcs, op)
    if factor != 1.0:
        want = model_scale(want, factor)
    dsts = [torch.empty_like(srcs[0]) for _ in range(3)]
    kernels.reduce_many_to(dsts, srcs, op, factor)
    for dst in dsts:
        assert_bitwise(dst, want)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16", "float64"))
def test_reduce_many_to_publishes_over_its_sources(dtype, threads, kernel_threads):
    # The shared-memory all-reduce's shape: the result goes over both sources (the rank's own
    # array and its peer's contribution), at an odd address, across many blocks and threads.
    n = (1 << 19) + 5
    kernels.set_num_threads(threads)
    for dsts_of in (lambda s: [s[0], s[1]], lambda s: [torch.empty_like(s[0]), s[1]]):
        srcs = [make(dtype, n + 1, seed=110 + j)[1:] for j in range(2)]
        want = model_scale(model_reduce_many(srcs, "sum"), 0.5)
        dsts = dsts_of(srcs)
        kernels.reduce_many_to(dsts, srcs, "sum", 0.5)
        for dst in dsts:
            assert_bitwise(dst, want)


def test_reduce_many_to_errors():
    x = torch.zeros(4)
    with pytest.raises(InvalidArgumentError, match="at least one destination"):
        kernels.reduce_many_to([], [x])
    with pytest.raises(InvalidArgumentError, match="at least one source"):
        kernels.reduce_many_to([x], [])
    with pytest.raises(InvalidArgumentError, match="count"):
        kernels.reduce_many_to([x, torch.zeros(3)], [x])
    with pytest.raises(InvalidArgumentError, match="dtype"):
        kernels.reduce_many_to([x], [x, torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(UnsupportedDtypeError, match="truncated"):
        kernels.reduce_many_to([torch.zeros(4, dtype=torch.int32)], [torch.zeros(4, dtype=torch.int32)], "sum", 0.5)
    with pytest.raises(InvalidArgumentError, match="valid ops"):
        kernels.reduce_many_to([x], [x], "mean")
    with pytest.raises(InvalidArgumentError, match="null pointer"):
        kernels.reduce_many_to_ptr([0], [x.data_ptr()], 4, "float32", "sum")


# ---- casts -----------------------------------------------------------------------------------

def float32_edge_values():
    """Ties, near-ties, subnormals, overflow, Inf and random bit patterns as float32."""
    g = torch.Generator().manual_seed(60)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = []
    for base in (0x3F800000, 0x3F810000, 0x47000000, 0x00800000, 0x38800000, 0x33800000):
        for low in (0x8000, 0x7FFF, 0x8001, 0x1000, 0x0FFF, 0x1001, 0x3000, 0x2000):
            ties += [base | low, (base | low) | -0x80000000]
    special = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 1e-8, 6e-8, 3e-8, 2.0**-24, 2.0**-25,
                            3.0 * 2.0**-26, 1e38, 3.4e38, 0.0, -0.0, float("inf"), float("-inf")],
                           dtype=torch.float32)
    ties = torch.tensor(ties, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([random_bits.view(torch.float32), ties, special])


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.usefixtures("isa")
def test_cast_float32_to_half_is_round_to_nearest_even(dtype):
    src = float32_edge_values()
    dst = torch.empty(src.numel(), dtype=tdtype(dtype))
    kernels.cast(dst, src)
    assert_bitwise(dst, src.to(tdtype(dtype)))  # torch's casts round to nearest even


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.usefixtures("isa")
def test_cast_half_to_float32_is_exact(dtype):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(tdtype(dtype))
    dst = torch.empty(every.numel(), dtype=torch.float32)
    kernels.cast(dst, every)
    assert_bitwise(dst, every.to(torch.float32))


@pytest.mark.parametrize("dst_dtype,src_dtype", [("float16", "float32"), ("bfloat16", "float32"),
                                                 ("float32", "float16"), ("float32", "bfloat16"),
                                                 ("float32", "float32"), ("bfloat16", "float16")])
@pytest.mark.parametrize("n", (0, 1, 7, 1023, (1 << 20) + 3))
@pytest.mark.usefixtures("isa")
def test_cast_with_scale_rounds_once(dst_dtype, src_dtype, n):
    src = make(src_dtype, n, seed=61)
    factor = 0.125  # a power of two: the scaled float32 value is exact, so only the cast rounds
    dst = torch.empty(n, dtype=tdtype(dst_dtype))
    kernels.cast(dst, src, scale=factor)
    assert_bitwise(dst, (src.to(torch.float32) * factor).to(tdtype(dst_dtype)))


@pytest.mark.usefixtures("isa")
def test_cast_misaligned_and_errors():
    src = make("float32", 1001, seed=62)[1:]
    dst = torch.empty(1001, dtype=torch.bfloat16)[1:]
    kernels.cast(dst, src, scale=3.0)
    assert_bitwise(dst, (src * 3.0).to(torch.bfloat16))
    with pytest.raises(UnsupportedDtypeError, match="float64"):
        kernels.cast(torch.empty(4, dtype=torch.float64), torch.empty(4))
    with pytest.raises(InvalidArgumentError, match="count"):
        kernels.cast(torch.empty(4, dtype=torch.float16), torch.empty(5))


# ---- pack / unpack ---------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(0,), (1, 7, 0, 1023), (300_000, 5, 700_001, 1 << 18)])
def test_pack_unpack_round_trip(sizes):
    parts = [make(DTYPES[i % len(DTYPES)], n, seed=70 + i) for i, n in enumerate(sizes)]
    total = sum(p.numel() * p.element_size() for p in parts)
    packed = torch.empty(total + 3, dtype=torch.uint8)
    kernels.pack(packed, parts)
    want = torch.cat([p.view(torch.uint8) for p in parts]) if total else torch.empty(0, dtype=torch.uint8)
    assert torch.equal(packed[:total], want)
    outs = [torch.empty_like(p) for p in parts]
    kernels.unpack(packed, outs)
    for out, part in zip(outs, parts):
        assert torch.equal(bits(out), bits(part))


def test_pack_needs_room():
    with pytest.raises(InvalidArgumentError, match="bytes"):
        kernels.pack(np.empty(7, dtype=np.uint8), [np.ones(2, dtype=np.float32)])


# ---- argument errors -------------------------------------------------------------------------

def test_mismatched_arguments_name_what_differs():
    with pytest.raises(InvalidArgumentError, match="dtype"):
        kernels.reduce(torch.zeros(4), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match="count"):
        kernels.reduce(torch.zeros(4), torch.zeros(5))
    with pytest.raises(InvalidArgumentError, match=r"srcs\[1\].*count"):
        kernels.reduce_many(torch.zeros(4), [torch.zeros(4), torch.zeros(3)])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        kernels.reduce_many(torch.zeros(4), [])


def test_unknown_op_lists_valid_ops():
    with pytest.raises(InvalidArgumentError, match="sum, min, max, prod"):
        kernels.reduce(torch.zeros(4), torch.zeros(4), "avg")
    with pytest.raises(InvalidArgumentError, match="'xor'"):
        kernels.reduce_ptr(0, 0, 0, "float32", "xor")


def test_unsupported_dtypes():
    with pytest.raises(UnsupportedDtypeError, match="complex64"):
        kernels.reduce(np.zeros(4, dtype=np.complex64), np.zeros(4, dtype=np.complex64))
    with pytest.raises(UnsupportedDtypeError, match="float8"):
        kernels.reduce_ptr(0, 0, 0, "float8", "sum")
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        _C.reduce(0, 0, 0, "float8", "sum")
    with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
        _C.reduce(0, 0, 0, "float32", "avg")


@pytest.mark.skipif(_C.built_with_cuda, reason="mpidist._C has CUDA: the no-CUDA error cannot happen")
def test_cuda_buffer_without_cuda_build_is_a_clear_error():
    with pytest.raises(MpidistError, match="built without CUDA; reinstall with MPIDIST_CUDA=1"):
        kernels.reduce_ptr(1, 1, 1, "float32", "sum", device="cuda:0")
    assert not hasattr(_C, "cuda_reduce")
    assert kernels.cuda_available() is False
    assert kernels.built_with_cuda() is False and kernels.cuda_device_count() == 0


@pytest.mark.skipif(not _C.built_with_cuda or _C.cuda_device_count() > 0,
                    reason="needs mpidist._C built with CUDA on a machine without a GPU")
def test_cuda_call_without_gpu_raises_the_cuda_error():
    assert kernels.cuda_available() is False
    assert kernels.built_with_cuda() is True and kernels.cuda_device_count() == 0
    with pytest.raises(MpidistError, match="mpidist CUDA error"):
        kernels.reduce_ptr(16, 16, 4, "float32", "sum", device="cuda:0")
    with pytest.raises(MpidistError, match="synchronize: mpidist CUDA error"):
        kernels.synchronize("cuda:0")
    kernels.synchronize("cpu")  # nothing to wait for


def test_cpu_isa_switch():
    assert kernels.cpu_isa() == ISAS[0] and "baseline" in ISAS
    kernels.set_cpu_isa("baseline")
    try:
        assert kernels.cpu_isa() == "baseline"
        with pytest.raises(InvalidArgumentError, match="'neon' is not one this CPU runs; it runs: " + ", ".join(ISAS)):
            kernels.set_cpu_isa("neon")
        assert kernels.cpu_isa() == "baseline"
    finally:
        kernels.set_cpu_isa(ISAS[0])
    assert kernels.cpu_isa() == ISAS[0]


def test_thread_count_setting(kernel_threads):
    kernels.set_num_threads(3)
    assert kernels.get_num_threads() == 3
    with pytest.raises(InvalidArgumentError):
        kernels.set_num_threads(0)


@pytest.mark.parametrize("env,expected", [
    ({"OMP_NUM_THREADS": "3"}, lambda procs: 3),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, lambda procs: max(1, procs // 2)),
    ({"SLURM_NTASKS_PER_NODE": "64"}, lambda procs: max(1, procs // 64)),
    ({}, lambda procs: procs),
])
def test_default_thread_count_shares_cores_between_local_ranks(env, expected):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_NUM_THREADS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")}
    clean.update(env)
    clean["PYTHONPATH"] = REPO + os.pathsep + clean.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", "import os; from mpidist import kernels; "
                          "print(kernels.get_num_threads(), len(os.sched_getaffinity(0)))"],
                         env=clean, capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == expected(int(out[1]))


# ---- CUDA ------------------------------------------------------------------------------------

ARM_CXX = shutil.which("aarch64-linux-gnu-g++")
EM_AARCH64 = 183  # e_machine of an ELF object for 64-bit Arm


@pytest.mark.skipif(ARM_CXX is None, reason="no aarch64 cross compiler (Debian's g++-aarch64-linux-gnu)")
def test_cpu_kernels_compile_for_arm(tmp_path):
    """The CPU loops build for 64-bit Arm (clusters of Grace CPUs), with setup.py's flags and no
    warnings: no x86-only code outside the x86 copies, which such a build leaves out."""
    obj = tmp_path / "reduce.o"
    result = subprocess.run([ARM_CXX, "-std=c++17", "-O3", "-fopenmp", "-fno-trapping-math", "-Wall", "-Werror",
                             "-Icsrc", "-c", "csrc/reduce.cpp", "-o", str(obj)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64


def _cuda_skip_reason():
    if not _C.built_with_cuda:
        return "no CUDA device: mpidist._C built without CUDA"
    if _C.cuda_device_count() == 0 or not torch.cuda.is_available():
        return "no GPU present"
    return None


cuda = pytest.mark.skipif(_cuda_skip_reason() is not None, reason=_cuda_skip_reason() or "")


@cuda
@pytest.mark.parametrize("n", (0, 1, 7, 1023, (1 << 20) + 3))
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_reduce_matches_reference(dtype, op, n):
    dst, src = make(dtype, n, op, seed=1), make(dtype, n, op, seed=2)
    want = reference(dst, src, op)
    dst, src = dst.cuda(), src.cuda()
    kernels.reduce(dst, src, op)
    torch.cuda.synchronize()
    assert_bitwise(dst, want)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", (0, 1, 3))
def test_cuda_misaligned_and_reduce_many_on_a_stream(dtype, offset):
    n = 100_003
    srcs = [make(dtype, n + offset, seed=80 + j)[offset:] for j in range(4)]
    want = model_reduce_many(srcs, "sum")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gpu = [s.cuda() for s in srcs]
        kernels.reduce_many(gpu[1], gpu, "sum")
    stream.synchronize()
    assert_bitwise(gpu[1], want)


@cuda
def test_cuda_synchronize_waits_for_the_pointer_kernels_stream():
    # The pointer-level kernels run on the legacy default stream when given none, and
    # kernels.synchronize waits for that stream, whatever stream torch has made current
    # (torch's own streams do not wait for the legacy one).
    n = 1 << 24
    dst, src = torch.ones(n, device="cuda"), torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(20):
            kernels.reduce_ptr(dst.data_ptr(), src.data_ptr(), n, "float32", "sum", device="cuda:0")
        kernels.synchronize("cuda:0")
        host = dst.cpu()  # copies on torch's current stream
    assert (host == 21).all()


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_matches_cpu_kernels(dtype):
    n = 300_001
    a, b = make(dtype, n, seed=90), make(dtype, n, seed=91)
    for op in kernels.OPS:
        cpu, gpu = a.clone(), a.cuda()
        kernels.reduce_scale(cpu, b, op, 0.25)
        kernels.reduce_scale(gpu, b.cuda(), op, 0.25)
        torch.cuda.synchronize()
        assert_bitwise(gpu, cpu)
    cpu, gpu = a.clone(), a.cuda()
    kernels.scale(cpu, 0.3)
    kernels.scale(gpu, 0.3)
    torch.cuda.synchronize()
    assert_bitwise(gpu, cpu)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_reduce_many_to_matches_cpu(dtype):
    n = 300_001
    srcs = [make(dtype, n, seed=120 + j) for j in range(3)]
    factor = 0.25 if dtype in FLOATS else 1.0
    cpu = [torch.empty_like(srcs[0]) for _ in range(2)]
    kernels.reduce_many_to(cpu, srcs, "sum", factor)
    gpu_srcs = [s.cuda() for s in srcs]
    gpu = [torch.empty_like(gpu_srcs[0]), gpu_srcs[2]]  # the second over a source
    kernels.reduce_many_to(gpu, gpu_srcs, "sum", factor)
    torch.cuda.synchronize()
    for got in gpu:
        assert_bitwise(got, cpu[0])


@cuda
def test_cuda_nan_inf_cast_and_pack():
    src = float32_edge_values().cuda()
    for dtype in HALVES:
        dst = torch.empty(src.numel(), dtype=tdtype(dtype), device="cuda")
        kernels.cast(dst, src)
        assert_bitwise(dst, src.to(tdtype(dtype)))
        back = torch.empty(src.numel(), dtype=torch.float32, device="cuda")
        kernels.cast(back, dst, scale=2.0)
        assert_bitwise(back, dst.float() * 2.0)
    x = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")], device="cuda")
    y = torch.tensor([1.0, float("nan"), -float("inf"), 2.0], device="cuda")
    for op, fn in (("min", torch.minimum), ("max", torch.maximum), ("sum", torch.add)):
        got = x.clone()
        kernels.reduce(got, y, op)
        assert_bitwise(got, fn(x, y))
    parts = [make(d, n, seed=i).cuda() for i, (d, n) in enumerate([("float32", 5), ("int8", 3), ("bfloat16", 70001)])]
    total = sum(p.numel() * p.element_size() for p in parts)
    packed = torch.empty(total, dtype=torch.uint8, device="cuda")
    kernels.pack(packed, parts)
    assert torch.equal(packed, torch.cat([p.view(torch.uint8) for p in parts]))
    outs = [torch.empty_like(p) for p in parts]
    kernels.unpack(packed, outs)
    torch.cuda.synchronize()
    for out, part in zip(outs, parts):
        assert torch.equal(bits(out), bits(part))
    assert kernels.cuda_available()
    assert kernels.built_with_cuda() is True and kernels.cuda_device_count() >= 1


@cuda
@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8, 16])
def test_cuda_pack_unpack_at_every_alignment(offset):
    """Parts whose bytes land at every alignment relative to the packed buffer (the copy's word
    width depends on it), one longer than a launch's pieces and more pieces than one launch
    holds; the bytes around the packed ones must stay untouched."""
    sizes = [("float32", 3), ("uint8", 5), ("float16", 7), ("float32", (3 << 20) + 1), ("bfloat16", 9),
             ("int8", 1), ("float32", 33), ("float64", 2)] + [("float32", (1 << 18) + 3)] * 70
    parts = [make(d, n, seed=90 + i).cuda() for i, (d, n) in enumerate(sizes)]
    total = sum(p.numel() * p.element_size() for p in parts)
    guard = torch.full((offset + total + 16,), 0xA5, dtype=torch.uint8, device="cuda")
    kernels.pack(guard[offset:offset + total], parts)
    want = torch.cat([p.view(torch.uint8) for p in parts])
    assert torch.equal(guard[offset:offset + total], want)
    assert bool((guard[:offset] == 0xA5).all()) and bool((guard[offset + total:] == 0xA5).all())
    outs = [torch.empty_like(p) for p in parts]
    kernels.unpack(guard[offset:offset + total], outs)
    torch.cuda.synchronize()
    for out, part in zip(outs, parts):
        assert torch.equal(bits(out), bits(part))


def test_node_one_shot_of_one_rank_reduces_its_own_slot_and_refuses_what_does_not_fit():
    """_C.node_one_shot with one local rank in plain memory: the one-shot's steps (copy in, publish,
    reduce every slot) give the input times the scale back, and arguments that would write past
    the slots or name no half are refused before anything is written."""
    counter = np.zeros(1, dtype=np.uint64)
    slots = np.zeros(2 * 128, dtype=np.uint8)
    first, second = slots.ctypes.data, slots.ctypes.data + 128
    one_shot = _C.NodeOneShotSlots([counter.ctypes.data], 0, [first], [second], 128)
    values = np.arange(1, 9, dtype=np.float32)
    for half, round_ in ((0, 0), (1, 1)):
        assert _C.node_one_shot(one_shot, half, round_, values.ctypes.data, 8, "float32", "sum", 0.5, 0, 0, 0.0) == -1
        assert counter[0] == round_ + 1
    np.testing.assert_array_equal(values, np.arange(1, 9, dtype=np.float32) / 4)
    np.testing.assert_array_equal(slots[128:160].view(np.float32), np.arange(1, 9, dtype=np.float32) / 2)
    large = np.ones(34, dtype=np.float32)
    with pytest.raises(ValueError, match="136 bytes do not fit slots of 128"):
        _C.node_one_shot(one_shot, 0, 2, large.ctypes.data, 34, "float32", "sum", 1.0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="132 bytes do not fit slots of 128"):  # behind a signature's 64
        _C.node_one_shot(one_shot, 0, 2, large.ctypes.data, 17, "float32", "sum", 1.0, large.ctypes.data, 0, 0.0)
    with pytest.raises(ValueError, match="no half 2"):
        _C.node_one_shot(one_shot, 2, 2, values.ctypes.data, 8, "float32", "sum", 1.0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="the two halves have 1 and 2 slots"):
        _C.NodeOneShotSlots([counter.ctypes.data], 0, [first], [first, second], 128)
    assert counter[0] == 2
