"""CIFAR-10 (Krizhevsky 2009), the "python version" as distributed and as torchvision reads it:
``cifar-10-batches-py/data_batch_{1..5}`` (train) and ``test_batch`` (test), Python pickles of ``data`` (N x 3072
uint8: 32 x 32 x 3 in CHW order) and ``labels`` (0-9), with ``batches.meta`` holding ``label_names``. One domain,
``CIFAR-10``; subsets train / test. The class list comes from ``batches.meta`` when the copy has it."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import (
    array_records,
    load_arrays,
    read_cifar_batch,
    read_python_pickle,
    records_frame,
)

DOMAIN = "CIFAR-10"
DOMAINS = (DOMAIN,)
# the order of batches.meta's label_names in the official archive (used only when a copy lacks batches.meta)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FOLDER = "cifar-10-batches-py"
# address and md5 as published with torchvision's CIFAR10 dataset (the archive unpacks to cifar-10-batches-py/)
DOWNLOADS = [
    Remote("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz", "md5:c58f30108f718f92721af3b95e74349a", True),
]
__all__ = ["read_records", "load_container", "classes", "DOMAINS", "DOWNLOADS", "CLASSES"]

_BATCH = re.compile(r"^(data_batch_\d+|test_batch)$")


def _read(path: Path):
    return read_cifar_batch(path, "labels")


def load_container(raw_dir: Path, container: str):
    return load_arrays(raw_dir, container, _read)[0]


def batch_folder(raw_dir: Path) -> Path:
    """The shallowest folder below ``raw_dir`` holding CIFAR-10 python batches."""
    hits = sorted({p.parent for p in walk(Path(raw_dir), "*") if p.is_file() and _BATCH.match(p.name)}, key=lambda d: (len(d.parts), str(d)))
    if not hits:
        if any(walk(Path(raw_dir), "data_batch_*.bin")):
            raise LabelFileError(f"{raw_dir}: this is CIFAR-10's binary version (cifar-10-batches-bin); fedsilo reads the python version (cifar-10-python.tar.gz)")
        raise LabelFileError(f"{raw_dir}: no CIFAR-10 batches (expected {FOLDER}/data_batch_1..5 and test_batch)")
    return hits[0]


def classes(raw_dir: Path) -> tuple[str, ...]:
    """``label_names`` of ``batches.meta`` (10 names), or :data:`CLASSES` when the copy has no meta file."""
    meta = batch_folder(raw_dir) / "batches.meta"
    if not meta.exists():
        return CLASSES
    return meta_names(meta, "label_names", len(CLASSES))


def meta_names(meta: Path, key: str, n: int) -> tuple[str, ...]:
    d = read_python_pickle(meta)
    if key not in d:
        raise LabelFileError(f"{meta}: missing key {key!r} (have: {', '.join(sorted(d))})")
    names = tuple(x.decode("latin1") if isinstance(x, bytes) else str(x) for x in d[key])
    if len(names) != n or len(set(names)) != n:
        raise LabelFileError(f"{meta}: {key} has {len(names)} names ({len(set(names))} distinct), expected {n}")
    return names


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    folder = batch_folder(raw_dir)
    names = classes(raw_dir)
    batches = sorted((p for p in folder.iterdir() if p.is_file() and _BATCH.match(p.name)), key=lambda p: (p.name == "test_batch", int(re.sub(r"\D", "", p.name) or 0)))
    rows: list[dict] = []
    for b in batches:
        rel = b.relative_to(raw_dir).as_posix()
        subset = "test" if b.name == "test_batch" else "train"
        rows += array_records(rel, load_arrays(raw_dir, rel, _read)[1], subset, f"{DOMAIN}/{b.name}", classes=names)
    return records_frame(rows, DOMAIN)
