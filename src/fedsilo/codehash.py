"""The training code as one hash: what a run's checkpoint key holds of the code, and what every train stage's DVC
dependency is (``data/code/train.json``, written by the root pipeline's ``code_fingerprint`` stage). One file in place of
the code's folders in each of the thousands of train stages' deps keeps ``dvc status`` and ``dvc repro`` quick: DVC
hashes the folders once, for ``code_fingerprint``, instead of once per train stage."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

# The parts of the package (relative to src/fedsilo) whose code decides a run's numbers: the ``code_fingerprint`` stage
# depends on them (tests/test_code_reaches_results.py checks it and that every train stage depends on its output),
# and the checkpoint key hashes them.
TRAIN_CODE = ("client", "fl", "methods", "models", "utils", "config.py")
PACKAGE = Path(__file__).resolve().parent


def train_code_files(pkg: Optional[Path] = None) -> list[Path]:
    """The source files of :data:`TRAIN_CODE` under ``pkg`` (default: this package), in the order they are hashed."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    out: list[Path] = []
    for part in TRAIN_CODE:
        base = pkg / part
        out += sorted(base.rglob("*.py")) if base.is_dir() else [base]
    return out


def train_code_sha256(pkg: Optional[Path] = None) -> str:
    """sha256 over the source files of :data:`TRAIN_CODE` (each one's path below ``pkg`` and its bytes)."""
    pkg = PACKAGE if pkg is None else Path(pkg)
    h = hashlib.sha256()
    for f in train_code_files(pkg):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()
