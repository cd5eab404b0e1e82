"""What the readers of a label table of your own share (``reader: cxr_table`` for chest X-rays, ``reader:
image_table`` for the benchmark kinds): the table read with its separator and encoding (a missing column named
with its key, and the separator to set when the header holds another), each row's image path made relative to the
source's folder and found there (case- and Unicode-normalization-blind when it names no file exactly; one row per
image), and the check that a patient's rows stay on one side of the table's own test partition.

Row N is the table's N-th line as a spreadsheet numbers it, the header being row 1.
"""

from __future__ import annotations

import contextlib
import unicodedata
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, NamedTuple, Optional

import pandas as pd

from fedsilo.config import table_word
from fedsilo.data.sources.base import LabelFileError, read_csv, show, walk
from fedsilo.utils.progress import Progress

SUBSETS = ("train", "val", "test")
MISSING = {"", "na", "n/a", "nan", "none", "null", "-"}  # how exports write a missing value (a patient id, a label)


def load_table(raw_dir: Path, rules, columns: list[tuple[str, Optional[str]]], key: str) -> tuple[Path, pd.DataFrame]:
    """The table ``rules.file`` below ``raw_dir``, every cell a string, without the rows whose every cell is blank
    (a spreadsheet's trailing ``,,,``: left out, the rows after them keep their numbers); row ``index + 2`` is a row's
    number as a spreadsheet gives it, as long as the file has no wholly empty line and no cell across lines (pandas
    skips the one and joins the other, so the numbers after them run short of the file's line numbers).
    ``columns`` pairs each rule (``path``, ``label``, ...) with the column it names (None: not used). ``key`` is the
    dotted params key of ``rules``."""
    table_path = Path(raw_dir) / rules.file
    if not table_path.is_file():
        raise LabelFileError(f"{table_path}: the label table is missing ({key}.file: {rules.file!r}, relative to the source's folder)")
    try:
        df = read_csv(table_path, dtype=str, keep_default_na=False, sep=rules.sep, encoding=rules.encoding)
    except LabelFileError as err:
        hint = f" (set {key}.encoding to the table's encoding, e.g. cp1252 or utf-16)" if "codec" in str(err) else ""
        raise LabelFileError(f"{err}{hint}") from err
    trimmed = [str(c).strip() for c in df.columns]  # "path, label": the header's cells as the values are read, trimmed
    if len(set(trimmed)) == len(trimmed):
        df.columns = trimmed
    missing = [f"{col!r} ({key}.{role})" for role, col in columns if col is not None and col not in df.columns]
    if missing:
        header = rules.sep.join(map(str, df.columns))
        other = next((c for c in (",", ";", "\t", "|") if c != rules.sep and c in header), None)
        hint = f"; the header holds {other!r}: set {key}.sep to it" if other else ""
        raise LabelFileError(f"{table_path}: missing column(s) {', '.join(missing)}; its columns are {', '.join(map(repr, df.columns))}{hint}")
    if not df.empty:  # a spreadsheet's empty rows (",,,") are no image; the index keeps each row's place for messages
        df = df[(df.apply(lambda column: column.astype(str).str.strip()) != "").any(axis=1)]
    if df.empty:
        raise LabelFileError(f"{table_path}: the label table has no row")
    return table_path, df


def _fold_path(rel: str) -> str:
    return unicodedata.normalize("NFC", rel).casefold()


class FoldedFiles:
    """The folder's files by their case- and normalization-blind path, listed once and only when a row needs it."""

    def __init__(self, root: Path):
        self.root, self._index = root, None

    def find(self, rel: str) -> Optional[str]:
        """The one file whose path is ``rel`` but for case and Unicode normalization, else None."""
        if self._index is None:
            self._index = {}
            for f in walk(self.root):
                if f.is_file():
                    self._index.setdefault(_fold_path(f.relative_to(self.root).as_posix()), []).append(f.relative_to(self.root).as_posix())
        hits = self._index.get(_fold_path(rel), [])
        return hits[0] if len(hits) == 1 else None


def relative_path(raw_dir: Path, value: str, where: str) -> str:
    """The image's path below the source folder, as a POSIX relative path (``\\`` read as ``/``), or an error
    naming the row: absolute, leaving the folder, or naming the folder itself."""
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


class Rows:
    """Each row's image found once: ``locate`` gives the file a row's path reads (None when the folder lacks it) and
    refuses a second row reaching a file a row already named; ``side`` refuses a patient in the table's ``test``
    partition on one row and outside it on another."""

    MAX_ERRORS = 20  # a table's row mistakes said together, up to this many (then the reading stops)

    def __init__(self, raw_dir: Path):
        self.raw_dir, self.files = Path(raw_dir), FoldedFiles(Path(raw_dir))
        self.first_row: dict[str, int] = {}
        self.sides: dict[str, dict[str, int]] = {}
        self.errors: list[str] = []

    @contextlib.contextmanager
    def row(self) -> Iterator[None]:
        """The reading of one row: its mistake (a LabelFileError naming the row) is kept and the next rows are read,
        so that a table with several mistakes is refused once, naming them all (:meth:`refuse_rows`, after the last
        row), not one fix and rerun at a time. At :data:`MAX_ERRORS` mistakes the reading stops."""
        try:
            yield
        except LabelFileError as err:
            self.errors.append(str(err))
            if len(self.errors) >= self.MAX_ERRORS:
                self.refuse_rows(stopped=True)

    def refuse_rows(self, stopped: bool = False) -> None:
        """Raise the rows' mistakes :meth:`row` kept: one as it was, several in one message."""
        if not self.errors:
            return
        if len(self.errors) == 1:
            raise LabelFileError(self.errors[0])
        shown = "\n  ".join(self.errors[:10])
        more = f"\n  ... and {len(self.errors) - 10} more" if len(self.errors) > 10 else ""
        raise LabelFileError(f"{len(self.errors)} rows of the label table are refused"
                             + (f" (the reading stopped at {self.MAX_ERRORS})" if stopped else "")
                             + f"; correct them all, then harmonize again:\n  {shown}{more}")

    def each(self, df: pd.DataFrame, table_path: Path, key: str, quiet: bool) -> Iterator[tuple[int, dict, str]]:
        """(row number, row as a dict, ``<table>: row N`` for messages) of every row of ``df`` (:func:`load_table`),
        showing the rows read unless ``quiet`` (a DICOM's header may be read per row)."""
        bar = Progress(len(df), f"scan {key.rsplit('.', 1)[-1]}", "row", quiet=quiet)
        try:
            for i, rec in zip(df.index, df.to_dict("records")):
                bar.update(1)
                yield i + 2, rec, f"{table_path}: row {i + 2}"
        finally:
            bar.close()

    def locate(self, rel: str, row: int, where: str) -> Optional[str]:
        found = rel if (self.raw_dir / rel).is_file() else self.files.find(rel)
        for name in dict.fromkeys(x for x in (rel, found) if x):  # as typed, and the file it reads
            if name in self.first_row:
                what = "is listed again" if name == rel else f"reads the file {name}, listed already"
                raise LabelFileError(f"{where}: {rel} {what} (first on row {self.first_row[name]}); one row per image")
            self.first_row[name] = row
        return found

    def group_and_subset(self, rec: dict, rules, rel: str, why: str, row: int, where: str, key: str) -> tuple[str, str, str]:
        """A row's group (its ``patient`` cell; the image itself without the column), its ``subset`` and its
        exclusion reason (``why``, else "no patient id" for a blank patient); a subset other than train / val / test
        is an error, and so is a kept patient on both sides of the table's test partition."""
        group = rel
        if rules.patient is not None:
            group = str(rec[rules.patient]).strip()
            if group.casefold() in MISSING:
                group, why = rel, why or "no patient id"
        subset = ""
        if rules.subset is not None:
            subset = table_word(rec[rules.subset])
            if subset and subset not in SUBSETS:
                raise LabelFileError(f"{where}: {rules.subset} {show(str(rec[rules.subset]))} is not one of {', '.join(SUBSETS)} "
                                     f"(or blank) ({key}.subset)")
            if rules.patient is not None and not why:  # the splits' two sides: test, and everything else
                self.side(group, subset, row, where, rules.subset)
        return group, subset, why

    def matched_group(self, group: str, found: Optional["MatchedDicom"], rules, subset: str, kept: bool, row: int,
                      where: str) -> str:
        """The group of one image a DICOM header match found (``found``; None for a row with no image): the row's
        (its patient cell, else the row's ID) or, without a patient column, the image header's PatientID, which keeps
        a patient's studies together, checked on one side of the table's test partition when ``kept``."""
        if rules.patient is not None or found is None or not found.patient:
            return group
        if rules.subset is not None and kept:
            self.side(found.patient, subset, row, where, rules.subset)
        return found.patient

    def side(self, patient: str, subset: str, row: int, where: str, column: str) -> None:
        side = "test" if subset == "test" else "outside test"
        mine = self.sides.setdefault(patient, {})
        mine.setdefault(side, row)
        if len(mine) == 2:
            other = "outside test" if side == "test" else "test"
            raise LabelFileError(f"{where}: patient {patient!r} is {side} here and {other} on row {mine[other]}: "
                                 f"the table's own partition ({column}) would put one patient on both sides of a split")


def study_folder(raw_dir: Path, rel: str) -> Optional[str]:
    """The folder a row's path names (a study's, in a study-level table), found exactly or, as image paths are, when
    case and Unicode normalization aside it names one folder only; None when it names no folder."""
    if (Path(raw_dir) / rel).is_dir():
        return rel
    here, parts = Path(raw_dir), []
    for part in PurePosixPath(rel).parts:
        if (here / part).is_dir():
            match = [part]
        else:
            match = [c.name for c in here.iterdir() if c.is_dir() and _fold_path(c.name) == _fold_path(part)] if here.is_dir() else []
        if len(match) != 1:
            return None
        here = here / match[0]
        parts.append(match[0])
    return "/".join(parts)


MATCH_NOUN = {"PatientID": "patient", "AccessionNumber": "study", "StudyInstanceUID": "study", "SeriesInstanceUID": "series",
              "SOPInstanceUID": "image"}  # what one row of a table matched by that header attribute stands for


class MatchedDicom(NamedTuple):
    """One DICOM below a ``dicom_match`` folder, from one read of its header: its path (posix, relative to the
    source's folder), why it is no picture (:func:`fedsilo.data.dicom.dataset_problem`: "" for an image), its View
    Position and its PatientID ("" where the header has none)."""

    path: str
    problem: str
    view: str
    patient: str


def _header_text(ds: Any, tag: str) -> str:
    from pydicom.multival import MultiValue

    value = ds.get(tag, "") or ""
    return ("\\".join(map(str, value)) if isinstance(value, (list, tuple, MultiValue)) else str(value)).strip()


def dicom_index(raw_dir: Path, folder: str, tag: str, key: str, quiet: bool = True, table: str = "",
                folder_key: str = "") -> tuple[dict[str, list[MatchedDicom]], list[tuple[str, str]]]:
    """Every file below ``raw_dir / folder`` but the label table (``table``) and fetch's manifest: the DICOMs (by
    suffix or preamble) by their header's ``tag`` (trimmed; a malformed multi-valued one joined with ``\\``), each a
    :class:`MatchedDicom` from one header read, and the files that cannot be matched with why (not a DICOM, a header
    that cannot be read, no ``tag``). ``key``: the params key that matches them, for messages (``folder_key`` the
    one naming the folder, default ``key``). By PatientID, one ID
    the headers give with two issuers (IssuerOfPatientID) is an error: one table row cannot tell the two patients
    apart."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    from fedsilo.data.dicom import dataset_problem, is_dicom_file
    from fedsilo.data.fetch import MANIFEST

    base = Path(raw_dir) / folder
    if not base.is_dir():
        raise LabelFileError(f"{base}: no such folder in the source ({folder_key or key}: {folder!r})")
    skip = {Path(raw_dir) / table, Path(raw_dir) / MANIFEST}
    files = [f for f in walk(base) if f.is_file() and f not in skip]
    by_value: dict[str, list[MatchedDicom]] = {}
    issuers: dict[str, dict[str, str]] = {}
    unmatched: list[tuple[str, str]] = []
    bar = Progress(len(files), f"scan {key.split('.')[-2] if '.' in key else key}", "file", quiet=quiet)
    for f in files:
        bar.update(1)
        rel = f.relative_to(raw_dir).as_posix()
        try:
            dicom = is_dicom_file(f)
        except OSError as err:
            unmatched.append((rel, f"cannot be read ({err.strerror or err})"))
            continue
        if not dicom:
            unmatched.append((rel, f"not a DICOM ({key} matches DICOMs by their {tag})"))
            continue
        try:
            ds = pydicom.dcmread(str(f), defer_size="1 KB")  # the header, the pixel data's tag without its bytes
        except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError) as err:
            unmatched.append((rel, f"a DICOM whose header cannot be read ({type(err).__name__})"))
            continue
        value = _header_text(ds, tag)
        if value.casefold() in MISSING:  # blank, or a placeholder an export writes (N/A, none, -)
            unmatched.append((rel, f"no {tag} in its DICOM header" + (f" ({value})" if value else "")))
            continue
        patient = _header_text(ds, "PatientID")
        patient = "" if patient.casefold() in MISSING else patient
        by_value.setdefault(value, []).append(MatchedDicom(rel, dataset_problem(ds), _header_text(ds, "ViewPosition"), patient))
        issuer = str(ds.get("IssuerOfPatientID", "") or "").strip()
        if issuer and tag == "PatientID":
            seen = issuers.setdefault(value, {})
            seen.setdefault(issuer, rel)
            if len(seen) > 1:
                (a, fa), (b, fb) = list(seen.items())[:2]
                raise LabelFileError(f"{base}: PatientID {value!r} comes from two issuers ({a!r} in {fa}, {b!r} in {fb}): "
                                     f"two patients one table row cannot tell apart ({key})")
    bar.close()
    return by_value, unmatched


class MatchedRows:
    """The rows of a table matched to DICOMs by a header attribute (``by_value``: :func:`dicom_index`'s), each ID
    taken by one row: :meth:`take` gives a row's images and refuses an ID a row took already; :meth:`unlisted` the
    DICOMs no row took. ``key``: the params key that matches them; ``what``: what a row gives its images (a label,
    a finding), for the refusal."""

    def __init__(self, by_value: dict[str, list[MatchedDicom]], tag: str, key: str, what: str):
        self.by_value, self.tag, self.key, self.what = by_value, tag, key, what
        self.noun = MATCH_NOUN[tag]
        self.first: dict[str, int] = {}

    def take(self, ident: str, row: int, where: str) -> Optional[list[MatchedDicom]]:
        """The images of the row naming ``ident`` (maybe none); None when the row names no ID (blank or a placeholder)."""
        if not ident or ident.casefold() in MISSING:
            return None
        if ident in self.first:
            raise LabelFileError(f"{where}: {self.noun} {ident!r} is listed again (first on row {self.first[ident]}); with "
                                 f"{self.key} the table has one row per {self.noun}, its {self.what} every image's")
        self.first[ident] = row
        return self.by_value.pop(ident, [])

    def row_id(self, table_file: str, row: int, ident: str) -> str:
        """The record id of a row no image stands for."""
        return f"{table_file}: row {row}" + (f" ({self.noun} {ident})" if ident else "")

    def unlisted(self) -> list[tuple[str, str]]:
        """The DICOMs whose ID no row took, each with its exclusion reason."""
        return [(f.path, f"its {self.tag} is in no row of the table") for found in self.by_value.values() for f in found]


def _a(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"


def check_matched(by_value: dict[str, list[MatchedDicom]], unmatched: list[tuple[str, str]], cells: Any,
                  raw_dir: Path, folder: str, tag: str, column: str, column_key: str, key: str, table_path: Path) -> None:
    """The refusals of a table matched to DICOMs by ``tag``: no DICOM holding it (an anonymised export, the wrong
    folder), none of the table's IDs (``cells``: the column's values; blanks and placeholders are none) in any header
    (both sides shown), or some that differ from a header's only in leading zeros (a spreadsheet that read the column
    as numbers)."""
    listed = {str(v).strip() for v in cells} - {""}
    listed = {v for v in listed if v.casefold() not in MISSING}
    if not by_value:
        raise LabelFileError(f"{Path(raw_dir) / folder}: no DICOM with {_a(tag)} {tag} in its header ({len(unmatched)} files: "
                             f"{', '.join(sorted({why for _, why in unmatched})) or 'none'}); {key} matches the table's "
                             "rows to DICOMs by that header")
    if not listed & set(by_value):
        ours, theirs = sorted(listed)[:3], sorted(by_value)[:3]
        raise LabelFileError(f"{table_path}: no DICOM under {folder} has {_a(tag)} {tag} in the column {column} (the table's: "
                             f"{', '.join(ours)}, ...; the headers': {', '.join(theirs)}, ...); check leading zeros a "
                             f"spreadsheet dropped, prefixes and the column ({column_key})")
    unzeroed: dict[str, str] = {}
    for h in set(by_value) - listed:
        unzeroed.setdefault(h.lstrip("0"), h)
    zeros = {t: unzeroed[t.lstrip("0")] for t in listed - set(by_value) if t.lstrip("0") in unzeroed}
    if zeros:
        pairs = ", ".join(f"{t} / {h}" for t, h in sorted(zeros.items())[:3])
        raise LabelFileError(f"{table_path}: {len(zeros)} of the column {column}'s IDs differ from a DICOM header's "
                             f"{tag} only in leading zeros (table / header: {pairs}); a spreadsheet drops them from "
                             "numbers: export the column as text")


def header_patients_warning(patients: list[str], key: str, patient_key: str) -> Optional[str]:
    """A warning on the groups a header match gives without a patient column (``patients``: each kept image's header
    PatientID, "" for none): how many images have none (each is then grouped with its row's images only), or one
    PatientID naming most of 20 or more images (an anonymised export's placeholder would make them one patient)."""
    n = len(patients)
    if n == 0:
        return None
    missing = sum(1 for p in patients if not p)
    if missing:
        return (f"{missing} of {n} images {key} matched have no PatientID in their header (blank or a placeholder): each "
                f"is grouped with its row's images only; name the table's patient column ({patient_key}) if it has one")
    (pid, count), = Counter(patients).most_common(1)
    if n >= 20 and count > n / 2:
        return (f"one PatientID ({pid!r}) names {count} of the {n} images {key} matched: if it is an anonymised export's "
                f"placeholder, they are one patient to every split; name the table's patient column ({patient_key}) if it has one")
    return None
