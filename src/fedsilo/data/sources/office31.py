"""Office-31 (Saenko et al. 2010): 31 office object classes in three domains, amazon (product photos from
amazon.com), dslr (a digital SLR camera) and webcam (a low-resolution webcam); 4,110 images (2,817 / 498 / 795).

Layout read: ``<domain>/images/<class>/frame_NNNN.jpg`` as ``domain_adaptation_images.tar.gz`` unpacks (the domain
folders at the top of the archive), below any folder; ``<domain>/<class>/`` (the ``images`` level flattened, as some
copies are) is read too. The distribution has no train / test partition: ``subset`` is empty and the split
protocols draw test images from the pool. The reader is strict because a partial copy would silently change the task
stream: every domain must be there, and every domain must hold an image folder for each of the 31 classes; a folder
that is not an Office-31 class is an error naming it.

Download: the archive's address is the Google Drive file linked from the dataset's page
(https://people.eecs.berkeley.edu/~jhoffman/domainadapt/). The authors publish no checksum: the download is recorded
with its sha256 and ``verified: false`` until it is pinned under ``sources.office31.checksums``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.benchmark import (
    class_folder_records,
    class_root,
    find_dirs,
    norm_name,
    records_frame,
    require_every_class,
)

DOMAINS = ("amazon", "dslr", "webcam")
CLASSES = (
    "back_pack", "bike", "bike_helmet", "bookcase", "bottle", "calculator", "desk_chair", "desk_lamp",
    "desktop_computer", "file_cabinet", "headphones", "keyboard", "laptop_computer", "letter_tray", "mobile_phone",
    "monitor", "mouse", "mug", "paper_notebook", "pen", "phone", "printer", "projector", "punchers", "ring_binder",
    "ruler", "scissors", "speaker", "stapler", "tape_dispenser", "trash_can",
)
DOMAIN_ALIASES = {d: d for d in DOMAINS}
CLASS_ALIASES = {norm_name(c): c for c in CLASSES}
ARCHIVE = "domain_adaptation_images.tar.gz"
# the Google Drive file of the dataset page; no published checksum (pin it under sources.office31.checksums)
DOWNLOADS = [Remote("https://docs.google.com/uc?export=download&id=0B4IapRTv9pJ1WGZVd1VDMmhwdlE", ARCHIVE, None, True)]
__all__ = ["read_records", "DOMAINS", "DOWNLOADS", "CLASSES"]


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    dirs = find_dirs(raw_dir, DOMAIN_ALIASES)
    missing = [d for d in DOMAINS if d not in dirs]
    if missing:
        raise LabelFileError(
            f"{raw_dir}: no Office-31 domain folder {', '.join(missing)} (expected amazon/, dslr/ and webcam/, each "
            f"with images/<class>/*.jpg, as {ARCHIVE} unpacks)"
        )
    frames = []
    for domain in DOMAINS:
        rows = class_folder_records(dirs[domain], raw_dir, domain, CLASSES, CLASS_ALIASES)
        require_every_class(rows, CLASSES, class_root(dirs[domain]), "Office-31", ".jpg files")
        frames.append(records_frame(rows, domain))
    return pd.concat(frames, ignore_index=True)
