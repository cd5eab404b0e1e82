"""A process pool's workers end with the process that started them, even one killed outright (SIGKILL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

SCRIPT = """
import os, signal, sys, time
from fedsilo.utils.workers import worker_pool
pool = worker_pool(2)
pids = set()
while len(pids) < 2:  # both workers started (each reports its pid)
    pids |= {f.result() for f in [pool.submit(os.getpid) for _ in range(8)]}
print(" ".join(map(str, sorted(pids))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone, waiting to be reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_do_not_outlive_a_killed_parent():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == -9, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived the process that started it"
