"""Progress of long work (rounds, images), the way the field's tools show it.

On a terminal: a live tqdm bar on stderr (count, rate, time left, and a postfix such as the round's loss and
accuracy). Not on a terminal (DVC's captured output, a job log): a plain line when a step says it matters (an
evaluated round, a finished domain) and otherwise at most one every ``every_s`` seconds, so logs stay short and carry
no carriage returns. ``quiet`` (the CLI's ``-q``) prints nothing.

A stream whose reader went away (a `| tee` killed with its job's process group, a closed terminal) silences the
progress instead of ending the work: Python raises BrokenPipeError where the reader of a pipe is gone, and a
training stopped by SIGTERM must still end as a stopped run (its round checkpointed, MLflow KILLED), not fail on its
progress line.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional


class Progress:
    def __init__(self, total: Optional[int], desc: str, unit: str, quiet: bool = False, initial: int = 0,
                 stream: Optional[IO[str]] = None, every_s: float = 30.0):
        """``total`` None when unknown (a download without Content-Length); ``unit`` "B" shows bytes as MiB."""
        self.total, self.desc, self.unit, self.quiet, self.every_s = total or 0, desc, unit, quiet, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.n = self.start_n = initial
        self.t0 = self.last = time.monotonic()
        self.info = ""
        isatty = getattr(self.stream, "isatty", None)
        self.bar = None
        if not quiet and isatty is not None and isatty():
            from tqdm import tqdm

            if unit == "B":  # bytes: KiB / MiB / GiB and their rates, as download tools show them
                self.bar = tqdm(total=total or None, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                file=self.stream, dynamic_ncols=True)
            else:
                self.bar = tqdm(total=total, initial=initial, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1, info: str = "", line: bool = False) -> None:
        """``n`` more done; ``info`` replaces the postfix; ``line`` asks for a log line now (not on a terminal)."""
        self.n += n
        if info:
            self.info = info
        if self.quiet:
            return
        try:
            if self.bar is not None:
                if info:
                    self.bar.set_postfix_str(info, refresh=False)
                self.bar.update(n)
                return
            now = time.monotonic()
            if line or (self.total and self.n >= self.total) or now - self.last >= self.every_s:
                self.last = now
                self.stream.write(self.line() + "\n")
                self.stream.flush()
        except (BrokenPipeError, ValueError):  # the reader is gone (ValueError: the stream was closed)
            self._gone()

    def line(self) -> str:
        secs = time.monotonic() - self.t0
        rate = (self.n - self.start_n) / secs if secs > 0 else 0.0
        if self.unit == "B":
            of = f" of {mib(self.total)}" if self.total else ""
            text = f"{self.desc}: {mib(self.n)}{of}, {mib(rate)}/s, {secs:.0f} s"
        else:
            done = self.n - self.start_n
            # a slow unit (a round of a minute) as seconds per unit, as tqdm shows it, not "0.0 rounds/s"
            speed = f"{secs / done:.1f} s/{self.unit}" if 0 < rate < 1 else f"{rate:.1f} {self.unit}s/s"
            text = f"{self.desc}: {self.n}/{self.total} {self.unit}s, {speed}, {secs:.0f} s"
        return f"{text}; {self.info}" if self.info else text

    def close(self) -> None:
        if self.bar is not None:
            try:
                self.bar.close()
            except (BrokenPipeError, ValueError):
                self._gone()

    def _gone(self) -> None:
        """Nothing reads the stream any more: print nothing from now on (the work goes on)."""
        self.quiet, self.bar = True, None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
