"""Exclusive locks on a file (``flock``) for work two processes must not do at once on the same output: a train run
(its checkpoint and MLflow run), a deployment's ServerApp (its state folder), a fetch or harmonize (the output folder
they replace whole). The operating system releases a lock when its holder dies, SIGKILL included, so a stale lock
never blocks a rerun; the file holds ``pid N on host`` to name the holder. POSIX only (``fcntl``)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


@contextlib.contextmanager
def held(path: Path, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the exclusive lock on ``path`` for the block; where another process holds it, raise ``refuse(holder)``
    at once (``holder``: ``pid N on host``) instead of waiting."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        holder = _take(fh)
        if holder is not None:
            raise refuse(holder)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def of_output(out: Path) -> Path:
    """The lock file of the work that replaces the folder ``out`` whole: in this machine's temporary folder
    (``fedsilo-locks/<name>-<hash of out's absolute path>.lock``), not beside ``out``, so that a refusal before
    anything is written leaves the data folders as they were."""
    import hashlib
    import tempfile

    out = Path(out).absolute()
    key = hashlib.sha256(str(out).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "fedsilo-locks" / f"{out.name}-{key}.lock"


def holder(path: Path) -> Optional[str]:
    """Who holds :func:`held`'s lock on ``path`` now (``pid N on host``), or None when no process does (none ever,
    or one that ended, however it ended). Asked on the machine the lock is on."""
    import fcntl

    if not Path(path).exists():
        return None
    with open(path, "a+") as fh:
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
