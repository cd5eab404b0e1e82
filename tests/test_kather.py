"""Kather et al.'s colorectal histology patches (HISTO-FED's two public centres) and ResNet-32 (CD2-pFed; issue 14)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedsilo.config import BenchmarkDatasetParams, DomainClientsSplit, MirrorParams, SourceParams
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.data.sources import kather_crc
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import make_split
from fedsilo.models import build_model

PER_CLASS = 4


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kather") / "raw"
    fetch("kather_crc", SourceParams(mirror=MirrorParams(per_class=PER_CLASS, image_px=64)), root / "kather_crc")
    return root


def test_mirror_is_the_zenodo_layout_and_each_archive_is_a_centre(raw):
    rec = kather_crc.read_records(raw / "kather_crc")
    assert list(rec["domain"].unique()) == ["NCT-CRC-HE-100K", "CRC-VAL-HE-7K"]
    counts = rec.groupby(["domain", "original_label"]).size()
    assert (counts == PER_CLASS).all() and len(counts) == 2 * 9
    assert rec["path"].str.fullmatch(r"(NCT-CRC-HE-100K|CRC-VAL-HE-7K)/[A-Z]+/[A-Z]+-[A-Z]{8}\.tif").all()
    assert (rec["label"] == [kather_crc.CLASSES.index(c) for c in rec["original_label"]]).all()
    assert rec["group"].is_unique and (rec["subset"] == "").all(), "no patient per patch; the archive is the split"


def test_harmonize_keeps_the_centres_stains_apart_and_splits_one_client_per_centre(raw, tmp_path):
    out = tmp_path / "k"
    harmonize_dataset(BenchmarkDatasetParams(kind="kather_crc", image_size=32, workers=1), raw, out, quiet=True)
    rec = pd.read_parquet(out / "records.parquet")
    images = np.load(out / "images.npy")
    assert images.shape == (2 * 9 * PER_CLASS, 32, 32, 3)
    means = [images[(rec["domain"] == d).to_numpy()].reshape(-1, 3).mean(0) for d in ("NCT-CRC-HE-100K", "CRC-VAL-HE-7K")]
    assert np.abs(means[0] - means[1]).max() > 3, "the two centres are stained differently (the feature skew)"
    split = make_split(rec, DomainClientsSplit(n_train=27, n_test=9, test_from="pooled"), seed=0)
    assert [c["domain"] for c in split["clients"]] == ["NCT-CRC-HE-100K", "CRC-VAL-HE-7K"]
    assert all((len(c["train"]), len(c["test"])) == (27, 9) for c in split["clients"])


def test_the_unnormalized_release_is_read_only_without_the_normalized_one(raw, tmp_path):
    copy = tmp_path / "k"
    shutil.copytree(raw / "kather_crc", copy)
    shutil.copytree(copy / "NCT-CRC-HE-100K", copy / "NCT-CRC-HE-100K-NONORM")
    assert set(kather_crc.read_records(copy)["domain"]) == {"NCT-CRC-HE-100K", "CRC-VAL-HE-7K"}, "the same patches once"
    shutil.rmtree(copy / "NCT-CRC-HE-100K")
    rec = kather_crc.read_records(copy)
    assert set(rec["domain"]) == {"NCT-CRC-HE-100K", "CRC-VAL-HE-7K"}, "the centre, whichever release"
    assert rec.loc[rec["domain"] == "NCT-CRC-HE-100K", "path"].str.startswith("NCT-CRC-HE-100K-NONORM/").all()
    (copy / "CRC-VAL-HE-7K" / "FAT").mkdir()
    with pytest.raises(LabelFileError, match="class folder 'FAT' is not a class"):
        kather_crc.read_records(copy)
    with pytest.raises(LabelFileError, match="no Kather colorectal folder"):
        kather_crc.read_records(tmp_path / "k" / "CRC-VAL-HE-7K" / "ADI")


def test_downloads_are_the_zenodo_record_with_the_one_checksum_that_is_certain():
    got = {d.name: (d.url, d.checksum) for d in kather_crc.DOWNLOADS}
    assert got == {
        "NCT-CRC-HE-100K.zip": ("https://zenodo.org/records/1214456/files/NCT-CRC-HE-100K.zip", None),
        "CRC-VAL-HE-7K.zip": ("https://zenodo.org/records/1214456/files/CRC-VAL-HE-7K.zip", "md5:2fd1651b4f94ebd818ebf90ad2b6ce06"),
    }


def test_resnet32_is_he_et_al_cifar_resnet():
    import torch

    m = build_model("resnet32", 3, 10, seed=0)
    assert sum(p.numel() for p in m.parameters()) == 464_154, "0.46 M parameters (He et al. 2016, Table 6)"
    assert m.num_layers == 32 and m.unit_names[0] == "stem" and m.unit_names[-1] == "fc"
    assert len([u for u in m.unit_names if u.startswith("layer")]) == 15
    down = m.units[m.unit_names.index("layer2.0")].downsample
    assert down is not None and not list(down.parameters()), "option A: a parameter-free shortcut"
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10) and m(torch.zeros(1, 3, 224, 224)).shape == (1, 10)
