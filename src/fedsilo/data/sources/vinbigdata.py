"""VinBigData Chest X-ray Abnormalities Detection (VinDr-CXR, Nguyen et al. 2022), Kaggle layout:
``train.csv`` (``image_id,class_name,class_id,rad_id,x_min,y_min,x_max,y_max``; one row per radiologist finding,
three radiologists per training image) and ``train/<image_id>.dicom`` (PhysioNet's VinDr-CXR release names the
files ``<image_id>.dicom`` as well; ``.dcm`` is accepted too).

Label rule (DESIGN §3), per image:
- positive (1): ``Lung Opacity`` marked by a majority of the image's radiologists (``opacity_rule: majority``,
  the default) or by any of them (``any``);
- negative (0): every radiologist of the image reported ``No finding``;
- otherwise excluded (other findings only, or opacity marked by a minority).
VinDr-CXR publishes no patient id, so ``group`` is the image id. Every image is a frontal (PA) radiograph.
Class names are matched to VinDr-CXR's findings (``FINDINGS``) regardless of case and spacing; any other name (a typo
of ``No finding`` would silently turn a negative into an exclusion) is an error naming the value and the row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.config import VinBigDataRules
from fedsilo.data.sources.base import LabelFileError, finalize, find_one, read_csv, require_columns, show, walk

DOMAIN = "VinBigData"
DOMAINS = (DOMAIN,)
KAGGLE_COMPETITION = "vinbigdata-chest-xray-abnormalities-detection"
# the same images as DICOM on PhysioNet (VinDr-CXR): annotations/annotations_train.csv has the columns of train.csv
PHYSIONET_PROJECT = ("vindr-cxr", "1.0.0")
# VinDr-CXR's class names: the 14 findings and "No finding" of Kaggle's train.csv, the other local findings of
# PhysioNet's annotations_train.csv, and its global labels
FINDINGS = (
    "No finding", "Lung Opacity", "Aortic enlargement", "Atelectasis", "Calcification", "Cardiomegaly", "Consolidation",
    "ILD", "Infiltration", "Nodule/Mass", "Other lesion", "Pleural effusion", "Pleural thickening", "Pneumothorax",
    "Pulmonary fibrosis", "Clavicle fracture", "Edema", "Emphysema", "Enlarged PA", "Lung cavity", "Lung cyst",
    "Mediastinal shift", "Rib fracture", "COPD", "Lung tumor", "Pneumonia", "Tuberculosis", "Other disease",
    "Other diseases",
)


def _key(name: str) -> str:
    return " ".join(name.split()).lower()


_CANONICAL = {_key(f): f for f in FINDINGS}


def canonical_class_names(df: pd.DataFrame, path: Path) -> pd.Series:
    """``class_name`` as VinDr-CXR spells it; a blank or unknown name is an error naming the row and the value."""
    canon = df["class_name"].map(lambda v: _CANONICAL.get(_key(v)) if isinstance(v, str) else None)
    bad = canon.isna().to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LabelFileError(
            f"{path}: row {df.index[i] + 2} (image_id {df['image_id'].iloc[i]}): class_name {show(df['class_name'].iloc[i])} is "
            f"not a VinDr-CXR finding (known: {', '.join(FINDINGS)})"
        )
    return canon


def read_records(raw_dir: Path, rules: VinBigDataRules) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    path = find_one(raw_dir, ["train.csv", "train.csv.gz", "annotations_train.csv"], "VinBigData train.csv (Kaggle) or annotations/annotations_train.csv (PhysioNet VinDr-CXR)")
    df = read_csv(path, dtype={"image_id": str, "class_name": str, "rad_id": str})
    require_columns(df, ("image_id", "class_name", "rad_id"), path)
    df["class_name"] = canonical_class_names(df, path)
    n_rads = df.groupby("image_id")["rad_id"].nunique()
    opacity_rads = df[df["class_name"] == "Lung Opacity"].groupby("image_id")["rad_id"].nunique()
    nofind_rads = df[df["class_name"] == "No finding"].groupby("image_id")["rad_id"].nunique()
    other_rows = df[~df["class_name"].isin(["No finding"])].groupby("image_id").size()
    opacity_rads = opacity_rads.reindex(n_rads.index, fill_value=0)
    nofind_rads = nofind_rads.reindex(n_rads.index, fill_value=0)
    other_rows = other_rows.reindex(n_rads.index, fill_value=0)

    if rules.opacity_rule == "majority":
        pos = opacity_rads * 2 > n_rads
    else:
        pos = opacity_rads > 0
    neg = (nofind_rads == n_rads) & (other_rows == 0)
    label = np.where(pos, 1, np.where(neg, 0, -1))
    excluded = np.where(
        pos | neg, "", np.where(opacity_rads > 0, "Lung Opacity by a minority of radiologists", "other findings only")
    )
    images = {p.stem: p for ext in ("*.dicom", "*.dcm") for p in walk(raw_dir, ext)}
    ids = n_rads.index.astype(str)
    out = pd.DataFrame(
        {
            "id": ids,
            "label": label,
            "original_label": [
                f"Lung Opacity by {o}/{n} radiologists;No finding by {f}/{n}"
                for o, f, n in zip(opacity_rads, nofind_rads, n_rads)
            ],
            "group": ids,
            "view": "frontal",
            "path": [str(images[i].relative_to(raw_dir)) if i in images else "" for i in ids],
            "reader": "dicom",
            "excluded": excluded,
        }
    )
    return finalize(out, DOMAIN)
