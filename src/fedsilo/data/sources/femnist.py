"""FEMNIST (LEAF; Caldas et al. 2019): NIST Special Database 19's handwritten characters grouped by writer, as LEAF's
``data/femnist/preprocess.sh`` writes them: JSON files ``{"users": [...], "num_samples": [...], "user_data": {<writer>:
{"x": [[784 pixel values], ...], "y": [labels]}}}``. Each image is a 28 x 28 grey thumbnail of the 128 x 128 scan, row
by row, stored as grey / 255 (so 0-1, dark ink on a white background, as LEAF's models and FedeCouple's Table V read
it); integer 0-255 values are read too. Labels 0-61: the digits, then upper-case, then lower-case letters (LEAF's
``relabel_class``; EMNIST ByClass's order). Only FEMNIST's files are read: ``<stage>/*.json`` or ``data/<stage>/*.json`` in the folder, or
``femnist/data/<stage>/*.json`` below it (another LEAF dataset's files beside them are not); a writer found in two
files of one subset (two LEAF runs' outputs in one folder) is refused.

LEAF's stages write to ``data/all_data/`` (every writer), ``data/sampled_data/`` (``--sf``), ``data/rem_user_data/``
(``-k``) and ``data/train/`` + ``data/test/`` (``-t sample``: each writer's images split into train and test, so a
writer is in both; ``-t user``: writers split). The reader takes the last stage present, as LEAF's own scripts do:
``train/`` + ``test/`` (subsets train / test), else ``rem_user_data/``, ``sampled_data/``, ``all_data/`` (no subset:
the ``by_writer`` split draws each writer's test images). One domain, ``FEMNIST``; each record names its writer in
the ``writer`` column.

No download: LEAF publishes no pre-processed file, only the scripts that build the JSON from NIST's SD19 zips; run
them (``./preprocess.sh -s niid --sf 1.0 -k 0 -t sample``, or the sampling the paper used) and point ``local`` at
LEAF's ``data/femnist/data`` folder (or any folder above it)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.data.sources.base import LabelFileError, finalize, walk
from fedsilo.data.sources.emnist import CLASSES

DOMAIN = "FEMNIST"
DOMAINS = (DOMAIN,)
# LEAF's stage folders, the last stage first: the reader takes the first one present
STAGES = (("train", "test"), ("rem_user_data",), ("sampled_data",), ("all_data",))
DOWNLOADS: list = []
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS", "CLASSES"]


def _is_femnist(raw_dir: Path, path: Path) -> bool:
    """A JSON of FEMNIST's stages: ``<stage>/<file>`` (the folder is LEAF's ``femnist/data``), ``data/<stage>/<file>``
    (the folder is ``femnist``), or ``.../femnist/data/<stage>/<file>`` below it; not another LEAF dataset's
    ``shakespeare/data/train/...`` beside it."""
    rel = path.relative_to(raw_dir).parts
    return len(rel) == 2 or (len(rel) == 3 and rel[0] == "data") or (len(rel) >= 4 and rel[-4] == "femnist" and rel[-3] == "data")


def _stage_files(raw_dir: Path) -> list[tuple[Path, str]]:
    """(JSON file, subset) of the last LEAF stage present below ``raw_dir``."""
    jsons = [p for p in walk(raw_dir, "*.json") if _is_femnist(raw_dir, p)]
    for stage in STAGES:
        hits = [(p, p.parent.name if len(stage) == 2 else "") for p in jsons if p.parent.name in stage]
        if hits and all(any(sub == s for _, sub in hits) for s in (stage if len(stage) == 2 else ("",))):
            return hits
    return []


@lru_cache(maxsize=2)
def _read(path: str, mtime: float, size: int) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(images N x 28 x 28 uint8, labels, the writer of each image) of one LEAF JSON file, in its users' order."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        users, user_data = list(data["users"]), data["user_data"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LabelFileError(f"{path}: not a LEAF JSON file (users, num_samples, user_data): {err}") from None
    xs, ys, who = [], [], []
    for u in users:
        if u not in user_data:
            raise LabelFileError(f"{path}: user {u!r} is listed in 'users' but has no 'user_data'")
        x, y = user_data[u].get("x", []), user_data[u].get("y", [])
        if len(x) != len(y):
            raise LabelFileError(f"{path}: user {u!r} has {len(x)} images and {len(y)} labels")
        xs.extend(x)
        ys.extend(y)
        who.extend([str(u)] * len(y))
    if not ys:
        return np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.int64), ()
    try:
        arr = np.asarray(xs, dtype=np.float64)
    except ValueError:
        raise LabelFileError(f"{path}: the images are not all 784 numbers") from None
    if arr.ndim != 2 or arr.shape[1] != 28 * 28:
        raise LabelFileError(f"{path}: images of {arr.shape[1:] if arr.ndim == 2 else 'uneven'} values, expected 784 (28 x 28)")
    scale = 255.0 if arr.max() <= 1.0 else 1.0  # LEAF's grey / 255, or raw 0-255 values
    images = np.clip(np.rint(arr * scale), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return images, np.asarray(ys, dtype=np.int64), tuple(who)


def _load(raw_dir: Path, container: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    p = Path(raw_dir) / container
    st = p.stat()
    return _read(str(p), st.st_mtime, st.st_size)


def load_container(raw_dir: Path, container: str) -> np.ndarray:
    return _load(raw_dir, container)[0]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    files = _stage_files(raw_dir)
    if not files:
        raise LabelFileError(f"{raw_dir}: no LEAF FEMNIST JSON files (expected data/train/*.json and data/test/*.json, or "
                             "data/all_data/*.json, as LEAF's preprocess.sh writes them)")
    frames = []
    for path, subset in files:
        rel = path.relative_to(raw_dir).as_posix()
        _, labels, who = _load(raw_dir, rel)
        bad = np.flatnonzero((labels < 0) | (labels >= len(CLASSES)))
        if bad.size:
            raise LabelFileError(f"{rel}: label {int(labels[bad[0]])} of writer {who[bad[0]]!r} is not one of the 62 classes (0-61)")
        n = len(labels)
        stem = path.stem
        frames.append(pd.DataFrame({
            "id": [f"{DOMAIN}/{stem}/{i}" for i in range(n)],
            "label": labels,
            "original_label": [CLASSES[k] for k in labels],
            "group": [f"{DOMAIN}/{stem}/{i}" for i in range(n)],  # an image is its own group (writers are not patients)
            "view": "",
            "path": [f"{rel}#{i}" for i in range(n)],
            "reader": "array",
            "excluded": "",
            "subset": subset,
            "writer": list(who),
        }))
    records = pd.concat(frames, ignore_index=True)
    # a writer in two files of one subset: two LEAF runs' outputs in one folder (another --tf, another sampling)
    files = records.assign(file=records["path"].str.rpartition("#")[0]).groupby(["writer", "subset"])["file"].unique()
    twice = files[files.map(len) > 1]
    if len(twice):
        (writer, subset), names = twice.index[0], twice.iloc[0]
        raise LabelFileError(f"{raw_dir}: writer {writer!r} is in {len(names)} {subset or 'all_data'} files ({', '.join(sorted(names)[:2])}): "
                             "the outputs of two LEAF runs? keep one run's files")
    return finalize(records, DOMAIN)
