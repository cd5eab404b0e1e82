"""Issue 16.3: the pFedDB authors' released Chest-X-Ray-4 (OVCR_<source>/{train,test}/<class>/) builds chest_xray4
with its own train/test partition, classes mapped by name."""

from __future__ import annotations

import shutil
import tarfile

import pandas as pd
import pytest

from fedsilo.config import CXRDatasetParams, DomainClientsSplit, MirrorParams, SourceParams, parse_params
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.data.sources import chest_xray4_released
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import make_split
from tests.conftest import small_params

SRC = "chest_xray4_released"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    fetch(SRC, SourceParams(mirror=MirrorParams(patients=16, image_px=48)), root / "raw" / SRC, quiet=True)
    return root


def test_the_released_layout_reads_with_its_partition_and_labels_by_name(released):
    rec = chest_xray4_released.read_records(released / "raw" / SRC)
    assert sorted(rec["domain"].unique()) == ["CheXpert", "OpenI", "RSNA", "VinBigData"]
    # the mirror writes 16 images a source, 4 of them in test, classes alternating
    counts = rec.groupby(["domain", "subset"]).size()
    assert all(counts.xs("test", level="subset") == 4) and all(counts.xs("train", level="subset") == 12)
    assert set(rec.loc[rec["original_label"] == "Lung_Opacity", "label"]) == {1}
    assert set(rec.loc[rec["original_label"] == "Normal", "label"]) == {0}
    assert (rec["excluded"] == "").all() and rec["id"].is_unique


def test_harmonize_and_an_official_split_keep_the_authors_test_images(released, tmp_path):
    p = CXRDatasetParams(sources=(SRC,), image_size=32, workers=1)
    harmonize_dataset(p, released / "raw", tmp_path / "h", quiet=True)
    table = pd.read_parquet(tmp_path / "h" / "records.parquet")
    assert len(table) == 64 and set(table["subset"]) == {"train", "test"}
    split = make_split(table, DomainClientsSplit(n_train=12, n_test=4, test_from="official"), seed=0)
    assert len(split["clients"]) == 4
    for c in split["clients"]:
        dom = table[table["domain"] == c["domain"]]
        # every one of the domain's released test images, and only those, is its test set
        assert set(table.iloc[c["test"]]["id"]) == set(dom.loc[dom["subset"] == "test", "id"])
        assert all("/train/" in i for i in table.iloc[c["train"]]["id"])


def test_a_test_size_beyond_the_released_test_folder_says_so(released, tmp_path):
    """4 test images a domain in the release: asking 8 of them blamed the domain's images and patients overall."""
    from fedsilo.data.splits import SplitError

    p = CXRDatasetParams(sources=(SRC,), image_size=32, workers=1)
    harmonize_dataset(p, released / "raw", tmp_path / "h", quiet=True)
    table = pd.read_parquet(tmp_path / "h" / "records.parquet")
    with pytest.raises(SplitError, match=r"domain 'CheXpert': its official test subset holds 4 images \(4 groups\), not the 8 of split.n_test"):
        make_split(table, DomainClientsSplit(n_train=8, n_test=8), seed=0)


def test_an_unknown_class_folder_is_an_error_naming_the_key_and_a_mapping_fixes_it(released, tmp_path):
    raw = tmp_path / SRC
    shutil.copytree(released / "raw" / SRC, raw)
    for sub in raw.glob("OVCR_*/*/Lung_Opacity"):
        sub.rename(sub.with_name("Pneumonia_like"))
    with pytest.raises(LabelFileError, match=r"'Pneumonia_like'.*chest_xray4_released\.class_folders"):
        chest_xray4_released.read_records(raw)
    rules = CXRDatasetParams(sources=(SRC,), chest_xray4_released={"class_folders": {"Pneumonia_like": 1}}).chest_xray4_released
    rec = chest_xray4_released.read_records(raw, rules)
    assert set(rec.loc[rec["original_label"] == "Pneumonia_like", "label"]) == {1}
    stale = CXRDatasetParams(sources=(SRC,), chest_xray4_released={"class_folders": {"Opacity_X": 1}}).chest_xray4_released
    with pytest.raises(LabelFileError, match="Opacity_X"):  # a mapping that names no folder is a typo, not ignored
        chest_xray4_released.read_records(released / "raw" / SRC, stale)


def test_a_folder_beside_train_and_test_is_refused(released, tmp_path):
    raw = tmp_path / SRC
    shutil.copytree(released / "raw" / SRC, raw)
    (raw / "OVCR_rsna" / "val" / "Normal").mkdir(parents=True)
    with pytest.raises(LabelFileError, match=r"OVCR_rsna: expected train/ and test/ folders, found \['test', 'train', 'val'\]"):
        chest_xray4_released.read_records(raw)


def test_a_release_without_one_of_its_domains_is_refused_naming_it(released, tmp_path):
    """An interrupted download: three domains read as a three-client "Chest-X-Ray-4" beside the paper's four."""
    raw = tmp_path / SRC
    shutil.copytree(released / "raw" / SRC, raw)
    shutil.rmtree(raw / "OVCR_rsna")
    with pytest.raises(LabelFileError, match=r"four domains; no folder for RSNA \(OVCR_rsna\): an incomplete download"):
        chest_xray4_released.read_records(raw)


def test_local_mode_reads_an_archive_of_the_release(released, tmp_path):
    archive = tmp_path / "Chest-X-Ray-4.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(released / "raw" / SRC, arcname="Chest-X-Ray-4")
    fetch(SRC, SourceParams(mode="local", path=str(archive)), tmp_path / "raw" / SRC, quiet=True)
    assert len(chest_xray4_released.read_records(tmp_path / "raw" / SRC)) == 64


def test_params_refuse_mixing_the_release_with_raw_sources_and_modes_it_lacks():
    raw = small_params()
    raw["sources"][SRC] = {"mode": "local", "path": "/data/Chest-X-Ray-4"}
    raw["datasets"]["chest_xray4"]["sources"] = [SRC, "rsna"]
    with pytest.raises(Exception, match=r"chest_xray4_released holds all four domains"):
        parse_params(raw)
    raw["datasets"]["chest_xray4"]["sources"] = [SRC]
    raw["pipeline"]["sources"] = [SRC]
    assert parse_params(raw).datasets["chest_xray4"].source_list == (SRC,)
    raw["sources"][SRC] = {"mode": "download"}
    with pytest.raises(Exception, match=r"sources\.chest_xray4_released\.mode: 'download' is not offered"):
        parse_params(raw)
