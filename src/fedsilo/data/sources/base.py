"""What every raw source module provides, and the record table they all return.

A source module reads the label files of the source's *real* raw layout into a record table with one row per
image, included or not:

``id`` (unique within the source), ``domain``, ``label`` (1 / 0, or -1 when excluded), ``original_label`` (the
source's own label, verbatim enough to audit the mapping), ``group`` (patient id; one group never spans train and
test), ``view`` (``frontal`` / ``lateral`` / ``unknown``), ``path`` (relative to the raw folder; empty when the label
file names an image the raw folder does not hold), ``reader`` (``dicom`` or ``image``), ``excluded`` (empty, or the
reason), ``subset`` (the distribution's own train / test / val partition, empty when it has none); and, only where
the data has it, ``writer`` (who produced the image: FEMNIST's writers, the natural clients of ``split.protocol:
by_writer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

RECORD_COLUMNS = ["id", "domain", "label", "original_label", "group", "view", "path", "reader", "excluded", "subset"]
# columns a source adds only when its data has them (every other dataset's records stay byte for byte as they were)
OPTIONAL_COLUMNS = ["writer"]


class LabelFileError(ValueError):
    """A label file that is missing, or lacks a column the rules need; the message names file and column."""


def is_hidden(name: str) -> bool:
    """A file or folder name no reader takes for data: dot files (the ``._<name>`` AppleDouble twin macOS writes
    beside every file on a non-Mac disk or into a zip, ``.DS_Store``) and the ``__MACOSX`` folder of a Mac-made zip."""
    return name.startswith(".") or name == "__MACOSX"


def walk(root: Path, pattern: str = "*") -> list[Path]:
    """``root.rglob(pattern)``, sorted, without hidden files (:func:`is_hidden`) and whatever hidden folders below
    ``root`` hold: every reader lists raw files through it, so a Mac-made or zipped copy reads as the original."""
    root = Path(root)
    return sorted(p for p in root.rglob(pattern) if not any(is_hidden(part) for part in p.relative_to(root).parts))


def show(value: Any) -> str:
    """A value from a label file as a message shows it: numpy scalars as the plain values they hold (``2.0``, not
    ``np.float64(2.0)``), strings quoted."""
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)


def require_columns(df: pd.DataFrame, columns: Iterable[str], path: Path) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise LabelFileError(f"{path}: missing column(s) {', '.join(repr(c) for c in missing)}")


def find_one(root: Path, names: Iterable[str], what: str) -> Path:
    """The first file below ``root`` whose name is one of ``names`` (shallowest first)."""
    names = list(names)
    hits: list[Path] = []
    for name in names:
        hits.extend(walk(root, name))
    if not hits:
        raise LabelFileError(f"{root}: no {what} found (looked for {', '.join(names)})")
    hits.sort(key=lambda p: (len(p.relative_to(root).parts), names.index(p.name) if p.name in names else 0, str(p)))
    return hits[0]


def read_csv(path: Path, **kw) -> pd.DataFrame:
    try:
        return pd.read_csv(path, **kw)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, EOFError, OSError) as err:
        raise LabelFileError(f"{path}: cannot parse: {err}") from err


def finalize(df: pd.DataFrame, domain: str) -> pd.DataFrame:
    df = df.copy()
    df["domain"] = domain
    if "subset" not in df.columns:
        df["subset"] = ""
    df["excluded"] = df["excluded"].fillna("").astype(str)
    df.loc[df["excluded"] != "", "label"] = -1
    df["label"] = df["label"].astype("int64")
    optional = [c for c in OPTIONAL_COLUMNS if c in df.columns]
    for col in ("id", "original_label", "group", "view", "path", "reader", "subset", *optional):
        df[col] = df[col].fillna("").astype(str)
    if df["id"].duplicated().any():
        dup = df.loc[df["id"].duplicated(), "id"].iloc[0]
        raise LabelFileError(f"{domain}: duplicate record id {dup!r}")
    return df[RECORD_COLUMNS + optional].reset_index(drop=True)


def explode_records(rec: pd.DataFrame, parts: list[Any], column: str, suffix: Any) -> pd.DataFrame:
    """``rec`` with row i repeated once per item of ``parts[i]`` (a file that holds several images: a cine's frames,
    a slide's patches), the item in ``column`` and ``suffix(item)`` added to the row's id; a row whose ``parts[i]``
    is None stays one row, its ``column`` None and its id as it was. Every copy keeps the row's class, group and
    subset, so a file's images stay on one side of every split."""
    items = [p if p else [None] for p in parts]
    out = rec.loc[rec.index.repeat([len(p) for p in items])].reset_index(drop=True)
    out[column] = [x for p in items for x in p]
    named = np.array([x is not None for p in items for x in p], dtype=bool)
    out.loc[named, "id"] = [f"{i}{suffix(x)}" for i, x in zip(out.loc[named, "id"], out.loc[named, column])]
    return out


def summarize(df: pd.DataFrame) -> dict[str, object]:
    inc = df[df["excluded"] == ""]
    return {
        "positive": int((inc["label"] == 1).sum()),
        "negative": int((inc["label"] == 0).sum()),
        "excluded": int((df["excluded"] != "").sum()),
        "excluded_by_reason": {k: int(v) for k, v in df.loc[df["excluded"] != "", "excluded"].value_counts().items()},
    }
