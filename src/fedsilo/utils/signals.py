"""SIGTERM (a cancelled job, `kill`, a scheduler's preemption) handled for the length of a block.

A signal is delivered to the main thread only, so a handler is installed there and nowhere else; the previous one is
put back when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator


def exit_on_signal(signum: int, frame: Any) -> None:
    """Ends the process the way Ctrl-C does (through every ``finally`` on the way out), with the shell's status for a
    death by that signal (128 + signum: 143 for SIGTERM)."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def on_sigterm(handler: Callable[[int, Any], None] = exit_on_signal) -> Iterator[None]:
    """``handler`` answers SIGTERM while the block runs (in the main thread; elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
