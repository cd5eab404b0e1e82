"""Office-Caltech-10 (Gong et al. 2012): the 10 classes shared by Office-31 (amazon, dslr, webcam) and Caltech-256.

Layouts read: ``<domain>/<class>/<file>`` under any folder, with either naming in circulation: the benchmark
repository's ``caltech10`` / ``backpack`` / ``laptop`` or FedBN's ``caltech`` / ``back_pack`` / ``laptop_computer``
(and Office-31's ``<domain>/images/<class>/``). FedBN's split lists ``<domain>_train.pkl`` / ``<domain>_test.pkl``
(pickled ``(paths, class names)``), when present, set each image's ``subset``; otherwise the subset is empty and the
split protocols draw test images from the pool. Domains: amazon, caltech, dslr, webcam.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import (
    class_folder_records,
    fedbn_split_lists,
    find_dirs,
    no_domain_folder,
    norm_name,
    records_frame,
    require_every_class,
)

DOMAINS = ("amazon", "caltech", "dslr", "webcam")
CLASSES = ("backpack", "bike", "calculator", "headphones", "keyboard", "laptop", "monitor", "mouse", "mug", "projector")
DOMAIN_ALIASES = {"amazon": "amazon", "caltech": "caltech", "caltech10": "caltech", "caltech256": "caltech", "dslr": "dslr", "webcam": "webcam"}
CLASS_ALIASES = {norm_name(c): c for c in CLASSES} | {"backpack": "backpack", "laptopcomputer": "laptop", "bicycle": "bike"}
DOWNLOADS: list = []  # FedBN's and the benchmark's copies live behind Google Drive / Dropbox links: use files or local


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, DOMAIN_ALIASES)
    if not dirs:
        raise no_domain_folder(raw_dir, DOMAIN_ALIASES, "Office-Caltech-10", "amazon, caltech or caltech10, dslr, webcam")
    missing = [d for d in DOMAINS if d not in dirs]
    if missing:  # a copy without a domain would silently make a federation of fewer sites
        raise LabelFileError(f"{raw_dir}: no Office-Caltech-10 domain folder {', '.join(missing)} (expected amazon/, "
                             "caltech/ or caltech10/, dslr/ and webcam/, each with a folder per class)")
    frames = []
    for domain in DOMAINS:
        rows = class_folder_records(dirs[domain], raw_dir, domain, CLASSES, CLASS_ALIASES, fedbn_split_lists(raw_dir, domain, DOMAIN_ALIASES))
        require_every_class(rows, CLASSES, dirs[domain], "Office-Caltech-10")
        frames.append(records_frame(rows, domain))
    return pd.concat(frames, ignore_index=True)
