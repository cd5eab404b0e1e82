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
- ``dicom_patient`` (a folder): the table has one row per patient instead, and the row's images are the DICOMs below
  the folder whose header's PatientID is the row's patient (:func:`dicom_patients`, :func:`_scan_by_patient`).
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
from fedsilo.data.sources.tables import MISSING, Rows, load_table, relative_path, study_folder

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


def scan(raw_dir: Path, rules: ImageTableRules, domain: str, key: str, quiet: bool = True) -> list[dict]:
    """The table's rows as entries for :func:`fedsilo.data.sources.image_folder.read_records` (``strict``: every label
    a row writes is checked): ``id`` (the path the row names), ``path`` (the file it reads, empty when the folder lacks
    it), ``where`` (file and row), ``domain``, ``subset``, ``value`` (the class as the table writes it), ``group``,
    ``reason`` (no label, several labels, skipped, no patient id, not an image file)."""
    raw_dir = Path(raw_dir)
    if rules.dicom_patient is not None:
        return _scan_by_patient(raw_dir, rules, domain, key, quiet)
    columns = [("path", rules.path), ("label", rules.label_column), ("patient", rules.patient), ("subset", rules.subset)]
    columns += [("label_columns", c) for c in rules.label_columns]
    table_path, df = load_table(raw_dir, rules, columns, key)
    classmap = table_classes(rules, key)
    table = Rows(raw_dir)
    out, cuts = [], rules.slides is not None
    for row, rec, where in table.each(df, table_path, key, quiet):
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


def dicom_patients(raw_dir: Path, folder: str, key: str, quiet: bool = True,
                   table: str = "") -> tuple[dict[str, list[tuple[str, str, str]]], list[tuple[str, str]]]:
    """Every file below ``raw_dir / folder`` but the label table (``table``) and fetch's manifest: the DICOMs (by
    suffix or preamble) by their header's PatientID (trimmed; a malformed multi-valued one joined with ``\\``), each
    as ``(path, reader, why not)`` as :func:`~fedsilo.data.sources.image_folder.file_reader` gives it (from the same
    header read: one read per file), and the files that cannot be matched with why (not a DICOM, a header that cannot
    be read, no PatientID). A PatientID the headers give with two issuers (IssuerOfPatientID) is an error: one table
    row cannot tell the two patients apart. Paths are posix, relative to ``raw_dir``."""
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.multival import MultiValue

    from fedsilo.data.dicom import dataset_problem, is_dicom_file
    from fedsilo.data.fetch import MANIFEST
    from fedsilo.utils.progress import Progress

    base = Path(raw_dir) / folder
    if not base.is_dir():
        raise LabelFileError(f"{base}: no such folder in the source ({key}.dicom_patient: {folder!r})")
    skip = {Path(raw_dir) / table, Path(raw_dir) / MANIFEST}
    files = [f for f in walk(base) if f.is_file() and f not in skip]
    by_patient: dict[str, list[tuple[str, str, str]]] = {}
    issuers: dict[str, dict[str, str]] = {}
    unmatched: list[tuple[str, str]] = []
    bar = Progress(len(files), f"scan {key.rsplit('.', 1)[-1]}", "file", quiet=quiet)
    for f in files:
        bar.update(1)
        rel = f.relative_to(raw_dir).as_posix()
        try:
            dicom = is_dicom_file(f)
        except OSError:
            dicom = False
        if not dicom:
            unmatched.append((rel, f"not a DICOM ({key}.dicom_patient matches DICOMs by their PatientID)"))
            continue
        try:
            ds = pydicom.dcmread(str(f), defer_size="1 KB")  # the header, the pixel data's tag without its bytes
        except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError) as err:
            unmatched.append((rel, f"a DICOM whose header cannot be read ({type(err).__name__})"))
            continue
        value = ds.get("PatientID", "") or ""
        pid = ("\\".join(map(str, value)) if isinstance(value, (list, tuple, MultiValue)) else str(value)).strip()
        if not pid:
            unmatched.append((rel, "no PatientID in its DICOM header"))
            continue
        if f.suffix.lower() in IMAGE_SUFFIXES or is_slide_file(f):  # a DICOM named like a picture: read as a folder's
            reader, why = file_reader(f)
        else:  # as file_reader reads a DICOM, from this header
            reader, why = dicom_reader(dataset_problem(ds))
        by_patient.setdefault(pid, []).append((rel, reader, why))
        issuer = str(ds.get("IssuerOfPatientID", "") or "").strip()
        if issuer:
            seen = issuers.setdefault(pid, {})
            seen.setdefault(issuer, rel)
            if len(seen) > 1:
                (a, fa), (b, fb) = list(seen.items())[:2]
                raise LabelFileError(f"{base}: PatientID {pid!r} comes from two issuers ({a!r} in {fa}, {b!r} in {fb}): "
                                     f"two patients one table row cannot tell apart ({key}.dicom_patient)")
    bar.close()
    return by_patient, unmatched


def _scan_by_patient(raw_dir: Path, rules: ImageTableRules, domain: str, key: str, quiet: bool) -> list[dict]:
    """:func:`scan` of a table with one row per patient and its DICOMs found by their header's PatientID
    (``dicom_patient``): every image of a row's patient is an entry of the row's class, subset and group (the
    patient); a row whose patient has no DICOM is excluded; a DICOM of a patient no row lists, or that cannot be
    matched, is an excluded entry of its own; a patient on two rows is an error; no PatientID matching any row is an
    error showing both sides' IDs (leading zeros a spreadsheet dropped, say)."""
    columns = [("label", rules.label_column), ("patient", rules.patient), ("subset", rules.subset)]
    columns += [("label_columns", c) for c in rules.label_columns]
    table_path, df = load_table(raw_dir, rules, columns, key)
    classmap = table_classes(rules, key)
    by_patient, unmatched = dicom_patients(raw_dir, rules.dicom_patient, key, quiet, rules.file)
    table = Rows(raw_dir)
    listed = {str(v).strip() for v in df[rules.patient]} - {""}
    listed = {v for v in listed if v.casefold() not in MISSING}
    if not by_patient:
        raise LabelFileError(f"{raw_dir / rules.dicom_patient}: no DICOM with a PatientID in its header ({len(unmatched)} "
                             f"files: {', '.join(sorted({why for _, why in unmatched})) or 'none'}); {key}.dicom_patient "
                             "matches the table's patients to DICOMs by that header")
    if not listed & set(by_patient):
        ours, theirs = sorted(listed)[:3], sorted(by_patient)[:3]
        raise LabelFileError(f"{table_path}: no DICOM under {rules.dicom_patient} has a PatientID in the column {rules.patient} "
                             f"(the table's: {', '.join(ours)}, ...; the headers': {', '.join(theirs)}, ...); check leading "
                             f"zeros a spreadsheet dropped, prefixes and the column ({key}.patient)")
    zeros = {t: h for h in set(by_patient) - listed for t in listed - set(by_patient) if h.lstrip("0") == t.lstrip("0")}
    if zeros:
        pairs = ", ".join(f"{t} / {h}" for t, h in sorted(zeros.items())[:3])
        raise LabelFileError(f"{table_path}: {len(zeros)} of the column {rules.patient}'s IDs differ from a DICOM header's "
                             f"PatientID only in leading zeros (table / header: {pairs}); a spreadsheet drops them from "
                             "numbers: export the column as text")
    out, first = [], {}
    for row, rec, where in table.each(df, table_path, key, quiet):
        value, reason = _label(rec, rules, where)
        if value and classmap.skipped(value):
            reason = f"{classmap.what} skipped ({key}.skip)"
        pid = str(rec[rules.patient]).strip()
        files = []
        if not pid or pid.casefold() in MISSING:
            reason = reason or "no patient id"
        else:
            if pid in first:
                raise LabelFileError(f"{where}: patient {pid!r} is listed again (first on row {first[pid]}); with "
                                     f"{key}.dicom_patient the table has one row per patient, its label every image's")
            first[pid] = row
            files = by_patient.pop(pid, [])
        if not files:
            reason = reason or f"no DICOM with this PatientID under {rules.dicom_patient}"
        elif not reason and all(why for _, _, why in files):
            reason = files[0][2]
        group, subset, reason = table.group_and_subset(rec, rules, f"patient {pid}", reason, row, where, key)
        for rel, reader, why in files or [("", "image", "")]:
            out.append({"id": rel or f"{rules.file}: row {row} (patient {pid})", "path": rel, "where": where, "domain": domain,
                        "subset": subset, "value": value, "group": group, "reason": reason or why, "strict": True,
                        "reader": reader or "image"})
    unlisted = [(rel, "its PatientID is in no row of the table") for found in by_patient.values() for rel, _, _ in found]
    for rel, why in unmatched + unlisted:
        out.append({"id": rel, "path": rel, "where": str(raw_dir / rel), "domain": domain, "subset": "", "value": "",
                    "group": None, "reason": why, "strict": False, "reader": "image"})
    return one_entry_per_dicom_slide(out, raw_dir)
