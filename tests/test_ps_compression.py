"""Compressed pushes to a parameter server (mpidist/parallel/push_compression.py): each codec
against a NumPy description of it (int8 bit for bit, top-k's exact set, fp16's rounding), error
feedback losing nothing over the steps; synchronous training with each compressor on one and
two servers against float64 synchronous SGD on the gradients as the NumPy codecs deliver them;
the bytes each worker pushed; and the refusals, raised on every rank.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import math

import numpy as np
import pytest
import torch
from test_ps import LR, MOMENTUM, flat, loss_of, make_model, steps_of

import mpidist as md
from mpidist.parallel.compressors import Int8, PowerSGD, TopK, parse_compression

pytestmark = pytest.mark.mpi_shared_launch


# ---- the codecs in NumPy, float64 ------------------------------------------------------------

class Reference:
    """A worker's push of one range as the module docstring describes it, with its residual."""

    def __init__(self, compression, numel):
        self.compressor = parse_compression(compression) if isinstance(compression, str) else compression
        self.residual = np.zeros(numel)

    def delivered(self, gradient):
        """What the server decodes from this push of `gradient` (float64)."""
        c = self.compressor
        if str(c) == "fp16":
            return gradient.astype(np.float16).astype(np.float64)
        had = gradient + self.residual
        sent = np.zeros_like(had)
        if isinstance(c, Int8):
            for start in range(0, had.size, c.chunk):
                block = had[start:start + c.chunk]
                scale = np.float32(np.abs(block).max() / 127)
                levels = np.clip(np.round(block / (np.float64(scale) if scale > 0 else 1.0)), -127, 127)
                sent[start:start + c.chunk] = levels * np.float64(scale)
        else:
            k = min(had.size, max(1, math.ceil(c.fraction * had.size)))
            chosen = np.argsort(-np.abs(had), kind="stable")[:k]
            sent[chosen] = had[chosen]
        self.residual = had - sent
        return sent

    def payload_bytes(self, numel, itemsize=8):
        c = self.compressor
        if str(c) == "fp16":
            return 2 * numel
        if isinstance(c, Int8):
            return numel + 4 * -(-numel // c.chunk)
        return min(numel, max(1, math.ceil(c.fraction * numel))) * (4 + itemsize)


@pytest.mark.parametrize("spelling", ["fp16", "int8", Int8(chunk=7), "topk:0.1"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_codec_delivers_its_numpy_description_and_loses_nothing(spelling, dtype):
    """Six pushes of random ranges of 1000 elements: the payload's bytes are the codec's, the
    decoded payload is the NumPy codec's result bit for bit (float64 ranges, and fp16 in either
    dtype), and the decoded pushes plus the residual are the gradients' sum (every dtype)."""
    compressor = parse_compression(spelling) if isinstance(spelling, str) else spelling
    compressor.check_push()
    codec, reference = compressor.push_codec(1000, dtype), Reference(compressor, 1000)
    generator = torch.Generator().manual_seed(3)
    total_sent, total = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(6):
        gradient = torch.randn(1000, generator=generator, dtype=dtype) * 5
        payload = codec.encode(gradient)
        assert payload.numel() * payload.element_size() == reference.payload_bytes(1000, dtype.itemsize)
        decoded = codec.decode(payload)
        assert decoded.dtype == dtype and decoded.shape == (1000,)
        expected = reference.delivered(gradient.double().numpy())
        if dtype == torch.float64 or str(compressor) == "fp16":
            np.testing.assert_array_equal(decoded.double().numpy(), expected)
        total_sent += decoded.double()
        total += gradient.double()
    if str(compressor) != "fp16":  # error feedback: nothing lost, only delayed
        assert codec.residual.abs().max() > 0
        torch.testing.assert_close(total_sent + codec.residual.double(), total, rtol=0, atol=1e-4)


def test_a_topk_push_of_a_float32_range_looks_like_its_float64_push():
    """Top-k picks the same elements whatever the dtype of equal values: the same indices."""
    values = torch.randn(300, generator=torch.Generator().manual_seed(1))
    pushes = [TopK(0.05).push_codec(300, dtype).encode(values.to(dtype)) for dtype in (torch.float32, torch.float64)]
    assert torch.equal(pushes[0][:4 * 15], pushes[1][:4 * 15])


def test_powersgd_is_refused_for_a_push_naming_what_to_use():
    with pytest.raises(md.InvalidArgumentError, match=r"compression='powersgd:2' cannot compress a parameter "
                                                      r"server's push.*use int8, topk:<fraction> or fp16"):
        PowerSGD(rank=2).check_push()


# ---- every rank ------------------------------------------------------------------------------


def sync_reference(spelling, workers, chief, ranges):
    """Synchronous SGD with momentum on the mean of the gradients the servers decode: each
    worker's gradient pushed range by range through the NumPy codecs, residuals kept per worker
    and range."""
    model = make_model(chief)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pushes = {w: [Reference(spelling, end - start) for start, end in ranges] for w in workers}
    for step in range(max(steps_of(w) for w in workers)):
        present = [w for w in workers if step < steps_of(w)]
        delivered = []
        for worker in present:
            optimizer.zero_grad()
            loss_of(model, worker, step).backward()
            gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
            delivered.append(np.concatenate([push.delivered(gradient[start:end])
                                             for push, (start, end) in zip(pushes[worker], ranges)]))
        mean = torch.from_numpy(sum(delivered) / len(delivered))
        for param, part in zip(model.parameters(), mean.split([p.numel() for p in model.parameters()])):
            param.grad = part.view_as(param).clone()
        optimizer.step()
    return flat(model), pushes


@pytest.mark.mpi(ranks=[3, 5])
@pytest.mark.parametrize("spelling", ["fp16", "int8", "topk:0.3"])
def test_sync_training_is_sgd_on_the_decoded_pushes(mpi_world, spelling):
    """Synchronous mode with compressed pushes (two servers on 5 ranks): the final weights are
    float64 synchronous SGD on the gradients as the NumPy codecs deliver them, and each worker
    pushed exactly the payload bytes the codecs make."""
    comm = mpi_world
    servers = 2 if comm.size == 5 else 1
    model = make_model(seed=comm.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM) if comm.rank < servers else None
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=servers, compression=spelling)
    assert str(ps.compression) == spelling
    if ps.is_server:
        ps.serve()
    else:
        for step in range(steps_of(comm.rank)):
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            ps.step()
        ps.close()
    workers = list(range(servers, comm.size))
    expected, pushes = sync_reference(spelling, workers, workers[0], ps.ranges)
    torch.testing.assert_close(flat(model), expected, rtol=1e-12, atol=1e-14)
    if ps.is_server:
        assert ps.compression_state_dict() == {}
        return
    per_step = sum(push.payload_bytes(end - start) for push, (start, end) in zip(pushes[comm.rank], ps.ranges))
    assert ps.bytes_pushed == steps_of(comm.rank) * per_step
    # The residuals a checkpoint keeps are the reference's, and load back.
    state = ps.compression_state_dict()
    if spelling == "fp16":
        assert state == {}
        return
    assert sorted(state) == [f"range{index}" for index in range(servers)]
    for index, push in enumerate(pushes[comm.rank]):
        np.testing.assert_array_equal(state[f"range{index}"].numpy(), push.residual)
    ps.load_compression_state_dict({key: residual * 2 for key, residual in state.items()})
    assert torch.equal(ps.compression_state_dict()["range0"], state["range0"] * 2)
    with pytest.raises(md.InvalidArgumentError, match=r"compression state 'range0' of shape \[1\]; this rank's is"):
        ps.load_compression_state_dict({**state, "range0": torch.zeros(1, dtype=torch.float64)})


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("compression, error, refusal", [
    (lambda last: "powersgd:2", md.InvalidArgumentError, "cannot compress a parameter server's push"),
    (lambda last: "int8" if last else "fp16", md.MismatchError,
     "disagree on compression: rank 0: fp16; rank 1: fp16; rank 2: int8"),
    (lambda last: "gzip", md.InvalidArgumentError, "compression 'gzip' is unknown"),
], ids=["powersgd", "spellings_differ", "unknown"])
def test_refusals_are_raised_on_every_rank(mpi_world, compression, error, refusal):
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(error, match=refusal):
        md.ParameterServer(model, optimizer, compression=compression(mpi_world.rank == mpi_world.size - 1))
