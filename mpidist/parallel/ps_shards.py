"""How a parameter server's model is partitioned over several server ranks: the parameters laid
end to end in one flat vector, cut into one contiguous range per server, balanced by size. A cut
falls on a row boundary, so a large tensor is split into row ranges (as TensorFlow's variable
partitioners and ps-lite's key ranges split theirs) and a small one stays whole.
"""
from __future__ import annotations

import bisect
import zlib

from ..errors import InvalidArgumentError


def row_boundaries(shapes) -> list:
    """Every flat offset where a cut may fall: the start of each row of each parameter (a 0-d
    or 1-d tensor's rows are its elements), and the end of the last."""
    boundaries, offset = [0], 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        rows = shape[0] if shape else 1
        row = numel // rows if rows else 0
        boundaries.extend(offset + row * index for index in range(1, rows + 1))
        offset += numel
    return sorted(set(boundaries))


def partition(shapes, servers: int) -> list:
    """[(start, end)] of the flat vector for each of `servers` servers: every range non-empty,
    each cut at the row boundary nearest to an equal share."""
    boundaries = row_boundaries(shapes)
    total = boundaries[-1]
    if len(boundaries) - 1 < servers:
        raise InvalidArgumentError(f"the model's parameters have {len(boundaries) - 1} rows in all, too few to "
                                   f"split over {servers} servers (each needs at least one row)")
    cuts = [0]
    for index in range(1, servers):
        target = total * index / servers
        at = bisect.bisect_left(boundaries, target)
        nearest = min((i for i in (at - 1, at) if 0 <= i < len(boundaries)),
                      key=lambda i: abs(boundaries[i] - target))
        # Each server keeps at least one row, and leaves one to each server after it.
        lowest = boundaries.index(cuts[-1]) + 1
        highest = len(boundaries) - 1 - (servers - index)
        cuts.append(boundaries[min(max(nearest, lowest), highest)])
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


def fingerprint(shapes, ranges) -> int:
    """A number that differs (almost surely) between two layouts: what ranks compare to agree."""
    return zlib.crc32(repr((tuple(tuple(s) for s in shapes), tuple(ranges))).encode()) & 0x7FFFFFFF
