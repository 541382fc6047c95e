"""Data for distributed training: a resumable sharded sampler, an HDF5 dataset, and the embedded
handwritten-digits data set.

Two ways to give each rank its part of a data set:

* ``ShardedSampler`` over the whole data set (every rank can read every row): a fresh seeded
  permutation each epoch, dealt out round-robin, so the ranks' shards change from epoch to epoch.
* ``HDF5Dataset(path, rank=r, size=p)``: the rank reads only its own contiguous block of rows
  (``shard_range``), for data sets that should not be read in full on every rank; blocks are
  padded (or with ``drop_last=True`` trimmed) to even shards, as ``DistributedSampler`` does.
"""
from __future__ import annotations

import os

import numpy as np

from .checkpoint import atomic_hdf5
from .errors import InvalidArgumentError, MpidistError
from .runtime import config
from .runtime.together import on_root

__all__ = ["ShardedSampler", "HDF5Dataset", "shard_range", "default_digits_path", "prepare_digits", "ensure_digits",
           "DataFileError", "DataPreparationError"]

# torch, h5py and scikit-learn are imported in the functions that use them: `mpidist prepare-data`
# runs without torch, scikit-learn is needed only to make the file once, and each takes a
# noticeable part of a second to import.

DIGITS_FILENAME = "digits.h5"
DIGITS_TEST_SIZE = 297
DIGITS_SPLIT_SEED = 0
DIGITS_FORMAT_VERSION = 1


class DataPreparationError(MpidistError):
    """Preparing a data set failed (on rank 0, when the ranks prepare it together)."""


class DataFileError(MpidistError):
    """A data file cannot be read: it is not HDF5, or it is damaged."""


# ---- sampler ------------------------------------------------------------------------------------

class ShardedSampler:
    """This rank's indices of a data set of ``dataset_len`` rows, reshuffled every epoch.

    Same order as ``torch.utils.data.DistributedSampler`` with the same arguments:

    * Permutation: ``torch.randperm(dataset_len)`` drawn from a ``torch.Generator`` seeded with
      ``seed + epoch``, so it is the same on every rank and changes with ``set_epoch``.
      ``shuffle=False`` uses ``0, 1, ..., dataset_len - 1``.
    * Even shards: every rank gets ``len(self)`` indices. With ``drop_last=False`` (default)
      the permutation is padded to a multiple of ``size`` by repeating it from its start, so a
      few rows are seen twice per epoch; with ``drop_last=True`` its tail is dropped, so up to
      ``size - 1`` rows are not seen that epoch.
    * Dealing: rank ``r`` takes positions ``r, r + size, r + 2 * size, ...`` of the padded
      permutation.

    Every iteration starts the epoch from its first index, as ``DistributedSampler`` does, also
    after an iteration that stopped early (``next(iter(loader))`` to peek at a batch does not
    make the following ``for batch in loader`` skip it). The one exception is resuming.

    Resuming mid-epoch: the sampler counts the indices it has handed out in the current epoch
    (``position``). ``state_dict()`` records epoch, seed and position; after
    ``load_state_dict(state)`` the first iteration continues with the next index (and yields
    nothing if the saved epoch was complete), so a resumed run sees exactly the batches the
    interrupted run had not seen yet; later iterations start from the first index again. The
    count is exact when the sampler is read as it is consumed, as a ``DataLoader`` with
    ``num_workers=0`` does. Workers read ahead of training, so with ``num_workers > 0`` pass the
    count yourself: ``state_dict(consumed=batches_done * batch_size)``.

    ``set_epoch(e)`` with a new epoch starts it from its first index; calling it again with the
    current epoch keeps the loaded position, so the usual loop resumes correctly::

        sampler.load_state_dict(state)            # e.g. epoch 3, position 40
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)              # epoch 3 keeps position 40
            for batch in loader: ...

    A state saved with another ``dataset_len``, ``size``, ``shuffle`` or ``drop_last`` names
    other rows mid-epoch and is refused; at an epoch boundary (position 0, or the saved epoch
    complete) it names none, so it loads: the run continues with the same seed and epoch on
    this sampler's shards, e.g. after a restart with another number of ranks.

    ``len(self)`` is the number of indices per rank per epoch, also when resuming mid-epoch
    (``remaining()`` is what the next iteration yields).

    Give the ``DataLoader`` its own ``generator=torch.Generator()``: otherwise every new
    iterator draws a seed from the global torch RNG, so a resumed run (which creates one more
    iterator) would see different dropout masks than an uninterrupted one.
    """

    def __init__(self, dataset_len: int, rank: int, size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        dataset_len, size, rank, seed = (_whole(dataset_len, "dataset_len"), _whole(size, "size"),
                                         _whole(rank, "rank"), _whole(seed, "seed"))
        if dataset_len < 0:
            raise InvalidArgumentError(f"dataset_len must be >= 0, got {dataset_len}")
        if size < 1:
            raise InvalidArgumentError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise InvalidArgumentError(f"rank={rank} is not a rank of {size}")
        self.dataset_len = dataset_len
        self.rank = rank
        self.size = size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        if self.drop_last:
            self.num_samples = dataset_len // size
        else:
            self.num_samples = -(-dataset_len // size)
        self.total_size = self.num_samples * size
        self.epoch = 0
        self.position = 0
        self._resuming = False

    def set_epoch(self, epoch: int) -> None:
        epoch = _whole(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0
            self._resuming = False

    def permutation(self, epoch: int | None = None) -> list[int]:
        """The padded (or truncated) permutation of ``epoch`` shared by all ranks."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            import torch
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.drop_last:
            return order[:self.total_size]
        padding = self.total_size - len(order)
        if padding and order:
            repeats = -(-padding // len(order))
            order += (order * repeats)[:padding]
        return order

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (the current one by default), from the first."""
        return self.permutation(epoch)[self.rank:self.total_size:self.size]

    def remaining(self) -> int:
        """How many indices the next iteration yields."""
        return self.num_samples - self._start()

    def _start(self) -> int:
        # Only the first iteration after load_state_dict continues from the saved position; any
        # other starts the epoch afresh, whatever an earlier, unfinished iteration handed out.
        return self.position if self._resuming else 0

    def __iter__(self):
        start = self._start()
        self._resuming = False
        self.position = start
        return self._hand_out(self.indices()[start:])

    def _hand_out(self, indices):
        for index in indices:
            self.position += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self, consumed: int | None = None) -> dict:
        """JSON-serializable resume state; ``consumed`` overrides the counted position."""
        position = self.position if consumed is None else _whole(consumed, "consumed")
        if not 0 <= position <= self.num_samples:
            raise InvalidArgumentError(
                f"consumed={position} is outside this epoch's 0..{self.num_samples} indices per rank")
        return {"epoch": self.epoch, "seed": self.seed, "position": position, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": self.dataset_len, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken.

        With the same data set length, world size, shuffle and drop_last any position loads.
        With other values a saved position inside the epoch names other rows than this sampler
        would hand out, so it is refused; at an epoch boundary it names none and loads: saved
        position 0 starts the saved epoch from its first index, and a complete saved epoch
        (position == the saved sampler's indices per rank) leaves this sampler's epoch complete,
        so the next iteration yields nothing and ``set_epoch(epoch + 1)`` starts the next one.
        """
        saved = {key: state.get(key, getattr(self, key))
                 for key in ("dataset_len", "size", "shuffle", "drop_last")}
        saved_len, saved_size = _whole(saved["dataset_len"], "dataset_len"), _whole(saved["size"], "size")
        if saved_len < 0 or saved_size < 1:
            raise InvalidArgumentError(f"sampler state has dataset_len={saved_len} and size={saved_size}")
        saved_samples = saved_len // saved_size if saved["drop_last"] else -(-saved_len // saved_size)
        position = _whole(state.get("position", 0), "position")
        if not 0 <= position <= saved_samples:
            raise InvalidArgumentError(f"sampler state position {position} is outside 0..{saved_samples}")
        differing = [key for key in saved if saved[key] != getattr(self, key)]
        if differing and 0 < position < saved_samples:
            key = differing[0]
            raise InvalidArgumentError(
                f"sampler state has {key}={saved[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                f"the saved position {position} of {saved_samples} in epoch {state.get('epoch')} cannot be "
                "resumed (a state with other values loads only at an epoch boundary)")
        if differing and position:
            position = self.num_samples  # the saved epoch was complete, and so is this one
        self.seed = _whole(state["seed"], "seed")
        self.epoch = _whole(state["epoch"], "epoch")
        self.position = position
        self._resuming = True


def _whole(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    return int(value)


def shard_range(count: int, rank: int, size: int) -> range:
    """The contiguous block of ``count`` rows that ``rank`` of ``size`` owns.

    Blocks are ``count // size`` rows, and the first ``count % size`` ranks take one row more:
    10 rows on 3 ranks are rows 0-3, 4-6 and 7-9.
    """
    count, rank, size = _whole(count, "count"), _whole(rank, "rank"), _whole(size, "size")
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgumentError(f"rank={rank} is not a rank of size={size}")
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def _shard_rows(count: int, rank: int, size: int, drop_last: bool):
    """The global row of each item of ``HDF5Dataset``'s even shard (see its docstring)."""
    block = shard_range(count, rank, size)
    even = count // size if drop_last else -(-count // size)
    if len(block) >= even:
        return block[:even]
    if block:
        # One row short: repeating a row of its own block keeps the rank reading only its rows.
        return tuple(block) + (block.start,)
    if even:
        # Fewer rows than ranks: no own row to repeat, so borrow one, spread over the rows.
        row = rank % count
        return range(row, row + 1)
    return block


# ---- HDF5 data set ------------------------------------------------------------------------------

class HDF5Dataset:
    """A torch map-style Dataset over ``<split>/x`` and ``<split>/y`` of an HDF5 file.

    Items are ``(x, y)``: a float32 tensor row of ``x`` and ``y``'s entry as a tensor: int64
    when ``y`` holds integers (class labels: a scalar, as ``cross_entropy`` wants), float32 when
    it holds floating-point numbers (regression targets, never truncated to integers). Other
    dtypes of ``y`` are refused when the dataset is made.

    With ``rank`` and ``size`` the dataset is only this rank's contiguous block of rows
    (``shard_range``: remainder rows go to the first ranks) and only those rows are ever read.
    Shards are even, as with ``DistributedSampler``, so that every rank runs as many batches
    (one rank running an extra batch would leave its extra all-reduce waiting forever):

    * ``drop_last=False`` (default): every rank has ``ceil(count / size)`` items. A block one
      row short repeats its first row at the end; a rank with an empty block (fewer rows than
      ranks) holds global row ``rank % count``, read for it alone. A few rows are seen twice.
    * ``drop_last=True``: every rank has ``count // size`` items; the ranks with one row more
      drop their block's last row, so up to ``size - 1`` rows are never seen.

    ``rows`` holds the global row of each item, padding included: item ``i`` is global row
    ``rows[i]``. It is a ``range`` (e.g. ``range(500, 1000)``), or a tuple when the shard is
    padded (10 rows on 3 ranks: ``range(0, 4)``, ``(4, 5, 6, 4)``, ``(7, 8, 9, 7)``).
    Without ``rank`` and ``size`` the dataset holds every row, ``rows == range(total_rows)``,
    for use with ``ShardedSampler``.

    ``preload=True`` (default) reads the rows once, when the dataset is made, into the NumPy
    arrays ``x`` and ``y``: each distinct row of ``rows`` once, in file order (a padding item is
    not stored twice). ``preload=False`` reads one row per item from a file handle opened
    lazily in each process, which suits data sets larger than memory and ``DataLoader`` workers
    (h5py handles must not cross a fork).
    """

    def __init__(self, path, split: str = "train", rank: int | None = None, size: int | None = None,
                 preload: bool = True, drop_last: bool = False):
        self.path = os.fspath(path)
        self.split = split
        if not os.path.exists(self.path):
            if os.path.basename(self.path) == DIGITS_FILENAME:
                raise FileNotFoundError(
                    f"{self.path} does not exist; make the digits file with `mpidist prepare-data` "
                    "or mpidist.data.ensure_digits()")
            raise FileNotFoundError(f"{self.path} does not exist")
        if (rank is None) != (size is None):
            raise InvalidArgumentError("give both rank and size to read a shard, or neither")
        try:
            total, label_dtype = self._read_header(split)
        except MpidistError:
            raise
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:  # h5py's, for a file it cannot read
            raise self._unreadable(exc) from exc
        if np.issubdtype(label_dtype, np.integer):
            self._label_dtype = np.int64
        elif np.issubdtype(label_dtype, np.floating):
            self._label_dtype = np.float32
        else:
            raise InvalidArgumentError(
                f"{self.path}: {split}/y has dtype {label_dtype}; labels must be integers (classes) "
                "or floating-point numbers (targets)")
        self.total_rows = total
        self.drop_last = bool(drop_last)
        self.rows = range(total) if rank is None else _shard_rows(total, rank, size, self.drop_last)
        self._file = None
        self._file_pid = None
        self.x = self.y = None
        if preload:
            # Each row once: a padded shard's last item repeats its first row (see _shard_rows).
            held = self.rows if isinstance(self.rows, range) else range(self.rows[0], self.rows[-2] + 1)
            try:
                self.x, self.y = self._read(held.start, held.stop)
            except (OSError, RuntimeError, KeyError) as exc:
                raise self._unreadable(exc) from exc
            self.close()

    def _read_header(self, split: str):
        """(rows, the labels' dtype) of `split`, whose x and y datasets are checked."""
        import h5py
        with h5py.File(self.path, "r") as f:
            if split not in f:
                splits = sorted(name for name in f if isinstance(f[name], h5py.Group))
                raise InvalidArgumentError(f"{self.path} has no split {split!r} (splits: {splits})")
            group = f[split]
            if not isinstance(group, h5py.Group):
                what = "a dataset" if isinstance(group, h5py.Dataset) else "not a group"
                raise InvalidArgumentError(
                    f"{self.path}: {split!r} is {what}, not a split (a group holding x and y datasets)")
            listed = sorted(group)
            for name in ("x", "y"):
                # By the listing and group[name]: in a damaged file an entry can be listed yet
                # neither `in` the group nor opened (group.get answers None), which is not a missing
                # entry; opening it raises h5py's error, reported as a file that cannot be read.
                if name not in listed:
                    raise InvalidArgumentError(
                        f"{self.path}: split {split!r} has no dataset {name!r} (it holds {listed})")
                if not isinstance(group[name], h5py.Dataset):
                    raise InvalidArgumentError(f"{self.path}: {split}/{name} is not a dataset")
                if group[name].ndim < 1:
                    raise InvalidArgumentError(f"{self.path}: {split}/{name} is a scalar, not rows")
            if group["x"].dtype.kind not in "biuf":
                raise InvalidArgumentError(f"{self.path}: {split}/x has dtype {group['x'].dtype}; inputs must be numbers")
            total, labels = group["x"].shape[0], group["y"].shape[0]
            if labels != total:
                raise InvalidArgumentError(
                    f"{self.path}: {split}/x has {total} rows but {split}/y has {labels}; they must match")
            return total, group["y"].dtype

    def _unreadable(self, exc) -> DataFileError:
        reason = exc.args[0] if exc.args else type(exc).__name__
        return DataFileError(f"{self.path} cannot be read as HDF5 ({reason}): is it damaged, or not an HDF5 file?")

    def _read(self, start: int, stop: int):
        """Rows [start, stop) of x and y as NumPy arrays: every read of the file goes through here."""
        split = self._handle()[self.split]
        return split["x"][start:stop], split["y"][start:stop]

    def _handle(self):
        import h5py
        if self._file is None or self._file_pid != os.getpid():
            self._file = h5py.File(self.path, "r")
            self._file_pid = os.getpid()
        return self._file

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        import torch
        if not -len(self.rows) <= index < len(self.rows):
            raise IndexError(f"index {index} out of range for {len(self.rows)} rows")
        row = self.rows[index]
        if self.x is not None:
            x, y = self.x[row - self.rows[0]], self.y[row - self.rows[0]]
        else:
            xs, ys = self._read(row, row + 1)
            x, y = xs[0], ys[0]
        label = torch.from_numpy(np.array(y, dtype=self._label_dtype))
        return torch.from_numpy(np.asarray(x, dtype=np.float32)), label

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self):
        # DataLoader workers get a copy of the dataset: each opens its own file handle.
        state = dict(self.__dict__)
        state["_file"] = state["_file_pid"] = None
        return state


# ---- embedded digits data set -------------------------------------------------------------------

def default_digits_path() -> str:
    """Where the digits file lives when no path is given.

    ``$MPIDIST_DATA_DIR/digits.h5`` when MPIDIST_DATA_DIR is set. Otherwise
    ``<checkout>/data/digits.h5`` when mpidist runs from a source checkout (a ``setup.py``
    beside the package), so every job of the checkout finds the same file whatever its working
    directory; for an installed package, ``./data/digits.h5`` in the working directory.
    """
    directory = config.value("MPIDIST_DATA_DIR")
    if not directory:
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base = checkout if os.path.exists(os.path.join(checkout, "setup.py")) else os.getcwd()
        directory = os.path.join(base, "data")
    return os.path.join(directory, DIGITS_FILENAME)


def prepare_digits(path) -> str:
    """Write scikit-learn's handwritten digits (1797 8x8 images, shipped inside scikit-learn)
    to the HDF5 file ``path``; returns the path.

    Layout: ``train/x``, ``test/x`` float32 (N x 64, pixel values 0-16 divided by 16, so in
    [0, 1]); ``train/y``, ``test/y`` int64 labels 0-9; ``train/index``, ``test/index`` the
    samples' positions in scikit-learn's order. Split: the samples are put in a fixed order
    (``numpy.random.default_rng(0).permutation(1797)``, the same on every machine), the first
    1500 are ``train`` and the last 297 ``test``. A fixed shuffle mixes the writers of the
    original order into both parts (the last 297 in scikit-learn's order are noticeably harder).
    The file is written beside ``path`` and renamed into place, so a reader never sees a
    half-written file.
    """
    from sklearn import __version__ as sklearn_version
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(digits.target, dtype=np.int64)
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(y))
    split = len(y) - DIGITS_TEST_SIZE
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_hdf5(path) as f:
        f.attrs["source"] = "sklearn.datasets.load_digits (UCI ML hand-written digits, optdigits test set)"
        f.attrs["sklearn_version"] = sklearn_version
        f.attrs["description"] = "8x8 grey images of digits 0-9, flattened to 64 pixels, pixel values 0-16 scaled to [0, 1]"
        f.attrs["split"] = (f"train = {split} samples, test = {len(y) - split} samples of load_digits, after the "
                            f"fixed order numpy.random.default_rng({DIGITS_SPLIT_SEED}).permutation({len(y)})")
        f.attrs["image_shape"] = np.array([8, 8], dtype=np.int64)
        f.attrs["num_classes"] = 10
        f.attrs["format_version"] = DIGITS_FORMAT_VERSION
        for name, rows in (("train", order[:split]), ("test", order[split:])):
            group = f.create_group(name)
            group.create_dataset("x", data=x[rows])
            group.create_dataset("y", data=y[rows])
            group.create_dataset("index", data=rows.astype(np.int64))
    return path


def ensure_digits(path=None, comm=None) -> str:
    """The digits file at ``path`` (default ``default_digits_path()``), made if missing.

    With a communicator (mpidist Communicator or mpi4py communicator; every rank must call)
    only rank 0 checks and writes, and the others wait for it; a failure on rank 0 is raised on
    every rank (``DataPreparationError`` on the others), never a hang.
    """

    path = os.fspath(path) if path is not None else default_digits_path()

    def prepare_if_missing():
        if not os.path.exists(path):
            prepare_digits(path)

    on_root(comm, prepare_if_missing, f"preparing {path}", DataPreparationError)
    return path

