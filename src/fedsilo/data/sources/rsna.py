"""RSNA Pneumonia Detection Challenge (Shih et al. 2019), Kaggle stage-2 layout:
``stage_2_train_labels.csv`` (``patientId,x,y,width,height,Target``; one row per box, several per positive patient),
``stage_2_detailed_class_info.csv`` (``patientId,class``, repeated per box row) and
``stage_2_train_images/<patientId>.dcm`` (one frontal DICOM per patient).

Label rule (DESIGN §3), per patient: class ``Lung Opacity`` -> 1, ``Normal`` -> 0,
``No Lung Opacity / Not Normal`` -> excluded. A patient missing from the class file takes the class implied by
``Target`` only when Target = 1 (the only class with boxes); otherwise it is excluded as ``no class``. A patient
whose class disagrees with its Target is excluded as ``class/Target conflict``. A ``Target`` other than 0 / 1 and a
class outside the three are errors naming the file, the row and the patientId.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.config import RSNARules
from fedsilo.data.sources.base import LabelFileError, finalize, find_one, read_csv, require_columns, show, walk

DOMAIN = "RSNA"
DOMAINS = (DOMAIN,)
KAGGLE_COMPETITION = "rsna-pneumonia-detection-challenge"
CLASSES = {"Lung Opacity": 1, "Normal": 0, "No Lung Opacity / Not Normal": -1}


def check_values(df: pd.DataFrame, column: str, allowed: tuple, path: Path) -> None:
    """Every value of ``column`` is one of ``allowed``; the first that is not is an error naming its row (the file's
    line, the header being line 1), its patientId and the value."""
    values = df[column]
    if all(isinstance(a, int) for a in allowed):
        values = pd.to_numeric(values, errors="coerce")
    bad = ~values.isin(allowed)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise LabelFileError(
            f"{path}: row {df.index[i] + 2} (patientId {df['patientId'].iloc[i]}): {column} {show(df[column].iloc[i])} "
            f"is not one of {', '.join(show(a) for a in allowed)}"
        )


def read_records(raw_dir: Path, rules: RSNARules) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    lab_path = find_one(raw_dir, ["stage_2_train_labels.csv"], "RSNA stage_2_train_labels.csv")
    cls_path = find_one(raw_dir, ["stage_2_detailed_class_info.csv"], "RSNA stage_2_detailed_class_info.csv")
    labels = read_csv(lab_path)
    require_columns(labels, ("patientId", "Target"), lab_path)
    classes = read_csv(cls_path)
    require_columns(classes, ("patientId", "class"), cls_path)
    check_values(labels, "Target", (0, 1), lab_path)
    labels["Target"] = pd.to_numeric(labels["Target"]).astype("int64")
    check_values(classes.dropna(subset=["class"]), "class", tuple(CLASSES), cls_path)
    target = labels.groupby("patientId", sort=False)["Target"].max()
    per_patient = classes.drop_duplicates("patientId").set_index("patientId")["class"]
    n_conflicting = classes.groupby("patientId")["class"].nunique()
    images = {p.stem: p for p in walk(raw_dir, "*.dcm")}

    rows = []
    for pid, tgt in target.items():
        cls = per_patient.get(pid)
        why = ""
        if cls is None or (isinstance(cls, float) and np.isnan(cls)):
            if tgt == 1:
                cls = "Lung Opacity"
                orig = "class=(missing);Target=1"
            else:
                cls, why, orig = None, "no class", f"class=(missing);Target={tgt}"
        else:
            orig = f"class={cls};Target={tgt}"
        label = CLASSES.get(cls, -1) if cls else -1
        if not why:
            if n_conflicting.get(pid, 1) > 1 or (label == 1) != (tgt == 1):
                why = "class/Target conflict"
            elif label == -1:
                why = "No Lung Opacity / Not Normal"
        img = images.get(str(pid))
        rows.append(
            {
                "id": str(pid),
                "label": label,
                "original_label": orig,
                "group": str(pid),
                "view": "frontal",
                "path": str(img.relative_to(raw_dir)) if img is not None else "",
                "reader": "dicom",
                "excluded": why,
            }
        )
    return finalize(pd.DataFrame(rows), DOMAIN)
