"""A GPU for each of several runs started at once on one machine (``fedsilo grid``'s DVC queue workers).

DVC's queue starts its workers with one environment, so it cannot give each its own ``CUDA_VISIBLE_DEVICES`` as Ray
does. Instead the grid names a folder in ``FEDSILO_GPU_SLOTS``, and a run whose ``train.device`` is ``auto`` on a
machine with several GPUs claims one there: an exclusive ``flock`` on ``cuda<i>.<k>.lock``, the k-th place on GPU i
(i as ``CUDA_VISIBLE_DEVICES`` names it, when set), held until the process exits (the kernel releases it even after
a crash, so a killed run frees its place). Places are tried k-major (every GPU's first place, then every GPU's
second), so runs spread evenly over the GPUs and a finished run's place goes to the next one. The GPU a run trains on
does not change its parameters or its hash (``auto`` is what params say); only its speed depends on it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Optional

GPU_SLOTS_ENV = "FEDSILO_GPU_SLOTS"
MAX_PER_GPU = 256  # places per GPU tried before giving up (far above any useful number of runs on one GPU)

_held: dict[str, tuple[int, IO[bytes]]] = {}  # this process's place per folder: kept open, so locked, until it exits


def gpu_names(gpus: int) -> list[str]:
    """What names each of the ``gpus`` GPUs this process sees in the slot folder: the machine's own index (or UUID)
    from ``CUDA_VISIBLE_DEVICES`` when it lists them, so that grids shown different GPUs never share a place; else
    0..gpus-1."""
    listed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return listed[:gpus] if len(listed) >= gpus else [str(i) for i in range(gpus)]


def claim_slot(folder: Path, gpus: int) -> tuple[int, IO[bytes]]:
    """The first free place in ``folder`` over ``gpus`` GPUs, k-major: (the GPU's index as this process sees it, the
    open locked file)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = gpu_names(gpus)
    for k in range(MAX_PER_GPU):
        for i in range(gpus):
            f = open(folder / f"cuda{names[i]}.{k}.lock", "ab")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            f.truncate(0)
            f.write(f"{os.getpid()}\n".encode())
            f.flush()
            return i, f
    raise RuntimeError(f"{folder}: every one of {gpus} x {MAX_PER_GPU} GPU places is taken")


def claim_gpu(gpus: int) -> Optional[int]:
    """The GPU this process trains on when ``FEDSILO_GPU_SLOTS`` names a folder and there are several GPUs (the place
    stays held until the process exits; asked again, the same GPU); None otherwise."""
    folder = os.environ.get(GPU_SLOTS_ENV)
    if not folder or gpus < 2:
        return None
    if folder not in _held:
        _held[folder] = claim_slot(Path(folder), gpus)
    return _held[folder][0]
