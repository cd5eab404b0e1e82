"""A hospital's own chest X-rays: image files (DICOM, with or without a suffix; PNG; JPEG) below one folder and a
label table (CSV) with one row per image, read by the rules the user writes for it
(``datasets.<dataset>.tables.<source>``: :class:`~fedsilo.config.CXRTableRules`). The images become one more
domain of the binary Chest-X-Ray-4 task, harmonized exactly as the four public sources are (the same decoders,
VOI / intensity rule, squaring and size), so a hospital joins a federation, or a study, with the export its PACS and
its radiology reports give it.

Row by row (row N is the table's N-th line as a spreadsheet numbers it, the header being row 1; the CSV reader skips
blank lines, so after one the numbers run one short of the file's line numbers). Values are compared trimmed,
case-blind, and numbers by their value (``1``, ``1.0``: :func:`~fedsilo.config.table_word`):

- ``path``: the image file relative to the source's folder (``\\`` read as ``/``, as a Windows export writes it).
  A path that is absolute or leaves the folder is an error. A path that matches no file exactly but exactly one file
  of the folder when case and Unicode normalization are ignored (a table typed on Windows, a folder copied from a
  Mac) is read from that file; otherwise the row is kept and quarantined by harmonize as "image file missing" (the
  share of missing files counts against ``max_quarantine_fraction``). An image listed twice is an error naming both
  rows. DICOM is told by its suffix or by its preamble; a file that cannot be opened is left to the decoder, which
  quarantines it with the operating system's reason.
- a study-level table (one row per study, a radiology report's finding): the row's path names the study's folder,
  and every file below it is an image of the row, each with its own view from its DICOM header (so ``dicom_view``
  must be set and the row's view cell left blank: a study holds frontal and lateral images), the study (or the
  row's patient) their group.
- ``label``: a value among ``positive`` -> 1, among ``negative`` -> 0 (case-blind, trimmed); a blank -> excluded as
  "no label"; any other value (another finding) -> excluded under that value, so the card counts every finding left
  out.
- ``view`` (when the rules name a column): a ``frontal`` value is kept, a ``lateral`` one excluded as "lateral view"
  (DESIGN §3), a blank excluded as "no view"; any other value is an error naming it and the two rules that could
  take it, never a silent exclusion. With ``dicom_view`` a blank cell (or every row, with no view column) takes the
  View Position of the DICOM's header, mapped by the same two rules; an image with none (a PNG, a header without the
  tag) is excluded as "no view", one whose header cannot be read is left to the decoder (quarantined). Headers can
  be wrong (OpenI's record PA for many lateral images): a table's view column, where there is one, comes first.
- ``patient`` (when named): the group a split keeps on one side; a blank (or ``NA``, ``N/A``, ``nan``, ``none``,
  ``null``, ``-``) -> excluded as "no patient id". Without a patient column each image is its own group, and
  harmonize says so (:data:`NO_PATIENT_WARNING`); without a view column every image is taken as frontal, and it
  says that too (:data:`NO_VIEW_WARNING`).
- ``dicom_match`` (instead of ``path``): the rows find their images by their DICOM headers, a radiology report
  table by AccessionNumber (one row per study; :func:`_records_by_dicom`).
- ``subset`` (when named): the hospital's own partition, ``train`` / ``val`` / ``test`` (blank: none); another
  value is an error. The splits draw test images from ``test`` and training images from the rest (train, val and
  blank alike), so a kept patient with images in ``test`` and outside it is an error naming both rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from fedsilo.config import CXRTableRules, table_word
from fedsilo.data.dicom import WHOLE_SLIDE_PROBLEM, is_dicom_file, view_position
from fedsilo.data.imageops import ImageDecodeError
from fedsilo.data.slides import is_slide_file
from fedsilo.data.sources.base import LabelFileError, finalize, show, walk
from fedsilo.data.sources.image_folder import file_reader
from fedsilo.data.sources.tables import (
    MatchedRows,
    Rows,
    check_matched,
    dicom_index,
    header_patients_warning,
    load_table,
    relative_path,
    study_folder,
)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
NO_PATIENT_WARNING = ("has no patient column (patient: null): each image is its own group, so two images of one "
                      "patient may land on both sides of a split; name the column that identifies patients if the table has one")
NO_VIEW_WARNING = ("has no view column (view: null): every image is taken as frontal, so a lateral view in the export "
                   "would be trained on; name the column that gives the view if the table has one")


def _folded(values: tuple[str, ...]) -> set[str]:
    return {table_word(v) for v in values}


def _reader(file: Path) -> str:
    if file.suffix.lower() in IMAGE_SUFFIXES:
        return "image"
    try:
        return "dicom" if is_dicom_file(file) else "image"
    except OSError:  # unreadable here: the decoder quarantines it with the reason
        return "image"


def _view(rec: dict, rules: CXRTableRules, raw_dir: Path, found: Optional[str], reader: str, why: str, frontal: set[str],
          lateral: set[str], where: str, key: str, study: bool) -> tuple[str, str]:
    """(view, exclusion reason) of one image: the table's view cell (not for a study's folder), else with
    ``dicom_view`` the DICOM header's View Position; a frontal view is kept, a lateral one excluded, none excluded as
    "no view"; a value in neither rule is an error. ``why`` is the row's reason already (no header read then)."""
    if rules.view is None and not rules.dicom_view:
        return "frontal", ""
    v, told, unseen = (str(rec[rules.view]).strip() if rules.view is not None and not study else ""), "view", False
    if not v and rules.dicom_view and not why:
        if not found:  # kept: harmonize quarantines it as missing
            unseen = True
        elif reader == "dicom":
            try:
                v, told = view_position(raw_dir / found), f"the DICOM header's View Position ({found})"
            except ImageDecodeError:
                unseen = True  # kept for the decoder, which quarantines the file with the reason
            v = _one_view(v)
    if unseen:
        return "unknown", ""
    return _classify_view(v, told, frontal, lateral, where, key)


def _one_view(v: str) -> str:
    """A header's View Position as one value: the same view repeated (``PA\\PA``) is that view."""
    words = {table_word(x) for x in v.split("\\")}
    return v.split("\\")[0] if len(words) == 1 else v


def _classify_view(v: str, told: str, frontal: set[str], lateral: set[str], where: str, key: str) -> tuple[str, str]:
    """(view, exclusion reason) of a view value (``told``: where it was read, for the error): frontal kept, lateral
    excluded, blank "no view"; a value in neither rule is an error naming it and both rules."""
    if not v:
        return "unknown", "no view"
    if table_word(v) in frontal:
        return "frontal", ""
    if table_word(v) in lateral:
        return "lateral", "lateral view"
    raise LabelFileError(f"{where}: {told} {show(v)} is neither frontal nor lateral; add it to {key}.frontal or {key}.lateral")


def _label_of(value: str, positive: set[str], negative: set[str]) -> tuple[int, str]:
    """(label, exclusion reason) of a label cell: 1 positive, 0 negative; a blank "no label", another finding excluded
    under its own value."""
    word = table_word(value)
    label = 1 if word in positive else 0 if word in negative else -1
    return label, ("no label" if not value else f"label {value}" if label == -1 else "")


def _check_labels(df: pd.DataFrame, rules: CXRTableRules, key: str, where: Path, warnings: Optional[list[str]]) -> None:
    """A class no row is labelled with while other label values come close to the rules' words is a typo (in the
    rules or the table): an error naming both, as it would otherwise leave a one-class site silently. A value close
    to a rule word beside rows of its class is a warning (``warnings``)."""
    import difflib

    words = {table_word(w): w for w in (*rules.positive, *rules.negative)}
    other = df.loc[(df["label"] == -1) & (df["original_label"] != ""), "original_label"].value_counts() if len(df) else pd.Series(dtype=int)
    near = {}
    for value, n in other.items():
        close = difflib.get_close_matches(table_word(value), list(words), n=1, cutoff=0.8)
        if close:
            near[value] = (words[close[0]], int(n))
    for label, side in ((1, "positive"), (0, "negative")):
        if len(df) and not (df["label"] == label).any():
            theirs = {v: m for v, m in near.items() if table_word(m[0]) in {table_word(w) for w in getattr(rules, side)}}
            if theirs:
                said = "; ".join(f"{show(v)} ({m[1]} row(s)) is close to {show(m[0])}" for v, m in theirs.items())
                raise LabelFileError(f"{where}: no row is {side} ({key}.{side}: {list(getattr(rules, side))}), and the label column's "
                                     f"values are excluded as other findings where {said}: a typo in {key}.{side} or in "
                                     "the table? Write the value as the table has it")
    if warnings is not None:
        for value, (word, n) in near.items():
            warnings.append(f"{key}: {n} row(s) labelled {show(value)} are excluded as another finding; close to "
                            f"{show(word)} of the rules: add it there if it means the same")


def _records_by_dicom(raw_dir: Path, rules: CXRTableRules, domain: str, key: str, quiet: bool,
                      warnings: Optional[list[str]] = None) -> pd.DataFrame:
    """:func:`read_records` of a table whose rows find their images by a DICOM header attribute (``dicom_match``): a
    report table by AccessionNumber, one row per study (or per patient, series or image by the other attributes).
    Every DICOM below the folder whose header holds a row's ID is an image of the row's finding, its view from its
    header's View Position (the table's view cell too where a row is one image, by SOPInstanceUID), its group the row's
    patient or, without a patient column, its header's PatientID. A row no DICOM matches, a DICOM no row lists or that
    cannot be matched, and a DICOM that is no picture (a report) or a whole-slide image are excluded with the reason;
    an ID on two rows is an error, and so are :func:`~fedsilo.data.sources.tables.check_matched`'s refusals."""
    match = rules.dicom_match
    assert match is not None
    mkey, one_image = f"{key}.dicom_match", match.tag == "SOPInstanceUID"
    columns = [("label", rules.label), ("patient", rules.patient), ("subset", rules.subset), ("dicom_match.column", match.column)]
    columns += [("view", rules.view)] if one_image else []
    table_path, df = load_table(raw_dir, rules, columns, key)
    positive, negative = _folded(rules.positive), _folded(rules.negative)
    frontal, lateral = _folded(rules.frontal), _folded(rules.lateral)
    by_value, unmatched = dicom_index(raw_dir, match.folder, match.tag, mkey, quiet, rules.file, f"{mkey}.folder")
    check_matched(by_value, unmatched, df[match.column], raw_dir, match.folder, match.tag,
                  match.column, f"{mkey}.column", mkey, table_path)
    table, matched = Rows(raw_dir), MatchedRows(by_value, match.tag, mkey, "finding")
    rows, header_patients = [], []  # header_patients: each kept image's PatientID ("" none)
    for row, rec, where in table.each(df, table_path, key, quiet):
        with table.row():
            value = str(rec[rules.label]).strip()
            label, label_why = _label_of(value, positive, negative)
            ident = str(rec[match.column]).strip()
            files = matched.take(ident, row, where)
            if files is None:
                label_why, files = label_why or f"no {match.tag} in the row", []
            per = []
            for f in files:
                if f.problem:  # a report, a presentation state; a slide is no chest X-ray
                    per.append((f, "", "unknown", "a whole-slide image (not a chest X-ray)" if f.problem == WHOLE_SLIDE_PROBLEM
                                else f"not an image: {f.problem}"))
                    continue
                cell = str(rec[rules.view]).strip() if one_image and rules.view is not None else ""
                if rules.view is None and not rules.dicom_view:
                    view, view_why = "frontal", ""
                elif cell or label_why or not rules.dicom_view:
                    view, view_why = _classify_view(cell, "view", frontal, lateral, where, key)
                else:
                    view, view_why = _classify_view(_one_view(f.view), f"the DICOM header's View Position ({f.path})", frontal,
                                                    lateral, where, key)
                per.append((f, "dicom", view, view_why))
            files_why = per[0][3] if per and all(w for *_, w in per) else ""
            pre = label_why or files_why or ("" if files else f"no DICOM with this {match.tag} under {match.folder}")
            group, subset, row_why = table.group_and_subset(rec, rules, f"{matched.noun} {ident}", pre, row, where, key)
            patient_why = row_why if row_why != pre else ""
            for f, reader, view, view_why in per or [(None, "", "unknown", "")]:
                mine = table.matched_group(group, f, rules, subset, not (pre or view_why), row, where)
                if f is not None and not (label_why or view_why or patient_why):
                    header_patients.append(f.patient)
                rows.append({"id": f.path if f else matched.row_id(rules.file, row, ident), "label": label,
                             "original_label": value, "group": mine, "view": view, "path": f.path if f else "", "reader": reader,
                             "excluded": (label_why or view_why or patient_why) if f else pre, "subset": subset})
    table.refuse_rows()
    for rel, why in unmatched + matched.unlisted():
        rows.append({"id": rel, "label": -1, "original_label": "", "group": rel, "view": "unknown", "path": rel,
                     "reader": "", "excluded": why, "subset": ""})
    if rules.patient is None and warnings is not None:
        note = header_patients_warning(header_patients, mkey, f"{key}.patient")
        warnings += [note] if note else []
    out = pd.DataFrame(rows)
    _check_labels(out, rules, key, table_path, warnings)
    return finalize(out, domain)


def read_records(raw_dir: Path, rules: CXRTableRules, domain: str, key: str = "tables", quiet: bool = True,
                 warnings: Optional[list[str]] = None) -> pd.DataFrame:
    """The record table of one hospital's export (``key``: the dotted params key of ``rules``, for messages); unless
    ``quiet``, the rows read are shown (with ``dicom_view`` each DICOM's header is read here). ``warnings`` gets a
    line where a header match without a patient column finds images of no (or one placeholder) patient."""
    raw_dir = Path(raw_dir)
    if rules.dicom_match is not None:
        return _records_by_dicom(raw_dir, rules, domain, key, quiet, warnings)
    columns = [("path", rules.path), ("label", rules.label), ("patient", rules.patient), ("view", rules.view), ("subset", rules.subset)]
    table_path, df = load_table(raw_dir, rules, columns, key)
    positive, negative = _folded(rules.positive), _folded(rules.negative)
    frontal, lateral = _folded(rules.frontal), _folded(rules.lateral)

    table = Rows(raw_dir)
    rows = []
    for row, rec, where in table.each(df, table_path, key, quiet):
        with table.row():
            rel = relative_path(raw_dir, str(rec[rules.path]), where)
            value = str(rec[rules.label]).strip()
            label, label_why = _label_of(value, positive, negative)
            folder = study_folder(raw_dir, rel)
            study = folder is not None
            if folder is not None:  # a study-level table: the row's finding is every image of the study's folder
                cell = str(rec[rules.view]).strip() if rules.view is not None else ""
                if cell or not rules.dicom_view:
                    raise LabelFileError(f"{where}: {rel} is a study's folder, whose images may be frontal and lateral: "
                                         + ("leave its view cell blank and " if cell else "") + f"set {key}.dicom_view: true "
                                         "(each DICOM's View Position from its header)")
                files = [f.relative_to(raw_dir).as_posix() for f in walk(raw_dir / folder) if f.is_file()]
                if not files:
                    raise LabelFileError(f"{where}: {rel} is a folder without files; a row names an image, or a study's folder")
                found_list = [table.locate(f, row, where) for f in files]
            else:
                found_list = [table.locate(rel, row, where)]
            per = []
            for found in found_list:
                reader = _reader(raw_dir / found) if found else ""
                not_image = file_reader(raw_dir / found)[1] if study and found else ""  # a study's report, its DICOMDIR
                if found and not not_image and is_slide_file(raw_dir / found):  # never decoded whole
                    not_image = "a whole-slide image (not a chest X-ray)"
                if not_image:
                    per.append((found, "", "unknown", not_image))
                    continue
                view, view_why = _view(rec, rules, raw_dir, found, reader, label_why, frontal, lateral, where, key, study)
                per.append((found, reader, view, view_why))
            files_why = per[0][3] if all(w for *_, w in per) else ""  # a row none of whose images is kept
            pre = label_why or files_why
            group, subset, row_why = table.group_and_subset(rec, rules, rel, pre, row, where, key)
            patient_why = row_why if row_why != pre else ""
            for found, reader, view, view_why in per:
                rows.append({
                    "id": found if study else rel,
                    "label": label,
                    "original_label": value,
                    "group": group,
                    "view": view,
                    "path": found or "",
                    "reader": reader,
                    "excluded": label_why or view_why or patient_why,  # an image's own reason before its row's patient
                    "subset": subset,
                })
    table.refuse_rows()
    out = pd.DataFrame(rows)
    _check_labels(out, rules, key, table_path, warnings)
    return finalize(out, domain)
