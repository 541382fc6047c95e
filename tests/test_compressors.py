"""Gradient compressors (mpidist/parallel/compressors.py) against float64 NumPy references: each
one's exchange, its error feedback (nothing lost over the steps), the same bits on every rank,
exact resumption, training on the digits data, and their refusals, raised on every rank.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import copy
import gc

import h5py
import numpy as np
import pytest
import torch
from conftest import run_python
from mpi4py import MPI
from tolerances import assert_within

import mpidist as md
from mpidist import kernels
from mpidist.parallel import bucket_exchanges, compressors, topk_codec
from mpidist.parallel.compressors import Int8, PowerSGD, TopK, parse_compression
from mpidist.parallel.int8_parts import Int8Parts

pytestmark = pytest.mark.mpi_shared_launch

# A matrix PowerSGD sends as factors, a vector it sends whole, and a 3-d tensor (5 x 12).
SHAPES = [(12, 9), (9,), (5, 4, 3)]
STEPS = 4
COMPRESSORS = {"powersgd": PowerSGD(rank=2, start_iter=1, min_compression_rate=1.0), "int8": Int8(chunk=16),
               "topk": TopK(0.25)}
# Training on the digits: how far below the uncompressed run's test accuracy a compressed run may
# end (the test set has 297 images: 0.05 is 15 of them).
ACCURACY_MARGIN = 0.05


def gradient(rank, step, numel=None):
    """Rank `rank`'s gradient of step `step`: any rank can make every rank's."""
    numel = numel or sum(int(np.prod(s)) for s in SHAPES)
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def exchange(compressor, comm, steps=STEPS, op="sum"):
    """The results of `steps` exchanges of this rank's gradients, and the bucket compressor."""
    bucket = compressor.bucket_exchange([torch.zeros(s) for s in SHAPES], comm, "auto")
    results = []
    for step in range(steps):
        flat = gradient(comm.rank, step)
        bucket.start(flat, op).wait()
        results.append(flat)
    return results, bucket


def everyones(comm, tensor):
    """Every rank's `tensor`, stacked in rank order."""
    return comm.allgather(tensor.reshape(1, -1).contiguous())


def assert_same_on_every_rank(comm, tensor):
    gathered = everyones(comm, tensor)
    assert (gathered == gathered[0]).all(), "the ranks hold different bits"


# ---- one process ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("none", compressors.NoCompression()), ("fp16", compressors.Cast("fp16")), ("bf16", compressors.Cast("bf16")),
    ("int8", Int8()), ("powersgd:4", PowerSGD(rank=4)), ("powersgd", PowerSGD(rank=1)), ("topk:0.01", TopK(0.01)),
    ("TopK:1", TopK(1.0))])
def test_spellings_name_their_compressor(text, expected):
    compressor = parse_compression(text)
    assert compressor == expected
    assert parse_compression(str(compressor)) == compressor


@pytest.mark.parametrize("text, message", [
    ("powersgd:0", "'powersgd:0'.*rank=0"), ("powersgd:1.5", "'powersgd:1.5'.*rank '1.5' is not a number"),
    ("topk:0", "'topk:0'.*fraction=0.0"), ("topk:1.5", "'topk:1.5'.*fraction=1.5"), ("int8:4", "'int8:4'.*no setting"),
    ("gzip", "'gzip' is unknown; choose none, fp16"), ("", "'' is unknown")])
def test_bad_spellings_are_refused_naming_them(text, message):
    with pytest.raises(md.InvalidArgumentError, match=message):
        parse_compression(text)


def test_integer_tensors_are_refused():
    with pytest.raises(md.InvalidArgumentError, match="compression='int8' compresses floating-point gradients; "
                                                      "parameter 1 is torch.int64"):
        Int8().check([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])


def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space():
    matrix = torch.randn(20, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    original = matrix.numpy().copy()
    bucket_exchanges.orthogonalize(matrix)
    q = np.linalg.qr(original)[0]
    np.testing.assert_allclose(matrix.T @ matrix, np.eye(4), atol=1e-13)
    # Gram-Schmidt is QR's Q up to the columns' signs.
    np.testing.assert_allclose(np.abs(matrix.numpy()), np.abs(q), atol=1e-13)


@pytest.mark.parametrize("case", ["random", "sample larger", "sample smaller", "k near the limit"])
def test_largest_magnitudes_picks_the_top_k_of_a_large_bucket(case):
    """Above DIRECT_TOPK_NUMEL, top-k looks through candidates read off a strided sample: still the
    k elements largest in magnitude (NumPy's argsort), also where the sample misleads it."""
    numel, k = 3 * topk_codec.DIRECT_TOPK_NUMEL + 5, 700
    x = torch.randn(numel, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if case == "sample larger":  # the sampled elements are the largest: fewer than k pass its threshold
        x[::topk_codec.SAMPLE_STRIDE] *= 1000
    elif case == "sample smaller":  # far more than 2k pass
        x[::topk_codec.SAMPLE_STRIDE] /= 1000
    elif case == "k near the limit":
        k = numel // 4
    indices = topk_codec.largest_magnitudes(x, k)
    assert indices.dtype == torch.int64 and indices.numel() == k
    expected = np.argsort(-np.abs(x.numpy()), kind="stable")[:k]
    np.testing.assert_array_equal(np.sort(indices.numpy()), np.sort(expected))


def int8_pair(dtype, numel, size, chunk):
    """Int8's arithmetic over `numel` elements as rank 1 of `size` does it (only the exchange's
    local steps run here): once through mpidist._C's kernels, once through torch's operations;
    and the same random residual for each."""
    fused, torch_ops = (Int8Parts(numel, size, 1, chunk, dtype, "cpu") for _ in "ab")
    assert fused.fused
    torch_ops.fused = False
    residual = torch.randn(numel, generator=torch.Generator().manual_seed(5), dtype=dtype)
    return fused, torch_ops, residual, residual.clone()


def assert_bits_equal(a, b, what):
    np.testing.assert_array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8), err_msg=what)


@pytest.fixture(params=kernels.cpu_isas())
def cpu_isa(request):
    """Each instruction set this CPU runs the kernels' loops with, in turn."""
    chosen = kernels.cpu_isa()
    kernels.set_cpu_isa(request.param)
    yield request.param
    kernels.set_cpu_isa(chosen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel, size, chunk", [(1000, 3, 7), (1000, 3, 1024), (10, 4, 3), (200_000, 2, 1024)])
def test_int8_kernels_give_the_bits_of_torchs_operations(dtype, numel, size, chunk, cpu_isa):
    """Each step of the int8 exchange (quantize the parts, sum one part, dequantize every part),
    run by the kernels of mpidist._C (with each instruction set's loops) and by torch's
    operations: the same payload bytes, sums and residuals, including the last part short and,
    for 10 elements over 4 ranks, the last empty."""
    fused, torch_ops, fused_residual, torch_residual = int8_pair(dtype, numel, size, chunk)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(6), dtype=dtype) * 10
    payloads = [fused.quantize(grad, fused_residual), torch_ops.quantize(grad, torch_residual)]
    assert_bits_equal(*payloads, "the payload")
    assert_bits_equal(fused_residual, torch_residual, "the residual after quantizing")
    # What the ranks send this one: its part of their payloads, here of two different gradients.
    others = torch_ops.quantize(grad * 3, torch.zeros(numel, dtype=dtype))
    received = torch.stack([others[1] if rank % 2 else payloads[0][1] for rank in range(size)])
    sums = [fused.sum_own(received, fused_residual), torch_ops.sum_own(received, torch_residual)]
    assert_bits_equal(*sums, "the summed part")
    assert_bits_equal(fused_residual, torch_residual, "the residual after summing")
    gathered = torch.cat([sums[0]] * size)
    flats = [torch.full((numel,), 7.0, dtype=dtype) for _ in "ab"]
    for parts, flat in zip((fused, torch_ops), flats):
        parts.dequantize_into(flat, gathered)
    assert_bits_equal(*flats, "the dequantized bucket")


def test_int8_kernels_make_a_chunk_with_nan_or_infinity_nan():
    """A non-finite value makes its chunk's scale NaN: that chunk comes out NaN, as an
    uncompressed sum would; the other chunks are untouched by it."""
    fused, _, residual, _ = int8_pair(torch.float32, 64, 2, 16)
    residual.zero_()
    grad = torch.ones(64)
    grad[3], grad[40] = float("nan"), float("inf")
    payload = fused.quantize(grad, residual)
    flat = torch.empty(64)
    fused.dequantize_into(flat, payload)
    assert flat[:16].isnan().all() and flat[32:48].isnan().all()
    assert (flat[16:32] == 1).all() and (flat[48:] == 1).all()


def test_int8_kernels_refuse_bad_arrays_naming_them():
    row = kernels.int8_row_bytes(10, 4)
    assert row == 10 + 4 * 3
    grad, payload = torch.zeros(20), torch.zeros(2, row, dtype=torch.uint8)
    with pytest.raises(md.UnsupportedDtypeError, match="grad, residual must share one dtype of float32, float64; "
                                                       "got float32, float16"):
        kernels.int8_quantize(grad, torch.zeros(20, dtype=torch.float16), payload, 2, 10, 4)
    with pytest.raises(md.InvalidArgumentError, match="the payload holds 44 bytes, not 3 rows of 22"):
        kernels.int8_quantize(grad, torch.zeros(20), payload, 3, 10, 4)
    with pytest.raises(md.InvalidArgumentError, match=r"at most rows x part \(18\)"):
        kernels.int8_quantize(grad, torch.zeros(20), torch.zeros(2, 9 + 4 * 3, dtype=torch.uint8), 2, 9, 3)
    with pytest.raises(md.InvalidArgumentError, match="part \\(0\\) and chunk \\(4\\) must be >= 1"):
        kernels.int8_dequantize(payload, 2, 0, 4, grad)
    with pytest.raises(md.InvalidArgumentError, match=r"the residual \(11\) is longer than a part \(10\)"):
        kernels.int8_sum_requantize(payload, 2, 10, 4, torch.zeros(11), torch.zeros(1, row, dtype=torch.uint8))


def test_mpidist_train_resumes_exactly_with_error_feedback(tmp_path):
    """`mpidist train --compression powersgd:2` for 2 epochs of 12 steps (compressed from step 10
    on), and the same run resumed from its first epoch's checkpoint: the same final weights, bit
    for bit (the resumed run must restore every rank's residuals, warm-start Q and step count)."""
    from mpidist.data import ensure_digits
    data = ensure_digits()
    train = "from mpidist.cli import main; raise SystemExit(main({args!r}))"

    def run(directory, *extra):
        args = ["train", "--no-progress", "--checkpoint-dir", str(directory), "--data", data, "--epochs", "2",
                "--batch-size", "64", "--compression", "powersgd:2", *extra]
        result = run_python(train.format(args=args), ranks=2, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    full = tmp_path / "full"
    run(full)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for directory in ("", "compression-rank0", "compression-rank1"):
        (resumed / directory).mkdir(exist_ok=True)
        first = next((full / directory).glob("ckpt-0001-*.h5"))
        (resumed / directory / first.name).write_bytes(first.read_bytes())
    assert "resumed from" in run(resumed, "--resume")

    def weights(directory):
        with h5py.File(next(directory.glob("ckpt-0002-*.h5")), "r") as f:
            return {name: f["model"][name][()] for name in f["model"]}

    expected, actual = weights(full), weights(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


# ---- every rank -------------------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_error_feedback_loses_nothing(mpi_world, name):
    """Over the steps, the results' sum plus every rank's last residual is the sum of every
    rank's gradients (float64 reference), and every rank gets the same bits."""
    comm = mpi_world
    results, bucket = exchange(COMPRESSORS[name], comm)
    for result in results:
        assert_same_on_every_rank(comm, result)
    residuals = everyones(comm, bucket.residual).to(torch.float64)
    delivered = torch.stack(results).to(torch.float64).sum(0) + residuals.sum(0)
    expected = sum(gradient(rank, step).to(torch.float64) for rank in range(comm.size) for step in range(STEPS))
    # Each step's result and residual round a few times per element (a quantized value, a
    # product of inner dimension <= 12 for PowerSGD, a sum over the ranks).
    assert_within(delivered.float(), expected, roundings=16 * STEPS * (comm.size + 12))
    # and something was left behind: the compression was lossy
    assert residuals.abs().max() > 1e-3


def orthonormal(matrix):
    """An orthonormal basis of the columns of `matrix` (QR, not the Gram-Schmidt under test)."""
    return np.linalg.qr(matrix)[0]


def powersgd_reference(settings, size):
    """PowerSGD's results per step in float64 NumPy: every rank's gradients, error feedback, the
    same initial Q draws (float32 normal numbers from the seeded generator)."""
    numel = sum(int(np.prod(s)) for s in SHAPES)
    layout, offset = [], 0
    for shape in SHAPES:
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, settings.rank)
        layout.append((offset, n, m, r, len(shape) > 1 and (n + m) * r * settings.min_compression_rate < n * m))
        offset += n * m
    generator = torch.Generator().manual_seed(settings.seed)
    q_size = sum(m * r for _, _, m, r, compressed in layout if compressed)
    errors, q, results = np.zeros((size, numel)), None, []
    for step in range(STEPS):
        grads = np.stack([gradient(rank, step).double().numpy() for rank in range(size)])
        if step < settings.start_iter:
            results.append(grads.sum(0))
            continue
        ms = grads + errors
        if q is None or not settings.warm_start:
            q = torch.randn(q_size, generator=generator, dtype=torch.float32).double().numpy()
        out, q_at, new_q = ms.sum(0), 0, []
        errors[:] = 0
        for offset, n, m, r, compressed in layout:
            if not compressed:
                continue
            block = ms[:, offset:offset + n * m].reshape(size, n, m)
            start_q = orthonormal(q[q_at:q_at + m * r].reshape(m, r))
            p = orthonormal(sum(block[rank] @ start_q for rank in range(size)))
            qs = [block[rank].T @ p for rank in range(size)]
            for rank in range(size):
                errors[rank, offset:offset + n * m] = (block[rank] - p @ qs[rank].T).ravel()
            out[offset:offset + n * m] = (p @ sum(qs).T).ravel()
            new_q.append(sum(qs).ravel())
            q_at += m * r
        q = np.concatenate(new_q)
        results.append(out)
    return results


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("warm_start", [True, False])
def test_powersgd_matches_a_float64_numpy_implementation(mpi_world, warm_start):
    settings = PowerSGD(rank=2, start_iter=1, min_compression_rate=1.0, warm_start=warm_start, seed=3)
    results, _ = exchange(settings, mpi_world)
    for step, (result, expected) in enumerate(zip(results, powersgd_reference(settings, mpi_world.size))):
        # float32 against float64: products of inner dimension <= 12 summed over the ranks, and
        # orthogonalizations of well-conditioned random matrices, a few hundred roundings.
        assert_within(result, torch.from_numpy(expected), roundings=512), f"step {step}"


@pytest.mark.mpi(ranks=[2, 3])
def test_int8_result_is_the_sum_within_its_quantization(mpi_world):
    """One step: each rank's values round by at most half its scale (max |x| / 127 per chunk),
    the sum by half of its own: within that of the float64 sum."""
    comm = mpi_world
    (result,), _ = exchange(Int8(chunk=16), comm, steps=1)
    grads = [gradient(rank, 0).double() for rank in range(comm.size)]
    exact = sum(grads)
    bound = (sum(g.abs().max() for g in grads) + exact.abs().max()) / 254
    assert (result.double() - exact).abs().max() <= 1.01 * bound + 1e-6


def int8_quantized(x, chunk):
    """The float32 vector `x` as Int8 sends it, dequantized: per chunk of `chunk` elements, the
    scale max |x| / 127 (float32) and the values round(x / scale) (half to even) within +-127;
    a chunk of zeros has the scale 0 and the values 0."""
    sent = np.empty_like(x)
    for start in range(0, x.size, chunk):
        block = x[start:start + chunk]
        scale = np.float32(np.abs(block).max()) / np.float32(127)
        values = np.clip(np.round(block / (scale if scale > 0 else np.float32(1))), -127, 127).astype(np.int8)
        sent[start:start + chunk] = values.astype(np.float32) * scale
    return sent


def int8_reference(size, steps, chunk, values=None):
    """(each step's result, each rank's residual after the last step) of Int8's summing
    exchange of every rank's float32 gradients (or of values(rank, step), float32 vectors), as
    the module docstring describes it, in NumPy float32: each rank adds its residual, cuts the
    bucket into one part per rank (the last one short or empty), quantizes each part; rank j
    adds the parts j in rank order from zero, quantizes that sum, and every rank gets the
    quantized sums. A rank's residual: what it had less what it sent, and for its own part also
    the sum less its quantized sum."""
    values = values or (lambda rank, step: gradient(rank, step).numpy())
    numel = values(0, 0).size
    part = -(-numel // size)
    residuals = [np.zeros(size * part, np.float32) for _ in range(size)]
    results = []
    for step in range(steps):
        parts = []
        for rank in range(size):
            had = np.zeros(size * part, np.float32)
            had[:numel] = values(rank, step) + residuals[rank][:numel]
            had = had.reshape(size, part)
            sent = np.stack([int8_quantized(row, chunk) for row in had])
            residuals[rank] = (had - sent).reshape(-1)
            parts.append(sent)
        sums = []
        for owner in range(size):
            total = np.zeros(part, np.float32)
            for rank in range(size):
                total += parts[rank][owner]
            sums.append(int8_quantized(total, chunk))
            residuals[owner][owner * part:(owner + 1) * part] += total - sums[-1]
        results.append(np.concatenate(sums)[:numel])
    return results, [residual[:numel] for residual in residuals]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("chunk", [16, 7, 1024])
def test_int8_exchange_is_bit_for_bit_its_numpy_description(mpi_world, chunk):
    comm = mpi_world
    results, bucket = exchange(Int8(chunk=chunk), comm)
    expected, residuals = int8_reference(comm.size, STEPS, chunk)
    for step, (result, reference) in enumerate(zip(results, expected)):
        np.testing.assert_array_equal(result.numpy().view(np.int32), reference.view(np.int32), err_msg=f"step {step}")
    np.testing.assert_array_equal(bucket.residual.numpy().view(np.int32), residuals[comm.rank].view(np.int32))


@pytest.mark.mpi(ranks=[4])
def test_int8_across_nodes_compresses_only_the_node_sums(mpi_world, monkeypatch):
    """Four ranks on two emulated nodes of two: each node sums its ranks' gradients
    uncompressed, the local ranks 0 exchange the first half of the sums through int8 between the
    nodes, the local ranks 1 the second half. Bit for bit the NumPy replay of that (int8_reference
    over the two nodes' sums, per half); nothing lost (results plus every rank's residual are
    the gradients' sum, float64); the same bits on every rank."""
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "2")
    comm = md.Communicator(MPI.COMM_WORLD)
    results, bucket = exchange(Int8(chunk=16), comm)
    assert (bucket.node.size, bucket.across.size) == (2, 2)
    numel = results[0].numel()
    halves = [(0, -(-numel // 2)), (-(-numel // 2), numel)]
    expected, residual = [np.empty(numel, np.float32) for _ in range(STEPS)], np.zeros(numel, np.float32)
    for local, (begin, end) in enumerate(halves):
        def node_sum(node, step, begin=begin, end=end):
            return (gradient(2 * node, step).numpy() + gradient(2 * node + 1, step).numpy())[begin:end]
        half_results, half_residuals = int8_reference(2, STEPS, 16, node_sum)
        for step, half in enumerate(half_results):
            expected[step][begin:end] = half
        if comm.local_rank == local:
            residual[begin:end] = half_residuals[comm.node_rank]
    for step, (result, reference) in enumerate(zip(results, expected)):
        np.testing.assert_array_equal(result.numpy().view(np.int32), reference.view(np.int32), err_msg=f"step {step}")
        assert_same_on_every_rank(comm, result)
    np.testing.assert_array_equal(bucket.residual.numpy().view(np.int32), residual.view(np.int32))
    residuals = everyones(comm, bucket.residual).to(torch.float64)
    delivered = torch.stack(results).to(torch.float64).sum(0) + residuals.sum(0)
    everything = sum(gradient(rank, step).to(torch.float64) for rank in range(4) for step in range(STEPS))
    assert_within(delivered.float(), everything, roundings=16 * STEPS * 6)


@pytest.mark.mpi(ranks=[2, 3])
def test_topk_sends_each_ranks_largest_elements(mpi_world):
    comm = mpi_world
    (result,), _ = exchange(TopK(0.25), comm, steps=1)
    numel = result.numel()
    k = int(np.ceil(0.25 * numel))
    expected = np.zeros(numel)
    for rank in range(comm.size):
        values = gradient(rank, 0).double().numpy()
        largest = np.argsort(-np.abs(values))[:k]
        expected[largest] += values[largest]
    assert_within(result, torch.from_numpy(expected), roundings=comm.size)


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train_steps(ddp, optimizer, steps, rank):
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 10, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("compression", [PowerSGD(rank=2, start_iter=1, warm_start=False), "int8", "topk:0.2"],
                         ids=["powersgd", "int8", "topk"])
def test_resuming_from_the_compression_state_continues_exactly(mpi_world, compression):
    """6 steps, against 3 steps, the state saved and loaded into a new model, and 3 more: the same
    weights. Without the compression state the resumed run ends elsewhere."""
    rank = mpi_world.rank

    def start(saved=None, with_compression_state=True):
        model = small_model()
        ddp = md.DataParallel(model, compression=compression)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if saved is not None:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            if with_compression_state:
                ddp.load_compression_state_dict(saved[2])
        return model, ddp, optimizer

    model, ddp, optimizer = start()
    train_steps(ddp, optimizer, range(6), rank)
    expected = [p.detach().clone() for p in model.parameters()]
    model, ddp, optimizer = start()
    train_steps(ddp, optimizer, range(3), rank)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), ddp.compression_state_dict()))
    assert saved[2], "no compression state"
    del model, ddp, optimizer
    gc.collect()
    outcomes = []
    for with_state in (True, False):
        model, ddp, optimizer = start(saved, with_state)
        train_steps(ddp, optimizer, range(3, 6), rank)
        outcomes.append([p.detach() for p in model.parameters()])
        del ddp, optimizer
        gc.collect()
    for actual, wanted in zip(outcomes[0], expected):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)
    assert any(not torch.equal(actual, wanted) for actual, wanted in zip(outcomes[1], expected))


@pytest.mark.mpi(ranks=[2])
def test_data_parallel_trains_the_digits_with_every_compression(mpi_world):
    """4 epochs of `mpidist train`'s network on each rank's share of the digits: every
    compression ends within ACCURACY_MARGIN of the uncompressed run's test accuracy, with the
    same weights on every rank."""
    from mpidist.cli.train import build_model
    from mpidist.data import HDF5Dataset, ensure_digits
    comm = mpi_world
    path = ensure_digits(comm=comm)
    train, test = HDF5Dataset(path, "train"), HDF5Dataset(path, "test")
    x, y = torch.as_tensor(train.x[comm.rank::comm.size]), torch.as_tensor(train.y[comm.rank::comm.size])
    steps = len(y) // 32
    accuracy = {}
    for compression in ("none", "fp16", "bf16", "int8", "powersgd:4", "topk:0.1"):
        torch.manual_seed(0)
        model = build_model()
        ddp = md.DataParallel(model, compression=compression)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for epoch in range(4):
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
            for step in range(steps):
                batch = order[32 * step:32 * (step + 1)]
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch]).backward()
                optimizer.step()
        assert_same_on_every_rank(comm, torch.cat([p.detach().flatten() for p in model.parameters()]))
        with torch.no_grad():
            predictions = model(torch.as_tensor(test.x)).argmax(1)
        accuracy[compression] = (predictions == torch.as_tensor(test.y)).double().mean().item()
        del ddp, optimizer
        gc.collect()
    assert accuracy["none"] > 0.8, accuracy
    for compression, value in accuracy.items():
        assert value >= accuracy["none"] - ACCURACY_MARGIN, (compression, accuracy)


@pytest.mark.mpi(ranks=[2, 3])
def test_distributed_optimizer_runs_the_same_compressor(mpi_world):
    """hvd.DistributedOptimizer(compression=hvd.Compression.powersgd(2)) trains to the same bits
    as md.DataParallel(compression=PowerSGD(2))."""
    import mpidist.torch as hvd
    hvd.init()
    trained = []
    for route in ("horovod", "data_parallel"):
        model = small_model()
        if route == "horovod":
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=hvd.Compression.powersgd(2, start_iter=1))
            ddp = model
        else:
            ddp = md.DataParallel(model, compression=PowerSGD(2, start_iter=1))
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train_steps(ddp, optimizer, range(4), mpi_world.rank)
        trained.append([p.detach() for p in model.parameters()])
        del ddp, optimizer
        gc.collect()
    for horovod, data_parallel in zip(*trained):
        torch.testing.assert_close(horovod, data_parallel, rtol=0, atol=0)


@pytest.mark.mpi(ranks=[2, 3])
def test_torchs_powersgd_hook_maps_onto_powersgd(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    ddp = md.DataParallel(small_model())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                                        min_compression_rate=1.5, use_error_feedback=False, warm_start=False,
                                        orthogonalization_epsilon=1e-8, random_seed=7)
    seed = np.random.RandomState(7).randint(1_000_000_000)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    assert ddp.buckets.compressor == PowerSGD(rank=2, start_iter=3, min_compression_rate=1.5, error_feedback=False,
                                              warm_start=False, epsilon=1e-8, seed=seed)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, optimizer, range(4), mpi_world.rank)
    assert_same_on_every_rank(mpi_world, torch.cat([p.detach().flatten() for p in ddp.parameters()]))


@pytest.mark.mpi(ranks=[2, 3])
def test_bad_settings_are_refused_on_every_rank(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    import mpidist.torch as hvd
    hvd.init()
    for bad, message in (("topk:0", "'topk:0'.*fraction=0.0"), ("powersgd:0", "'powersgd:0'.*rank=0"),
                         ("lz4", "'lz4' is unknown")):
        with pytest.raises(md.InvalidArgumentError, match=message):
            md.DataParallel(small_model(), compression=bad)
    with pytest.raises(md.InvalidArgumentError, match="allreduce / reducescatter with compression int8: a "
                                                      "compression with error feedback.*choose hvd.Compression.none, "
                                                      "fp16 or bf16"):
        hvd.allreduce(torch.ones(3), compression=hvd.Compression.int8)
    with pytest.raises(md.InvalidArgumentError, match="compression topk:0.5 keeps error feedback between steps"):
        hvd.Compression.topk(0.5).compress(torch.ones(3))
    ddp = md.DataParallel(small_model())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2)
    with pytest.raises(md.NotOfferedError, match='batched_powerSGD_hook.*compression="powersgd:2"'):
        ddp.register_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)
    with pytest.raises(md.InvalidArgumentError, match="takes a PowerSGDState, not NoneType"):
        ddp.register_comm_hook(None, powerSGD_hook.powerSGD_hook)
    with pytest.raises(md.InvalidArgumentError, match='process_group=None.*or compression="powersgd:2"'):
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=object(), matrix_approximation_rank=2),
                               powerSGD_hook.powerSGD_hook)
    del ddp
    gc.collect()
    # Every rank refused alike: the next collective runs.
    assert mpi_world.allreduce(torch.ones(1)).item() == mpi_world.size
