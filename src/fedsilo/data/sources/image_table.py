"""Your own images with a label table of their classes (a source with ``reader: image_table``): a dermatology
clinic's photographs and its ground-truth CSV (ISIC's one-hot layout among them), a pathology archive's patch list.
Read by :class:`~fedsilo.config.ImageTableRules` (``datasets.<dataset>.tables.<source>``) through the machinery every
table of your own shares (:mod:`fedsilo.data.sources.tables`: separator, encoding, paths found case-blind, one row
per image, a patient on one side of the table's test partition).

Row by row (the header is row 1), values trimmed and compared case-blind, numbers by their value:

- ``path`` (with ``path_format``, ``{}`` standing for the cell: ``ISIC_2019_Training_Input/{}.jpg`` for a column of
  image ids): the image file, relative to the source's folder. A file the folder lacks is kept and quarantined by
  harmonize as "image file missing" (it counts against ``max_quarantine_fraction``); a path that is absolute, leaves
  the folder or is listed twice is an error naming the row. A path may name a folder instead (a study-level table:
  one row per study, its images in the study's folder): every file below it takes the row's label, and the study is
  their group unless a ``patient`` column names one; a folder without files is an error. A listed DICOM (by suffix or preamble) is read as
  ``image_folder`` reads one; a listed file that is neither an image nor a DICOM is excluded as "not an image file".
- the class: the ``label`` column's value, or with ``label_columns`` the one column holding 1 (0 or blank elsewhere;
  ``1.0`` is 1); a blank label, or no column holding 1, is excluded as "no label", several columns holding 1 as
  "several labels (A, B)", any other cell is an error naming the row and the column. A value is the dataset's class of
  the same name (case, spaces, ``_`` and ``-`` aside), or the class ``classes`` maps it to; a value in ``skip`` is
  excluded with the reason; any other value is an error naming it and both keys.
- ``patient`` (when named): the group every split keeps whole; a blank (or ``NA``, ``N/A``, ``nan``, ``none``,
  ``null``, ``-``) is excluded as "no patient id". Without it each image is its own group and harmonize warns
  (:data:`NO_PATIENT_WARNING`).
- ``subset`` (when named): ``train`` / ``val`` / ``test`` or blank; another value is an error; a patient both in
  ``test`` and outside it is an error naming both rows.
- ``dicom_match`` (a folder, a column, a header attribute): the rows find their images by the DICOM header instead of
  a path, one row per ID (an accession number, a study UID, a patient): every DICOM below the folder whose header holds
  the row's ID (:func:`_scan_by_dicom`); ``dicom_patient`` (a folder) is the same by PatientID on the patient column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fedsilo.config import ImageTableRules, table_word
from fedsilo.data.slides import is_slide_file, one_entry_per_dicom_slide
from fedsilo.data.sources.base import LabelFileError, show, walk
from fedsilo.data.sources.benchmark import IMAGE_SUFFIXES
from fedsilo.data.sources.classmap import ClassMap
from fedsilo.data.sources.image_folder import dicom_reader, file_reader
from fedsilo.data.sources.tables import (
    MISSING,
    MatchedRows,
    Rows,
    check_matched,
    dicom_index,
    header_patients_warning,
    load_table,
    relative_path,
    study_folder,
)

NO_PATIENT_WARNING = ("has no patient column (patient: null): each row's image (or study folder) is its own group, so two "
                      "images of one patient (or lesion, or slide) may land on both sides of a split; name the column that "
                      "identifies them if the table has one")


def table_classes(rules: ImageTableRules, key: str) -> ClassMap:
    return ClassMap(rules, key, "label column" if rules.label_columns else "label")


def declared_classes(rules: ImageTableRules, classmap: ClassMap) -> set[str]:
    """The classes a one-hot table declares by its columns (mapped, skipped ones left out), whether or not a row holds
    1 in them: every site with the same columns gets the same class list."""
    return classmap.names(rules.label_columns)


def _label(rec: dict, rules: ImageTableRules, where: str) -> tuple[str, str]:
    """(the row's class value, an exclusion reason): the label column's value, or the one label column holding 1; a
    blank (or NA, N/A, nan, none, null, -: how R and pandas write a missing value) is "no label"."""
    if rules.label_column is not None:
        value = str(rec[rules.label_column]).strip()
        return (value, "") if value.casefold() not in MISSING else ("", "no label")
    ones = []
    for col in rules.label_columns:
        word = table_word(rec[col])
        if word == "1":
            ones.append(col)
        elif word not in ("0", ""):
            raise LabelFileError(f"{where}: {col} {show(str(rec[col]))} is not 1, 0 or blank (label_columns: one column "
                                 "per class, 1 in the row's class)")
    if len(ones) > 1:
        return "", f"several labels ({', '.join(ones)})"
    return (ones[0], "") if ones else ("", "no label")


def _path(raw_dir: Path, rules: ImageTableRules, table: Rows, cell: str, where: str) -> str:
    """The path a cell names through ``path_format``: with several formats, the first that names a file (exactly or
    case-blind), else the first (the file is then missing)."""
    if not cell:
        return relative_path(raw_dir, "", where)  # the error: no image path
    candidates = [relative_path(raw_dir, fmt.replace("{}", cell), where) for fmt in rules.path_formats]
    for rel in candidates:
        if (raw_dir / rel).is_file() or table.files.find(rel):
            return rel
    return candidates[0]


def scan(raw_dir: Path, rules: ImageTableRules, domain: str, key: str, quiet: bool = True,
         warnings: Optional[list[str]] = None) -> list[dict]:
    """The table's rows as entries for :func:`fedsilo.data.sources.image_folder.read_records` (``strict``: every label
    a row writes is checked): ``id`` (the path the row names), ``path`` (the file it reads, empty when the folder lacks
    it), ``where`` (file and row), ``domain``, ``subset``, ``value`` (the class as the table writes it), ``group``,
    ``reason`` (no label, several labels, skipped, no patient id, not an image file)."""
    raw_dir = Path(raw_dir)
    if rules.matched is not None:
        return _scan_by_dicom(raw_dir, rules, domain, key, quiet, warnings)
    columns = [("path", rules.path), ("label", rules.label_column), ("patient", rules.patient), ("subset", rules.subset)]
    columns += [("label_columns", c) for c in rules.label_columns]
    table_path, df = load_table(raw_dir, rules, columns, key)
    classmap = table_classes(rules, key)
    table = Rows(raw_dir)
    out, cuts = [], rules.slides is not None
    for row, rec, where in table.each(df, table_path, key, quiet):
        with table.row():
            rel = _path(raw_dir, rules, table, str(rec[rules.path]).strip(), where)
            value, reason = _label(rec, rules, where)
            if value and classmap.skipped(value):  # before the partition check: a skipped row is no image of its patient's
                reason = f"{classmap.what} skipped ({key}.skip)"
            files = [(found, *(file_reader(raw_dir / found, cuts) if found else ("image", ""))) for found in _files(raw_dir, rel, table, row, where)]
            if not reason and all(why for _, _, why in files):  # a row with no image (a listed report) is no image of its patient's
                reason = files[0][2]
            # the group is the row's: its patient, else the file, or the folder a study's row names (all its images)
            group, subset, reason = table.group_and_subset(rec, rules, rel, reason, row, where, key)
            for found, reader, why in files:
                out.append({"id": found or rel, "path": found or "", "where": where, "domain": domain, "subset": subset,
                            "value": value, "group": group, "reason": reason or why, "strict": True, "reader": reader or "image"})
    table.refuse_rows()
    return one_entry_per_dicom_slide(out, raw_dir)


def _files(raw_dir: Path, rel: str, table: Rows, row: int, where: str) -> list[Optional[str]]:
    """The files a row reads: the one file its path names (None when the folder lacks it), or every file below the
    folder it names (a study's images, by a study-level label table), each reached by one row only."""
    folder = study_folder(raw_dir, rel)
    if folder is not None:
        files = [f.relative_to(raw_dir).as_posix() for f in walk(raw_dir / folder) if f.is_file()]
        if not files:
            raise LabelFileError(f"{where}: {rel} is a folder without files; a row names an image, or a folder of a study's images")
        return [table.locate(f, row, where) for f in files]
    return [table.locate(rel, row, where)]


def _match_key(rules: ImageTableRules, key: str) -> str:
    return f"{key}.dicom_patient" if rules.dicom_patient is not None else f"{key}.dicom_match"


def _scan_by_dicom(raw_dir: Path, rules: ImageTableRules, domain: str, key: str, quiet: bool,
                   warnings: Optional[list[str]] = None) -> list[dict]:
    """:func:`scan` of a table whose rows find their DICOMs by a header attribute (``dicom_match``, or
    ``dicom_patient``: by PatientID), one row per ID (a patient, a study's accession number or UID): every image
    whose header holds a row's ID is an entry of the row's class and subset; its group is the row's patient (the
    patient column) or, without one, the image header's PatientID. A row no DICOM matches is excluded; a DICOM no row
    lists, or that cannot be matched, is an excluded entry of its own; an ID on two rows is an error, and so are the
    refusals of :func:`~fedsilo.data.sources.tables.check_matched`."""
    match = rules.matched
    assert match is not None
    mkey = _match_key(rules, key)
    column_key = f"{key}.patient" if rules.dicom_patient is not None else f"{key}.dicom_match.column"
    columns = [("label", rules.label_column), ("patient", rules.patient), ("subset", rules.subset)]
    columns += [("dicom_match.column", match.column)] if rules.dicom_match is not None else []
    columns += [("label_columns", c) for c in rules.label_columns]
    table_path, df = load_table(raw_dir, rules, columns, key)
    classmap = table_classes(rules, key)
    by_value, unmatched = dicom_index(raw_dir, match.folder, match.tag, mkey, quiet, rules.file,
                                      mkey if rules.dicom_patient is not None else f"{mkey}.folder")
    check_matched(by_value, unmatched, df[match.column], raw_dir, match.folder,
                  match.tag, match.column, column_key, mkey, table_path)
    table, matched = Rows(raw_dir), MatchedRows(by_value, match.tag, mkey, "label")
    out, header_patients = [], []  # header_patients: each kept image's PatientID ("" none)
    for row, rec, where in table.each(df, table_path, key, quiet):
        with table.row():
            value, reason = _label(rec, rules, where)
            if value and classmap.skipped(value):
                reason = f"{classmap.what} skipped ({key}.skip)"
            ident = str(rec[match.column]).strip()
            files = matched.take(ident, row, where)
            if files is None:
                reason, files = reason or ("no patient id" if match.tag == "PatientID" else f"no {match.tag} in the row"), []
            readers = [file_reader(raw_dir / f.path) if Path(f.path).suffix.lower() in IMAGE_SUFFIXES or is_slide_file(raw_dir / f.path)
                       else dicom_reader(f.problem) for f in files]  # a DICOM named like a picture: read as a folder's
            if not files:
                reason = reason or f"no DICOM with this {match.tag} under {match.folder}"
            elif not reason and all(why for _, why in readers):
                reason = readers[0][1]
            group, subset, reason = table.group_and_subset(rec, rules, f"{matched.noun} {ident}", reason, row, where, key)
            for f, (reader, why) in zip(files, readers) if files else [(None, ("image", ""))]:
                mine = table.matched_group(group, f, rules, subset, not (reason or why), row, where)
                if f is not None and not (reason or why):
                    header_patients.append(f.patient)
                out.append({"id": f.path if f else matched.row_id(rules.file, row, ident), "path": f.path if f else "",
                            "where": where, "domain": domain, "subset": subset, "value": value, "group": mine,
                            "reason": reason or why, "strict": True, "reader": reader or "image"})
    table.refuse_rows()
    for rel, why in unmatched + matched.unlisted():
        out.append({"id": rel, "path": rel, "where": str(raw_dir / rel), "domain": domain, "subset": "", "value": "",
                    "group": None, "reason": why, "strict": False, "reader": "image"})
    if rules.patient is None and warnings is not None:
        note = header_patients_warning(header_patients, mkey, f"{key}.patient")
        warnings += [note] if note else []
    return one_entry_per_dicom_slide(out, raw_dir)
