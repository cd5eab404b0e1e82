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
