"""Offline mirrors of the four chest X-ray sources, written in each source's real raw layout and encodings.

- CheXpert: ``CheXpert-v1.0-small/{train,valid}.csv`` with all 19 columns and 1/0/-1/blank values; 8-bit JPEGs at
  ``{train,valid}/patientNNNNN/studyN/viewN_{frontal,lateral}.jpg``.
- OpenI: ``NLMCXR_png/CXR<n>_IM-<s>-<k>.png`` (frontal and lateral), ``ecgen-radiology/<n>.xml`` NLM reports
  with MeSH major/automatic terms and parentImage ids, and Kaggle's ``indiana_projections.csv`` view table.
- RSNA: ``stage_2_train_images/<patientId>.dcm`` (8-bit MONOCHROME2, JPEG Baseline like the challenge files),
  ``stage_2_train_labels.csv`` with one row per box, ``stage_2_detailed_class_info.csv`` with all three classes.
- VinBigData: ``train/<image_id>.dicom`` with 12, 14 or 16 bits stored, some MONOCHROME1, some JPEG 2000
  (lossless) compressed, some with a VOI window; ``train.csv`` with one row per radiologist finding and three
  radiologists per image.
- The released Chest-X-Ray-4 (the pFedDB authors' pre-processed copy): ``OVCR_<source>/{train,test}/<class>/*.png``.
- A hospital's own export (``reader: cxr_table``): ``export/<patient>/<study>/<n>`` DICOMs (no suffix, as PACS
  exports write them, or ``.dcm``; 12–16 bits, some MONOCHROME1, some JPEG 2000) and 8-bit PNGs, with ``labels.csv``
  in the reader's default columns (``path``, ``label``, ``patient_id``, ``view``).

Labels are drawn first; images follow from labels (an opacity blob for positives), so the mirror is learnable.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from fedsilo.config import MirrorParams
from fedsilo.data.mirror.synth import STYLES, frontal, lateral
from fedsilo.data.sources.chexpert import OBSERVATIONS as CHEXPERT_OBS


def _rng(source: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, int(hashlib.sha256(source.encode()).hexdigest()[:8], 16)])


def _kind(rng: np.random.Generator) -> str:
    """positive / negative / other (excluded) / uncertain."""
    return str(rng.choice(["pos", "neg", "other", "uncertain"], p=[0.42, 0.42, 0.11, 0.05]))


def _u8(img: np.ndarray) -> np.ndarray:
    return np.round(img * 255).astype(np.uint8)


# --------------------------------------------------------------------------- CheXpert
def write_chexpert(out: Path, p: MirrorParams) -> None:
    from PIL import Image

    rng = _rng("chexpert", p.seed)
    root = out / "CheXpert-v1.0-small"
    rows: dict[str, list[dict]] = {"train": [], "valid": []}
    n_valid = max(2, p.patients // 10)
    for i in range(p.patients):
        split = "valid" if i >= p.patients - n_valid else "train"
        pid = 64541 + i if split == "valid" else i + 1
        for study in range(1, int(rng.integers(1, 3)) + 1):
            kind = _kind(rng)
            obs: dict[str, str] = {c: "" for c in CHEXPERT_OBS}
            if kind == "pos":
                obs["Lung Opacity"] = "1.0"
                if rng.random() < 0.3:
                    obs["Pleural Effusion"] = str(rng.choice(["1.0", "-1.0", "0.0"]))
            elif kind == "neg":
                obs["No Finding"] = "1.0"
                if rng.random() < 0.3:
                    obs["Support Devices"] = "1.0"
            elif kind == "uncertain":
                obs["Lung Opacity"] = "-1.0"
            else:
                obs[str(rng.choice(["Cardiomegaly", "Fracture", "Pleural Other"]))] = "1.0"
                obs["Lung Opacity"] = str(rng.choice(["", "0.0"]))
            sex = str(rng.choice(["Male", "Female"]))
            age = int(rng.integers(18, 90))
            views = ["frontal"] + (["lateral"] if rng.random() < 0.5 else [])
            for v, view in enumerate(views, start=1):
                rel = f"CheXpert-v1.0-small/{split}/patient{pid:05d}/study{study}/view{v}_{view}.jpg"
                if view == "frontal":
                    img = frontal(rng, p.image_px, kind == "pos" or (kind == "uncertain" and rng.random() < 0.5), STYLES["chexpert"])
                else:
                    img = lateral(rng, p.image_px, STYLES["chexpert"])
                path = out / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(_u8(img), mode="L").save(path, quality=88)
                rows[split].append(
                    {
                        "Path": rel,
                        "Sex": sex,
                        "Age": age,
                        "Frontal/Lateral": "Frontal" if view == "frontal" else "Lateral",
                        "AP/PA": str(rng.choice(["AP", "PA"])) if view == "frontal" else "",
                        **obs,
                    }
                )
    root.mkdir(parents=True, exist_ok=True)
    for split, r in rows.items():
        pd.DataFrame(r).to_csv(root / f"{split}.csv", index=False)


# --------------------------------------------------------------------------- OpenI
_XML = """<?xml version="1.0" encoding="utf-8"?>
<eCitation>
   <meta type="rr"/>
   <uId id="CXR{uid}"/>
   <pmcId id="{uid}"/>
   <docSource>CXR</docSource>
   <IUXRId id="{uid}"/>
   <licenseType>open-access</licenseType>
   <publisher>Indiana University</publisher>
   <title>Indiana University Chest X-ray Collection</title>
   <MedlineCitation Owner="Indiana University" Status="supplied by publisher">
      <Article PubModel="Electronic">
         <ArticleTitle>Indiana University Chest X-ray Collection</ArticleTitle>
         <Abstract>
            <AbstractText Label="COMPARISON">None.</AbstractText>
            <AbstractText Label="INDICATION">XXXX-year-old with cough</AbstractText>
            <AbstractText Label="FINDINGS">{findings}</AbstractText>
            <AbstractText Label="IMPRESSION">{impression}</AbstractText>
         </Abstract>
      </Article>
   </MedlineCitation>
   <MeSH>
{mesh}
   </MeSH>
{images}
</eCitation>
"""

_IMG = """   <parentImage id="{iid}">
      <figureId>F{k}</figureId>
      <caption>PA and lateral chest x-XXXX XXXX.</caption>
      <panel type="single">
         <url>/hadoop/storage/radiology/extract/{iid}.jpg</url>
         <imgModality>7</imgModality>
      </panel>
   </parentImage>"""


def write_openi(out: Path, p: MirrorParams) -> None:
    from PIL import Image

    rng = _rng("openi", p.seed)
    (out / "NLMCXR_png").mkdir(parents=True, exist_ok=True)
    (out / "ecgen-radiology").mkdir(parents=True, exist_ok=True)
    proj = []
    for i in range(p.patients):
        uid = i + 1
        kind = _kind(rng)
        if kind == "pos":
            major = [str(rng.choice(["Opacity/lung/base/left", "Opacity/lung/upper lobe/right", "Opacity/lung"]))]
            auto = ["opacity"]
            findings, impression = "Patchy airspace opacity.", "Focal airspace disease."
        elif kind == "neg":
            major, auto = ["normal"], []
            findings, impression = "The lungs are clear.", "No active disease."
        else:
            major = [str(rng.choice(["Cardiomegaly/mild", "Calcified Granuloma/lung/upper lobe/right", "Opacity/retrocardiac"]))]
            auto = []
            findings, impression = "Stable findings.", "No acute cardiopulmonary process."
        series = 100 + i
        images = []
        for k, view in enumerate(["frontal", "lateral"], start=1):
            iid = f"CXR{uid}_IM-{series:04d}-{k}001"
            img = frontal(rng, p.image_px, kind == "pos", STYLES["openi"]) if view == "frontal" else lateral(rng, p.image_px, STYLES["openi"])
            Image.fromarray(_u8(img), mode="L").save(out / "NLMCXR_png" / f"{iid}.png")
            images.append(_IMG.format(iid=iid, k=k))
            proj.append({"uid": uid, "filename": f"{uid}_IM-{series:04d}-{k}001.dcm.png", "projection": view.title()})
        mesh = "\n".join([f"      <major>{t}</major>" for t in major] + [f"      <automatic>{t}</automatic>" for t in auto])
        (out / "ecgen-radiology" / f"{uid}.xml").write_text(
            _XML.format(uid=uid, findings=findings, impression=impression, mesh=mesh, images="\n".join(images))
        )
    pd.DataFrame(proj).to_csv(out / "indiana_projections.csv", index=False)


# --------------------------------------------------------------------------- DICOM helpers
def _dicom_dataset(patient_id: str, uid_seed: str, view: str, modality: str):
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1"  # CR image storage
    meta.MediaStorageSOPInstanceUID = generate_uid(entropy_srcs=[uid_seed, "sop"])
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(None, {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID = generate_uid(entropy_srcs=[uid_seed, "study"])
    ds.SeriesInstanceUID = generate_uid(entropy_srcs=[uid_seed, "series"])
    ds.PatientID = patient_id
    ds.PatientName = patient_id
    ds.Modality = modality
    ds.BodyPartExamined = "CHEST"
    ds.ViewPosition = view
    ds.SamplesPerPixel = 1
    ds.PixelRepresentation = 0
    return ds


def _write_rsna_dicom(path: Path, pid: str, img: np.ndarray, rng: np.random.Generator) -> None:
    from PIL import Image
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEGBaseline8Bit

    ds = _dicom_dataset(pid, pid, str(rng.choice(["PA", "AP"])), "CR")
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    ds.PatientAge = f"{int(rng.integers(2, 90)):03d}Y"
    ds.PatientSex = str(rng.choice(["M", "F"]))
    ds.ConversionType = "WSD"
    ds.SeriesDescription = f"view: {ds.ViewPosition}"
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows, ds.Columns = img.shape
    ds.BitsAllocated = ds.BitsStored = 8
    ds.HighBit = 7
    ds.LossyImageCompression = "01"
    buf = io.BytesIO()
    Image.fromarray(_u8(img), mode="L").save(buf, format="JPEG", quality=90)
    ds.PixelData = encapsulate([buf.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.save_as(path, enforce_file_format=True)


def write_rsna(out: Path, p: MirrorParams) -> None:
    import uuid

    rng = _rng("rsna", p.seed)
    img_dir = out / "stage_2_train_images"
    img_dir.mkdir(parents=True, exist_ok=True)
    labels, classes = [], []
    for i in range(p.patients):
        pid = str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | i, version=4))
        kind = _kind(rng)
        if kind == "pos":
            for _ in range(int(rng.integers(1, 4))):
                x, y = rng.uniform(100, 600), rng.uniform(150, 600)
                labels.append({"patientId": pid, "x": round(x), "y": round(y), "width": round(rng.uniform(100, 300)), "height": round(rng.uniform(150, 400)), "Target": 1})
                classes.append({"patientId": pid, "class": "Lung Opacity"})
        else:
            labels.append({"patientId": pid, "x": None, "y": None, "width": None, "height": None, "Target": 0})
            classes.append({"patientId": pid, "class": "Normal" if kind == "neg" else "No Lung Opacity / Not Normal"})
        img = frontal(rng, p.image_px, kind == "pos", STYLES["rsna"])
        _write_rsna_dicom(img_dir / f"{pid}.dcm", pid, img, rng)
    lab = pd.DataFrame(labels)
    for c in ("x", "y", "width", "height"):
        lab[c] = lab[c].astype("float64")
    lab.to_csv(out / "stage_2_train_labels.csv", index=False)
    pd.DataFrame(classes).to_csv(out / "stage_2_detailed_class_info.csv", index=False)


# --------------------------------------------------------------------------- VinBigData
VIN_OTHER = [("Aortic enlargement", 0), ("Cardiomegaly", 3), ("Pleural thickening", 11), ("Pulmonary fibrosis", 13)]


def _write_vin_dicom(path: Path, image_id: str, img: np.ndarray, rng: np.random.Generator, k: int, view: str = "PA") -> None:
    from pydicom.uid import JPEG2000Lossless

    bits = (12, 14, 16)[k % 3]
    mono1 = k % 4 == 1
    j2k = k % 5 in (2, 3)
    windowed = k % 3 == 0 and not mono1
    ds = _dicom_dataset(image_id, image_id, view, "DX")
    ds.PhotometricInterpretation = "MONOCHROME1" if mono1 else "MONOCHROME2"
    ds.Rows, ds.Columns = img.shape
    ds.BitsAllocated = 16
    ds.BitsStored = bits
    ds.HighBit = bits - 1
    top = 2**bits - 1
    # real detectors rarely use the whole range: place the signal in a band of it
    lo, hi = top * rng.uniform(0.02, 0.1), top * rng.uniform(0.75, 0.95)
    stored = img if not mono1 else 1.0 - img
    arr = np.round(lo + stored * (hi - lo)).astype(np.uint16)
    if windowed:
        ds.WindowCenter = f"{(lo + hi) / 2:.0f}"
        ds.WindowWidth = f"{hi - lo:.0f}"
        ds.VOILUTFunction = "LINEAR"
    if j2k:
        ds.compress(JPEG2000Lossless, arr, encoding_plugin="pylibjpeg", generate_instance_uid=False)
    else:
        ds.PixelData = arr.tobytes()
        ds["PixelData"].VR = "OW"
    ds.save_as(path, enforce_file_format=True)


def write_vinbigdata(out: Path, p: MirrorParams) -> None:
    rng = _rng("vinbigdata", p.seed)
    img_dir = out / "train"
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(p.patients):
        image_id = hashlib.md5(f"vin{p.seed}-{i}".encode()).hexdigest()
        kind = str(rng.choice(["pos", "neg", "other", "minority"], p=[0.42, 0.42, 0.1, 0.06]))
        rads = [f"R{r}" for r in rng.choice(np.arange(8, 11), size=3, replace=False)]
        for j, rad in enumerate(rads):
            if kind == "neg" or (kind == "minority" and j > 0 and rng.random() < 0.5):
                rows.append({"image_id": image_id, "class_name": "No finding", "class_id": 14, "rad_id": rad})
                continue
            marks_opacity = kind == "pos" and (j < 2 or rng.random() < 0.6) or (kind == "minority" and j == 0)
            if marks_opacity:
                x0, y0 = rng.uniform(300, 1500), rng.uniform(400, 1800)
                rows.append({"image_id": image_id, "class_name": "Lung Opacity", "class_id": 7, "rad_id": rad, "x_min": round(x0, 1), "y_min": round(y0, 1), "x_max": round(x0 + rng.uniform(150, 500), 1), "y_max": round(y0 + rng.uniform(150, 500), 1)})
            if not marks_opacity or rng.random() < 0.3:
                name, cid = VIN_OTHER[int(rng.integers(0, len(VIN_OTHER)))]
                x0, y0 = rng.uniform(300, 1500), rng.uniform(400, 1800)
                rows.append({"image_id": image_id, "class_name": name, "class_id": cid, "rad_id": rad, "x_min": round(x0, 1), "y_min": round(y0, 1), "x_max": round(x0 + 300, 1), "y_max": round(y0 + 300, 1)})
        img = frontal(rng, p.image_px, kind == "pos", STYLES["vinbigdata"])
        _write_vin_dicom(img_dir / f"{image_id}.dicom", image_id, img, rng, i)
    df = pd.DataFrame(rows, columns=["image_id", "class_name", "class_id", "rad_id", "x_min", "y_min", "x_max", "y_max"])
    df.to_csv(out / "train.csv", index=False)


# --------------------------------------------------------------------------- the released Chest-X-Ray-4
RELEASED_FOLDERS = {"chexpert": "OVCR_chex", "openi": "OVCR_openi", "rsna": "OVCR_rsna", "vinbigdata": "OVCR_vinbigdata"}
RELEASED_CLASSES = {1: "Lung_Opacity", 0: "Normal"}  # folder names this mirror writes (the release's were not seen here)


def write_chest_xray4_released(out: Path, p: MirrorParams) -> None:
    """The pFedDB authors' released layout, ``OVCR_<source>/{train,test}/<class>/<n>.png``: 8-bit grey frontal PNGs in
    each source's acquisition style, ``patients`` images per source (a quarter of them in ``test``), classes balanced
    within each subset; an opacity blob for Lung Opacity, as the raw-source mirrors draw it."""
    from PIL import Image

    for src, folder in RELEASED_FOLDERS.items():
        rng = _rng(f"released/{src}", p.seed)
        n_test = max(4, p.patients // 4)
        for i in range(p.patients):
            subset = "test" if i < n_test else "train"
            label = i % 2
            img = frontal(rng, p.image_px, bool(label), STYLES[src])
            path = out / folder / subset / RELEASED_CLASSES[label] / f"{src}_{i:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(_u8(img), mode="L").save(path)


# --------------------------------------------------------------------------- a hospital's own export (cxr_table)
TABLE_OTHER = ("Pleural Effusion", "Cardiomegaly", "Atelectasis")


def write_cxr_table(out: Path, p: MirrorParams, name: str = "cxr_table") -> None:
    """What a hospital's PACS export and its report labels look like to ``reader: cxr_table`` (the reader's default
    rules): ``patients`` patients with one or two studies, a frontal image per study (view PA / AP, in either case)
    and for some a lateral one (LL); labels ``Lung Opacity``, ``Normal`` / ``No Finding``, other findings and blanks;
    some paths written with backslashes; each DICOM's header records its view (View Position). Drawn from the seed and
    the source's ``name``: two hospitals' mirrors differ."""
    from PIL import Image

    rng = _rng(f"cxr_table/{name}", p.seed)
    rows, k = [], 0
    for i in range(p.patients):
        pid = f"H{p.seed:02d}{i:05d}"
        for study in range(1, int(rng.integers(1, 3)) + 1):
            kind = _kind(rng)
            label = {"pos": "Lung Opacity", "neg": str(rng.choice(["Normal", "No Finding"])),
                     "other": str(rng.choice(TABLE_OTHER)), "uncertain": ""}[kind]
            views = [str(rng.choice(["PA", "AP", "pa"]))] + (["LL"] if rng.random() < 0.3 else [])
            for n, view in enumerate(views, start=1):
                img = (frontal(rng, p.image_px, kind == "pos", STYLES["cxr_table"]) if view != "LL"
                       else lateral(rng, p.image_px, STYLES["cxr_table"]))
                rel = f"export/{pid}/{study}/{n}" + ("" if k % 3 == 0 else ".dcm" if k % 3 == 1 else ".png")
                path = out / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if rel.endswith(".png"):
                    Image.fromarray(_u8(img), mode="L").save(path)
                else:
                    _write_vin_dicom(path, f"{pid}-{study}-{n}", img, rng, k, view=view.upper())  # its header says its view
                rows.append({"path": rel.replace("/", "\\") if k % 7 == 6 else rel, "label": label, "patient_id": pid, "view": view})
                k += 1
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=["path", "label", "patient_id", "view"]).to_csv(out / "labels.csv", index=False)


WRITERS: dict[str, Callable[[Path, MirrorParams], None]] = {
    "chexpert": write_chexpert,
    "openi": write_openi,
    "rsna": write_rsna,
    "vinbigdata": write_vinbigdata,
    "chest_xray4_released": write_chest_xray4_released,
    "cxr_table": write_cxr_table,  # the mirror of a source of your own with reader: cxr_table
}
