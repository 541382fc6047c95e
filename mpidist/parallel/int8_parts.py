"""Int8 with one float32 scale per chunk: the arithmetic of the int8 compressor's exchange
(bucket_exchanges.Int8Bucket) and of its push to a parameter server (push_compression.py), on values
cut into one part per rank, each part into chunks. Each step runs in one kernel of mpidist._C
(csrc/quantize.h) for float32 and float64 values on the CPU, and as torch operations otherwise;
both give the same bits.
"""
from __future__ import annotations

import torch

from .. import kernels


class Int8Parts:
    """Int8's arithmetic over `numel` elements cut into one part per rank of `size` (`rank` owns
    one), each part into chunks; the work runs on rows of whole chunks (one row per part, zero
    past the part's end), so that quantizing and dequantizing are one view and a few whole-tensor
    operations each."""

    def __init__(self, numel, size, rank, chunk, dtype, device):
        self.numel, self.size, self.rank, self.chunk = numel, size, rank, chunk
        self.part = max(1, -(-numel // size))
        self.chunks = -(-self.part // chunk)
        self.width = self.chunks * chunk
        self.row_bytes = self.part + 4 * self.chunks
        self.compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.fused = dtype == self.compute_dtype and torch.device(device).type == "cpu"

    def _parts(self, flat, rows):
        """(flat, rows) views of the parts: the whole ones as matrices, then a short last one."""
        part = self.part
        full, tail = divmod(self.numel, part)
        views = [(flat[:full * part].view(full, part), rows[:full, :part])]
        if tail:
            views.append((flat[full * part:], rows[full, :tail]))
        return views

    def _quantize(self, rows):
        """(int8 values (rows x width), float32 scales (rows x chunks), the values dequantized) of
        `rows` (rows x width, compute dtype)."""
        blocks = rows.view(rows.shape[0], self.chunks, self.chunk)
        # The largest magnitude, from two reductions that vectorize where abs().amax() and
        # aminmax() do not (abs_: a chunk of zeros has the scale +0, whichever zero maximum gives).
        largest = torch.maximum(blocks.amax(dim=2), blocks.amin(dim=2).neg_()).abs_()
        scales = (largest / 127).float()
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(rows.dtype)
        levels = torch.div(blocks, divisor[:, :, None]).round_().clamp_(-127, 127)
        values = levels.to(torch.int8).view(rows.shape[0], self.width)
        # The levels are the int8 values exactly: dequantized without converting those back.
        return values, scales, levels.mul_(scales.to(rows.dtype)[:, :, None]).view(rows.shape[0], self.width)

    def _payload(self, values, scales):
        """Each row's int8 values (the part's, not the padding) and float32 scales as one row of bytes."""
        return torch.cat([values[:, :self.part].view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)

    def _dequantize(self, payload):
        """Payload rows' values times their chunks' scales, as compute-dtype rows (zero past the part)."""
        rows = torch.empty(payload.shape[0], self.width, dtype=self.compute_dtype, device=payload.device)
        rows[:, self.part:].zero_()
        rows[:, :self.part] = payload[:, :self.part].view(torch.int8)
        scales = bytes_as(payload[:, self.part:], torch.float32).to(self.compute_dtype)
        return rows.view(payload.shape[0], self.chunks, self.chunk).mul_(scales[:, :, None]).view_as(rows)

    def quantize(self, values, residual):
        """The payload rows of values plus residual, one per rank's part; leaves in residual what
        this rank meant to send less what it sent."""
        if self.fused:
            payload = torch.empty(self.size, self.row_bytes, dtype=torch.uint8)
            kernels.int8_quantize(values, residual, payload, self.size, self.part, self.chunk)
            return payload
        # The values plus the residual, as rows of whole chunks (zero past each part's end).
        rows = torch.empty(self.size, self.width, dtype=self.compute_dtype, device=values.device)
        rows[self.numel // self.part:].zero_()
        rows[:self.numel // self.part, self.part:].zero_()
        for (value_part, row_part), (residual_part, _) in zip(self._parts(values, rows), self._parts(residual, rows)):
            torch.add(value_part, residual_part, out=row_part)
        levels, scales, sent = self._quantize(rows)
        for (residual_part, row_part), (_, sent_part) in zip(self._parts(residual, rows), self._parts(residual, sent)):
            torch.sub(row_part, sent_part, out=residual_part)
        return self._payload(levels, scales)

    def sum_own(self, received, residual):
        """The payload row of this rank's part summed over the received rows in rank order; the
        residual of that part gains the sum's own quantization error."""
        own = residual[self.rank * self.part:][:self.part]  # empty past the values' end
        if self.fused:
            summed = torch.empty(1, self.row_bytes, dtype=torch.uint8)
            kernels.int8_sum_requantize(received, self.size, self.part, self.chunk, own, summed)
            return summed
        dequantized = self._dequantize(received)
        total = torch.zeros(1, self.width, dtype=self.compute_dtype, device=received.device)
        for rank in range(self.size):  # in rank order
            total[0] += dequantized[rank]
        sum_values, sum_scales, sum_sent = self._quantize(total)
        own += (total - sum_sent)[0, :own.numel()]
        return self._payload(sum_values, sum_scales)

    def dequantize_into(self, values, gathered):
        """values = every rank's summed part, dequantized."""
        if self.fused:
            kernels.int8_dequantize(gathered, self.size, self.part, self.chunk, values)
            return
        for value_part, sum_part in self._parts(values, self._dequantize(gathered)):
            value_part.copy_(sum_part)


def bytes_as(data, dtype):
    """The bytes `data` (uint8, last dimension) read as `dtype`, from a copy aligned for it."""
    return data.clone(memory_format=torch.contiguous_format).view(dtype)
