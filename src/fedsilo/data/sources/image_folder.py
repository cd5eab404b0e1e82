"""Your own images sorted into one folder per class (a source with ``reader: image_folder``): a pathology department's
patches, a dermatology clinic's photographs, a site's copy of a benchmark. The layout is torchvision's ``ImageFolder``
and its common variants (:class:`~fedsilo.config.ImageFolderRules`, ``datasets.<dataset>.folders.<source>``):

- ``layout``: the folder levels above the images, ``class`` (``<class>/<image>``, the default), ``subset/class``
  (``<train|val|test>/<class>/<image>``: your own partition; ``training``, ``valid``, ``validation`` and ``testing``
  read as their short names, case-blind), ``domain/class`` or ``domain/subset/class`` (several sites in one folder: each
  domain folder is a domain, its name the client's). Images may sit at any depth below their class folder
  (``<class>/<slide>/<patch>.png``). An image above the class level is an error naming the layout (an image where a
  folder is expected means the layout is not the one set); other files there (a README, a list) are not read.
  ``root`` steps into a folder that wraps the layout (an archive's top-level folder); when the layout's first level
  is one lone folder, the errors and the card say so. With the dataset's ``domains`` filter, domain folders it leaves
  out are not read at all (a stray ``old copy/`` beside the sites); two domain folders differing only in case are an
  error.
- class folders: a folder's name is the dataset's class it matches ignoring case, spaces, ``_`` and ``-``, or the
  class ``classes`` maps it to (itself matched to the class list as loosely); a folder in ``skip`` is left out (its
  images excluded with the reason, so the card counts them); any other folder is an error naming it and both keys,
  never a silent exclusion. Names are compared in one Unicode normalization (a Mac's decomposed ``Tumör`` is the
  composed one). With ``kind: image_folder``
  and no ``classes`` list the class list is the folders' (mapped) names, sorted, as ``ImageFolder`` builds it, names
  that differ only in case, spaces, ``_`` and ``-`` one class (:func:`one_spelling`).
- files: ``.png``, ``.jpg`` / ``.jpeg``, ``.bmp``, ``.gif``, ``.tif`` / ``.tiff`` are images (decoded to RGB, grey
  replicated, as every benchmark image), and so are DICOMs, by their ``.dcm`` / ``.dicom`` suffix or their preamble (a
  PACS export's suffix-less files): colour ones as their pixels are, greyscale ones through the radiograph decoder's
  LUTs (:func:`fedsilo.data.dicom.dicom_to_rgb`); another file inside a class folder is excluded as "not an image
  file"; hidden files (``.DS_Store``, macOS's ``._`` twins) are not files at all.
- ``group``: what a split keeps on one side (a patient, a slide): none (each image its own group, and harmonize warns:
  :data:`NO_GROUP_WARNING`), ``folder`` (the first folder below the class folder; an image directly in its class folder
  is then excluded as "not in a group folder"), or a regular expression whose one capture group, searched in the file
  name, names the group (a name it does not match is excluded). A group is a group of its domain, across classes
  (a slide's tumour and stroma patches stay together). A group with images in ``test`` and outside it is an error
  naming two of them: the splits draw training images from everything but ``test``.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pandas as pd

from fedsilo.config import ImageFolderRules, check_domain_name
from fedsilo.data.dicom import WHOLE_SLIDE_PROBLEM, dicom_image_problem, is_dicom_file
from fedsilo.data.slides import is_slide_file, one_entry_per_dicom_slide
from fedsilo.data.sources.base import LabelFileError, is_hidden, walk
from fedsilo.data.sources.benchmark import IMAGE_SUFFIXES, norm_name, records_frame
from fedsilo.data.sources.classmap import ClassMap, class_key
from fedsilo.utils.progress import Progress

SUBSET_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
                "test": "test", "testing": "test"}
NO_GROUP_WARNING = ("has no group rule (group: null): each image is its own group, so images of one patient or slide "
                    "may land on both sides of a split; set group: folder, or a file-name pattern, if they can be told")


def _level_names(layout: str) -> list[str]:
    return layout.split("/")


def file_reader(path: Path, slides: bool = False) -> tuple[str, str]:
    """(reader, why not): ``("slide", "")`` for a whole-slide image (:func:`~fedsilo.data.slides.is_slide_file`, or
    an instance of a DICOM whole-slide image: cut into patches where the rules say ``slides``), ``("image", "")`` for
    an image suffix, ``("dicom", "")`` for a DICOM image (by suffix or preamble: a PACS export's files often have
    none), else ``("", reason)``: not an image file, a DICOM without pixels (a report, a DICOMDIR). A file that cannot
    be opened is no DICOM here. ``slides``: the rules cut slides, so a small pyramidal TIFF is one too."""
    if is_slide_file(path, small_too=slides):  # before the image suffixes: a pyramidal .tif is a slide, never decoded whole
        return "slide", ""
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return "image", ""
    try:
        dicom = is_dicom_file(path)
    except OSError:
        dicom = False
    if dicom:
        return dicom_reader(dicom_image_problem(path))
    return "", f"not an image file ({path.suffix.lower() or 'no suffix'})"


def dicom_reader(problem: str) -> tuple[str, str]:
    """:func:`file_reader`'s answer for a DICOM, from why it is no picture (:func:`~fedsilo.data.dicom.dataset_problem`):
    a whole-slide image's instance is a slide (one per series is kept: scan), a DICOM without pixels no image."""
    if problem == WHOLE_SLIDE_PROBLEM:
        return "slide", ""
    return ("", f"not an image: {problem}") if problem else ("dicom", "")


def wrapper_hint(raw_dir: Path, rules: ImageFolderRules, key: str) -> str:
    """A sentence for a layout error when the source's folder holds one folder and nothing else to read: the folder
    an archive (or a copy) wraps everything in, which ``root`` steps into."""
    base = Path(raw_dir) / (rules.root or "")
    if not base.is_dir():
        return ""
    entries = [c for c in base.iterdir() if not is_hidden(c.name) and (c.is_dir() or c.suffix.lower() in IMAGE_SUFFIXES)]
    if len(entries) == 1 and entries[0].is_dir():
        inner = f"{rules.root}/{entries[0].name}" if rules.root else entries[0].name
        return f"; if {entries[0].name!r} only wraps the layout (an archive's top-level folder), set {key}.root: {inner}"
    return ""


def scan(raw_dir: Path, rules: ImageFolderRules, domain: Optional[str], key: str,
         domains: Optional[Iterable[str]] = None, quiet: bool = True) -> list[dict]:
    """Every file at or below a class folder (below ``raw_dir``, or its ``root``), as an entry for
    :func:`read_records`: ``id`` and ``path`` (posix path from ``raw_dir``), ``where`` (the file), ``domain``,
    ``subset``, ``value`` (the class folder's name), ``group`` (None where the rule finds none), ``reason`` (not an
    image, no group). ``domain`` is the source's one domain (None with a ``domain/...`` layout); a domain folder not
    among ``domains`` (the dataset's filter) is not read at all; ``key`` is the dotted params key of the rules.
    Shows the files scanned unless ``quiet`` (a PACS export's suffix-less DICOMs have their headers read here)."""
    raw_dir = Path(raw_dir)
    base = raw_dir / rules.root if rules.root else raw_dir
    if not base.is_dir():
        raise LabelFileError(f"{base}: no such folder in the source ({key}.root: {rules.root!r})")
    levels = _level_names(rules.layout)
    pattern = re.compile(rules.group) if rules.group not in (None, "folder") else None
    expected = "/".join(f"<{level}>" for level in levels) + "/<image>"
    wanted = set(domains) if domains is not None else None
    seen_domains: dict[str, str] = {}
    out: list[dict] = []
    files = [f for f in walk(base) if f.is_file()]
    bar = Progress(len(files), f"scan {key.rsplit('.', 1)[-1]}", "file", quiet=quiet)
    for f in files:
        bar.update(1)
        parts = f.relative_to(base).parts
        named = dict(zip(levels, parts))
        if wanted is not None and "domain" in named and len(parts) > 1 and named["domain"] not in wanted:
            continue  # a domain folder the dataset leaves out (not opened)
        if len(parts) <= len(levels):  # above the class folders: a README, a DICOMDIR are not read; an image is an error
            if file_reader(f)[0]:
                raise LabelFileError(f"{f}: an image outside any class folder: {key}.layout is {rules.layout!r}, "
                                     f"which expects {expected}")
            continue
        dom = domain
        if "domain" in named:
            dom = named["domain"]
            if dom not in seen_domains:
                try:
                    check_domain_name(dom)
                except ValueError as err:
                    raise LabelFileError(f"{base / dom}: domain folder {err} ({key}.layout is {rules.layout!r})") from None
                twin = next((d for d in seen_domains if d.casefold() == dom.casefold()), None)
                if twin is not None:
                    raise LabelFileError(f"{base / dom}: domain folders {twin!r} and {dom!r} differ only in case; one site "
                                         "is one folder (merge them, or rename one)")
                seen_domains[dom] = dom
        subset = ""
        if "subset" in named:
            subset = SUBSET_WORDS.get(norm_name(named["subset"]), "")
            if not subset:
                where = base.joinpath(*parts[: levels.index("subset") + 1])
                raise LabelFileError(f"{where}: {named['subset']!r} is not a subset folder (train, val or test: "
                                     f"{key}.layout is {rules.layout!r}, which expects {expected}){wrapper_hint(raw_dir, rules, key)}")
        below = parts[len(levels):]  # the file's path below its class folder
        rel = f.relative_to(raw_dir).as_posix()
        if rules.group is None:
            group: Optional[str] = rel
        elif rules.group == "folder":
            group = below[0] if len(below) >= 2 else None
        else:
            assert pattern is not None
            m = pattern.search(f.name)
            group = m.group(1) if m and m.group(1) else None
        reader, reason = file_reader(f, rules.slides is not None)
        if not reason and group is None:
            reason = "not in a group folder (group: folder)" if rules.group == "folder" else "file name does not match the group pattern"
        out.append({"id": rel, "path": rel, "where": str(f), "domain": dom, "subset": subset, "value": named["class"],
                    "group": group, "reason": reason, "reader": reader or "image"})
    bar.close()
    out = one_entry_per_dicom_slide(out, raw_dir)
    if not any(not e["reason"].startswith("not an image") for e in out):
        raise LabelFileError(f"{base}: no image ({', '.join(IMAGE_SUFFIXES)}) in class folders laid out as {expected} "
                             f"({key}.layout){wrapper_hint(raw_dir, rules, key)}")
    return out


def folder_classes(raw_dir: Path, rules: ImageFolderRules, key: str) -> ClassMap:
    """The class map of a source's class folders (names compared ignoring case, spaces, '_' and '-'), with the hints
    that a folder named like a subset means a layout with a subset level, and that one lone folder may wrap it all."""
    def hint(folder: str) -> str:
        if norm_name(folder) in SUBSET_WORDS and "subset" not in rules.layout:
            return f"; {key}.layout is {rules.layout!r}: is {folder!r} a subset folder (layout subset/class)?"
        return wrapper_hint(raw_dir, rules, key)

    return ClassMap(rules, key, "class folder", class_key, hint)


def class_names(entries: list[dict], classmap: ClassMap) -> set[str]:
    """The class names a source gives (:meth:`ClassMap.names`): its kept images', and every label a ``strict`` entry
    writes (a table's row, excluded for another reason or not: the labels it checks are the ones it declares)."""
    return classmap.names(e["value"] for e in entries if e["value"] and (not e["reason"] or e.get("strict")))


def one_spelling(names: set[str]) -> list[str]:
    """Class names sorted (as ``ImageFolder`` sorts its folders), names :func:`class_key` takes as one (``Benign`` at
    one site, ``benign`` at another; ``1`` and ``1.0``) one class under the first of their spellings."""
    out: dict[str, str] = {}
    for n in sorted(unicodedata.normalize("NFC", n) for n in names):  # a class name in its composed form
        out.setdefault(class_key(n), n)
    return list(out.values())


def read_records(entries: list[dict], classmap: ClassMap, classes: Sequence[str], check_groups: bool = True) -> pd.DataFrame:
    """The record table of a source's entries (:func:`scan`, or a table's rows: ``id``, ``path`` (empty: the file is
    missing), ``where``, ``domain``, ``subset``, ``value`` (empty: no label), ``group`` (None: none), ``reason`` (an
    exclusion the reader found)): ``label`` the index of the value's class in ``classes``, ``original_label`` the
    value, ``group`` ``<domain>/<group>``. A value in ``skip`` is excluded as such; every other value of a kept entry
    must resolve, and of an excluded one too where the entry is ``strict`` (a table's row: every label it writes is
    checked; a class folder holding only a ``Thumbs.db`` is not)."""
    index = {c: i for i, c in enumerate(classes)}
    resolve = classmap.resolver(classes)
    rows: dict[str, list[dict]] = defaultdict(list)
    for e in entries:
        reason, cls = e["reason"], None
        if e["value"] and (not reason or e.get("strict")):
            cls = resolve(e["value"], e["where"])
            if cls is None:
                reason = f"{classmap.what} skipped ({classmap.key}.skip)"
        elif e["value"] and classmap.skipped(e["value"]):  # excluded already (not an image, no group): the skip comes first
            reason = f"{classmap.what} skipped ({classmap.key}.skip)"
        rows[e["domain"]].append({
            "id": e["id"], "label": index[cls] if cls is not None and not reason else -1, "original_label": e["value"],
            "group": f"{e['domain']}/{e['group']}" if e["group"] is not None else "", "view": "", "path": e["path"],
            "reader": e.get("reader", "image"), "excluded": reason, "subset": e["subset"],
        })
    frame = pd.concat([records_frame(r, d) for d, r in rows.items()], ignore_index=True)
    if check_groups:
        _check_test_groups(frame, classmap.key)
    return frame


def _check_test_groups(frame: pd.DataFrame, key: str) -> None:
    """A kept group (patient, slide) with images in ``test`` and outside it is an error naming two of them."""
    kept = frame[(frame["excluded"] == "") & (frame["subset"] != "")]
    if kept.empty:
        return
    in_test = kept["subset"] == "test"
    mixed = set(kept.loc[in_test, "group"]) & set(frame.loc[(frame["excluded"] == "") & (frame["subset"] != "test"), "group"])
    if mixed:
        g = sorted(mixed)[0]
        rows = frame[(frame["group"] == g) & (frame["excluded"] == "")]
        a = rows.loc[rows["subset"] == "test", "path"].iloc[0]
        b = rows.loc[rows["subset"] != "test", "path"].iloc[0]
        raise LabelFileError(f"group {g!r} has images in test ({a}) and outside it ({b}); the splits draw training images "
                             f"from everything but test, so a group stays on one side ({len(mixed)} groups mixed; {key}.group)")
