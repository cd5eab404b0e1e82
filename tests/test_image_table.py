"""Your own images with a label table of their classes (``reader: image_table``): a pathology archive's patch list
joins Kather's centres as a domain of its own, an ISIC-style one-hot ground truth forms a dataset of its own; the
table's mistakes are refused by row and key."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from fedsilo.config import ConfigError, parse_params
from fedsilo.data.fetch import fetch
from fedsilo.data.harmonize import HarmonizeError, decode_one, harmonize_benchmark
from fedsilo.data.sources.base import LabelFileError
from fedsilo.data.sources.kather_crc import CLASSES as KATHER
from fedsilo.data.splits import check_patient_disjoint, make_split


def _joined(tables: dict | None = None, **own) -> dict:
    return {
        "sources": {"kather_crc": {"mode": "mirror", "mirror": {"per_class": 3, "image_px": 32}},
                    "archive": {"mode": "mirror", "reader": "image_table", "mirror": {"per_class": 4, "image_px": 32}, **own}},
        "datasets": {"crc": {"kind": "kather_crc", "sources": ["kather_crc", "archive"], "image_size": 16, "workers": 1,
                             "tables": tables if tables is not None else {"archive": {"domain": "Archive", "patient": "patient"}}}},
        "experiments": {"quick": {"dataset": "crc", "split": {"protocol": "domain_clients", "n_train": 10, "n_test": 6}}},
        "methods": {"fedavg": {}},
        "pipeline": {"sources": ["kather_crc", "archive"], "datasets": ["crc"], "splits": {"quick": "crc"},
                     "experiments": ["quick"], "methods": ["fedavg"], "seeds": [0]},
        "tracking": {"enabled": False},
    }


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    p = parse_params(_joined())
    out = tmp_path_factory.mktemp("table") / "raw"
    for s in ("kather_crc", "archive"):
        fetch(s, p.sources[s], out / s)
    return out


def test_an_archives_patch_list_joins_kather_as_a_domain_of_its_own_and_patients_stay_whole(raw, tmp_path):
    p = parse_params(_joined())
    card = harmonize_benchmark(p.datasets["crc"], raw, tmp_path / "h", quiet=True)
    mine = card["domains"]["Archive"]
    assert card["classes"] == list(KATHER) and mine["excluded_by_reason"] == {"no label": 1}
    assert mine["quarantined"] == 1 and mine["images"] == 4 * len(KATHER)  # the listed patch never exported: quarantined
    table = pd.read_csv(raw / "archive" / "labels.csv", dtype=str, keep_default_na=False)
    recs, images = pd.read_parquet(tmp_path / "h" / "records.parquet"), np.load(tmp_path / "h" / "images.npy")
    own = recs[recs["domain"] == "Archive"].set_index("source_path")
    written = table.set_index("path").loc[own.index]
    assert (own["label"] == [KATHER.index(v.strip().upper()) for v in written["label"]]).all()  # " TUM", "tum": TUM
    assert (own["group"] == "Archive/" + written["patient"]).all() and own["group"].nunique() == 3
    for rel in own.index[:5]:
        np.testing.assert_array_equal(images[recs.index[recs["source_path"] == rel][0]],
                                      decode_one((str(raw / "archive" / rel), "rgb", 16, "stretch", "", (0.0, 100.0))))
    split = make_split(recs, p.experiments["quick"].split.model_copy(update={"domains": ("Archive",), "n_train": 10, "n_test": 6}), 0)
    check_patient_disjoint(recs, split)
    assert card["rules"]["own_sources"]["archive"]["reader"] == "image_table" and "warnings" not in card


def _isic(root: Path, rows: list[tuple[str, str]]) -> None:
    """An ISIC-2019-like release: images by id and a one-hot ground truth (1.0 / 0.0)."""
    cols = ["MEL", "NV", "BCC", "UNK"]
    lines = ["image," + ",".join(cols)]
    for i, (image, hot) in enumerate(rows):
        path = root / "ISIC_2019_Training_Input" / f"{image}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        assert cv2.imwrite(str(path), np.random.default_rng(i).integers(0, 256, (30, 40, 3), dtype=np.uint8))
        lines.append(image + "," + ",".join(("1.0" if c in hot.split("+") else "0.0") if hot != "?" else "0.5" for c in cols))
    (root / "ISIC_2019_Training_GroundTruth.csv").write_text("\n".join(lines) + "\n")


def _isic_params(root: Path, **rules) -> dict:
    return {
        "sources": {"isic": {"mode": "local", "reader": "image_table", "path": str(root)}},
        "datasets": {"derm": {"kind": "image_folder", "sources": ["isic"], "classes": ["NV", "MEL", "BCC"], "image_size": 16,
                              "workers": 1, "tables": {"isic": {"file": "ISIC_2019_Training_GroundTruth.csv", "path": "image",
                                                                "path_format": "ISIC_2019_Training_Input/{}.jpg", "label": None,
                                                                "label_columns": ["MEL", "NV", "BCC", "UNK"], "skip": ["UNK"],
                                                                "domain": "ISIC", **rules}}}},
        "experiments": {}, "methods": {},
        "pipeline": {"sources": ["isic"], "datasets": ["derm"], "splits": {}, "experiments": [], "methods": [], "seeds": [0]},
        "tracking": {"enabled": False},
    }


def test_a_one_hot_ground_truth_of_image_ids_forms_a_dataset_of_its_own(tmp_path):
    rows = [(f"ISIC_{i:07d}", ["MEL", "NV", "BCC"][i % 3]) for i in range(9)] + [
        ("ISIC_0000009", "UNK"), ("ISIC_0000010", ""), ("ISIC_0000011", "MEL+NV")]
    _isic(tmp_path / "isic", rows)
    p = parse_params(_isic_params(tmp_path / "isic"))
    fetch("isic", p.sources["isic"], tmp_path / "raw" / "isic")
    card = harmonize_benchmark(p.datasets["derm"], tmp_path / "raw", tmp_path / "h" / "derm", quiet=True)
    assert card["classes"] == ["NV", "MEL", "BCC"]  # the params' order, not the table's columns'
    assert card["domains"]["ISIC"]["by_class"] == {"NV": 3, "MEL": 3, "BCC": 3}
    assert card["domains"]["ISIC"]["excluded_by_reason"] == {
        "label column skipped (datasets.derm.tables.isic.skip)": 1, "no label": 1, "several labels (MEL, NV)": 1}
    assert "no patient column" in card["warnings"][0]
    recs = pd.read_parquet(tmp_path / "h" / "derm" / "records.parquet")
    assert (recs["label"] == [["NV", "MEL", "BCC"].index(["MEL", "NV", "BCC"][i % 3]) for i in range(9)]).all()
    # a soft label is no one-hot cell: refused by row and column
    _isic(tmp_path / "soft", rows[:3] + [("ISIC_0000099", "?")])
    with pytest.raises(LabelFileError, match=r"row 5: MEL '0.5' is not 1, 0 or blank"):
        _harmonize_at(tmp_path / "soft", "isic", _isic_params(tmp_path / "soft"), tmp_path / "h2")


def _harmonize_at(folder: Path, source: str, raw_params: dict, out: Path):
    """Harmonize with the source's raw folder being ``folder`` itself (no copy)."""
    link = out.parent / f"raw_{out.name}"
    link.mkdir(parents=True)
    (link / source).symlink_to(folder)
    (name, ds), = parse_params(raw_params).datasets.items()
    return harmonize_benchmark(ds, link, out / name, quiet=True)  # the dataset's own folder name: its key in messages


def _table(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, line in enumerate(text.strip().splitlines()[1:]):
        rel = line.split(",")[0].strip()
        if rel.endswith((".png", ".jpg")) and not rel.startswith(("/", "..")) and "gone" not in rel:
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if not any(q.name.casefold() == path.name.casefold() for q in path.parent.iterdir()):  # as typed, once
                assert cv2.imwrite(str(path), np.full((8, 8, 3), 40 + i, np.uint8) + np.eye(8, dtype=np.uint8)[:, :, None] * 90)
    (root / "labels.csv").write_text(text.strip() + "\n")
    return root


@pytest.mark.parametrize("text, rules, message", [
    ("path,label\na.png,tum\nb.png,Tumour\n", {}, r"labels\.csv: row 3: label 'Tumour' is not a class of this dataset .*map it with "
     r"datasets\.crc\.tables\.archive\.classes: \{Tumour: <class>\} or leave it out with datasets\.crc\.tables\.archive\.skip: \[Tumour\]"),
    ("path,label\na.png,tum\n", {"classes": {"tum": "TUMOR"}}, r"classes maps it to 'TUMOR', which is not among them"),
    ("path,label\na.png,tum\n,\nb.png,Tumour\n", {}, r"row 4: label 'Tumour'"),  # an empty row keeps the rows' numbers
    ("file,label\na.png,tum\n", {}, r"missing column\(s\) 'path' \(datasets\.crc\.tables\.archive\.path\)"),
    ("path;label\na.png;tum\n", {}, r"the header holds ';': set datasets\.crc\.tables\.archive\.sep to it"),
    ("path,label\n/data/a.png,tum\n", {}, r"row 2: '/data/a.png' is an absolute path"),
    ("path,label\na.png,tum\nA.PNG,adi\n", {}, r"row 3: A.PNG reads the file a.png, listed already \(first on row 2\)"),
    ("path,label,part\na.png,tum,holdout\n", {"subset": "part"}, r"row 2: part 'holdout' is not one of train, val, test"),
    ("path,label,pid,part\na.png,tum,p1,test\nb.png,adi,p1,train\n", {"subset": "part", "patient": "pid"},
     r"row 3: patient 'p1' is outside test here and test on row 2"),
    # several rows' mistakes: refused together, each named
    ("path,label,part\n/data/a.png,tum,train\nb.png,adi,holdout\n", {"subset": "part"},
     r"^2 rows of the label table are refused; correct them all, then harmonize again:\n  .*row 2: '/data/a\.png' is an "
     r"absolute path.*\n  .*row 3: part 'holdout' is not one of train, val, test"),
])
def test_the_tables_mistakes_are_refused_by_row_and_key(tmp_path, text, rules, message):
    raw = _joined({"archive": rules})
    raw["sources"]["archive"] = {"mode": "local", "reader": "image_table", "path": "/x"}
    with pytest.raises(LabelFileError, match=message):
        _harmonize_at(_table(tmp_path / "archive", text), "archive",
                      {**raw, "datasets": {"crc": {**raw["datasets"]["crc"], "sources": ["archive"]}}}, tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_a_patch_the_folder_lacks_is_quarantined_and_too_many_fail_the_domain(tmp_path):
    raw = _joined({"archive": {}})
    raw["sources"]["archive"] = {"mode": "local", "reader": "image_table", "path": "/x"}
    raw = {**raw, "datasets": {"crc": {**raw["datasets"]["crc"], "sources": ["archive"]}}}
    text = "path,label\n" + "".join(f"p{i}.png,{KATHER[i % 9]}\n" for i in range(18)) + "gone.png,TUM\n"
    with pytest.raises(HarmonizeError, match=r"archive: 1 of 19 images could not be decoded .*image file missing for archive/gone.png"):
        _harmonize_at(_table(tmp_path / "a", text), "archive", raw, tmp_path / "h")
    raw["datasets"]["crc"]["max_quarantine_fraction"] = 0.1
    card = _harmonize_at(tmp_path / "a", "archive", raw, tmp_path / "h2")
    assert card["domains"]["archive"]["quarantined"] == 1 and card["domains"]["archive"]["images"] == 18


@pytest.mark.parametrize("change, message", [
    ({"datasets": {"crc": {"tables": {}}}}, r"datasets\.crc\.tables\.archive: missing; a source with reader: image_table needs"),
    ({"datasets": {"crc": {"tables": {"archive": {"label": "dx", "label_columns": ["a", "b"]}}}}}, r"label and label_columns: .*set label: null"),
    ({"datasets": {"crc": {"tables": {"archive": {"label": None}}}}}, r"label: null needs label_columns"),
    ({"datasets": {"crc": {"tables": {"archive": {"path_format": "images/x.jpg"}}}}}, r"path_format: 'images/x.jpg' needs exactly one"),
    ({"datasets": {"crc": {"tables": {"archive": {"skip": [1], "classes": {"1.0": "TUM"}}}}}}, r"skip and classes both name 1"),
    ({"datasets": {"crc": {"folders": {"archive": {}}}}}, r"folders\.archive and tables\.archive: .*not both"),
    ({"sources": {"archive": {"reader": "image_folder"}}}, r"tables\.archive: archive has reader: image_folder .*reader: image_table"),
    ({"datasets": {"crc": {"tables": {"archive": {"domain": "CRC-VAL-HE-7K"}}}}}, None),  # a public domain: caught at harmonize
])
def test_params_refuse_what_the_table_reader_cannot_read(change, message):
    raw = _joined()
    for section, entries in change.items():
        for k, v in entries.items():
            raw[section][k] = {**raw[section][k], **v}
    if message is None:
        assert parse_params(raw).datasets["crc"].domain_of("archive") == "CRC-VAL-HE-7K"
        return
    with pytest.raises(ConfigError, match=message):
        parse_params(raw)


def test_a_domain_a_public_source_forms_is_refused_at_harmonize(raw, tmp_path):
    p = parse_params(_joined({"archive": {"domain": "crc-val-he-7k"}}))
    with pytest.raises(HarmonizeError, match=r"archive: domain 'crc-val-he-7k' is also a domain of kather_crc"):
        harmonize_benchmark(p.datasets["crc"], raw, tmp_path / "h", quiet=True)


def _own_table(root: Path, text: str, **rules) -> dict:
    _table(root, text)
    return {"sources": {"t": {"mode": "local", "reader": "image_table", "path": str(root)}},
            "datasets": {"d": {"kind": "image_folder", "sources": ["t"], "image_size": 8, "workers": 1,
                               "max_quarantine_fraction": 0.5, "tables": {"t": rules}}},
            "experiments": {}, "methods": {},
            "pipeline": {"sources": ["t"], "datasets": ["d"], "splits": {}, "experiments": [], "methods": [], "seeds": [0]},
            "tracking": {"enabled": False}}


def test_what_real_tables_bring(tmp_path):
    """Labels written 1 and 1.0 by two exports, R's NA, a skipped row in a patient's test images, a spreadsheet's
    empty rows, a report listed among the images, HAM10000's two image folders, a one-hot column no row uses yet."""
    text = ("path,label,pid,part\na.png,1,p1,train\nb.png,1.0,p1,train\nc.png,0,p2,train\nd.png,NA,p2,train\n"
            "e.png,unsure,p1,test\n,,,\nf.xml,0,p3,train\n,,,\n")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f.xml").write_text("<report/>")
    card = _harmonize_at(tmp_path / "t", "t", _own_table(tmp_path / "t", text, patient="pid", subset="part", skip=["unsure"]), tmp_path / "h")
    assert card["classes"] == ["0", "1"] and card["domains"]["t"]["by_class"] == {"0": 1, "1": 2}
    assert card["domains"]["t"]["excluded_by_reason"] == {"no label": 1, "label skipped (datasets.d.tables.t.skip)": 1,
                                                          "not an image file (.xml)": 1}
    # a label no class of the params' list takes is refused even on a row excluded for another reason (a blank
    # patient here); without a list, every label the table writes is a class, its rows excluded or not
    raw = _own_table(tmp_path / "t2", "path,label,pid\na.png,x,p1\nb.png,WHATEVER,\nc.png,y,p2\n", patient="pid")
    assert _harmonize_at(tmp_path / "t2", "t", raw, tmp_path / "h2")["classes"] == ["WHATEVER", "x", "y"]
    raw["datasets"]["d"]["classes"] = ["x", "y"]
    with pytest.raises(LabelFileError, match=r"row 3: label 'WHATEVER' is not a class of this dataset"):
        _harmonize_at(tmp_path / "t2", "t", raw, tmp_path / "h2b")
    # HAM10000: ids in two image folders; the first format that names a file
    for part, ids in (("part_1", ("ISIC_1", "ISIC_2")), ("part_2", ("ISIC_3",))):
        (tmp_path / "ham" / f"HAM10000_images_{part}").mkdir(parents=True)
        for n in ids:
            assert cv2.imwrite(str(tmp_path / "ham" / f"HAM10000_images_{part}" / f"{n}.jpg"), np.full((8, 8, 3), 90 + int(n[-1]), np.uint8))
    raw = _own_table(tmp_path / "ham", "image_id,dx,lesion_id\nISIC_1,nv,L1\nISIC_2,mel,L2\nISIC_3,nv,L3\n", path="image_id",
                     label="dx", patient="lesion_id",
                     path_format=["HAM10000_images_part_1/{}.jpg", "HAM10000_images_part_2/{}.jpg"])
    card = _harmonize_at(tmp_path / "ham", "t", raw, tmp_path / "h3")
    assert card["domains"]["t"]["by_class"] == {"mel": 1, "nv": 2} and card["domains"]["t"]["quarantined"] == 0
    # one-hot columns declare the classes, also one no row holds 1 in yet; a yes / no column must be quoted
    raw = _own_table(tmp_path / "oh", "path,A,B,C\na.png,1,0,0\nb.png,0,1,0\n", label=None, label_columns=["A", "B", "C"])
    assert _harmonize_at(tmp_path / "oh", "t", raw, tmp_path / "h4")["classes"] == ["A", "B", "C"]
    raw["datasets"]["d"]["tables"]["t"]["skip"] = [True]
    with pytest.raises(ConfigError, match=r"datasets\.d\.tables\.t\.skip: .*quote the value"):
        parse_params(raw)


def test_an_empty_table_is_refused_by_name(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "labels.csv").write_bytes(b"\xef\xbb\xbf")
    raw = _own_table(tmp_path / "t", "path,label\n")
    (tmp_path / "t" / "labels.csv").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(LabelFileError, match=r"labels\.csv: cannot parse"):
        _harmonize_at(tmp_path / "t", "t", raw, tmp_path / "h")


def _colour_dicom(path: Path, rgb: np.ndarray, photometric: str = "RGB", frames: int = 1,
                  sop: str = "1.2.840.10008.5.1.4.1.1.77.1.4", patient: str | None = None) -> None:
    """An uncompressed colour DICOM (a dermatology photograph, an ultrasound cine of ``frames`` frames)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.pixels import convert_color_space
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    data = convert_color_space(rgb, "RGB", photometric) if photometric != "RGB" else rgb
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = sop  # default: VL photographic image
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    if patient is not None:
        ds.PatientID = patient
    ds.Rows, ds.Columns = rgb.shape[:2]
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, photometric, 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    if frames > 1:
        ds.NumberOfFrames = frames
        data = np.stack([data] + [255 - data] * (frames - 1))
    ds.PixelData = np.ascontiguousarray(data).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def test_a_sites_dicoms_grey_and_colour_read_as_rgb_beside_its_pngs(tmp_path):
    """DICOMs listed in a table or lying in class folders (with a suffix or none, as PACS exports write them): colour
    (RGB, YBR, a cine's first frame) as the pixels are, greyscale through the chest X-ray decoder's LUTs, replicated."""
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.dicom import dicom_to_rgb, dicom_to_uint8
    from fedsilo.data.harmonize import to_rgb_square

    rng = np.random.default_rng(0)
    photo = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    root = tmp_path / "raw" / "clinic"
    _colour_dicom(root / "lesion" / "IMG0001", photo)  # no suffix: told by its preamble
    _colour_dicom(root / "lesion" / "IMG0002.dcm", photo, "YBR_FULL")
    _colour_dicom(root / "normal" / "cine.dcm", photo[::-1], frames=3)
    assert cv2.imwrite(str(root / "normal" / "a.png"), photo[:, ::-1, ::-1])
    np.testing.assert_array_equal(dicom_to_rgb(root / "lesion" / "IMG0001"), photo)
    np.testing.assert_allclose(dicom_to_rgb(root / "lesion" / "IMG0002.dcm").astype(int), photo.astype(int), atol=2)  # YBR round trip
    np.testing.assert_array_equal(dicom_to_rgb(root / "normal" / "cine.dcm"), photo[::-1])
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=16, workers=1)
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    assert card["domains"]["clinic"]["by_class"] == {"lesion": 2, "normal": 2} and card["domains"]["clinic"]["quarantined"] == 0
    recs, images = pd.read_parquet(tmp_path / "h" / "d" / "records.parquet"), np.load(tmp_path / "h" / "d" / "images.npy")
    row = recs.index[recs["source_path"] == "lesion/IMG0001"][0]
    np.testing.assert_array_equal(images[row], to_rgb_square(photo, 16, "stretch"))
    assert set(pd.read_parquet(tmp_path / "h" / "d" / "records.parquet")["source_path"]) >= {"lesion/IMG0001", "normal/a.png"}

    sample = Path(__file__).resolve().parents[2] / "shared" / "samples" / "cxr" / "dicom"
    grey = sorted(sample.glob("*.dcm"))
    if not grey:
        pytest.skip(f"{sample} absent (the real chest DICOMs)")
    table = tmp_path / "raw" / "grey"
    table.mkdir()
    lines = ["path,label"]
    for k, f in enumerate(grey):
        (table / f.name).symlink_to(f)
        lines.append(f"{f.name},{['lesion', 'normal'][k % 2]}")
    (table / "labels.csv").write_text("\n".join(lines) + "\n")
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("grey",), image_size=16, workers=1, tables={"grey": {}})
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h2" / "d", quiet=True)
    assert card["total_images"] == len(grey) and card["domains"]["grey"]["quarantined"] == 0
    recs, images = pd.read_parquet(tmp_path / "h2" / "d" / "records.parquet"), np.load(tmp_path / "h2" / "d" / "images.npy")
    import pydicom

    from fedsilo.data.dicom import has_voi

    for i, rel in zip(recs.index, recs["source_path"]):  # the radiograph decoder's pixels (no VOI: percentiles), as RGB
        voi = has_voi(pydicom.dcmread(table / rel, stop_before_pixels=True))
        grey = dicom_to_uint8(table / rel, "bit_depth" if voi else "percentile")[0]
        np.testing.assert_array_equal(images[i], to_rgb_square(grey, 16, "stretch"))


def test_a_study_level_table_labels_every_image_of_the_studys_folder(tmp_path):
    root = tmp_path / "pacs_export"
    for s, (study, n) in enumerate((("S001", 3), ("S002", 2), ("S003", 2))):
        (root / "studies" / study).mkdir(parents=True)
        for k in range(n):
            assert cv2.imwrite(str(root / "studies" / study / f"{k}.png"), np.full((8, 8, 3), 30 * k + 5 + s, np.uint8))
    _colour_dicom(root / "studies" / "S002" / "IM3", np.random.default_rng(3).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    (root / "labels.csv").write_text("study,finding\nstudies/S001,benign\nstudies/S002,malignant\nstudies/S003,benign\n")
    raw = _own_table(root, (root / "labels.csv").read_text(), path="study", label="finding")
    card = _harmonize_at(root, "t", raw, tmp_path / "h")
    assert card["domains"]["t"]["by_class"] == {"benign": 5, "malignant": 3}
    recs = pd.read_parquet(tmp_path / "h" / "d" / "records.parquet")
    assert (recs["group"] == "t/" + recs["source_path"].str.rsplit("/", n=1).str[0]).all()  # a study is its images' group
    assert recs["group"].nunique() == 3 and "studies/S002/IM3" in set(recs["source_path"])
    (root / "labels.csv").write_text("study,finding\nstudies/S001,benign\nstudies/S001/1.png,malignant\n")
    with pytest.raises(LabelFileError, match=r"row 3: studies/S001/1.png is listed again \(first on row 2\)"):
        _harmonize_at(root, "t", raw, tmp_path / "h2")


def _pixelless_dicom(path: Path, sop: str = "1.2.840.10008.5.1.4.1.1.88.22") -> None:
    """A DICOM with no pixels (default: an Enhanced SR, a structured report) as PACS exports carry beside images."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = sop
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.Modality = "SR"
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def test_dicoms_that_are_no_picture_are_left_out_not_quarantined(tmp_path):
    """A structured report in a class folder and a DICOMDIR above them (a PACS CD's), a whole-slide image, a constant
    photograph; and a listed report in a patient's test rows keeps the table's partition check quiet."""
    from fedsilo.config import BenchmarkDatasetParams

    rng = np.random.default_rng(1)
    root = tmp_path / "raw" / "clinic"
    for cls in ("a", "b"):
        for k in range(3):
            _colour_dicom(root / cls / f"IM{k}", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8))
    _pixelless_dicom(root / "a" / "SR0001")
    _pixelless_dicom(root / "DICOMDIR", "1.2.840.10008.1.3.10")  # Media Storage Directory: above the class level
    _colour_dicom(root / "b" / "WSI0001", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), sop="1.2.840.10008.5.1.4.1.1.77.1.6")
    _colour_dicom(root / "b" / "FLAT", np.full((12, 12, 3), 7, np.uint8))
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=8, workers=1, max_quarantine_fraction=0.5)
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    dom = card["domains"]["clinic"]
    assert dom["by_class"] == {"a": 3, "b": 3} and dom["quarantined"] == 1  # the constant photograph
    assert dom["excluded_by_reason"] == {"not an image: a DICOM without pixels (Enhanced SR Storage)": 1,
                                         "a whole-slide image (set datasets.d.folders.clinic.slides to cut it into patches)": 1}

    text = "path,label,pid,part\n0.png,a,p1,train\n1.png,b,p1,train\nreport.pdf,a,p1,test\n"
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "report.pdf").write_bytes(b"%PDF-1.4")
    card = _harmonize_at(tmp_path / "t", "t", _own_table(tmp_path / "t", text, patient="pid", subset="part"), tmp_path / "h2")
    assert card["domains"]["t"]["excluded_by_reason"] == {"not an image file (.pdf)": 1}


def test_deep_colour_and_palette_dicoms_scale_to_8_bits_and_a_blank_window_is_refused(tmp_path):
    """12-bit RGB scaled over its stored bits (not 16); a PALETTE COLOR file through its lookup table (16-bit entries
    scaled to 8); a greyscale file whose every pixel lies below its VOI window is a constant image."""
    from pydicom import dcmread

    from fedsilo.data.dicom import dicom_to_rgb
    from fedsilo.data.imageops import ImageDecodeError
    from tests.test_data import _radiograph

    deep = np.random.default_rng(0).integers(0, 4096, (8, 8, 3)).astype(np.uint16)
    _colour_dicom(tmp_path / "deep.dcm", np.zeros((8, 8, 3), np.uint8))
    ds = dcmread(tmp_path / "deep.dcm")
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelData = 16, 12, 11, deep.astype("<u2").tobytes()
    ds.save_as(tmp_path / "deep.dcm", enforce_file_format=True)
    np.testing.assert_array_equal(dicom_to_rgb(tmp_path / "deep.dcm"), np.round(deep * 255.0 / 4095).astype(np.uint8))

    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.BitsAllocated, ds.BitsStored, ds.HighBit = 1, "PALETTE COLOR", 8, 8, 7
    del ds.PlanarConfiguration
    ds.PixelData = np.tile(np.arange(8, dtype=np.uint8), (8, 1)).tobytes()  # indices 0 ... 7: red rising, blue falling
    ramp = np.zeros(256, "<u2")
    ramp[:8] = np.arange(8) * 9362
    for colour, lut in (("Red", ramp), ("Green", np.zeros(256, "<u2")), ("Blue", np.where(ramp > 0, 65535 - ramp, 0))):
        ds.add_new(f"{colour}PaletteColorLookupTableDescriptor", "US", [256, 0, 16])
        setattr(ds, f"{colour}PaletteColorLookupTableData", lut.astype("<u2").tobytes())
    ds.save_as(tmp_path / "palette.dcm", enforce_file_format=True)
    row = dicom_to_rgb(tmp_path / "palette.dcm")[0]
    assert row[:, 0].tolist() == [0, 36, 73, 109, 146, 182, 219, 255] and not row[:, 1].any()
    assert row[:, 2].tolist() == [0, 219, 182, 146, 109, 73, 36, 0]

    _radiograph(tmp_path / "blank.dcm", np.tile(np.arange(8) * 10, (8, 1)), window=(3000, 100))
    with pytest.raises(ImageDecodeError, match=r"blank\.dcm: constant image"):
        dicom_to_rgb(tmp_path / "blank.dcm")


def test_a_patient_level_table_labels_a_pacs_exports_dicoms_by_their_patient_id(tmp_path):
    """dicom_patient: one row per patient, its DICOMs (suffix-less, UID-named, any depth) found by their header's
    PatientID; each takes the row's class and the patient as its group; unlisted, ID-less and non-DICOM files and a
    patient without images are excluded with their reasons; a patient twice and IDs that match nothing are errors."""
    from fedsilo.config import BenchmarkDatasetParams

    rng = np.random.default_rng(3)
    root = tmp_path / "raw" / "clinic"
    ids = {"00017": 3, "00023": 2, "00031": 1, "00099": 1}  # patient -> images; 00099 is in no row
    for pid, n in ids.items():
        for k in range(n):
            _colour_dicom(root / "export" / f"1.2.840.{pid}" / f"{k}.77", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8),
                          patient=pid)
    _colour_dicom(root / "export" / "anon", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), patient="")
    import pydicom

    _pixelless_dicom(root / "export" / "1.2.840.00031" / "SR1")  # a report among a listed patient's images
    report = pydicom.dcmread(root / "export" / "1.2.840.00031" / "SR1")
    report.PatientID = "00031"
    report.save_as(root / "export" / "1.2.840.00031" / "SR1")
    (root / "export" / "README.txt").write_text("exported by the PACS")
    (root / "outcomes.csv").write_text("mrn,diagnosis,split\n00017,benign,\n00023,malignant,test\n00031,benign,\n00045,malignant,\n"
                                       "NA,benign,\n")
    rules = {"file": "outcomes.csv", "label": "diagnosis", "patient": "mrn", "subset": "split", "dicom_patient": "export"}
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=8, workers=1, max_quarantine_fraction=0.5,
                                tables={"clinic": rules})
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    recs = pd.read_parquet(tmp_path / "h" / "d" / "records.parquet")
    dom = card["domains"]["clinic"]
    assert dom["by_class"] == {"benign": 4, "malignant": 2}
    assert dom["excluded_by_reason"] == {"its PatientID is in no row of the table": 1, "no PatientID in its DICOM header": 1,
                                         "not a DICOM (datasets.d.tables.clinic.dicom_patient matches DICOMs by their PatientID)": 1,
                                         "no DICOM with this PatientID under export": 1, "no patient id": 1,
                                         "not an image: a DICOM without pixels (Enhanced SR Storage)": 1}
    assert recs.groupby("group").size().to_dict() == {"clinic/00017": 3, "clinic/00023": 2, "clinic/00031": 1}
    assert set(recs.loc[recs["group"] == "clinic/00023", "subset"]) == {"test"}
    assert set(recs.loc[recs["group"] == "clinic/00017", "original_label"]) == {"benign"}

    # a patient on two rows is an error naming both; a spreadsheet that dropped the zeros matches nothing: both sides shown
    (root / "outcomes.csv").write_text("mrn,diagnosis,split\n00017,benign,\n00017,malignant,\n")
    with pytest.raises(ValueError, match=r"row 3: patient '00017' is listed again \(first on row 2\); with "
                                         r"datasets.d.tables.clinic.dicom_patient the table has one row per patient"):
        harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h2" / "d", quiet=True)
    (root / "outcomes.csv").write_text("mrn,diagnosis,split\n17,benign,\n23,malignant,\n")
    with pytest.raises(ValueError, match=r"no DICOM under export has a PatientID in the column mrn \(the table's: 17, 23, "
                                         r"\.\.\.; the headers': 00017, 00023, 00031, \.\.\.\); check leading zeros"):
        harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h3" / "d", quiet=True)
    (root / "outcomes.csv").write_text("mrn,diagnosis,split\n00017,benign,\n23,malignant,\n")  # only some zeros lost
    with pytest.raises(ValueError, match=r"1 of the column mrn's IDs differ from a DICOM header's PatientID only in leading "
                                         r"zeros \(table / header: 23 / 00023\)"):
        harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h4" / "d", quiet=True)
    # one PatientID from two issuers is two patients one row cannot tell apart
    _colour_dicom(root / "export" / "other" / "x", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), patient="00031")
    _colour_dicom(root / "export" / "other" / "y", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), patient="00031")

    for name, issuer in (("x", "HOSP-A"), ("y", "HOSP-B")):
        d = pydicom.dcmread(root / "export" / "other" / name)
        d.IssuerOfPatientID = issuer
        d.save_as(root / "export" / "other" / name)
    with pytest.raises(ValueError, match=r"PatientID '00031' comes from two issuers \('HOSP-A' in export/other/x, 'HOSP-B'"):
        harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h5" / "d", quiet=True)
    with pytest.raises(ValueError, match="dicom_patient: needs patient"):
        BenchmarkDatasetParams(kind="image_folder", sources=("clinic",),
                               tables={"clinic": {"dicom_patient": "export", "patient": None}})
    with pytest.raises(ValueError, match="dicom_patient: the images are found by their PatientID, not by a path column"):
        BenchmarkDatasetParams(kind="image_folder", sources=("clinic",),
                               tables={"clinic": {"dicom_patient": "export", "patient": "mrn", "path": "file"}})
    # an export without PatientIDs (anonymised, or the wrong folder) is refused, not read as patients without images
    (root / "anon").mkdir()
    (root / "anon" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"anon: no DICOM with a PatientID in its header \(1 files: not a DICOM"):
        harmonize_benchmark(BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), tables={"clinic": {
            **rules, "dicom_patient": "anon"}}), tmp_path / "raw", tmp_path / "h6" / "d", quiet=True)


def test_a_study_table_finds_its_images_by_study_uid_and_groups_them_by_the_headers_patient(tmp_path):
    """dicom_match by StudyInstanceUID on a table without a patient column: each image's group is its header's
    PatientID (two studies of one patient one group, no warning that patients are unknown); dicom_patient and
    dicom_match together, or dicom_match with a path format, are refused."""
    import pydicom

    from fedsilo.config import BenchmarkDatasetParams

    rng = np.random.default_rng(5)
    root = tmp_path / "raw" / "clinic"
    for k, (study, pid) in enumerate((("1.2.3.1", "A"), ("1.2.3.1", "A"), ("1.2.3.2", "A"), ("1.2.3.3", "B"))):
        f = root / "pacs" / f"f{k}"
        _colour_dicom(f, rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), patient=pid)
        ds = pydicom.dcmread(f)
        ds.StudyInstanceUID = study
        ds.save_as(f)
    (root / "studies.csv").write_text("study_uid,diagnosis\n1.2.3.1,benign\n1.2.3.2,malignant\n1.2.3.3,benign\n")
    rules = {"file": "studies.csv", "label": "diagnosis", "dicom_match": {"folder": "pacs", "column": "study_uid", "tag": "StudyInstanceUID"}}
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=8, workers=1, tables={"clinic": rules})
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "h" / "d", quiet=True)
    recs = pd.read_parquet(tmp_path / "h" / "d" / "records.parquet")
    assert recs.groupby("group").size().to_dict() == {"clinic/A": 3, "clinic/B": 1}
    assert recs.set_index("source_path")["original_label"].to_dict() == {"pacs/f0": "benign", "pacs/f1": "benign",
                                                                       "pacs/f2": "malignant", "pacs/f3": "benign"}
    assert "warnings" not in card  # the headers name the patients: no warning that they are unknown
    with pytest.raises(ValueError, match="dicom_patient and dicom_match: dicom_patient is dicom_match by PatientID"):
        BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), tables={"clinic": {**rules, "patient": "mrn", "dicom_patient": "x"}})
    with pytest.raises(ValueError, match="dicom_match: the images are found by their DICOM headers, not by a path column; drop path_format"):
        BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), tables={"clinic": {**rules, "path_format": "{}.dcm"}})


def test_a_header_match_warns_of_patients_its_headers_do_not_tell():
    """Without a patient column the headers' PatientIDs are the groups: images without one, or one ID naming most of
    many images (an anonymised export's placeholder), are warned of; distinct IDs are not."""
    from fedsilo.data.sources.tables import header_patients_warning

    assert header_patients_warning([f"P{k}" for k in range(30)], "K.dicom_match", "K.patient") is None
    assert header_patients_warning(["ANON"] * 3 + ["P1"], "K.dicom_match", "K.patient") is None  # too few to tell
    assert header_patients_warning(["ANON"] * 15 + [f"P{k}" for k in range(5)], "K.dicom_match", "K.patient") == (
        "one PatientID ('ANON') names 15 of the 20 images K.dicom_match matched: if it is an anonymised export's "
        "placeholder, they are one patient to every split; name the table's patient column (K.patient) if it has one")
    assert header_patients_warning(["", "P1", "P2"], "K.dicom_match", "K.patient").startswith(
        "1 of 3 images K.dicom_match matched have no PatientID in their header")
