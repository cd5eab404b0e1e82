"""CINIC-10 (Darlow et al. 2018): CIFAR-10's classes with images from CIFAR-10 and ImageNet, 32 x 32 PNGs, as the
University of Edinburgh DataShare archive ``CINIC-10.tar.gz`` unpacks: ``{train,valid,test}/<class>/<file>.png``
(class folders ``airplane``, ``automobile``, ... ``truck``; file names such as ``cifar10-train-<n>.png`` or
``n<synset>_<n>.png``), at the top of the raw folder or anywhere below it. One domain, ``CINIC-10``; subsets train,
val (the archive's ``valid``) and test. A PNG stored grey is read as RGB (replicated)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import class_folder_records, find_dirs, norm_name, records_frame

DOMAIN = "CINIC-10"
DOMAINS = (DOMAIN,)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CLASS_ALIASES = {norm_name(c): c for c in CLASSES}
SUBSETS = {"train": "train", "valid": "val", "test": "test"}
# the DataShare item's address; no checksum is published with it: the download is recorded with its sha256 and
# ``verified: false`` until the user pins it under sources.cinic10.checksums
DOWNLOADS = [Remote("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz", "CINIC-10.tar.gz", None, True)]
__all__ = ["read_records", "DOMAINS", "DOWNLOADS", "CLASSES"]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, {s: s for s in SUBSETS})
    if not dirs:
        raise LabelFileError(f"{raw_dir}: no CINIC-10 folders (expected train/, valid/ and test/ with one folder per class)")
    rows: list[dict] = []
    for split, subset in SUBSETS.items():
        if split not in dirs:
            continue
        for r in class_folder_records(dirs[split], raw_dir, DOMAIN, CLASSES, CLASS_ALIASES):
            r["id"] = f"{DOMAIN}/{split}/{r['id'].split('/', 1)[1]}"
            r["subset"] = subset
            rows.append(r)
    if not rows:
        raise LabelFileError(f"{raw_dir}: CINIC-10 folders {', '.join(sorted(dirs))} hold no images")
    return records_frame(rows, DOMAIN)
