"""Checkpoint files written atomically: an HDF5 file appears at its path only once completely
written and on disk, and the temporary files of killed writers are cleaned up.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket

TEMPORARY = re.compile(r"^(?P<target>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


@contextlib.contextmanager
def atomic_hdf5(path):
    """Yield an h5py.File that appears at ``path`` only once completely written and on disk.

    The file is written to ``<path>.tmp-<host>-<pid>``, flushed, fsynced and renamed over
    ``path`` (``os.replace`` is atomic), so a crash at any moment leaves either the old file or
    the new one, never a torn one. On an error the temporary file is removed; one left by a
    killed writer (its process on this host no longer exists) is removed by the next write into
    the same directory.
    """
    import h5py
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(directory)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            yield f
            f.flush()
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
