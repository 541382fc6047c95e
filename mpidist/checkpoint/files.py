"""Checkpoint files written atomically and sealed: an HDF5 file appears at its path only once
completely written and on disk, the temporary files of killed writers are cleaned up, and a
sealed file carries the SHA-256 of its content, checked before HDF5 parses a byte of it.

The seal is HDF5's user block, the first 512 bytes, which the library skips (h5py and h5ls
read the file as any other): ``mpidist-checkpoint sha256`` and a line of JSON, ``{"bytes": size
of the whole file, "sha256": hex digest of every byte after the user block, "created_unix":
time}``. ``tail -c +513 FILE | sha256sum`` prints the digest. HDF5 has no checksums of its own
on data, and a damaged file can crash the library itself, so a file from elsewhere is checked
first: a truncated or altered one is refused before it is opened. ``verified`` hands the check on:
the path it returns records the file as checked, so that loading the file a search chose reads
its bytes once.

Checkpoints of format version 1, written before the seal, are HDF5 from their first byte: they
are read as before (``sealed`` False in what ``read_seal`` returns), unchecked, so that a run
resumes across an upgrade of mpidist; its next checkpoint is sealed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time

from ..errors import CheckpointError

TEMPORARY = re.compile(r"^(?P<target>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")
SEAL_BYTES = 512  # HDF5's smallest user block
SEAL_MAGIC = b"mpidist-checkpoint sha256\n"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@contextlib.contextmanager
def atomic_hdf5(path, sealed: bool = False):
    """Yield an h5py.File that appears at ``path`` only once completely written and on disk.

    The file is written to ``<path>.tmp-<host>-<pid>``, flushed, fsynced and renamed over
    ``path`` (``os.replace`` is atomic), so a crash at any moment leaves either the old file or
    the new one, never a torn one. On an error the temporary file is removed; one left by a
    killed writer (its process on this host no longer exists) is removed by the next write into
    the same directory. With ``sealed`` the file carries its checksum (``read_seal``, ``verify``).
    """
    import h5py
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(directory)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with h5py.File(tmp, "w", userblock_size=SEAL_BYTES if sealed else 0) as f:
            yield f
            f.flush()
        if sealed:
            seal(tmp)
        descriptor = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_directory(directory)


def seal(path, created_unix: float | None = None) -> None:
    """Write into the user block of the HDF5 file at ``path`` (made with ``userblock_size=512``)
    the size and digest of the file as it is now."""
    fields = {"bytes": os.path.getsize(path), "sha256": _digest(path),
              "created_unix": time.time() if created_unix is None else created_unix}
    block = SEAL_MAGIC + json.dumps(fields).encode() + b"\n"
    with open(path, "r+b") as f:
        f.write(block.ljust(SEAL_BYTES, b"\0"))


def read_seal(path) -> dict:
    """The seal's fields of the checkpoint at ``path``, once its size matches the one sealed (no
    read past the seal: cheap enough for every file of a directory), with ``sealed`` True. A file
    that is HDF5 from its first byte has no seal (format version 1; the loader checks the
    version): its fields are its size, its modification time and ``sealed`` False. A missing,
    empty, truncated or otherwise unsealed file is a CheckpointError naming the file and the
    problem."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    try:
        with open(path, "rb") as f:
            block = f.read(SEAL_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty")
    if block.startswith(HDF5_SIGNATURE):
        return {"bytes": size, "created_unix": os.path.getmtime(path), "sealed": False}
    if not block.startswith(SEAL_MAGIC):
        raise CheckpointError(f"{path} is a file without mpidist's checkpoint seal: not an mpidist checkpoint "
                              "(or one damaged at its start)")
    line, _, padding = block[len(SEAL_MAGIC):].partition(b"\n")
    try:
        if padding.strip(b"\0"):
            raise ValueError("bytes changed after its line")
        fields = json.loads(line)
        expected, digest = int(fields["bytes"]), str(fields["sha256"])
        float(fields["created_unix"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: its seal cannot be read ({exc})") from exc
    if size != expected or len(digest) != 64:
        raise CheckpointError(f"checkpoint {path} is truncated or damaged: it holds {size} bytes, its seal says "
                              f"{expected}")
    return {**fields, "sealed": True}


class Verified(str):
    """The path of a checkpoint that ``verified`` found intact, with the file's identity then
    (``identity``: device, inode, size, modification and change times, as os.stat saw them before
    its bytes were read). ``verify`` of it does not read the bytes again while the file's identity
    is unchanged; a file written to or replaced since is checked again. It is a str, the path, so
    it goes wherever a path goes. The record holds in this process only: pickled (sent to another
    rank, say) it becomes the plain path, which the receiver checks itself."""

    def __new__(cls, path, identity: tuple):
        record = super().__new__(cls, os.fspath(path))
        record.identity = identity
        return record

    def __reduce__(self):
        return str, (str(self),)


def verify(path) -> dict:
    """``read_seal``, then every byte checked against the sealed digest: a CheckpointError naming
    the file where any differs. Returns the seal's fields (an unsealed file's are not checked).
    A ``Verified`` record of a file unchanged since its check is not read again."""
    return _check(path)[0]


def verified(path) -> Verified:
    """``verify``; the path as a ``Verified`` record, which a later ``verify`` (the loader's) takes
    as checked while the file is unchanged."""
    return Verified(path, _check(path)[1])


def _check(path) -> tuple:
    """``verify``'s work: the seal's fields and the file's identity before its bytes were read."""
    fields = read_seal(path)
    identity = _identity(path)  # before the digest, so that a write during it counts as a change
    checked = isinstance(path, Verified) and path.identity == identity
    if fields["sealed"] and not checked and _digest(path) != fields["sha256"]:
        raise CheckpointError(f"checkpoint {path} is damaged: its content does not match the SHA-256 sealed in it "
                              "(bytes changed after it was written)")
    return fields, identity


def _identity(path) -> tuple:
    """What differs after the file at ``path`` is replaced, renamed over or written to."""
    try:
        status = os.stat(path)
    except OSError as exc:  # removed since read_seal read it
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _digest(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(SEAL_BYTES)
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_stale_temporaries(directory) -> list:
    """Remove the temporary files of writes on this host whose process is gone (killed mid-write);
    returns their paths. Files of other hosts, or of a process still running, are left alone."""
    host, removed = socket.gethostname(), []
    for name in os.listdir(directory):
        match = TEMPORARY.match(name)
        if match is None or match.group("host") != host or _process_exists(int(match.group("pid"))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process
        return True
    return True


def _fsync_directory(directory):
    # The rename is durable only once the directory entry is on disk.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(descriptor)
