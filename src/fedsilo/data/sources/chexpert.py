"""CheXpert (Irvin et al. 2019), as distributed: ``CheXpert-v1.0-small/{train,valid}.csv`` and JPEGs under
``CheXpert-v1.0-small/{train,valid}/patientNNNNN/studyN/viewN_{frontal,lateral}.jpg`` (the full-resolution
``CheXpert-v1.0/`` layout reads the same way). ``.csv.gz`` label files are read as well.

Label rule (DESIGN §3), per image:
- lateral views are excluded;
- ``Lung Opacity`` = 1 -> positive (1);
- ``Lung Opacity`` = -1 (uncertain) -> excluded by default (``uncertain: positive|negative`` maps it instead,
  the U-Ones / U-Zeros policies of the CheXpert paper);
- ``No Finding`` = 1 and no observation column positive -> negative (0); ``Support Devices`` is not a finding and
  is ignored by default (``negative_ignore``);
- anything else (other findings only, or no label) -> excluded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.config import CheXpertRules
from fedsilo.data.sources.base import LabelFileError, finalize, read_csv, require_columns, show, walk

DOMAIN = "CheXpert"
DOMAINS = (DOMAIN,)
DOWNLOADS: list = []  # distributed by Stanford AIMI behind a data-use agreement: mode aimi, or files / local
OBSERVATIONS = (
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
)


def label_files(raw_dir: Path, include_valid: bool) -> list[Path]:
    found: list[Path] = []
    for split in ("train", "valid") if include_valid else ("train",):
        hits = walk(raw_dir, f"{split}.csv") + walk(raw_dir, f"{split}.csv.gz")
        hits = [h for h in hits if "CheXpert" in h.parent.name or h.parent == raw_dir]
        if hits:
            found.append(hits[0])
        elif split == "train":
            raise LabelFileError(f"{raw_dir}: no CheXpert train.csv (expected CheXpert-v1.0-small/train.csv)")
    return found


def _label_table(df: pd.DataFrame, path: Path, rules: CheXpertRules) -> pd.DataFrame:
    require_columns(df, ("Path", "Frontal/Lateral") + OBSERVATIONS, path)
    obs = df[list(OBSERVATIONS)].apply(pd.to_numeric, errors="coerce")
    bad = ~obs.isin([1.0, 0.0, -1.0]) & df[list(OBSERVATIONS)].notna()  # a word is not a blank
    if bad.any().any():
        col = bad.any()[bad.any()].index[0]
        row = int(bad[col].to_numpy().nonzero()[0][0])
        raise LabelFileError(
            f"{path}: column {col!r} row {row + 2} (Path {df['Path'].iloc[row]}): value {show(df[col].iloc[row])} is not 1/0/-1/blank"
        )
    lo = obs["Lung Opacity"]
    findings = [c for c in OBSERVATIONS if c not in ("No Finding",) and c not in rules.negative_ignore]
    any_finding_pos = (obs[findings] == 1.0).any(axis=1)
    view = df["Frontal/Lateral"].astype(str).str.strip().str.lower()

    label = np.full(len(df), -1, dtype=np.int64)
    excluded = np.full(len(df), "other findings only", dtype=object)
    pos = lo == 1.0
    unc = lo == -1.0
    neg = (obs["No Finding"] == 1.0) & ~any_finding_pos & ~pos & ~unc
    label[pos.to_numpy()] = 1
    excluded[pos.to_numpy()] = ""
    if rules.uncertain == "exclude":
        excluded[unc.to_numpy()] = "uncertain Lung Opacity (-1)"
    else:
        label[unc.to_numpy()] = 1 if rules.uncertain == "positive" else 0
        excluded[unc.to_numpy()] = ""
    label[neg.to_numpy()] = 0
    excluded[neg.to_numpy()] = ""
    no_label = obs.isna().all(axis=1) & ~pos & ~unc
    excluded[(no_label & (excluded != "")).to_numpy()] = "no observation labelled"
    lateral = view != "frontal"
    excluded[lateral.to_numpy()] = "lateral view"

    rel = df["Path"].astype(str)
    orig = (
        "No Finding="
        + obs["No Finding"].map(lambda v: "" if pd.isna(v) else f"{v:g}")
        + ";Lung Opacity="
        + lo.map(lambda v: "" if pd.isna(v) else f"{v:g}")
    )
    return pd.DataFrame(
        {
            "id": rel.str.replace(r"\.(jpg|png)$", "", regex=True),
            "label": label,
            "original_label": orig,
            "group": rel.str.extract(r"(patient\d+)", expand=False).fillna(rel),
            "view": np.where(view == "frontal", "frontal", np.where(view == "lateral", "lateral", "unknown")),
            "rel": rel,
            "reader": "image",
            "excluded": excluded,
        }
    )


def read_records(raw_dir: Path, rules: CheXpertRules) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    tables = []
    for path in label_files(raw_dir, rules.include_valid):
        t = _label_table(read_csv(path), path, rules)
        # Path is relative to the folder that holds CheXpert-v1.0-small/
        base = path.parent.parent
        t["path"] = [
            str((base / r).relative_to(raw_dir)) if (base / r).is_file() else "" for r in t["rel"]
        ]
        tables.append(t.drop(columns=["rel"]))
    return finalize(pd.concat(tables, ignore_index=True), DOMAIN)
