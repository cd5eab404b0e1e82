"""Exclusive locks on a file (``flock``) for work two processes must not do at once on the same output: a train run
(its checkpoint and MLflow run), a deployment's ServerApp (its state folder), a fetch or harmonize (the output folder
they replace whole). The operating system releases a lock when its holder dies, SIGKILL included, so a stale lock
never blocks a rerun; the file holds ``pid N on host`` to name the holder, and its holder removes it when done (a
lock file left by a killed holder is taken over by the next). POSIX only (``fcntl``)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


@contextlib.contextmanager
def held(path: Path, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the exclusive lock on ``path`` for the block; where another process holds it, raise ``refuse(holder)``
    at once (``holder``: ``pid N on host``) instead of waiting. The file is removed while still locked at the end;
    a process that opened it before the removal finds, once it has the lock, that the path is no longer its file,
    and opens the path again (two processes never hold locks on two files of one path)."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fh = open(path, "a+")
        holder = _take(fh)
        if holder is not None:
            fh.close()
            raise refuse(holder)
        try:
            same = os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fcntl.flock(fh, fcntl.LOCK_UN)  # the holder before us removed it as we opened it: the path's file is another
        fh.close()
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
        fh.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def beside(out: Path) -> Path:
    """The lock file of the work that replaces the folder ``out`` whole: ``.<name>.lock`` beside it, on the same file
    system and writable by whoever may write ``out`` (not a name :func:`fedsilo.utils.io.clean_stale` removes)."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def holder(path: Path) -> Optional[str]:
    """Who holds :func:`held`'s lock on ``path`` now (``pid N on host``), or None when no process does (none ever,
    or one that ended, however it ended). Asked on the machine the lock is on."""
    import fcntl

    try:
        fh = open(path, "r")
    except FileNotFoundError:
        return None
    with fh:
        who = _take(fh)
        if who is None:
            fcntl.flock(fh, fcntl.LOCK_UN)
        return who


def _take(fh: Any) -> Optional[str]:
    """Takes the exclusive lock on the open file ``fh`` without waiting: None when taken, else who holds it (what
    :func:`held` wrote in it)."""
    import fcntl

    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        return fh.read().strip() or "another process"
    return None
