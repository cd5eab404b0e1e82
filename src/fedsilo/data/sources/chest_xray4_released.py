"""The released Chest-X-Ray-4: the pFedDB authors' pre-processed copy of the four chest X-ray sources (their Hugging
Face dataset ODDS2022/Chest-X-Ray-4), a fifth way to build ``chest_xray4`` beside the four raw sources.

Layout read (``local`` mode: the folder, or an archive of it)::

    OVCR_chex/{train,test}/<class>/<image>        -> domain CheXpert
    OVCR_openi/{train,test}/<class>/<image>       -> domain OpenI
    OVCR_rsna/{train,test}/<class>/<image>        -> domain RSNA
    OVCR_vinbigdata/{train,test}/<class>/<image>  -> domain VinBigData

``train`` / ``test`` become each image's ``subset``: a split with ``test_from: official`` (or ``auto``) keeps the
authors' partition, so a run sees exactly the paper's images on each side. The class is the folder name, mapped by
name to fedsilo's labels (1 = Lung Opacity, 0 = Normal), never by folder order: the authors' evaluation script
(``scripts/verify_chex_twophase.py``, dev branch of github.com/yiranpang/pFedDB) reads each test folder with
torchvision's ``ImageFolder``, whose label is the index of the class folder in sorted order, so whether their label 1
is Lung Opacity depends on the folder names. The release's folder names were not seen here (no network); the names
below are recognised (case, spaces, dashes and underscores ignored), and any other name is an error that asks for
``datasets.<d>.chest_xray4_released.class_folders`` ({folder name: 1 or 0}).

What the release does not carry: patient ids (every image is its own ``group``; the authors' partition is already
patient-disjoint or not, as they built it), the view (``unknown``; the release holds the images the authors kept)
and the source label that made each image positive or negative (``original_label`` is the class folder's name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from fedsilo.data.sources.base import LabelFileError, finalize, is_hidden, walk
from fedsilo.data.sources.benchmark import IMAGE_SUFFIXES, find_dirs, norm_name

FOLDERS = {"ovcrchex": "CheXpert", "ovcropeni": "OpenI", "ovcrrsna": "RSNA", "ovcrvinbigdata": "VinBigData"}
DOMAINS = tuple(FOLDERS.values())
SUBSETS = ("train", "test")
CLASS_NAMES = {  # normalized folder name -> label
    "lungopacity": 1, "opacity": 1, "abnormal": 1, "positive": 1, "1": 1,
    "normal": 0, "negative": 0, "0": 0,
}
DOWNLOADS: list = []  # a Hugging Face dataset: download it with its own tools, then use mode 'local'


def _label_of(folder: Path, class_folders: dict[str, int]) -> int:
    if folder.name in class_folders:
        return int(class_folders[folder.name])
    label = CLASS_NAMES.get(norm_name(folder.name))
    if label is None:
        raise LabelFileError(
            f"{folder}: class folder {folder.name!r} is not a known Chest-X-Ray-4 class (known: Lung_Opacity, Normal and "
            f"their spellings); map it under datasets.<dataset>.chest_xray4_released.class_folders, e.g. "
            f"{{{folder.name!r}: 1}} for Lung Opacity or 0 for Normal"
        )
    return label


def read_records(raw_dir: Path, rules: Any = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    class_folders = dict(getattr(rules, "class_folders", None) or {})
    domains = find_dirs(raw_dir, FOLDERS)  # the shallowest OVCR_<source> folder of each domain
    if not domains:
        raise LabelFileError(f"{raw_dir}: no OVCR_chex, OVCR_openi, OVCR_rsna or OVCR_vinbigdata folder (the released Chest-X-Ray-4 layout)")
    missing = [dom for dom in DOMAINS if dom not in domains]
    if missing:  # an interrupted download would otherwise be a smaller task set beside the paper's four domains
        names = {v: k for k, v in FOLDERS.items()}
        raise LabelFileError(f"{raw_dir}: the released Chest-X-Ray-4 has four domains; no folder for "
                             f"{', '.join(missing)} (OVCR_{', OVCR_'.join(names[d][4:] for d in missing)}): an incomplete "
                             "download? Put it back, then fetch again")
    frames = []
    used: set[str] = set()
    for dom in DOMAINS:
        base = domains[dom]
        subsets = {c.name: c for c in base.iterdir() if c.is_dir() and not is_hidden(c.name)}
        unknown = sorted(set(subsets) - set(SUBSETS))
        if unknown or not subsets:
            raise LabelFileError(f"{base}: expected train/ and test/ folders, found {sorted(subsets) or 'none'}")
        rows = []
        for subset in SUBSETS:
            if subset not in subsets:
                continue
            for cls in sorted(c for c in subsets[subset].iterdir() if c.is_dir() and not is_hidden(c.name)):
                label = _label_of(cls, class_folders)
                used.add(cls.name)
                for f in walk(cls, "*"):
                    if not f.is_file() or f.suffix.lower() not in IMAGE_SUFFIXES:
                        continue
                    rel = f.relative_to(raw_dir).as_posix()
                    image_id = f"{base.name}/{subset}/{cls.name}/{f.relative_to(cls).as_posix()}"
                    rows.append({"id": image_id, "label": label, "original_label": cls.name, "group": image_id,
                                 "view": "unknown", "path": rel, "reader": "image", "excluded": "", "subset": subset})
        if not rows:
            raise LabelFileError(f"{base}: no image under {'/'.join(SUBSETS)}/<class>/")
        frames.append(finalize(pd.DataFrame(rows), dom))
    stale = sorted(set(class_folders) - used)
    if stale:
        raise LabelFileError(f"{raw_dir}: class_folders names {stale}, but no such class folder exists (have: {sorted(used)})")
    return pd.concat(frames, ignore_index=True)
