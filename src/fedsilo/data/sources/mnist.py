"""MNIST (LeCun et al. 1998) as torchvision and the original site distribute it: ``MNIST/raw/{train,t10k}-images-
idx3-ubyte[.gz]`` and ``{train,t10k}-labels-idx1-ubyte[.gz]`` (idx format), or FedBN's pre-processed
``MNIST/partitions/train_part*.pkl`` + ``MNIST/test.pkl``. Domain ``MNIST`` of Digits-Five; subsets train / test."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import (
    array_records,
    fedbn_digit_records,
    load_arrays,
    load_container,
    records_frame,
)

DOMAIN = "MNIST"
DOMAINS = (DOMAIN,)
_BASE = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror of yann.lecun.com/exdb/mnist
# md5s as published with torchvision's MNIST dataset
DOWNLOADS = [
    Remote(_BASE + "train-images-idx3-ubyte.gz", "MNIST/raw/train-images-idx3-ubyte.gz", "md5:f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    Remote(_BASE + "train-labels-idx1-ubyte.gz", "MNIST/raw/train-labels-idx1-ubyte.gz", "md5:d53e105ee54ea40749a09fcbcd1e9432"),
    Remote(_BASE + "t10k-images-idx3-ubyte.gz", "MNIST/raw/t10k-images-idx3-ubyte.gz", "md5:9fb629c4189551a2d022fa330f9573f3"),
    Remote(_BASE + "t10k-labels-idx1-ubyte.gz", "MNIST/raw/t10k-labels-idx1-ubyte.gz", "md5:ec29112dd5afa0611ce80d1b7f02629c"),
]
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS"]


def _images_file(raw_dir: Path, prefix: str) -> Path | None:
    imgs = sorted(walk(raw_dir, f"{prefix}-images-idx3-ubyte*"), key=lambda p: (p.suffix != ".gz", len(p.parts)))
    return imgs[0] if imgs else None


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows = fedbn_digit_records(raw_dir, "MNIST", DOMAIN)
    if rows is None:
        rows = []
        for prefix, subset in (("train", "train"), ("t10k", "test")):
            img = _images_file(raw_dir, prefix)
            if img is None:
                continue
            rel = img.relative_to(raw_dir).as_posix()
            rows += array_records(rel, load_arrays(raw_dir, rel)[1], subset, f"{DOMAIN}/{subset}")
        if not rows:
            raise LabelFileError(f"{raw_dir}: no MNIST files (expected MNIST/raw/t10k-images-idx3-ubyte.gz or FedBN's MNIST/test.pkl)")
    return records_frame(rows, DOMAIN)
