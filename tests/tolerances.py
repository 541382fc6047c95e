"""How close the tests' results must be to their float64 references: bounds derived from the
dtype's unit roundoff u and the rank count p, so that float64 is checked at float64 precision.

- Data that only travels (broadcast, gather, scatter, all-to-all, send and receive) arrives bit
  for bit: assert_exact.
- A reduction over p ranks of inputs x_1..x_p, in any order of operations (reduction_bound,
  assert_reduced):
  - integers, min and max: exact.
  - sum: at most p-1 additions round once each (half types accumulate in float32 inside a
    kernel and round once per kernel call), so |error| <= (p-1) * u * sum_i |x_i|.
  - avg: the sum's bound divided by p, plus two roundings of the scaling: + 2u * |result|.
  - prod: p-1 multiplications, each off by a relative u: |error| <= (p-1) * u * |result|.
  - each scaling by a factor (Horovod's prescale and postscale) rounds once more, at most
    u * sum_i |x_i| (scaled).
- A computation around collectives (autograd through one, a normalization, training steps)
  against the same computation in one process (assert_within): the two differ only in the order
  of their operations. `roundings` bounds the roundings either side makes on the way to a value,
  each off by at most u times the largest magnitude involved, which the tests' inputs (of order
  one) keep within the result's largest: |error| <= roundings * u * max |expected| (normwise).
The float64 reference rounds too, so u is replaced by u + 2^-53 (this matters for float64). A
factor 1.01 covers the second-order terms of these first-order bounds.
"""
import numpy as np
import torch

# Unit roundoff per dtype: a correctly rounded operation is off by at most u * |result|.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
REDUCTIONS = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max, "prod": np.prod}


def dtype_name(dtype) -> str:
    """'float64' for torch.float64, np.dtype('float64') or 'float64'."""
    return str(dtype).removeprefix("torch.")


def roundoff(dtype) -> float:
    """u of `dtype` plus that of the float64 reference it is compared with."""
    return UNIT_ROUNDOFF[dtype_name(dtype)] + UNIT_ROUNDOFF["float64"]


def is_exact(dtype) -> bool:
    return dtype_name(dtype) not in UNIT_ROUNDOFF


def reduction_reference(inputs, op) -> np.ndarray:
    """The reduction of every rank's input (float64 NumPy arrays) in float64."""
    return REDUCTIONS[op](np.stack(inputs), axis=0)


def reduction_bound(inputs, op, dtype, scalings=0):
    """Elementwise bound of |result - reduction_reference(inputs, op)| for a reduction of
    `inputs` (float64 NumPy arrays, one per rank) in `dtype`, `scalings` scalings included."""
    p = len(inputs)
    if is_exact(dtype) or op in ("min", "max"):
        return 0.0
    u = roundoff(dtype)
    magnitude = np.abs(np.stack(inputs)).sum(axis=0)
    result = np.abs(reduction_reference(inputs, op))
    if op == "sum":
        bound = (p - 1) * u * magnitude
    elif op == "avg":
        bound = (p - 1) * u * magnitude / p + 2 * u * result
    else:  # prod
        bound = (p - 1) * u * result
    return 1.01 * (bound + scalings * u * magnitude)


def as_float64(array) -> np.ndarray:
    """A tensor's or an array's values in float64 NumPy."""
    if isinstance(array, torch.Tensor):
        return array.detach().to(torch.float64).numpy()
    return np.asarray(array, dtype=np.float64)


def assert_reduced(result, inputs, op, *, postscale=1.0, scalings=0, dtype=None):
    """`result` (a tensor) is the reduction `op` of `inputs` (tensors or arrays, one per rank,
    already prescaled), times `postscale`, within reduction_bound at `dtype`: the dtype the reduction
    ran in, by default the result's."""
    dtype = result.dtype if dtype is None else dtype
    inputs = [as_float64(x) for x in inputs]
    expected = reduction_reference(inputs, op) * postscale
    bound = reduction_bound(inputs, op, dtype, scalings) * abs(postscale)
    error = np.abs(as_float64(result) - expected)
    assert (error <= bound).all(), \
        f"{op} over {len(inputs)} ranks in {dtype}: error {error.max()} > bound {np.max(bound)}"


def assert_exact(actual, expected):
    """Bit for bit (NaNs equal)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def assert_within(actual, expected, *, roundings):
    """|actual - expected| <= 1.01 * roundings * u * max |expected|, elementwise, u of `actual`'s
    dtype (module docstring); integers exactly."""
    if is_exact(actual.dtype):
        return assert_exact(actual, expected)
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    atol = 1.01 * roundings * roundoff(actual.dtype) * scale
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, check_dtype=False)
