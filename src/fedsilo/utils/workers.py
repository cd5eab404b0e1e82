"""Worker processes that do not outlive the process that started them.

A process pool's workers wait on their queue for work; when the command that started them is killed outright
(SIGKILL, an out-of-memory kill) no one tells them, and they stay behind, re-parented, holding memory and file
handles. :func:`worker_pool` starts a pool whose workers ask the kernel (Linux ``prctl(PR_SET_PDEATHSIG)``) for a
SIGTERM when their parent dies, and end at once if it died before they asked."""

from __future__ import annotations

import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """A pool worker's initializer: SIGTERM when the parent dies (Linux; elsewhere nothing is asked)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # no prctl in this C library: the pool works, without the guard
            return
        if os.getppid() != parent:  # the parent died before the request: nothing would signal this worker
            os._exit(0)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A process pool of ``workers`` processes that end when this process does, however it ends."""
    return ProcessPoolExecutor(max_workers=workers, initializer=_die_with_parent, initargs=(os.getpid(),))
