"""pFedDIL's datasets: Digit-10 (MNIST, EMNIST's digits, USPS, SVHN) and Office-31 (amazon, dslr, webcam; 31 classes).
Mirror -> fetch -> harmonize, EMNIST's letters kept out, the cap, Office-31's local / download modes and its bad
layouts, the root params, and the reader on the real Office images of ../shared/samples (skipped when absent)."""

from __future__ import annotations

import copy
import os
import shutil
import string
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.config import (
    BenchmarkDatasetParams,
    ConfigError,
    DomainIncrementalSplit,
    MirrorParams,
    SourceParams,
    parse_params,
)
from fedsilo.data import fetch as fetch_mod
from fedsilo.data.download import Remote
from fedsilo.data.fetch import FetchError, fetch
from fedsilo.data.harmonize import harmonize_dataset
from fedsilo.data.sources import office31, source_module
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.splits import make_split
from fedsilo.utils.io import read_json
from tests.conftest import REPO, SAMPLES, small_params
from tests.test_single_domain_sources import _tar_gz

PER_CLASS = 3
DIGIT10_DOMAINS = ["MNIST", "EMNIST", "USPS", "SVHN"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pfeddil") / "raw"
    for s in ("mnist", "emnist", "usps", "svhn", "office31"):
        fetch(s, SourceParams(mirror=MirrorParams(per_class=PER_CLASS, image_px=32)), root / s, quiet=True)
    return root


@pytest.fixture(scope="module")
def harmonized(raw) -> Path:
    out = raw.parent / "harmonized"
    harmonize_dataset(BenchmarkDatasetParams(kind="digit10", image_size=16, workers=1), raw, out / "digit10", quiet=True)
    harmonize_dataset(BenchmarkDatasetParams(kind="office31", image_size=32, workers=1), raw, out / "office31", quiet=True)
    return out


def _load(h: Path) -> tuple[pd.DataFrame, np.ndarray, dict]:
    return pd.read_parquet(h / "records.parquet"), np.load(h / "images.npy"), read_json(h / "card.json")


# --------------------------------------------------------------------------- Digit-10
def test_digit10_has_four_domains_in_task_order_ten_digits_and_rgb(harmonized):
    rec, img, card = _load(harmonized / "digit10")
    assert list(dict.fromkeys(rec["domain"])) == DIGIT10_DOMAINS and sorted(card["domains"]) == sorted(DIGIT10_DOMAINS)
    assert card["classes"] == list(string.digits) and card["task"].startswith("10 digit classes")
    assert img.shape == (len(rec), 16, 16, 3) and img.dtype == np.uint8 and card["image_shape"] == [16, 16, 3]
    assert sorted(rec["label"].unique()) == list(range(10))
    for dom in DIGIT10_DOMAINS:  # the mirrors write PER_CLASS images per class and official subset
        d = card["domains"][dom]
        assert d["by_class"] == {c: 2 * PER_CLASS for c in string.digits} and d["by_subset"] == {"test": 10 * PER_CLASS, "train": 10 * PER_CLASS}
    grey = rec.index[rec["domain"] != "SVHN"].to_numpy()  # grey digits replicated to three channels
    assert (img[grey, :, :, 0] == img[grey, :, :, 2]).all()


def test_digit10_emnist_domain_holds_only_its_digits(raw, harmonized):
    rec, img, card = _load(harmonized / "digit10")
    em = rec[rec["domain"] == "EMNIST"]
    assert em["original_label"].astype(int).between(0, 9).all() and (em["label"] == em["original_label"].astype(int)).all()
    # the 52 letters are excluded, with the reason, and never decoded
    assert card["domains"]["EMNIST"]["excluded_by_reason"] == {"class not in digit10": 2 * 52 * PER_CLASS}
    exc = pd.read_parquet(harmonized / "digit10" / "excluded.parquet")
    assert set(exc["domain"]) == {"EMNIST"} and exc["original_label"].astype(int).min() == 10
    # pixels: each kept EMNIST image is the upright digit the source holds at that row
    src = source_module("emnist")
    for i in em.index[:5]:
        container, _, row = em.loc[i, "source_path"].rpartition("#")
        raw_img = src.load_container(raw / "emnist", container)[int(row)]
        assert np.abs(img[i, :, :, 0].astype(int) - cv2.resize(raw_img, (16, 16), interpolation=cv2.INTER_AREA).astype(int)).max() <= 1


def test_digit10_cap_applies_after_the_letters_are_dropped(raw, tmp_path):
    p = BenchmarkDatasetParams(kind="digit10", image_size=16, workers=1, max_per_domain=12, sources=("emnist", "usps"))
    a = harmonize_dataset(p, raw, tmp_path / "a", quiet=True)
    b = harmonize_dataset(p, raw, tmp_path / "b", quiet=True)
    assert list(a["domains"]) == ["EMNIST", "USPS"] and a["classes"] == list(string.digits)  # emnist first: still the digits
    assert all(d["by_subset"] == {"test": 12, "train": 12} for d in a["domains"].values())
    assert a["sha256"] == b["sha256"]


def test_digit10_and_office31_take_the_domain_incremental_split(harmonized, caplog):
    for name, order in (("digit10", DIGIT10_DOMAINS), ("office31", ["amazon", "dslr", "webcam"])):
        rec = pd.read_parquet(harmonized / name / "records.parquet")
        caplog.clear()
        split = make_split(rec, DomainIncrementalSplit(protocol="domain_incremental", clients=2, alpha=1.0, min_per_client=1,
                                                       test_fraction=0.25), seed=0)
        assert split["task_order"] == order and split["num_classes"] == (10 if name == "digit10" else 31)
        assert [t["domain"] for t in split["clients"][0]["tasks"]] == order
        # Digit-10's domains have their official test subsets, which test_from: auto takes: a test_fraction set is
        # said to go unused; Office-31 has none, and is split by it
        unused = f"split.test_fraction 0.25 is not used for {', '.join(order)}: each takes its official test subset"
        assert (unused in caplog.text) == (name == "digit10")


# --------------------------------------------------------------------------- Office-31
def test_office31_mirror_writes_the_archives_layout(raw):
    files = sorted(p.relative_to(raw / "office31").as_posix() for p in (raw / "office31").rglob("*.jpg"))
    assert len(files) == 3 * 31 * PER_CLASS
    assert files[0] == "amazon/images/back_pack/frame_0001.jpg" and files[-1] == f"webcam/images/trash_can/frame_{PER_CLASS:04d}.jpg"
    assert cv2.imread(str(raw / "office31" / files[0])).shape == (32, 32, 3)


def test_office31_has_three_domains_thirty_one_classes(harmonized):
    rec, img, card = _load(harmonized / "office31")
    assert list(dict.fromkeys(rec["domain"])) == ["amazon", "dslr", "webcam"]
    assert card["classes"] == list(office31.CLASSES) and len(card["classes"]) == 31
    assert sorted(rec["label"].unique()) == list(range(31)) and img.shape == (len(rec), 32, 32, 3)
    assert all(d["by_class"] == {c: PER_CLASS for c in office31.CLASSES} and d["by_subset"] == {"(none)": 31 * PER_CLASS} for d in card["domains"].values())
    assert (rec["original_label"] == [office31.CLASSES[k] for k in rec["label"]]).all()


def _office_copy(raw: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "office31"
    shutil.copytree(raw / "office31", dst, ignore=shutil.ignore_patterns("fedsilo_manifest.json"))
    return dst


def test_office31_missing_or_misnamed_class_folder_names_the_path(raw, tmp_path):
    o = _office_copy(raw, tmp_path)
    shutil.rmtree(o / "dslr" / "images" / "ruler")
    with pytest.raises(LabelFileError, match=r"office31/dslr/images: no images for 1 of the 31 Office-31 classes \(ruler\)"):
        office31.read_records(o)
    (o / "dslr" / "images" / "ruler").mkdir()  # an empty class folder is no better
    with pytest.raises(LabelFileError, match=r"dslr/images: no images for 1 of the 31 Office-31 classes \(ruler\)"):
        office31.read_records(o)
    shutil.copytree(o / "dslr" / "images" / "mug", o / "dslr" / "images" / "ruler", dirs_exist_ok=True)
    (o / "webcam" / "images" / "mug").rename(o / "webcam" / "images" / "cup")
    with pytest.raises(LabelFileError, match=r"webcam/images/cup: class folder 'cup' is not a class of this dataset"):
        office31.read_records(o)
    (o / "webcam" / "images" / "cup").rename(o / "webcam" / "images" / "Mug")  # case and _ do not matter
    assert len(office31.read_records(o)) == 3 * 31 * PER_CLASS
    shutil.rmtree(o / "webcam")
    with pytest.raises(LabelFileError, match=r"office31: no Office-31 domain folder webcam"):
        harmonize_dataset(BenchmarkDatasetParams(kind="office31", workers=1), tmp_path, tmp_path / "h", quiet=True)
    assert not (tmp_path / "h").exists()


def test_office31_local_mode_reads_the_archive_and_a_flattened_folder(raw, tmp_path):
    ref = office31.read_records(raw / "office31")
    archive = tmp_path / office31.ARCHIVE
    archive.write_bytes(_tar_gz(raw / "office31"))
    fetch("office31", SourceParams(mode="local", path=str(archive)), tmp_path / "raw" / "office31", quiet=True)
    rec = office31.read_records(tmp_path / "raw" / "office31")
    assert rec["id"].tolist() == ref["id"].tolist() and rec["label"].tolist() == ref["label"].tolist()
    flat = tmp_path / "flat" / "Office31"  # <domain>/<class>/ without the images level, below another folder
    for d in office31.DOMAINS:
        shutil.copytree(raw / "office31" / d / "images", flat / d)
    rec = office31.read_records(tmp_path / "flat")
    assert sorted(rec["label"].tolist()) == sorted(ref["label"].tolist()) and rec["path"].str.startswith("Office31/").all()


def test_office31_download_list_and_an_unverified_web_page(raw, tmp_path, monkeypatch):
    from tests.test_single_domain_sources import _Server

    (r,), headers = fetch_mod.remotes_for("office31", SourceParams(mode="download"))
    assert r.url == "https://docs.google.com/uc?export=download&id=0B4IapRTv9pJ1WGZVd1VDMmhwdlE" and headers == {}
    assert r.name == "domain_adaptation_images.tar.gz" and r.checksum is None and r.unpack  # no published checksum
    pin = "sha256:" + "b" * 64
    assert fetch_mod.remotes_for("office31", SourceParams(mode="download", checksums={r.name: pin}))[0][0].checksum == pin
    srv = _Server({"/good/" + r.name: _tar_gz(raw / "office31"), "/page/" + r.name: b"<html><body>Google Drive can't scan this file</body></html>"})
    monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    try:
        monkeypatch.setattr(office31, "DOWNLOADS", [Remote(f"{srv.url}/good/{r.name}", r.name, None, True)])
        m = fetch("office31", SourceParams(mode="download"), tmp_path / "raw" / "office31", quiet=True)
        assert m["downloads"][0]["verified"] is False and len(office31.read_records(tmp_path / "raw" / "office31")) == 3 * 31 * PER_CLASS
        monkeypatch.setenv("FEDSILO_DOWNLOAD_CACHE", str(tmp_path / "cache2"))
        monkeypatch.setattr(office31, "DOWNLOADS", [Remote(f"{srv.url}/page/{r.name}", r.name, None, True)])
        with pytest.raises(FetchError, match=r"(?s)sources\.office31: domain_adaptation_images\.tar\.gz: cannot unpack.*web page.*cache2/office31/domain_adaptation_images\.tar\.gz"):
            fetch("office31", SourceParams(mode="download"), tmp_path / "raw" / "office31b", quiet=True)
        assert not (tmp_path / "raw" / "office31b").exists()
    finally:
        srv.close()


# --------------------------------------------------------------------------- params
def test_root_params_build_the_pfeddil_quickstart_datasets_and_only_declare_the_paper_scale_ones():
    """The pFedDIL quickstart (pipelines/pfeddil) trains on digit10 and office31, so the root pipeline fetches their
    sources and harmonizes them; the paper-scale datasets are declared for the real data and not built by default."""
    p = parse_params(yaml.safe_load((REPO / "params.yaml").read_text()))
    assert p.sources["office31"].mode == "mirror" and p.sources["office31"].mirror.per_class <= 4
    sizes = {"digit10": 16, "office31": 32, "digit10_32": 32, "office31_224": 224, "domainnet10_224": 224}
    for name, px in sizes.items():
        assert p.datasets[name].image_size == px
        assert (name in p.pipeline.datasets) == (name in ("digit10", "office31")), name
    assert p.datasets["digit10"].kind == "digit10" and p.datasets["digit10"].source_list == ("mnist", "emnist", "usps", "svhn")
    assert p.datasets["office31_224"].kind == "office31" and {"office31", "emnist"} <= set(p.pipeline.sources)


def test_check_params_names_the_key_of_a_bad_pfeddil_entry():
    raw = small_params()
    raw["sources"].update({s: {"mode": "mirror"} for s in ("mnist", "emnist", "usps", "svhn", "office31")})
    raw["datasets"].update({"d10": {"kind": "digit10", "image_size": 16}, "o31": {"kind": "office31"}})
    assert parse_params(raw).datasets["o31"].source_list == ("office31",)
    for edit, key in (
        (lambda d: d["datasets"]["d10"].update(sources=["synthdigits"]), "'synthdigits' is not a source of digit10"),
        (lambda d: d["sources"]["office31"].update(mode="kaggle"), "sources.office31.mode: 'kaggle' is not offered by office31"),
        (lambda d: d["sources"].pop("emnist"), "datasets.d10.sources: 'emnist' has no entry under 'sources'"),
        (lambda d: d["datasets"]["o31"].update(channels="native"), "datasets.o31.channels: unknown key"),
    ):
        bad = copy.deepcopy(raw)
        edit(bad)
        with pytest.raises(ConfigError) as err:
            parse_params(bad)
        assert key in str(err.value)


# --------------------------------------------------------------------------- real images (skip when absent)
OFFICE_CALTECH = SAMPLES / "office_caltech_10"
TO_OFFICE31 = {"backpack": "back_pack", "laptop": "laptop_computer"}  # Office-Caltech-10's names -> Office-31's


@pytest.mark.skipif(not OFFICE_CALTECH.exists(), reason=f"{OFFICE_CALTECH} absent (real samples live in ../shared/samples)")
def test_office31_reader_on_the_real_office_images(raw, tmp_path):
    """Office-Caltech-10's amazon, dslr and webcam folders are Office-31's images of 10 of its classes. Laid out as
    the Office-31 archive (links, nothing copied), the reader names the 21 classes a 10-class copy lacks; with the
    mirror's images standing in for those 21, the real images read with their Office-31 labels and decode."""
    src = {d: next(p for p in OFFICE_CALTECH.rglob(d) if p.is_dir()) for d in office31.DOMAINS}
    o = tmp_path / "office31"
    real: dict[str, int] = {}
    for d, folder in src.items():
        for cdir in sorted(c for c in folder.iterdir() if c.is_dir()):
            name = TO_OFFICE31.get(cdir.name, cdir.name)
            (o / d / "images" / name).mkdir(parents=True)
            for f in sorted(cdir.glob("*.jpg")):
                os.symlink(f, o / d / "images" / name / f.name)
            real[f"{d}/{name}"] = len(list(cdir.glob("*.jpg")))
    assert len(real) == 30
    with pytest.raises(LabelFileError) as err:
        office31.read_records(o)
    missing = [c for c in office31.CLASSES if f"amazon/{c}" not in real]
    assert str(err.value) == f"{o / 'amazon' / 'images'}: no images for 21 of the 31 Office-31 classes ({', '.join(missing)}): each class is a folder <class>/ of .jpg files"
    for d in office31.DOMAINS:
        for c in missing:
            shutil.copytree(raw / "office31" / d / "images" / c, o / d / "images" / c)
    rec = office31.read_records(o)
    counts = rec.groupby(["domain", "original_label"]).size()
    assert all(counts[tuple(k.split("/"))] == n for k, n in real.items())
    assert (rec["label"] == [office31.CLASSES.index(c) for c in rec["original_label"]]).all()
    card = harmonize_dataset(BenchmarkDatasetParams(kind="office31", image_size=32, workers=1, max_per_domain=120), tmp_path, tmp_path / "h", quiet=True)
    assert all(d["quarantined"] == 0 and d["images"] == 120 for d in card["domains"].values())
