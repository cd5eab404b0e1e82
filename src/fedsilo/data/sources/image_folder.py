"""Your own images sorted into one folder per class (a source with ``reader: image_folder``): a pathology department's
patches, a dermatology clinic's photographs, a site's copy of a benchmark. The layout is torchvision's ``ImageFolder``
and its common variants (:class:`~fedsilo.config.ImageFolderRules`, ``datasets.<dataset>.folders.<source>``):

- ``layout``: the folder levels above the images, ``class`` (``<class>/<image>``, the default), ``subset/class``
  (``<train|val|test>/<class>/<image>``: your own partition; ``training``, ``valid``, ``validation`` and ``testing``
  read as their short names, case-blind), ``domain/class`` or ``domain/subset/class`` (several sites in one folder: each
  domain folder is a domain, its name the client's). Images may sit at any depth below their class folder
  (``<class>/<slide>/<patch>.png``). An image above the class level is an error naming the layout (an image where a
  folder is expected means the layout is not the one set); other files there (a README, a list) are not read.
- class folders: a folder's name is the dataset's class it matches ignoring case, spaces, ``_`` and ``-``, or the
  class ``classes`` maps it to; a folder in ``skip`` is left out (its images excluded with the reason, so the card counts
  them); any other folder is an error naming it and both keys, never a silent exclusion. With ``kind: image_folder``
  and no ``classes`` list the class list is the folders' (mapped) names, sorted, as ``ImageFolder`` builds it, names
  that differ only in case, spaces, ``_`` and ``-`` one class (:func:`one_spelling`).
- files: ``.png``, ``.jpg`` / ``.jpeg``, ``.bmp``, ``.gif``, ``.tif`` / ``.tiff`` are images (decoded to RGB, grey
  replicated, as every benchmark image); another file inside a class folder is excluded as "not an image file" (a
  DICOM belongs to ``reader: cxr_table``); hidden files (``.DS_Store``, macOS's ``._`` twins) are not files at all.
- ``group``: what a split keeps on one side (a patient, a slide): none (each image its own group, and harmonize warns:
  :data:`NO_GROUP_WARNING`), ``folder`` (the first folder below the class folder; an image directly in its class folder
  is then excluded as "not in a group folder"), or a regular expression whose one capture group, searched in the file
  name, names the group (a name it does not match is excluded). A group is a group of its domain, across classes
  (a slide's tumour and stroma patches stay together). A group with images in ``test`` and outside it is an error
  naming two of them: the splits draw training images from everything but ``test``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from fedsilo.config import ImageFolderRules, check_domain_name
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import IMAGE_SUFFIXES, norm_name, records_frame

SUBSET_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
                "test": "test", "testing": "test"}
NO_GROUP_WARNING = ("has no group rule (group: null): each image is its own group, so images of one patient or slide "
                    "may land on both sides of a split; set group: folder, or a file-name pattern, if they can be told")


def _level_names(layout: str) -> list[str]:
    return layout.split("/")


def scan(raw_dir: Path, rules: ImageFolderRules, domain: Optional[str], key: str) -> list[dict]:
    """Every file below ``raw_dir`` at or below a class folder, as a dict: ``rel`` (posix path from ``raw_dir``),
    ``domain``, ``subset``, ``folder`` (the class folder's name), ``image`` (an image suffix), ``group`` (None where
    the rule finds none). ``domain`` is the source's one domain (None with a ``domain/...`` layout); ``key`` is the
    dotted params key of the rules (for messages)."""
    raw_dir = Path(raw_dir)
    levels = _level_names(rules.layout)
    pattern = re.compile(rules.group) if rules.group not in (None, "folder") else None
    expected = "/".join(f"<{level}>" for level in levels) + "/<image>"
    checked_domains: set[str] = set()
    out: list[dict] = []
    for f in walk(raw_dir):
        if not f.is_file():
            continue
        parts = f.relative_to(raw_dir).parts
        image = f.suffix.lower() in IMAGE_SUFFIXES
        if len(parts) <= len(levels):  # above the class folders
            if image:
                raise LabelFileError(f"{f}: an image outside any class folder: {key}.layout is {rules.layout!r}, "
                                     f"which expects {expected}")
            continue
        named = dict(zip(levels, parts))
        dom = domain
        if "domain" in named:
            dom = named["domain"]
            if dom not in checked_domains:
                try:
                    check_domain_name(dom)
                except ValueError as err:
                    raise LabelFileError(f"{raw_dir / dom}: domain folder {err} ({key}.layout is {rules.layout!r})") from None
                checked_domains.add(dom)
        subset = ""
        if "subset" in named:
            subset = SUBSET_WORDS.get(norm_name(named["subset"]), "")
            if not subset:
                where = raw_dir.joinpath(*parts[: levels.index("subset") + 1])
                raise LabelFileError(f"{where}: {named['subset']!r} is not a subset folder (train, val or test: "
                                     f"{key}.layout is {rules.layout!r}, which expects {expected})")
        below = parts[len(levels):]  # the file's path below its class folder
        if rules.group is None:
            group: Optional[str] = f.relative_to(raw_dir).as_posix()
        elif rules.group == "folder":
            group = below[0] if len(below) >= 2 else None
        else:
            assert pattern is not None
            m = pattern.search(f.name)
            group = m.group(1) if m and m.group(1) else None
        out.append({"rel": f.relative_to(raw_dir).as_posix(), "domain": dom, "subset": subset, "folder": named["class"],
                    "image": image, "group": group})
    if not any(e["image"] for e in out):
        raise LabelFileError(f"{raw_dir}: no image ({', '.join(IMAGE_SUFFIXES)}) in class folders laid out as {expected} "
                             f"({key}.layout)")
    return out


def _mapped(folder: str, rules: ImageFolderRules) -> Optional[str]:
    """The class a folder's name maps to through ``classes`` (its key compared loosely), or None."""
    loose = {norm_name(k): v for k, v in rules.classes.items()}
    return rules.classes.get(folder, loose.get(norm_name(folder)))


def _skipped(folder: str, rules: ImageFolderRules) -> bool:
    return folder in rules.skip or norm_name(folder) in {norm_name(s) for s in rules.skip}


def class_names(entries: list[dict], rules: ImageFolderRules) -> set[str]:
    """The class names a scan's class folders give (mapped through ``classes``; skipped folders left out): the
    class list of a ``kind: image_folder`` dataset that names none."""
    return {_mapped(e["folder"], rules) or e["folder"] for e in entries if e["image"] and not _skipped(e["folder"], rules)}


def one_spelling(names: set[str]) -> list[str]:
    """Class names sorted (as ``ImageFolder`` sorts its folders), names that differ only in case, spaces, ``_`` and
    ``-`` taken as one class under the first of their spellings (``Benign`` at one site, ``benign`` at another)."""
    out: dict[str, str] = {}
    for n in sorted(names):
        out.setdefault(norm_name(n), n)
    return list(out.values())


def read_records(raw_dir: Path, entries: list[dict], rules: ImageFolderRules, classes: Sequence[str], key: str) -> pd.DataFrame:
    """The record table of a scan (:func:`scan`): ``label`` the index of the folder's class in ``classes``,
    ``original_label`` the folder's name, ``group`` ``<domain>/<group>``."""
    index = {c: i for i, c in enumerate(classes)}
    loose: dict[str, list[str]] = defaultdict(list)
    for c in classes:
        loose[norm_name(c)].append(c)
    resolved: dict[str, Optional[str]] = {}
    rows: dict[str, list[dict]] = defaultdict(list)
    for e in entries:
        folder = e["folder"]
        if folder not in resolved:
            if _skipped(folder, rules):
                resolved[folder] = None
            else:
                cls = _mapped(folder, rules)
                if cls is None:
                    cls = folder if folder in index else (loose[norm_name(folder)] or [None])[0]
                if cls not in index:
                    hint = (f"; {key}.layout is {rules.layout!r}: is {folder!r} a subset folder (layout subset/class)?"
                            if norm_name(folder) in SUBSET_WORDS and "subset" not in rules.layout else "")
                    target = (f"{key}.classes maps it to {cls!r}, which is not among them"
                              if _mapped(folder, rules) is not None else
                              f"map it with {key}.classes: {{{folder}: <class>}} or leave it out with {key}.skip: [{folder}]")
                    raise LabelFileError(f"{Path(raw_dir) / e['rel']}: class folder {folder!r} is not a class of this dataset "
                                         f"(classes: {', '.join(classes)}); {target}{hint}")
                resolved[folder] = cls
        cls = resolved[folder]
        reason = ""
        if cls is None:
            reason = f"class folder skipped ({key}.skip)"
        elif not e["image"]:
            suffix = Path(e["rel"]).suffix.lower()
            reason = f"not an image file ({suffix or 'no suffix'})"
        elif e["group"] is None:
            reason = "not in a group folder (group: folder)" if rules.group == "folder" else "file name does not match the group pattern"
        rows[e["domain"]].append({
            "id": e["rel"], "label": index[cls] if not reason else -1, "original_label": folder,
            "group": f"{e['domain']}/{e['group']}" if e["group"] is not None else "", "view": "", "path": e["rel"],
            "reader": "image", "excluded": reason, "subset": e["subset"],
        })
    frame = pd.concat([records_frame(r, d) for d, r in rows.items()], ignore_index=True)
    _check_test_groups(frame, key)
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
