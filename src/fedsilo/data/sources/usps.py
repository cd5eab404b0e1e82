"""USPS (Hull 1994) as LIBSVM distributes it and torchvision reads it: ``usps.bz2`` (7,291 train) and ``usps.t.bz2``
(2,007 test), one line ``<label 1..10> 1:<v> ... 256:<v>`` per 16 x 16 image in [-1, 1] (label - 1 = digit); or
FedBN's ``USPS/partitions/*.pkl`` + ``USPS/test.pkl``. Domain ``USPS`` of Digits-Five."""

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

DOMAIN = "USPS"
DOMAINS = (DOMAIN,)
_BASE = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"
DOWNLOADS = [  # md5s as published with torchvision's USPS dataset
    Remote(_BASE + "usps.bz2", "usps.bz2", "md5:ec16c51db3855ca6c91edd34d0e9b197"),
    Remote(_BASE + "usps.t.bz2", "usps.t.bz2", "md5:8ea070ee2aca1ac39742fdd1ef5ed118"),
]
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS"]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows = fedbn_digit_records(raw_dir, "USPS", DOMAIN)
    if rows is None:
        rows = []
        for name, subset in (("usps.bz2", "train"), ("usps.t.bz2", "test")):
            hits = walk(raw_dir, name) or walk(raw_dir, name[:-4])
            if not hits:
                continue
            rel = hits[0].relative_to(raw_dir).as_posix()
            raw_labels = load_arrays(raw_dir, rel)[1]
            rows += array_records(rel, raw_labels - 1, subset, f"{DOMAIN}/{subset}", raw_labels.tolist())
        if not rows:
            raise LabelFileError(f"{raw_dir}: no USPS files (expected usps.bz2 / usps.t.bz2 or FedBN's USPS/test.pkl)")
    return records_frame(rows, DOMAIN)
