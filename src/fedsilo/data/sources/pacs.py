"""PACS (Li et al. 2017): photo, art_painting, cartoon, sketch; 7 classes.

Layouts read: ``<domain>/<class>/<file>`` under ``PACS/``, ``kfold/`` or any folder, with or without the official
split lists (``<domain>_train_kfold.txt``, ``<domain>_crossval_kfold.txt``; lines ``<domain>/<class>/<file> <1-based
label>``). With the lists, images get ``subset`` train / val; the ``*_test_kfold.txt`` lists name every image of the
domain (the leave-one-domain-out protocol tests on a whole domain), so they set no subset. A list line whose image is
missing is kept and quarantined by harmonize; a label that disagrees with its class folder is an error naming the line.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import (
    class_folder_records,
    find_dirs,
    list_lines,
    no_domain_folder,
    norm_name,
    records_frame,
    require_every_class,
)

DOMAINS = ("photo", "art_painting", "cartoon", "sketch")
CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
DOMAIN_ALIASES = {norm_name(d): d for d in DOMAINS} | {"art": "art_painting", "artpainting": "art_painting", "photos": "photo", "sketches": "sketch"}
CLASS_ALIASES = {norm_name(c): c for c in CLASSES}
LIST_FORM = "'<domain>/<class>/<file> <label>'"
DOWNLOADS: list = []  # the authors share PACS through Google Drive: use files or local


def _split_lists(raw_dir: Path, domain: str, domain_dir: Path) -> tuple[dict[str, str], list[dict]]:
    """(class/file -> subset, rows for listed files that are missing on disk)."""
    subsets: dict[str, str] = {}
    missing: list[dict] = []
    for tag, subset in (("train", "train"), ("crossval", "val")):
        hits = [p for p in walk(raw_dir, f"*_{tag}_kfold.txt") if DOMAIN_ALIASES.get(norm_name(p.name[: -len(f"_{tag}_kfold.txt")])) == domain]
        if not hits:
            continue
        for n, listed, label, line in list_lines(hits[0], LIST_FORM):
            if not label.lstrip("-").isdigit():
                raise LabelFileError(f"{hits[0]}: line {n}: expected {LIST_FORM}, got {line!r}")
            rel = Path(listed)
            if len(rel.parts) < 3:
                raise LabelFileError(f"{hits[0]}: line {n}: path {listed!r} is not <domain>/<class>/<file>")
            cls = CLASS_ALIASES.get(norm_name(rel.parts[-2]))
            if cls is None:
                raise LabelFileError(f"{hits[0]}: line {n}: class folder {rel.parts[-2]!r} is not a PACS class")
            if int(label) - 1 != CLASSES.index(cls):
                raise LabelFileError(f"{hits[0]}: line {n}: label {label} disagrees with class folder {rel.parts[-2]!r}")
            key = f"{rel.parts[-2]}/{rel.parts[-1]}"
            subsets[key] = subset
            if not (domain_dir / rel.parts[-2] / rel.parts[-1]).exists():
                missing.append(
                    {"id": f"{domain}/{key}", "label": CLASSES.index(cls), "original_label": rel.parts[-2], "group": "", "view": "",
                     "path": "", "reader": "image", "excluded": "", "subset": subset}
                )
    return subsets, missing


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, DOMAIN_ALIASES)
    if not dirs:
        raise no_domain_folder(raw_dir, DOMAIN_ALIASES, "PACS", ", ".join(DOMAINS))
    frames = []
    for domain in DOMAINS:
        if domain in dirs:
            subsets, missing = _split_lists(raw_dir, domain, dirs[domain])
            rows = class_folder_records(dirs[domain], raw_dir, domain, CLASSES, CLASS_ALIASES, subsets)
            require_every_class(rows + missing, CLASSES, dirs[domain], "PACS")  # every PACS domain holds all seven
            frames.append(records_frame(rows + missing, domain))
    return pd.concat(frames, ignore_index=True)
