"""EMNIST ByClass (Cohen et al. 2017) as NIST distributes it (``gzip.zip``, which torchvision downloads):
``gzip/emnist-byclass-{train,test}-{images-idx3,labels-idx1}-ubyte.gz`` (idx files like MNIST's, 28 x 28 grey, labels
0-61) and ``gzip/emnist-byclass-mapping.txt`` (``<label> <ASCII code>`` per line: digits, upper-case, lower-case
letters). torchvision's ``EMNIST/raw/`` (unpacked idx files) is read too. The idx files store every image transposed
(column-major); the reader transposes them back, so harmonized images stand upright as MNIST's do. One domain,
``EMNIST``; subsets train / test; the other EMNIST splits in the zip (balanced, bymerge, letters, digits, mnist) are
not read."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import _read_container, array_records, load_arrays, records_frame
from fedsilo.data.sources.fmnist import images_file

DOMAIN = "EMNIST"
DOMAINS = (DOMAIN,)
SPLIT = "byclass"
# torchvision's EMNIST byclass classes, the order of emnist-byclass-mapping.txt (used when a copy lacks it)
CLASSES = tuple(string.digits + string.ascii_uppercase + string.ascii_lowercase)
# address and md5 as published with torchvision's EMNIST dataset; the zip unpacks to gzip/ (all six splits)
DOWNLOADS = [
    Remote("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip", "gzip.zip", "md5:58c8d27c78d21e728a6bc7b3cc06412e", True),
]
__all__ = ["read_records", "load_container", "classes", "DOMAINS", "DOWNLOADS", "CLASSES"]


def _read_upright(path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _read_container(path)
    return np.ascontiguousarray(images.transpose(0, 2, 1)), labels


def load_container(raw_dir: Path, container: str) -> np.ndarray:
    return load_arrays(raw_dir, container, _read_upright)[0]


def classes(raw_dir: Path) -> tuple[str, ...]:
    """The characters of ``emnist-byclass-mapping.txt`` in label order, or :data:`CLASSES` when the copy has none."""
    hits = sorted(walk(Path(raw_dir), f"emnist-{SPLIT}-mapping.txt"), key=lambda p: (len(p.parts), str(p)))
    if not hits:
        return CLASSES
    path = hits[0]
    names: dict[int, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            label, code = (int(v) for v in parts)
        except ValueError:
            raise LabelFileError(f"{path}: line {n}: expected '<label> <ASCII code>', got {line!r}") from None
        names[label] = chr(code)
    if sorted(names) != list(range(len(CLASSES))):
        raise LabelFileError(f"{path}: labels {min(names, default=None)}..{max(names, default=None)} ({len(names)}), expected 0..{len(CLASSES) - 1}")
    return tuple(names[i] for i in range(len(CLASSES)))


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    names = classes(raw_dir)
    rows: list[dict] = []
    for subset in ("train", "test"):
        img = images_file(raw_dir, f"emnist-{SPLIT}-{subset}-images-idx3-ubyte")
        if img is None:
            continue
        rel = img.relative_to(raw_dir).as_posix()
        labels = rel.replace("images-idx3", "labels-idx1")
        rows += array_records(rel, load_arrays(raw_dir, rel, _read_upright)[1], subset, f"{DOMAIN}/{subset}", classes=names, label_file=labels)
    if not rows:
        raise LabelFileError(f"{raw_dir}: no EMNIST ByClass files (expected gzip/emnist-{SPLIT}-{{train,test}}-images-idx3-ubyte.gz and the labels beside them)")
    return records_frame(rows, DOMAIN)
