"""A hospital's own chest X-rays: image files (DICOM, with or without a suffix; PNG; JPEG) below one folder and a
label table (CSV) with one row per image, read by the rules the user writes for it
(``datasets.<dataset>.tables.<source>``: :class:`~fedsilo.config.CXRTableRules`). The images become one more
domain of the binary Chest-X-Ray-4 task, harmonized exactly as the four public sources are (the same decoders,
VOI / intensity rule, squaring and size), so a hospital joins a federation, or a study, with the export its PACS and
its radiology reports give it.

Row by row (a row's line number counts the header as line 1):

- ``path``: the image file relative to the source's folder (``\\`` read as ``/``, as a Windows export writes it).
  A path that is absolute or leaves the folder is an error; a file the folder does not hold is kept and quarantined
  by harmonize as "image file missing" (the share of missing files counts against ``max_quarantine_fraction``).
  An image listed twice is an error naming both rows. DICOM is told by its suffix or by its preamble.
- ``label``: a value among ``positive`` -> 1, among ``negative`` -> 0 (case-blind, trimmed); a blank -> excluded as
  "no label"; any other value (another finding) -> excluded under that value, so the card counts every finding left
  out.
- ``view`` (when the rules name a column): a ``frontal`` value is kept, a ``lateral`` one excluded as "lateral view"
  (DESIGN §3), a blank excluded as "no view"; any other value is an error naming it and the two rules that could
  take it, never a silent exclusion.
- ``patient`` (when named): the group a split keeps on one side; a blank -> excluded as "no patient id". Without a
  patient column each image is its own group, and the reader says so (:data:`NO_PATIENT_WARNING`).
- ``subset`` (when named): the hospital's own partition, ``train`` / ``val`` / ``test`` (blank: none); another
  value is an error, and so is a patient with images on two sides of it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pandas as pd

from fedsilo.config import CXRTableRules
from fedsilo.data.dicom import is_dicom_file
from fedsilo.data.sources.base import LabelFileError, finalize, read_csv, show

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
SUBSETS = ("train", "val", "test")
NO_PATIENT_WARNING = ("has no patient column (patient: null): each image is its own group, so two images of one "
                      "patient may land on both sides of a split; name the column that identifies patients if the table has one")


def _folded(values: tuple[str, ...]) -> set[str]:
    return {v.strip().casefold() for v in values}


def _relative(raw_dir: Path, value: str, where: str) -> str:
    """The image's path below the source folder, as a POSIX relative path, or an error naming the row."""
    text = value.strip().replace("\\", "/")
    if not text:
        raise LabelFileError(f"{where}: no image path")
    rel = PurePosixPath(text)
    if rel.is_absolute() or (len(text) > 1 and text[1] == ":"):
        raise LabelFileError(f"{where}: {show(value)} is an absolute path; paths are relative to the source's folder {raw_dir}")
    parts: list[str] = []
    for part in rel.parts:
        if part == "..":
            if not parts:
                raise LabelFileError(f"{where}: {show(value)} leaves the source's folder {raw_dir}")
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    if not parts:
        raise LabelFileError(f"{where}: {show(value)} names the source's folder itself, not an image")
    return str(PurePosixPath(*parts))


def read_records(raw_dir: Path, rules: CXRTableRules, domain: str, key: str = "tables") -> pd.DataFrame:
    """The record table of one hospital's export (``key``: the dotted params key of ``rules``, for messages)."""
    raw_dir = Path(raw_dir)
    table_path = raw_dir / rules.file
    if not table_path.is_file():
        raise LabelFileError(f"{table_path}: the label table is missing ({key}.file: {rules.file!r}, relative to the source's folder)")
    df = read_csv(table_path, dtype=str, keep_default_na=False)
    columns = {"path": rules.path, "label": rules.label, "patient": rules.patient, "view": rules.view, "subset": rules.subset}
    named = {role: col for role, col in columns.items() if col is not None}
    missing = [f"{col!r} ({key}.{role})" for role, col in named.items() if col not in df.columns]
    if missing:
        raise LabelFileError(f"{table_path}: missing column(s) {', '.join(missing)}; its columns are {', '.join(map(repr, df.columns))}")
    positive, negative = _folded(rules.positive), _folded(rules.negative)
    frontal, lateral = _folded(rules.frontal), _folded(rules.lateral)

    rows, first_row, patient_sides = [], {}, {}
    for i, rec in enumerate(df.to_dict("records")):
        where = f"{table_path}: row {i + 2}"
        rel = _relative(raw_dir, str(rec[rules.path]), where)
        if rel in first_row:
            raise LabelFileError(f"{where}: {rel} is listed again (first on row {first_row[rel]}); one row per image")
        first_row[rel] = i + 2
        value = str(rec[rules.label]).strip()
        why = "" if value else "no label"
        label = 1 if value.casefold() in positive else 0 if value.casefold() in negative else -1
        if label == -1 and not why:
            why = f"label {value}"
        view = "frontal"
        if rules.view is not None:
            v = str(rec[rules.view]).strip()
            if not v:
                view, why = "unknown", why or "no view"
            elif v.casefold() in frontal:
                view = "frontal"
            elif v.casefold() in lateral:
                view, why = "lateral", why or "lateral view"
            else:
                raise LabelFileError(f"{where}: view {show(v)} is neither frontal nor lateral; add it to {key}.frontal or "
                                     f"{key}.lateral")
        group = rel
        if rules.patient is not None:
            group = str(rec[rules.patient]).strip()
            if not group:
                group, why = rel, why or "no patient id"
        subset = ""
        if rules.subset is not None:
            subset = str(rec[rules.subset]).strip().casefold()
            if subset and subset not in SUBSETS:
                raise LabelFileError(f"{where}: {rules.subset} {show(str(rec[rules.subset]))} is not one of {', '.join(SUBSETS)} "
                                     f"(or blank) ({key}.subset)")
            if subset and rules.patient is not None and not why:
                seen = patient_sides.setdefault(group, (subset, i + 2))
                if seen[0] != subset:
                    raise LabelFileError(f"{where}: patient {group!r} is in subset {subset}, and in {seen[0]} on row {seen[1]}: "
                                         "the table's own partition would put one patient on two sides")
        file = raw_dir / rel
        exists = file.is_file()
        rows.append({
            "id": rel,
            "label": label,
            "original_label": value,
            "group": group,
            "view": view,
            "path": rel if exists else "",
            "reader": ("image" if file.suffix.lower() in IMAGE_SUFFIXES else "dicom" if is_dicom_file(file) else "image") if exists else "",
            "excluded": why,
            "subset": subset,
        })
    if not rows:
        raise LabelFileError(f"{table_path}: the label table has no row")
    return finalize(pd.DataFrame(rows), domain)
