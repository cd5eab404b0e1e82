"""Mirrors, harmonization, bad input, splits."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pydicom
import pytest

from fedsilo.config import CXRDatasetParams, DomainClientsSplit, MirrorParams, SourceParams, parse_params
from fedsilo.data.fetch import MANIFEST, FetchError, fetch
from fedsilo.data.harmonize import HarmonizeError, harmonize_cxr
from fedsilo.data.sources import SOURCES
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import SplitError, check_patient_disjoint, make_split
from fedsilo.utils.io import file_sha256, read_json
from tests.conftest import small_params


def test_mirror_layouts_match_the_real_distributions(mirror_root):
    raw = mirror_root / "data" / "raw"
    chex = pd.read_csv(raw / "chexpert" / "CheXpert-v1.0-small" / "train.csv")
    assert list(chex.columns[:5]) == ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA"] and len(chex.columns) == 19
    assert set(chex["Lung Opacity"].dropna()) <= {1.0, 0.0, -1.0} and chex["Lung Opacity"].isna().any()
    assert (raw / "chexpert" / "CheXpert-v1.0-small" / "valid.csv").exists()
    assert chex["Path"].str.match(r"CheXpert-v1.0-small/train/patient\d{5}/study\d+/view\d_(frontal|lateral)\.jpg").all()
    assert (chex["Frontal/Lateral"] == "Lateral").any()
    assert list((raw / "openi" / "ecgen-radiology").glob("*.xml")) and list((raw / "openi" / "NLMCXR_png").glob("CXR*_IM-*.png"))
    labels = pd.read_csv(raw / "rsna" / "stage_2_train_labels.csv")
    assert list(labels.columns) == ["patientId", "x", "y", "width", "height", "Target"]
    assert labels.groupby("patientId").size().max() > 1, "positive patients carry several box rows"
    classes = pd.read_csv(raw / "rsna" / "stage_2_detailed_class_info.csv")
    assert set(classes["class"]) == {"Lung Opacity", "Normal", "No Lung Opacity / Not Normal"}
    ds = pydicom.dcmread(next((raw / "rsna" / "stage_2_train_images").glob("*.dcm")))
    assert (ds.PhotometricInterpretation, ds.BitsStored) == ("MONOCHROME2", 8)
    vin = pd.read_csv(raw / "vinbigdata" / "train.csv")
    assert list(vin.columns) == ["image_id", "class_name", "class_id", "rad_id", "x_min", "y_min", "x_max", "y_max"]
    assert (vin.groupby("image_id")["rad_id"].nunique() == 3).all()
    heads = [pydicom.dcmread(p, stop_before_pixels=True) for p in (raw / "vinbigdata" / "train").glob("*.dicom")]
    assert {h.BitsStored for h in heads} == {12, 14, 16}
    assert {h.PhotometricInterpretation for h in heads} == {"MONOCHROME1", "MONOCHROME2"}
    assert any(h.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.4.90" for h in heads), "some JPEG 2000"
    manifest = read_json(raw / "rsna" / MANIFEST)
    some = next(iter(manifest["files"]))
    assert manifest["files"][some]["sha256"] == file_sha256(raw / "rsna" / some)


def test_harmonized_dataset_follows_the_rules(mirror_root):
    out = mirror_root / "data" / "harmonized" / "chest_xray4"
    images = np.load(out / "images.npy", mmap_mode="r")
    rec = pd.read_parquet(out / "records.parquet")
    assert images.dtype == np.uint8 and images.shape[1:] == (32, 32, 1) and len(rec) == len(images)
    assert set(rec["domain"]) == {"CheXpert", "OpenI", "RSNA", "VinBigData"}
    assert set(rec["label"]) == {0, 1} and (rec["view"] == "frontal").all()
    card = read_json(out / "card.json")
    raw = mirror_root / "data" / "raw"
    for source, dom in (("chexpert", "CheXpert"), ("openi", "OpenI"), ("rsna", "RSNA"), ("vinbigdata", "VinBigData")):
        rules = getattr(CXRDatasetParams(), source)
        expect = SOURCES[source].read_records(raw / source, rules)
        kept = expect[expect["excluded"] == ""]
        assert card["domains"][dom]["images"] == len(kept)
        assert card["domains"][dom]["by_class"]["Lung Opacity"] == int((kept["label"] == 1).sum())
        assert card["domains"][dom]["excluded"] == int((expect["excluded"] != "").sum())
    assert "lateral view" in card["domains"]["CheXpert"]["excluded_by_reason"]
    assert card["sha256"]["images.npy"] == file_sha256(out / "images.npy")
    # the learnable signal: positives are brighter inside the lung fields than negatives, in every domain
    for dom in card["domains"]:
        idx = rec.index[rec["domain"] == dom]
        x = images[idx, 8:24, 4:28, 0].reshape(len(idx), -1).mean(1)
        y = rec.loc[idx, "label"].to_numpy()
        assert x[y == 1].mean() > x[y == 0].mean()


def _copy_raw(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_dicom_is_quarantined_and_reported(mirror_root, tmp_path):
    raw = _copy_raw(mirror_root / "data" / "raw", tmp_path / "raw")
    victim = sorted((raw / "rsna" / "stage_2_train_images").glob("*.dcm"))[0]
    victim.write_bytes(victim.read_bytes()[:700])  # truncated mid-header/pixels
    params = CXRDatasetParams(image_size=32, workers=1, max_quarantine_fraction=0.2)
    card = harmonize_cxr(params, raw, tmp_path / "out")
    q = pd.read_csv(tmp_path / "out" / "quarantine.csv")
    rsna = SOURCES["rsna"].read_records(raw / "rsna", params.rsna)
    assert rsna.loc[rsna["id"] == victim.stem, "excluded"].iloc[0] == ""  # a kept image: its decode is what fails
    assert q["id"].str.endswith(victim.stem).any() and card["domains"]["RSNA"]["quarantined"] == 1
    assert victim.stem in (tmp_path / "out" / "card.md").read_text()


def test_harmonize_fails_past_the_quarantine_fraction_and_leaves_nothing(mirror_root, tmp_path):
    raw = _copy_raw(mirror_root / "data" / "raw", tmp_path / "raw")
    for p in (raw / "vinbigdata" / "train").glob("*.dicom"):
        p.write_bytes(b"not a dicom at all")
    with pytest.raises(HarmonizeError, match="vinbigdata: .* could not be decoded"):
        harmonize_cxr(CXRDatasetParams(image_size=32, workers=1), raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["raw"], "no temporary folder left behind"


def test_label_file_missing_a_column_names_file_and_column(mirror_root, tmp_path):
    raw = _copy_raw(mirror_root / "data" / "raw", tmp_path / "raw")
    csv = raw / "rsna" / "stage_2_detailed_class_info.csv"
    pd.read_csv(csv).rename(columns={"class": "klass"}).to_csv(csv, index=False)
    with pytest.raises(LabelFileError, match=r"stage_2_detailed_class_info.csv: missing column\(s\) 'class'"):
        SOURCES["rsna"].read_records(raw / "rsna", CXRDatasetParams().rsna)
    csv = raw / "chexpert" / "CheXpert-v1.0-small" / "train.csv"
    pd.read_csv(csv).drop(columns=["Lung Opacity"]).to_csv(csv, index=False)
    with pytest.raises(LabelFileError, match=r"train.csv: missing column\(s\) 'Lung Opacity'"):
        SOURCES["chexpert"].read_records(raw / "chexpert", CXRDatasetParams().chexpert)


def test_local_mode_copies_a_folder_and_bad_path_fails_cleanly(mirror_root, tmp_path):
    m = fetch("openi", SourceParams(mode="local", path=str(mirror_root / "data" / "raw" / "openi")), tmp_path / "openi")
    assert (tmp_path / "openi" / "indiana_projections.csv").exists() and m["mode"] == "local"
    with pytest.raises(FetchError, match="does not exist"):
        fetch("rsna", SourceParams(mode="local", path=str(tmp_path / "nowhere")), tmp_path / "rsna")
    assert not (tmp_path / "rsna").exists()


def test_mirror_is_deterministic(tmp_path):
    a = fetch("vinbigdata", SourceParams(mirror=MirrorParams(patients=10, image_px=64)), tmp_path / "a")
    b = fetch("vinbigdata", SourceParams(mirror=MirrorParams(patients=10, image_px=64)), tmp_path / "b")
    assert a["files"] == b["files"]


# ---------------------------------------------------------------------------------------------------- splits
def test_domain_clients_split_sizes_disjoint_and_pure(mirror_root):
    rec = pd.read_parquet(mirror_root / "data" / "harmonized" / "chest_xray4" / "records.parquet")
    params = DomainClientsSplit(n_train=20, n_test=12, n_test_per_domain={"OpenI": 8})
    s1 = make_split(rec, params, seed=3)
    s2 = make_split(rec, params, seed=3)
    s3 = make_split(rec, params, seed=4)
    assert s1 == s2 and s1 != s3
    check_patient_disjoint(rec, s1)
    for c in s1["clients"]:
        assert len(c["train"]) == 20 and len(c["test"]) == (8 if c["name"] == "OpenI" else 12)
        assert set(rec.loc[c["train"] + c["test"], "domain"]) == {c["domain"]}
        assert not set(c["train"]) & set(c["test"])
    # CheXpert has patients with several studies: whole patients move together
    chex = next(c for c in s1["clients"] if c["name"] == "CheXpert")
    assert not set(rec.loc[chex["train"], "group"]) & set(rec.loc[chex["test"], "group"])


def test_split_asking_too_much_fails_naming_the_domain(mirror_root):
    rec = pd.read_parquet(mirror_root / "data" / "harmonized" / "chest_xray4" / "records.parquet")
    with pytest.raises(SplitError, match=r"domain '\w+': \d+ images from \d+ patients cannot give 10000 train"):
        make_split(rec, DomainClientsSplit(n_train=10_000), seed=0)


def test_small_params_parse():
    parse_params(small_params())
