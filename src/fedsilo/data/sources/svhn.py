"""SVHN cropped digits (Netzer et al. 2011) as distributed: ``train_32x32.mat`` / ``test_32x32.mat`` (``X`` 32 x 32 x
3 x N, ``y`` with digit 0 written as 10; ``extra_32x32.mat`` is not used), or FedBN's ``SVHN/partitions/*.pkl`` +
``SVHN/test.pkl``. Domain ``SVHN`` of Digits-Five."""

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

DOMAIN = "SVHN"
DOMAINS = (DOMAIN,)
_BASE = "http://ufldl.stanford.edu/housenumbers/"
DOWNLOADS = [  # md5s as published with torchvision's SVHN dataset
    Remote(_BASE + "train_32x32.mat", "train_32x32.mat", "md5:e26dedcc434d2e4c54c9b2d4a06d8373"),
    Remote(_BASE + "test_32x32.mat", "test_32x32.mat", "md5:eb5a983be6a315427106f1b164d9cef3"),
]
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS"]


def mat_records(raw_dir: Path, names: tuple[tuple[str, str], ...], domain: str) -> list[dict]:
    rows: list[dict] = []
    for name, subset in names:
        hits = walk(raw_dir, name)
        if not hits:
            continue
        rel = hits[0].relative_to(raw_dir).as_posix()
        y = load_arrays(raw_dir, rel)[1]
        rows += array_records(rel, y % 10, subset, f"{domain}/{subset}", y.tolist())
    return rows


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows = fedbn_digit_records(raw_dir, "SVHN", DOMAIN)
    if rows is None:
        rows = mat_records(raw_dir, (("train_32x32.mat", "train"), ("test_32x32.mat", "test")), DOMAIN)
        if not rows:
            raise LabelFileError(f"{raw_dir}: no SVHN files (expected train_32x32.mat / test_32x32.mat or FedBN's SVHN/test.pkl)")
    return records_frame(rows, DOMAIN)
