"""Readers on the real files in ../shared/samples/cxr (skipped when the folder is absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsilo.config import CheXpertRules, OpenIRules, RSNARules, VinBigDataRules
from fedsilo.data.dicom import dicom_to_uint8
from fedsilo.data.sources import SOURCES
from fedsilo.data.sources.base import summarize
from tests.conftest import SAMPLES, needs_samples

CXR = SAMPLES / "cxr"

# Counts under the default rules (DESIGN §3); the README quotes them. The label files are fixed, so any change here
# is a change of the rules and must be deliberate.
EXPECTED = {
    "chexpert": {"positive": 94211, "negative": 16974, "excluded": 112229},
    "openi": {"positive": 338, "negative": 1342, "excluded": 5790},
    "rsna": {"positive": 6012, "negative": 8851, "excluded": 11821},
    "vinbigdata": {"positive": 547, "negative": 10606, "excluded": 3847},
}


def _layout(tmp: Path, source: str) -> Path:
    """Lay the sample label files out the way each source distributes them (symlinks, nothing copied)."""
    d = tmp / source
    if source == "chexpert":
        (d / "CheXpert-v1.0-small").mkdir(parents=True)
        (d / "CheXpert-v1.0-small" / "train.csv.gz").symlink_to(CXR / "chexpert" / "chexpert_train.csv.gz")
    elif source == "openi":
        d.mkdir(parents=True)
        for name in ("NLMCXR_reports.tgz", "nlmcxr_dicom_metadata.csv.gz", "indiana_projections.csv"):
            (d / name).symlink_to(CXR / "openi" / name)
    elif source == "rsna":
        d.mkdir(parents=True)
        for name in ("stage_2_train_labels.csv", "stage_2_detailed_class_info.csv"):
            (d / name).symlink_to(CXR / "rsna" / name)
    else:
        d.mkdir(parents=True)
        (d / "train.csv.gz").symlink_to(CXR / "vinbigdata" / "vinbigdata-train.csv.gz")
    return d


RULES = {"chexpert": CheXpertRules(), "openi": OpenIRules(), "rsna": RSNARules(), "vinbigdata": VinBigDataRules()}


@needs_samples("cxr")
@pytest.mark.parametrize("source", list(EXPECTED))
def test_real_label_files_counts(tmp_path, source):
    df = SOURCES[source].read_records(_layout(tmp_path, source), RULES[source])
    s = summarize(df)
    print(f"\n{source}: positive {s['positive']}, negative {s['negative']}, excluded {s['excluded']} {s['excluded_by_reason']}")
    assert {k: s[k] for k in ("positive", "negative", "excluded")} == EXPECTED[source]
    kept = df[df["excluded"] == ""]
    assert set(kept["label"]) == {0, 1}
    assert (kept["view"] == "frontal").all()
    assert (df.loc[df["excluded"] != "", "label"] == -1).all()


@needs_samples("cxr")
def test_real_rsna_missing_class_row_is_implied_by_target(tmp_path):
    df = SOURCES["rsna"].read_records(_layout(tmp_path, "rsna"), RSNARules())
    row = df[df["id"] == "489a175a-4c5c-4b7f-8fdc-cd8514404dbe"].iloc[0]
    assert row["label"] == 1 and row["original_label"].startswith("class=(missing)")


@needs_samples("cxr")
def test_real_vinbigdata_any_rule_is_looser(tmp_path):
    d = _layout(tmp_path, "vinbigdata")
    any_ = summarize(SOURCES["vinbigdata"].read_records(d, VinBigDataRules(opacity_rule="any")))
    assert any_["positive"] > EXPECTED["vinbigdata"]["positive"]


DICOMS = sorted((CXR / "dicom").glob("*.dcm")) if (CXR / "dicom").exists() else []


@needs_samples("cxr/dicom")
@pytest.mark.parametrize("path", DICOMS, ids=[p.name[:24] for p in DICOMS])
@pytest.mark.parametrize("intensity", ["bit_depth", "percentile"])
def test_real_dicoms_decode_to_sane_uint8(path, intensity):
    img, facts = dicom_to_uint8(path, intensity)
    assert img.dtype == np.uint8 and img.ndim == 2 and min(img.shape) >= 512
    p1, p99 = np.percentile(img, [1, 99])
    assert p99 - p1 >= 150, "the image should use most of the 8-bit range"
    h, w = img.shape
    # PA chest: spine/mediastinum (centre strip) is brighter than the lung fields, for MONOCHROME1 too
    centre = img[h // 3 : 2 * h // 3, w // 2 - w // 20 : w // 2 + w // 20].mean()
    lungs = np.mean([img[h // 3 : 2 * h // 3, w // 5 : w // 3].mean(), img[h // 3 : 2 * h // 3, 2 * w // 3 : 4 * w // 5].mean()])
    assert centre > lungs + 30, f"bone should be bright ({facts['photometric']}): centre {centre:.0f} vs lungs {lungs:.0f}"


@needs_samples("cxr/dicom")
def test_real_jpeg2000_decodes_like_its_uncompressed_twin():
    j2k, unc = CXR / "dicom" / "RG1_J2KR.dcm", CXR / "dicom" / "RG1_UNCI.dcm"
    if not (j2k.exists() and unc.exists()):
        pytest.skip("twin files absent")
    a, fa = dicom_to_uint8(j2k)
    b, fb = dicom_to_uint8(unc)
    assert fa["transfer_syntax"].startswith("1.2.840.10008.1.2.4.9") and a.shape == b.shape
    # J2KR is lossless of UNCR; UNCI is the twin of the lossy J2KI, so allow a small difference
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 3


# ---------------------------------------------------------------------------------------------------- benchmarks
DIGITS = SAMPLES / "digits"


@needs_samples("digits/mnist")
def test_real_mnist_test_set_reads_with_its_labels():
    from fedsilo.data.sources.benchmark import load_container

    rec = SOURCES["mnist"].read_records(DIGITS / "mnist")
    assert len(rec) == 10000 and set(rec["subset"]) == {"test"}
    assert np.bincount(rec["label"]).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    arr = load_container(DIGITS / "mnist", rec["path"].iloc[0].split("#")[0])
    assert arr.shape == (10000, 28, 28) and rec["label"].iloc[:5].tolist() == [7, 2, 1, 0, 4]


@needs_samples("digits/usps")
def test_real_usps_test_set_matches_torchvision(tmp_path):
    from torchvision.datasets import USPS

    from fedsilo.data.sources.benchmark import load_container

    rec = SOURCES["usps"].read_records(DIGITS / "usps")
    assert len(rec) == 2007
    ours = load_container(DIGITS / "usps", "usps.t.bz2")
    tv = USPS(str(DIGITS / "usps"), train=False, download=False)
    assert rec["label"].tolist() == list(tv.targets)
    assert np.abs(ours.astype(int) - tv.data.astype(int)).max() <= 1  # rounding vs truncation of the [-1, 1] floats


@needs_samples("digits/mnist_m")
def test_real_mnist_m_test_set_reads_with_its_labels(tmp_path):
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.harmonize import harmonize_dataset

    rec = SOURCES["mnist_m"].read_records(DIGITS / "mnist_m")
    assert len(rec) == 9001 and (rec["path"] != "").all()
    assert rec["label"].iloc[:3].tolist() == [7, 2, 1]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "mnist_m").symlink_to(DIGITS / "mnist_m")
    card = harmonize_dataset(BenchmarkDatasetParams(kind="digits5", sources=("mnist_m",), image_size=28, workers=2, max_per_domain=500), tmp_path / "raw", tmp_path / "h")
    assert card["domains"]["MNIST-M"]["images"] == 500 and card["domains"]["MNIST-M"]["quarantined"] == 0


@needs_samples("office_caltech_10")
def test_real_office_caltech_harmonizes_all_2533_images_in_local_mode(tmp_path):
    """The issue's acceptance: local mode on the real copy (``caltech10`` / ``backpack`` naming), real counts."""
    from fedsilo.config import BenchmarkDatasetParams, SourceParams
    from fedsilo.data.fetch import fetch
    from fedsilo.data.harmonize import harmonize_dataset

    fetch("office_caltech10", SourceParams(mode="local", path=str(SAMPLES / "office_caltech_10")), tmp_path / "raw" / "office_caltech10")
    card = harmonize_dataset(BenchmarkDatasetParams(kind="office_caltech10", image_size=32), tmp_path / "raw", tmp_path / "h")
    assert {d: v["images"] for d, v in card["domains"].items()} == {"amazon": 958, "caltech": 1123, "dslr": 157, "webcam": 295}
    assert card["total_images"] == 2533 and all(v["quarantined"] == 0 for v in card["domains"].values())
    assert all(len([n for n in v["by_class"].values() if n > 0]) == 10 for v in card["domains"].values())
    md = (tmp_path / "h" / "card.md").read_text()
    assert "| amazon | 958 |" in md and "| caltech | 1123 |" in md


@needs_samples("pacs")
def test_real_pacs_sample_reads_and_harmonizes(tmp_path):
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.harmonize import harmonize_dataset

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "pacs").symlink_to(SAMPLES / "pacs")
    card = harmonize_dataset(BenchmarkDatasetParams(kind="pacs", image_size=32, workers=1), tmp_path / "raw", tmp_path / "h")
    assert card["total_images"] == 140
    assert all(v["by_class"] == {c: 5 for c in card["classes"]} for v in card["domains"].values())
    assert sorted(card["domains"]) == ["art_painting", "cartoon", "photo", "sketch"]
