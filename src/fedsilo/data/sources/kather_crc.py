"""Kather et al. 2019's colorectal histology patches (Zenodo record 1214456), the public half of CD2-pFed's HISTO-FED:
224 x 224 H&E patches at 0.5 um/px, nine tissue classes, as the record's zips unpack:

- ``NCT-CRC-HE-100K/<class>/<class>-<id>.tif``: 100,000 patches from 86 slides (NCT biobank, UMM pathology archive),
  Macenko stain-normalized; ``NCT-CRC-HE-100K-NONORM/`` is the same patches without normalization, read only when the
  normalized folder is absent, under the same domain name (the centre; ``source_path`` shows which release);
- ``CRC-VAL-HE-7K/<class>/<class>-<id>.tif``: 7,180 patches from 50 other patients (the record's validation set).

Each archive is a domain (a centre of HISTO-FED: CD2-pFed's clients 1 and 2 use subsets of these two; its third
client and its external test site are private and cannot be reproduced). Classes: ADI (adipose), BACK (background),
DEB (debris), LYM (lymphocytes), MUC (mucus), MUS (smooth muscle), NORM (normal colon mucosa), STR (cancer-associated
stroma), TUM (colorectal adenocarcinoma epithelium). The release names no patient per patch, so a patch is its own
group: a split may put patches of one slide on both sides of a client's train / test (say so beside a result).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import class_folder_records, find_dirs, norm_name, records_frame

NCT, NONORM, VAL = "NCT-CRC-HE-100K", "NCT-CRC-HE-100K-NONORM", "CRC-VAL-HE-7K"
DOMAINS = (NCT, VAL)
CLASSES = ("ADI", "BACK", "DEB", "LYM", "MUC", "MUS", "NORM", "STR", "TUM")
CLASS_ALIASES = {norm_name(c): c for c in CLASSES}
DOMAIN_ALIASES = {norm_name(d): d for d in (NCT, NONORM, VAL)}
# Zenodo record 1214456. CRC-VAL-HE-7K.zip's md5 is the record's (as kaiko-ai's eva and other loaders pin it); for
# NCT-CRC-HE-100K.zip the loaders seen disagree on whether md5 035777cf327776a71a05c95da6d6325f is that file's or the
# NONORM file's, so none is pinned: the download is recorded with its sha256 and `verified: false` until the user pins
# it under sources.kather_crc.checksums (the record page lists both md5s)
DOWNLOADS = [
    Remote("https://zenodo.org/records/1214456/files/NCT-CRC-HE-100K.zip", "NCT-CRC-HE-100K.zip", None, True),
    Remote("https://zenodo.org/records/1214456/files/CRC-VAL-HE-7K.zip", "CRC-VAL-HE-7K.zip", "md5:2fd1651b4f94ebd818ebf90ad2b6ce06", True),
]
__all__ = ["read_records", "DOMAINS", "DOWNLOADS", "CLASSES"]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, DOMAIN_ALIASES)
    if NCT in dirs:
        dirs.pop(NONORM, None)  # the same patches, unnormalized: one of the two
    if not dirs:
        raise LabelFileError(f"{raw_dir}: no Kather colorectal folder ({NCT}/, {NONORM}/ or {VAL}/ with one folder per "
                             f"class: {', '.join(CLASSES)})")
    frames = []
    for folder in (NCT, NONORM, VAL):
        if folder in dirs:
            domain = NCT if folder == NONORM else folder  # a centre is a domain, whichever release of its patches
            rows = class_folder_records(dirs[folder], raw_dir, domain, CLASSES, CLASS_ALIASES)
            if not rows:
                raise LabelFileError(f"{dirs[folder]}: no .tif patches in its class folders")
            frames.append(records_frame(rows, domain))
    return pd.concat(frames, ignore_index=True)
