"""Your own images in one folder per class (``reader: image_folder``): a pathology department's patches join Kather's
two centres as a domain of their own, or a dataset of several sites stands alone (``kind: image_folder``); groups
(slides, patients) stay whole in every split; the folders' mistakes are refused by path and key."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
import yaml

from fedsilo.cli import main as fedsilo
from fedsilo.config import ConfigError, parse_params
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import HarmonizeError, decode_one, harmonize_benchmark, preview_dataset
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.kather_crc import CLASSES as KATHER
from fedsilo.data.splits import check_patient_disjoint, make_split
from fedsilo.utils.io import read_json
from tests.conftest import SAMPLES, needs_samples


def _joined(folders: dict | None = None, **own) -> dict:
    """kather_crc's mirror and a department's own patches (its mirror unless ``own`` says otherwise)."""
    return {
        "sources": {"kather_crc": {"mode": "mirror", "mirror": {"per_class": 3, "image_px": 32}},
                    "path_lab": {"mode": "mirror", "reader": "image_folder", "mirror": {"per_class": 4, "image_px": 32}, **own}},
        "datasets": {"crc": {"kind": "kather_crc", "sources": ["kather_crc", "path_lab"], "image_size": 16, "workers": 1,
                             "folders": folders if folders is not None else {"path_lab": {"domain": "Path Lab", "group": "folder"}}}},
        "experiments": {"quick": {"dataset": "crc", "split": {"protocol": "domain_clients", "n_train": 10, "n_test": 6}}},
        "methods": {"fedavg": {}},
        "pipeline": {"sources": ["kather_crc", "path_lab"], "datasets": ["crc"], "splits": {"quick": "crc"},
                     "experiments": ["quick"], "methods": ["fedavg"], "seeds": [0]},
        "tracking": {"enabled": False},
    }


def _write(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    assert cv2.imwrite(str(path), rng.integers(0, 256, (20, 24, 3), dtype=np.uint8))


def test_a_departments_patches_join_kather_as_a_domain_of_their_own_and_slides_stay_whole(tmp_path):
    p = parse_params(_joined())
    raw = tmp_path / "raw"
    for s in ("kather_crc", "path_lab"):
        fetch(s, p.sources[s], raw / s)
    ds = p.datasets["crc"]
    card = harmonize_benchmark(ds, raw, tmp_path / "h" / "crc", quiet=True)
    assert list(card["domains"]) == ["NCT-CRC-HE-100K", "CRC-VAL-HE-7K", "Path Lab"]
    assert card["classes"] == list(KATHER)  # the department's lower-case folders mapped to Kather's codes by name
    mine = card["domains"]["Path Lab"]
    assert mine["images"] == 4 * len(KATHER) and mine["excluded_by_reason"] == {"not an image file (.db)": 1}
    assert card["rules"]["own_sources"]["path_lab"]["group"] == "folder" and "warnings" not in card

    h = tmp_path / "h" / "crc"
    recs, images = pd.read_parquet(h / "records.parquet"), np.load(h / "images.npy")
    own = recs[recs["domain"] == "Path Lab"]
    folder = own["source_path"].str.split("/").str[0]
    assert (own["label"].to_numpy() == [KATHER.index(f.upper()) for f in folder]).all()
    assert (own["original_label"] == folder).all()
    for i in own.index[:6]:  # each image is its own file's, decoded as every benchmark image
        src = raw / "path_lab" / own.loc[i, "source_path"]
        np.testing.assert_array_equal(images[i], decode_one((str(src), "rgb", 16, "stretch", "", (0.0, 100.0))))
    # a slide is a group across classes, and a split keeps it on one side
    slides = own["source_path"].str.split("/").str[1]
    assert (own["group"] == "Path Lab/" + slides).all() and slides.nunique() == 4 and own.groupby("group")["label"].nunique().min() > 1
    split = make_split(recs, p.experiments["quick"].split.model_copy(update={"domains": ("Path Lab",), "n_train": 18, "n_test": 9}), 0)
    check_patient_disjoint(recs, split)
    client = next(c for c in split["clients"] if c["domain"] == "Path Lab")
    assert not set(recs.loc[client["train"], "group"]) & set(recs.loc[client["test"], "group"])

    # a deployed site's dataset holds its own folder only: the kind's classes all the same, and the task its sites compare
    alone = harmonize_benchmark(ds.model_copy(update={"sources": ("path_lab",)}), raw, tmp_path / "h" / "site", quiet=True)
    assert alone["classes"] == list(KATHER) and alone["task"] == card["task"] and list(alone["domains"]) == ["Path Lab"]

    # without a group rule each patch is its own group, and harmonize says so
    p2 = parse_params(_joined({"path_lab": {"domain": "Path Lab"}}))
    pv = preview_dataset(p2.datasets["crc"], raw, "crc")
    assert pv["domains"]["Path Lab"]["kept"] == 4 * len(KATHER) and "no group rule" in pv["warnings"][0]


def test_several_sites_in_one_folder_with_their_own_partition_form_a_dataset_of_their_own(tmp_path, capsys):
    site = tmp_path / "derm_export"
    classes_seen = {"Site A": ("Benign", "malignant"), "Site B": ("benign", "Malignant", "Scar")}
    n = 0
    for dom, folders in classes_seen.items():
        for subset in ("Training", "Testing"):
            for f in folders:
                for k in range(3):
                    n += 1
                    _write(site / dom / subset / f / f"P{n % 5}_{subset}_{k}.jpg", n)
    (site / "labels_legend.txt").write_text("the folders are the classes\n")
    raw_params = {
        "sources": {"derm": {"mode": "local", "reader": "image_folder", "path": str(site)}},
        "datasets": {"derm": {"kind": "image_folder", "sources": ["derm"], "image_size": 16, "workers": 1,
                              "folders": {"derm": {"layout": "domain/subset/class", "skip": ["scar"], "group": r"^(P\d)_"}}}},
        "experiments": {"quick": {"dataset": "derm", "split": {"protocol": "domain_clients", "n_train": 4, "n_test": "all"}}},
        "methods": {"fedavg": {}},
        "pipeline": {"sources": ["derm"], "datasets": ["derm"], "splits": {"quick": "derm"}, "experiments": ["quick"],
                     "methods": ["fedavg"], "seeds": [0]},
        "tracking": {"enabled": False},
    }
    p = parse_params(raw_params)
    raw = tmp_path / "raw"
    fetch("derm", p.sources["derm"], raw / "derm")
    # the patients (P0..P4) span train and test folders here: refused, naming a patient and both sides
    with pytest.raises(LabelFileError, match=r"group 'Site A/P\d' has images in test .* and outside it .*datasets\.derm\.folders\.derm\.group"):
        harmonize_benchmark(p.datasets["derm"], raw, tmp_path / "h" / "derm", quiet=True)
    assert not (tmp_path / "h" / "derm").exists()

    raw_params["datasets"]["derm"]["folders"]["derm"]["group"] = r"^(P\d_\w+?)_"  # a patient per partition
    p = parse_params(raw_params)
    card = harmonize_benchmark(p.datasets["derm"], raw, tmp_path / "h" / "derm", quiet=True)
    assert not any("differs from its fetched copy" in w for w in card.get("warnings", []))
    # a file at the top of the user's folder edited after the fetch: harmonize read the fetched copy, and says so
    import os
    import time

    later = time.time() + 60
    os.utime(site / "labels_legend.txt", (later, later))  # touched, the same content: not a change
    (site / ".DS_Store").write_bytes(b"\0")  # hidden: passed over
    assert not any("differs from its fetched copy" in w for w in harmonize_benchmark(p.datasets["derm"], raw, tmp_path / "h" / "d1", quiet=True).get("warnings", []))
    (site / "labels_legend.txt").write_text("the folders are the classes; P4 is benign\n")
    os.utime(site / "labels_legend.txt", (later, later))
    (site / "notes.csv").write_text("a,b\n")
    edited = harmonize_benchmark(p.datasets["derm"], raw, tmp_path / "h" / "derm_edited", quiet=True)
    assert (f"derm: {site} differs from its fetched copy (labels_legend.txt changed, notes.csv added): harmonize read the "
            f"copy, {raw / 'derm'}; fetch again to take the change (`fedsilo fetch --source derm`, or `dvc repro -f "
            "fetch@derm`)") in edited["warnings"]
    assert any("differs from its fetched copy" in w for w in preview_dataset(p.datasets["derm"], raw, "derm", quiet=True)["warnings"])
    assert card["classes"] == ["Benign", "Malignant"]  # the folders' names, one spelling each, sorted; Scar skipped
    assert (card["dataset"], card["kind"]) == ("derm", "image_folder")  # the card names the dataset, then its kind
    assert (tmp_path / "h" / "derm" / "card.md").read_text().startswith("# Data card: derm (kind image_folder)\n")
    assert list(card["domains"]) == ["Site A", "Site B"]
    assert card["domains"]["Site B"]["excluded_by_reason"] == {"class folder skipped (datasets.derm.folders.derm.skip)": 6}
    recs = pd.read_parquet(tmp_path / "h" / "derm" / "records.parquet")
    assert set(recs["subset"]) == {"train", "test"} and (recs["subset"] == np.where(recs["source_path"].str.contains("Testing"), "test", "train")).all()
    assert set(recs.loc[recs["domain"] == "Site A", "group"].str.split("/").str[0]) == {"Site A"}

    # a class list in params fixes the label order, and the model's outputs count a class no site has an image of
    raw_params["datasets"]["derm"]["classes"] = ["malignant", "benign", "naevus"]
    root = tmp_path / "repo"
    (root / "data" / "raw").mkdir(parents=True)
    shutil.copytree(raw / "derm", root / "data" / "raw" / "derm")
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params))
    for argv in (["harmonize", "--dataset", "derm", "--dry-run"], ["harmonize", "--dataset", "derm"], ["split", "--experiment", "quick"]):
        assert fedsilo(["--root", str(root), "--params", str(root / "params.yaml"), *argv]) in (0, None)
    err = capsys.readouterr().err
    n_files = sum(1 for f in (root / "data" / "raw" / "derm").rglob("*") if f.is_file())  # 30 images, a legend, the manifest
    assert n_files == 32 and err.count(f"scan derm: {n_files}/{n_files} files") == 2  # the folders' scan shows its progress, dry run and harmonize
    card = read_json(root / "data" / "harmonized" / "derm" / "card.json")
    recs = pd.read_parquet(root / "data" / "harmonized" / "derm" / "records.parquet")
    assert card["classes"] == ["malignant", "benign", "naevus"]
    assert (recs["label"] == np.where(recs["original_label"].str.lower() == "malignant", 0, 1)).all()
    assert read_json(root / "data" / "splits" / "quick.json")["num_classes"] == 3


def test_the_folders_mistakes_are_refused_by_path_and_key(tmp_path):
    p = parse_params(_joined({"path_lab": {"group": "folder"}}))
    raw = tmp_path / "raw"
    for s in ("kather_crc", "path_lab"):
        fetch(s, p.sources[s], raw / s)
    ds = p.datasets["crc"]

    def harmonize(rules: dict | None = None):
        d = ds.model_copy(update={"folders": parse_params(_joined({"path_lab": rules or {}})).datasets["crc"].folders})
        return harmonize_benchmark(d, raw, tmp_path / "h" / "crc", quiet=True)

    lab = raw / "path_lab"
    shutil.move(lab / "tum", lab / "Tumour")  # a folder named otherwise: named with both keys that would take it
    with pytest.raises(LabelFileError, match=r"class folder 'Tumour' is not a class .*datasets\.crc\.folders\.path_lab\.classes: "
                       r"\{Tumour: <class>\} or leave it out with datasets\.crc\.folders\.path_lab\.skip: \[Tumour\]"):
        harmonize()
    with pytest.raises(LabelFileError, match=r"classes maps it to 'TUMOR', which is not among them"):
        harmonize({"classes": {"Tumour": "TUMOR"}})
    card = harmonize({"classes": {"tumour": "TUM"}, "group": "folder"})  # keys compared as folder names are
    assert card["domains"]["path_lab"]["by_class"]["TUM"] == 4
    # an image where the layout expects a folder
    _write(lab / "stray.png", 1)
    with pytest.raises(LabelFileError, match=r"stray\.png: an image outside any class folder: .*layout is 'class'"):
        harmonize({"classes": {"tumour": "TUM"}})
    (lab / "stray.png").unlink()
    # a subset level the layout does not name reads as a class folder, with the hint
    (lab / "train").mkdir()
    shutil.move(lab / "adi", lab / "train" / "adi")
    with pytest.raises(LabelFileError, match=r"class folder 'train' .*is 'train' a subset folder \(layout subset/class\)\?"):
        harmonize({"classes": {"tumour": "TUM"}})
    with pytest.raises(LabelFileError, match=r"'(adi|back|Tumour)' is not a subset folder \(train, val or test"):
        harmonize({"classes": {"tumour": "TUM"}, "layout": "subset/class"})
    shutil.move(lab / "train" / "adi", lab / "adi")
    (lab / "train").rmdir()
    # group rules: a patch directly in its class folder has no slide folder; a pattern a name misses
    _write(lab / "adi" / "loose.png", 2)
    card = harmonize({"classes": {"tumour": "TUM"}, "group": "folder"})
    assert card["domains"]["path_lab"]["excluded_by_reason"]["not in a group folder (group: folder)"] == 1
    card = harmonize({"classes": {"tumour": "TUM"}, "group": r"^(S\d+)_"})
    assert card["domains"]["path_lab"]["excluded_by_reason"]["file name does not match the group pattern"] == 1
    # a domain a public source already forms
    with pytest.raises(HarmonizeError, match=r"path_lab: domain 'CRC-VAL-HE-7K' is also a domain of kather_crc"):
        harmonize({"classes": {"tumour": "TUM"}, "domain": "CRC-VAL-HE-7K"})
    # nothing written by any refusal
    assert not (tmp_path / "h" / "crc.tmp").exists()


@pytest.mark.parametrize("change, message", [
    ({"sources": {"path_lab": {"mode": "download"}}}, r"sources\.path_lab\.mode: 'download' is not offered by reader image_folder"),
    ({"datasets": {"crc": {"folders": {"kather_crc": {}}}}}, r"datasets\.crc: folders\.kather_crc: kather_crc is a public source"),
    ({"datasets": {"crc": {"folders": {"elsewhere": {}}}}}, r"datasets\.crc: folders\.elsewhere: 'elsewhere' is not among"),
    ({"datasets": {"crc": {"classes": ["a", "b"]}}}, r"datasets\.crc: classes: only for kind image_folder"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"group": "^P\\d_"}}}}}, r"folders\.path_lab\.group: .*0 capture groups"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"group": "(["}}}}}, r"folders\.path_lab\.group: .*not a regular expression"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"domain": "x", "layout": "domain/class"}}}}}, r"domain: not with layout domain/class"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"domain": "Avg"}}}}}, r"folders\.path_lab\.domain: 'Avg' is a column"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"skip": ["x"], "classes": {"x": "TUM"}}}}}}, r"skip and classes both name x"),
    ({"sources": {"path_lab": {"reader": "cxr_table"}}}, r"datasets\.crc\.sources: 'path_lab' is not a source of kather_crc nor one with "
     r"reader: image_folder .*join a kind: chest_xray4 dataset"),
    ({"datasets": {"crc": {"kind": "cifar10", "sources": ["cifar10", "path_lab"]}}}, r"sources: 'path_lab' is not a source of cifar10"),
    ({"datasets": {"crc": {"kind": "image_folder", "sources": None}}}, r"kind image_folder needs your own sources"),
    ({"datasets": {"crc": {"kind": "image_folder", "sources": ["path_lab"], "classes": ["a", "a"]}}}, r"a listed twice"),
    # a region annotation's target or outside class misspelt: refused when the params are read, not at harmonize
    ({"datasets": {"crc": {"kind": "image_folder", "sources": ["path_lab"], "classes": ["normal", "tumour"], "folders": {"path_lab": {
        "slides": {"regions": {"classes": {"_0": "tumor"}}}}}}}}, r"folders\.path_lab\.slides\.regions\.classes\._0: 'tumor' is not among classes"),
    ({"datasets": {"crc": {"kind": "image_folder", "sources": ["path_lab"], "classes": ["normal", "tumour"], "folders": {"path_lab": {
        "slides": {"regions": {"classes": {"_0": "Tumour"}, "outside": "norm"}}}}}}}, r"slides\.regions\.outside: 'norm' is none of slide, drop"),
    ({"datasets": {"crc": {"folders": {"path_lab": {"slides": {"regions": {"skip": ["Nucleus"], "ignore": ["nucleus"]}}}}}}},
     r"regions: skip and ignore both name nucleus"),
])
def test_params_refuse_what_the_reader_cannot_read(change, message):
    raw = _joined()
    for section, entries in change.items():
        for k, v in entries.items():
            raw[section][k] = {**raw[section][k], **v}
    with pytest.raises(ConfigError, match=message):
        parse_params(raw)


def test_a_pipeline_harmonizes_only_datasets_whose_sources_it_fetches():
    raw = _joined()
    raw["pipeline"]["sources"] = ["kather_crc"]
    with pytest.raises(ConfigError, match=r"pipeline\.datasets: 'crc' is harmonized from path_lab, which is not in pipeline\.sources "
                                          r"\(add it there: no stage would fetch data/raw/path_lab\)"):
        parse_params(raw)


def test_two_folders_of_your_own_form_two_domains_and_a_paper_keeps_to_the_public_ones(tmp_path):
    raw = _joined()
    raw["sources"]["gp_lab"] = {"mode": "mirror", "reader": "image_folder"}
    raw["datasets"]["crc"]["sources"].append("gp_lab")
    raw["pipeline"]["sources"].append("gp_lab")
    raw["datasets"]["crc"]["folders"]["gp_lab"] = {"domain": "path lab"}
    with pytest.raises(ConfigError, match=r"folders\.gp_lab\.domain: 'path lab' is also the domain of path_lab"):
        parse_params(raw)
    raw["datasets"]["crc"]["folders"]["gp_lab"] = {"domain": "GP Lab"}
    assert parse_params(raw).datasets["crc"].own_sources() == ("path_lab", "gp_lab")
    with pytest.raises(ConfigError, match=r"sources\.mystery: unknown source .*'reader: image_folder' \(one folder per class\)"):
        parse_params({**raw, "sources": {**raw["sources"], "mystery": {"mode": "local", "path": "/x"}}})


@needs_samples("office_caltech_10")
def test_real_office_caltech_read_as_your_own_class_folders_matches_its_public_reader(tmp_path):
    """The real Office-Caltech-10 copy (``images/<domain>/<class>/*.jpg``) read as a folder of your own with layout
    domain/class: every image the public reader keeps, each with the same class, one domain per folder."""
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.harmonize import benchmark_records

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "office_caltech10").symlink_to(SAMPLES / "office_caltech_10")
    (tmp_path / "raw" / "ours").symlink_to(SAMPLES / "office_caltech_10" / "images")
    public, public_classes, _, _ = benchmark_records(BenchmarkDatasetParams(kind="office_caltech10"), tmp_path / "raw")
    ours_params = BenchmarkDatasetParams(kind="image_folder", sources=("ours",), folders={"ours": {"layout": "domain/class"}})
    pv = preview_dataset(ours_params, tmp_path / "raw", "oc")
    ours, classes, _, warnings = benchmark_records(ours_params, tmp_path / "raw", "oc")
    assert classes == sorted(public_classes) and any("no group rule" in w for w in warnings)
    by_file = {Path(p).relative_to("images").as_posix(): public_classes[label] for p, label in zip(public["path"], public["label"])}
    assert {p: classes[label] for p, label in zip(ours["path"], ours["label"])} == by_file
    # as a site's own folders, a byte-identical copy is kept once (the first in path order): the release holds some
    from fedsilo.data.harmonize import COPY_REASON
    from fedsilo.utils.io import file_sha256

    first: dict[str, str] = {}
    for p in sorted(by_file):
        first.setdefault(file_sha256(SAMPLES / "office_caltech_10" / "images" / p), p)
    copies = set(by_file) - set(first.values())
    assert set(ours.loc[ours["excluded"] == COPY_REASON, "path"]) == copies and len(copies) > 0
    kept = Counter(p.split("/")[0] for p in set(by_file) - copies)
    assert {d: v["kept"] for d, v in pv["domains"].items()} == dict(kept)
    assert sum(kept.values()) + len(copies) == 958 + 1123 + 157 + 295  # every image the public reader keeps
    assert any(w.startswith(f"ours: {len(copies)} files are byte-identical copies of another of its files") for w in warnings)


@needs_samples("pacs")
def test_real_pacs_sample_read_as_your_own_class_folders(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "ours").symlink_to(SAMPLES / "pacs" / "PACS")
    from fedsilo.config import BenchmarkDatasetParams

    ds = BenchmarkDatasetParams(kind="image_folder", sources=("ours",), image_size=16, workers=1, folders={"ours": {"layout": "domain/class"}})
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h", quiet=True)
    assert card["total_images"] == 140 and sorted(card["domains"]) == ["art_painting", "cartoon", "photo", "sketch"]
    assert card["classes"] == ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]
    assert all(v["by_class"] == {c: 5 for c in card["classes"]} for v in card["domains"].values())


def test_a_pathology_site_with_its_own_folders_makes_the_site_card_a_federation_admits(tmp_path, monkeypatch):
    """A deployed site on its class folders only (deploy/site/params.yaml's commented image_folder route): fetch,
    harmonize, split and `fedsilo site card` give a contract with the kind's classes, under the site's domain."""
    raw = _joined()
    raw["sources"].pop("kather_crc")
    raw["datasets"]["crc"]["sources"] = ["path_lab"]
    raw["experiments"] = {"site": {"dataset": "crc", "split": {"protocol": "domain_clients", "n_train": 18, "n_test": 9}}}
    raw["pipeline"].update(sources=["path_lab"], splits={"site": "crc"}, experiments=["site"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    for cmd in (["fetch", "--source", "path_lab"], ["harmonize", "--dataset", "crc"], ["split", "--experiment", "site"],
                ["site", "card", "--experiment", "site"]):
        assert fedsilo([*cmd, "-q"]) == 0, cmd
    card = read_json(tmp_path / "data" / "site" / "site.json")
    assert card["site"] == card["domain"] == "Path Lab" and (card["n_train"], card["n_test"]) == (18, 9)
    assert card["contract"]["classes"] == list(KATHER) and card["contract"]["image_shape"] == [16, 16, 3]
    assert card["contract"]["task"].startswith("9 colorectal tissue classes")


def test_what_real_copies_bring_wrappers_spellings_digits_and_strays(tmp_path):
    """An archive's top-level folder (root), a mapping onto a class the other site spells otherwise, one name written
    composed and decomposed, digit folders, case-only twin domains and a stray domain folder the dataset leaves out."""
    import unicodedata

    def ds(folders: dict, **kw):
        raw = {"sources": {"s": {"mode": "local", "reader": "image_folder", "path": "/x"}},
               "datasets": {"d": {"kind": "image_folder", "sources": ["s"], "image_size": 8, "workers": 1, "folders": {"s": folders}, **kw}},
               "experiments": {}, "methods": {},
               "pipeline": {"sources": ["s"], "datasets": ["d"], "splits": {}, "experiments": [], "methods": [], "seeds": [0]},
               "tracking": {"enabled": False}}
        return parse_params(raw).datasets["d"]

    src = tmp_path / "raw" / "s"
    tumour = unicodedata.normalize("NFC", "Tumör")
    for d, (dom, names) in enumerate({"Site A": ("Benign", tumour), "Site B": ("benign_lesions", unicodedata.normalize("NFD", tumour)),
                                      "old copy": ("x",)}.items()):
        for k, name in enumerate(names):
            for i in range(2):  # every image its own (a byte-identical copy would be kept once)
                _write(src / "export_2026" / dom / name / f"{k}_{i}.png", 100 * d + 10 * k + i)
    with pytest.raises(LabelFileError, match=r"'export_2026' is not a subset folder .*set datasets\.d\.folders\.s\.root: export_2026"):
        harmonize_benchmark(ds({"layout": "subset/class"}), tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    pv = preview_dataset(ds({"layout": "domain/class"}), tmp_path / "raw", "d")
    assert list(pv["domains"]) == ["export_2026"] and "set datasets.d.folders.s.root: export_2026" in pv["warnings"][-1]
    card = harmonize_benchmark(ds({"layout": "domain/class", "root": "export_2026", "classes": {"benign_lesions": "benign"}},
                                  domains=["Site A", "Site B"]), tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    assert card["classes"] == ["Benign", tumour]  # 'benign' mapped onto Site A's spelling; the two Tumör one class
    assert {d: v["by_class"] for d, v in card["domains"].items()} == {s: {"Benign": 2, tumour: 2} for s in ("Site A", "Site B")}

    digits = tmp_path / "raw2" / "s"
    for c in ("0", "1", "9"):
        _write(digits / c / "a.png", int(c))
    card = harmonize_benchmark(ds({"classes": {9: 1}, "skip": []}, classes=[0, 1]), tmp_path / "raw2", tmp_path / "h2" / "d", quiet=True)
    assert card["classes"] == ["0", "1"] and card["domains"]["s"]["by_class"] == {"0": 1, "1": 2}
    _write(tmp_path / "raw3" / "s" / "SiteC" / "x" / "a.png", 1)
    _write(tmp_path / "raw3" / "s" / "sitec" / "y" / "b.png", 2)
    with pytest.raises(LabelFileError, match=r"domain folders 'SiteC' and 'sitec' differ only in case"):
        harmonize_benchmark(ds({"layout": "domain/class"}), tmp_path / "raw3", tmp_path / "h3" / "d", quiet=True)


def test_the_data_card_shows_the_first_images_of_every_domain_and_class_as_harmonized(tmp_path):
    """samples.png: one row per domain, a block of tiles per class, each tile the harmonized image of the id the card
    lists for it (grey for an empty slot); the card links it."""
    from fedsilo.data import contact_sheet as cs

    p = parse_params(_joined())
    raw = tmp_path / "raw"
    for s in ("kather_crc", "path_lab"):
        fetch(s, p.sources[s], raw / s)
    out = tmp_path / "h" / "crc"
    card = harmonize_benchmark(p.datasets["crc"], raw, out, quiet=True)
    sm = card["samples"]
    k = sm["per_class"]
    assert k == cs.per_class_for(9) == 1 and sm["classes_shown"] == list(KATHER)
    sheet = cv2.imread(str(out / sm["file"]))[:, :, ::-1]
    recs, images = pd.read_parquet(out / "records.parquet"), np.load(out / "images.npy")
    index = {i: n for n, i in enumerate(recs["id"])}
    label_w, head_h, gap, tile = 120, 22, 6, cs.TILE
    for r, dom in enumerate(card["domains"]):
        for c, cls in enumerate(KATHER):
            shown = sm["ids"][dom][cls]
            first = recs[(recs["domain"] == dom) & (recs["label"] == c)]["id"].head(k).tolist()
            assert shown == first
            y, x = head_h + r * (tile + gap), label_w + c * (k * tile + gap)
            np.testing.assert_array_equal(sheet[y:y + tile, x:x + tile], cs._tile(images[index[shown[0]]]))
    assert "![samples](samples.png)" in (out / "card.md").read_text()
    # the sheet's text is ASCII (OpenCV's fonts): accents dropped, another script by its row or column number
    assert [cs.shown_name(n, "domain 2") for n in ("Tumör", "Sjukhus Malmö", "正常病院")] == ["Tumor", "Sjukhus Malmo", "domain 2"]


def test_a_contact_sheet_shows_several_groups_before_a_second_image_of_one_and_grey_where_images_lack(tmp_path):
    """Four tiles per class of a binary task: a slide's patches come after one of each other slide; a class with one
    image shows it and three mid-grey slots; larger images are averaged into the tile. At most MAX_CLASSES classes are
    shown; names drawn as ASCII, a name mostly in another script by its number."""
    from fedsilo.data import contact_sheet as cs

    table = pd.DataFrame({"domain": ["A"] * 5 + ["B"], "label": [0, 0, 0, 0, 1, 1],
                          "group": ["s1", "s1", "s1", "s2", "s3", "s4"], "id": [f"i{k}" for k in range(6)]})
    images = np.zeros((6, 128, 128, 1), np.uint8)
    images[:, ::2, ::2] = 255  # one bright pixel in four: 64 after averaging, 0 or 255 sampled
    sm = cs.write_contact_sheet(tmp_path / "samples.png", table, images, ["normal", "tumour"])
    assert sm["per_class"] == 4 and sm["ids"]["A"] == {"normal": ["i0", "i3", "i1", "i2"], "tumour": ["i4"]}
    assert sm["ids"]["B"] == {"normal": [], "tumour": ["i5"]}
    sheet = cv2.imread(str(tmp_path / "samples.png"))
    y, x, tile = 22 + 64 + 6, 120 + 4 * 64 + 6, cs.TILE  # row B, class "tumour"
    assert (np.abs(sheet[y:y + tile, x:x + tile].astype(int) - 64) <= 1).all()
    assert (sheet[y:y + tile, x + tile:x + 4 * tile] == 128).all() and (sheet[y:y + tile, 120:120 + 4 * tile] == 128).all()

    assert [cs.per_class_for(n) for n in (2, 5, 9, 40)] == [4, 3, 1, 1]
    many = [f"c{k}" for k in range(14)]
    sm = cs.write_contact_sheet(tmp_path / "many.png", table.assign(label=[0, 13, 2, 3, 4, 5]), images, many)
    assert sm["classes_shown"] == many[:cs.MAX_CLASSES] and set(sm["ids"]["A"]) == set(many[:cs.MAX_CLASSES])
    assert [cs.shown_name(n, "class 3") for n in ("Straße", "Łódź", "Klinik 東京", "東京大学病院 A")] == [
        "Strasse", "Lodz", "Klinik", "class 3"]


def test_harmonize_spools_each_image_as_it_is_decoded_and_refuses_mixed_shapes(tmp_path, monkeypatch):
    """Decoded images go one by one into the output's memory-mapped images.npy (never the whole dataset in a list: a
    hospital's 100k radiographs would be gigabytes of RAM); a failed slot is closed up in place; shapes must agree."""
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data import harmonize as hz

    for c, n in (("x", 3), ("y", 3)):
        for k in range(n):
            _write(tmp_path / "raw" / "s" / c / f"{k}.png", 10 * k + ord(c))
    log: list[str] = []
    decode, put = hz._decode_safe, hz.ImageSpool.put
    monkeypatch.setattr(hz, "_decode_safe", lambda job: (log.append("decode"), decode(job))[1])
    monkeypatch.setattr(hz.ImageSpool, "put", lambda self, i, img, image_id: (log.append("put"), put(self, i, img, image_id))[1])
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("s",), image_size=8, workers=1)
    card = hz.harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    assert card["total_images"] == 6 and log == ["decode", "put"] * 6  # each image stored before the next is decoded
    assert not list((tmp_path / "h").glob(".*.tmp"))  # nothing beside the output
    np.testing.assert_array_equal(np.load(tmp_path / "h" / "d" / "images.npy")[0], hz.decode_one(
        (str(tmp_path / "raw" / "s" / "x" / "0.png"), "rgb", 8, "stretch", "", (0.0, 100.0))))

    # slots kept in place: a quarantined image's slot is closed up, the file shrunk to what is kept (no second copy)
    (tmp_path / "h2").mkdir()
    spool = hz.ImageSpool(tmp_path / "h2", 4, "d")
    for i, v in enumerate((10, 11, 12, 13)):
        if i != 1:  # slot 1: the image that failed to decode
            spool.put(i, np.full((3, 5, 1), v, np.uint8), f"s/{i}.png")
    with pytest.raises(HarmonizeError, match=r"d: image of s/x.png is \(3, 5, 3\), the first \(s/0.png\) is \(3, 5, 1\)"):
        spool.put(1, np.zeros((3, 5, 3), np.uint8), "s/x.png")
    spool.finish(np.array([0, 2, 3]))
    kept = np.load(tmp_path / "h2" / "images.npy")
    assert kept.shape == (3, 3, 5, 1) and [int(a[0, 0, 0]) for a in kept] == [10, 12, 13]
    assert (tmp_path / "h2" / "images.npy").stat().st_size == np.load(tmp_path / "h2" / "images.npy", mmap_mode="r").offset + 3 * 15
    with pytest.raises(HarmonizeError, match=r"d: no image survived"):
        hz.ImageSpool(tmp_path / "h3", 2, "d").finish(np.array([], dtype=np.int64))


def test_byte_identical_copies_in_a_sites_export_are_kept_once(tmp_path):
    """A site's folder with a symbolic link to one of its own folders (fetch copies what it points to: every image
    twice) and one image filed under two classes: each image is kept once, the copies excluded with one reason, and
    harmonize warns how many copies there were, how many sat in another group and how many had another class."""
    from fedsilo.config import BenchmarkDatasetParams, SourceParams

    rng = np.random.default_rng(1)
    site = tmp_path / "site"
    for cls in ("benign", "malignant"):
        for k in range(3):
            (site / cls / "2024").mkdir(parents=True, exist_ok=True)
            assert cv2.imwrite(str(site / cls / "2024" / f"{cls}{k}.png"), rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    (site / "benign" / "latest").symlink_to(site / "benign" / "2024")  # the export's "latest" view of a folder
    (site / "malignant" / "2024" / "relabelled.png").write_bytes((site / "benign" / "2024" / "benign0.png").read_bytes())
    fetch("site", SourceParams(mode="local", reader="image_folder", path=str(site)), tmp_path / "raw" / "site", quiet=True)
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("site",), image_size=8, workers=1, max_quarantine_fraction=0.5)
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    recs = pd.read_parquet(tmp_path / "h" / "d" / "records.parquet")
    assert sorted(recs["source_path"]) == [f"{c}/2024/{c}{k}.png" for c in ("benign", "malignant") for k in range(3)]
    assert card["domains"]["site"]["excluded_by_reason"] == {
        "a byte-identical copy of another of the source's files (kept once)": 4}
    assert [w for w in card["warnings"] if "byte-identical" in w] == [
        "site: 4 files are byte-identical copies of another of its files (e.g. benign/latest/benign0.png = "
        "benign/2024/benign0.png); each image is kept once; 4 of the copies were in another group than the file kept (the "
        "same image would have been on both sides of a split); 1 had another class than the file kept: check the labels"]
    # read in place, without fetch's manifest: the files of one size are hashed here, to the same result
    (tmp_path / "raw" / "site" / "fedsilo_manifest.json").unlink()
    again = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h2" / "d", quiet=True)
    assert again["domains"]["site"]["excluded_by_reason"] == card["domains"]["site"]["excluded_by_reason"]
