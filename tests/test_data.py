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
    assert sorted(card["sources"]) == ["chexpert", "openi", "rsna", "vinbigdata"]
    assert {v["mode"] for v in card["sources"].values()} == {"mirror"}
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


# ---------------------------------------------------------------------------------------------------- label rules
def test_chexpert_uncertain_opacity_is_excluded_or_mapped_as_the_rule_says(tmp_path):
    from fedsilo.config import CheXpertRules
    from fedsilo.data.sources.chexpert import OBSERVATIONS, _label_table

    df = pd.DataFrame({"Path": ["train/patient00001/study1/view1_frontal.jpg"], "Frontal/Lateral": ["Frontal"],
                       **{c: [np.nan] for c in OBSERVATIONS}})
    df["Lung Opacity"] = -1.0
    got = {rule: _label_table(df, tmp_path / "train.csv", CheXpertRules(uncertain=rule)).iloc[0][["label", "excluded"]].tolist()
           for rule in ("exclude", "positive", "negative")}
    assert got == {"exclude": [-1, "uncertain Lung Opacity (-1)"], "positive": [1, ""], "negative": [0, ""]}


def test_rsna_patient_whose_class_rows_disagree_is_excluded_as_a_conflict(tmp_path):
    from fedsilo.config import RSNARules
    from fedsilo.data.sources import rsna

    (tmp_path / "stage_2_train_labels.csv").write_text("patientId,x,y,width,height,Target\np1,1,2,3,4,1\np1,5,6,7,8,1\np2,,,,,0\n")
    (tmp_path / "stage_2_detailed_class_info.csv").write_text("patientId,class\np1,Lung Opacity\np1,Normal\np2,Normal\n")
    df = rsna.read_records(tmp_path, RSNARules()).set_index("id")
    assert df.loc["p1", "excluded"] == "class/Target conflict" and df.loc["p1", "label"] == -1
    assert df.loc["p2", "excluded"] == "" and df.loc["p2", "label"] == 0


def test_vinbigdata_majority_is_more_than_half_and_a_negative_reports_no_finding_only(tmp_path):
    from fedsilo.config import VinBigDataRules
    from fedsilo.data.sources import vinbigdata

    (tmp_path / "train.csv").write_text(
        "image_id,class_name,class_id,rad_id,x_min,y_min,x_max,y_max\n"
        "half,Lung Opacity,7,R1,1,2,3,4\nhalf,No finding,14,R2,,,,\n"  # one of two: no majority
        "two,Lung Opacity,7,R1,1,2,3,4\ntwo,Lung Opacity,7,R2,1,2,3,4\ntwo,No finding,14,R3,,,,\n"  # two of three
        "mixed,No finding,14,R1,,,,\nmixed,No finding,14,R2,,,,\nmixed,Aortic enlargement,0,R2,1,2,3,4\n"  # R2 says both
        "clear,No finding,14,R1,,,,\nclear,No finding,14,R2,,,,\n")
    df = vinbigdata.read_records(tmp_path, VinBigDataRules()).set_index("id")
    assert df["label"].to_dict() == {"clear": 0, "half": -1, "mixed": -1, "two": 1}
    assert df.loc["half", "excluded"] == "Lung Opacity by a minority of radiologists"
    assert df.loc["mixed", "excluded"] == "other findings only"
    anyone = vinbigdata.read_records(tmp_path, VinBigDataRules(opacity_rule="any")).set_index("id")
    assert anyone.loc["half", "label"] == 1


def test_openi_lung_opacity_is_an_opacity_term_whose_site_is_the_lung_or_its_alveoli():
    from fedsilo.data.sources.openi import is_lung_opacity

    assert is_lung_opacity("Opacity/lung/base/left") and is_lung_opacity("Opacity/pulmonary alveoli/right")
    assert not is_lung_opacity("Opacity/heart") and not is_lung_opacity("Nodule/lung") and not is_lung_opacity("lung/Opacity")


# ---------------------------------------------------------------------------------------------------- pixel pipeline
def _radiograph(path, pixels: np.ndarray, photometric: str = "MONOCHROME2", window: tuple | None = None,
                slope: float | None = None) -> None:
    """An uncompressed 12-bit grey DICOM with the given stored pixels, optionally a rescale and a VOI window."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"  # digital X-ray
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    if slope is not None:
        ds.RescaleSlope, ds.RescaleIntercept = slope, 0
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    ds.PixelData = np.ascontiguousarray(pixels, dtype=np.uint16).tobytes()
    ds.save_as(path, enforce_file_format=True)


def test_dicom_rescale_window_and_monochrome1_follow_the_pixel_pipeline(tmp_path):
    """Stored 0, 512, 1024, 1536, 2047 rescaled x2 (0 ... 4094 of 0 ... 8190) and windowed at 2048 +- 1024: below the
    window black, the centre mid-grey, above it white; MONOCHROME1 the same inverted (bone always bright)."""
    from fedsilo.data.dicom import dicom_to_uint8

    pixels = np.tile(np.array([0, 512, 1024, 1536, 2047, 2047, 2047, 2047]), (8, 1))
    for photometric, want in (("MONOCHROME2", [0, 0, 128, 255, 255]), ("MONOCHROME1", [255, 255, 127, 0, 0])):
        _radiograph(tmp_path / f"{photometric}.dcm", pixels, photometric, window=(2048, 2048), slope=2.0)
        img, facts = dicom_to_uint8(tmp_path / f"{photometric}.dcm")
        assert facts["voi_applied"] and img[0, :5].tolist() == want, photometric
    _radiograph(tmp_path / "plain.dcm", pixels, slope=2.0)  # no window: the rescaled range, 0 ... 8190
    assert dicom_to_uint8(tmp_path / "plain.dcm")[0][0, :5].tolist() == [0, 32, 64, 96, 127]


def test_dicom_percentile_intensity_stretches_a_narrow_band_that_bit_depth_keeps_dark(tmp_path):
    from fedsilo.data.dicom import dicom_to_uint8

    _radiograph(tmp_path / "band.dcm", np.tile(np.linspace(1000, 1100, 8).round(), (8, 1)))
    deep, _ = dicom_to_uint8(tmp_path / "band.dcm", "bit_depth")
    wide, _ = dicom_to_uint8(tmp_path / "band.dcm", "percentile", (0.0, 100.0))
    assert deep.max() < 80 and (wide.min(), wide.max()) == (0, 255)


def test_dicom_negative_slope_and_lookup_tables_set_the_range_scaled_to_unit(tmp_path):
    """A negative Rescale Slope (stored 0 the brightest) scales over its ordered range; a Modality LUT Sequence maps
    over its own output depth (8 bits here, not the 12 stored); a VOI LUT Sequence is preferred to the window the
    same header gives, and scaled over the LUT's output depth (10 bits)."""
    from pydicom import dcmread
    from pydicom.dataset import Dataset

    from fedsilo.data.dicom import dicom_to_uint8

    pixels = np.tile(np.array([0, 512, 1024, 1536, 2047, 4095, 4095, 4095]), (8, 1))
    _radiograph(tmp_path / "negative.dcm", pixels, slope=-1.0)
    assert dicom_to_uint8(tmp_path / "negative.dcm")[0][0].tolist() == [255, 223, 191, 159, 128, 0, 0, 0]

    def with_lut(name: str, sequence: str, depth: int, data: np.ndarray, **rules) -> None:
        _radiograph(tmp_path / name, pixels, **rules)
        ds = dcmread(tmp_path / name)
        item = Dataset()
        item.LUTDescriptor, item.LUTData = [4096, 0, depth], data.astype("<u2").tobytes()
        if sequence == "ModalityLUTSequence":
            item.ModalityLUTType = "US"
        setattr(ds, sequence, [item])
        ds.save_as(tmp_path / name, enforce_file_format=True)

    with_lut("modality.dcm", "ModalityLUTSequence", 8, np.arange(4096) // 16)
    with_lut("voi.dcm", "VOILUTSequence", 10, np.arange(4096) // 4, window=(2048, 2048))
    for name in ("modality.dcm", "voi.dcm"):  # the window alone would give [0, 0, 128, 255, ...]
        assert dicom_to_uint8(tmp_path / name)[0][0].tolist() == [0, 32, 64, 96, 127, 255, 255, 255], name


def test_a_dicom_that_is_no_grey_radiograph_is_refused_by_reason(tmp_path):
    """A palette-colour file (its pixels are indices, not intensities) and a 4x4 icon are quarantined, not read as
    chest X-rays."""
    from fedsilo.data.dicom import dicom_to_uint8
    from fedsilo.data.imageops import ImageDecodeError

    _radiograph(tmp_path / "palette.dcm", np.tile(np.arange(8) * 500, (8, 1)), photometric="PALETTE COLOR")
    with pytest.raises(ImageDecodeError, match=r"palette\.dcm: photometric interpretation 'PALETTE COLOR' is not a grayscale"):
        dicom_to_uint8(tmp_path / "palette.dcm")
    _radiograph(tmp_path / "icon.dcm", np.array([[0, 100, 200, 300]] * 4))
    with pytest.raises(ImageDecodeError, match=r"icon\.dcm: unexpected pixel array shape \(4, 4\)"):
        dicom_to_uint8(tmp_path / "icon.dcm")


def test_a_dicom_is_told_by_its_suffix_in_any_case_or_by_its_preamble(tmp_path):
    """PACS CDs write IMG0001.DCM (a dataset with no preamble is still DICOM by its suffix); a suffixless export is
    DICOM by "DICM" at byte 128; a short or other file is not."""
    from fedsilo.data.dicom import is_dicom_file

    for name in ("IMG0001.DCM", "scan.Dicom", "scan.dcm"):
        (tmp_path / name).write_bytes(b"\x08\x00\x05\x00CS\x0a\x00ISO_IR 100")
        assert is_dicom_file(tmp_path / name), name
    (tmp_path / "IM0001").write_bytes(bytes(128) + b"DICM" + bytes(16))
    (tmp_path / "short").write_bytes(bytes(100) + b"DICM")
    (tmp_path / "photo.png").write_bytes(bytes(128) + b"PNG!" + bytes(16))
    assert is_dicom_file(tmp_path / "IM0001") and not is_dicom_file(tmp_path / "short")
    assert not is_dicom_file(tmp_path / "photo.png")


def test_a_16_bit_png_is_read_over_its_own_depth(tmp_path):
    from PIL import Image

    from fedsilo.data.harmonize import decode_one

    arr = np.tile(np.array([0, 0, 0, 32896, 32896, 65535, 65535, 65535], dtype=np.uint16), (8, 1))
    Image.fromarray(arr).save(tmp_path / "deep.png")
    img = decode_one((str(tmp_path / "deep.png"), "image", 8, "crop", "bit_depth", (0.5, 99.5)))
    assert img.shape == (8, 8, 1) and img[0, :, 0].tolist() == [0, 0, 0, 128, 128, 255, 255, 255]


def test_a_constant_image_is_quarantined_not_kept(tmp_path):
    from PIL import Image

    from fedsilo.data.harmonize import _decode_safe

    Image.fromarray(np.full((16, 16), 90, np.uint8)).save(tmp_path / "flat.png")
    img, err = _decode_safe((str(tmp_path / "flat.png"), "image", 8, "crop", "bit_depth", (0.5, 99.5)))
    assert img is None and err.endswith("flat.png: constant image")
    # under the percentile rule its range is empty: quarantined naming the file too (card.md's examples quote it)
    img, err = _decode_safe((str(tmp_path / "flat.png"), "image", 8, "crop", "percentile", (0.5, 99.5)))
    assert img is None and err == f"{tmp_path / 'flat.png'}: degenerate intensity range [90.0, 90.0] (a constant image, or a window of width 0)"


def test_percentiles_of_an_almost_flat_image_fall_back_to_its_range():
    """99 % of the pixels at one value put both percentiles there: the range falls back to min / max, so the few
    others stand out instead of the image being refused as degenerate."""
    from fedsilo.data.imageops import normalize_standard, percentile_range

    arr = np.full((20, 20), 100, np.uint8)
    arr[0, 0] = 200
    assert percentile_range(arr, 1.0, 99.0) == (100.0, 200.0)
    out = normalize_standard(arr, 8, "percentile", (1.0, 99.0), "almost_flat.png")
    assert out[0, 0] == 255 and out[5, 5] == 0


def test_square_crop_keeps_the_centre_and_pad_keeps_everything_on_black():
    from fedsilo.data.imageops import finish

    img = (np.arange(4 * 8).reshape(4, 8) + 1).astype(np.uint8)
    np.testing.assert_array_equal(finish(img, 4, "crop")[:, :, 0], img[:, 2:6])
    padded = finish(img, 8, "pad")[:, :, 0]
    np.testing.assert_array_equal(padded[2:6], img)
    assert not padded[:2].any() and not padded[6:].any()


def test_resize_averages_areas_when_shrinking_and_interpolates_when_growing():
    """A bright pixel in each 4x4 block shrinks to the block's mean (area), not to a sample of one pixel; a two-pixel
    edge grown to 8 ramps linearly instead of staying a hard step."""
    from fedsilo.data.imageops import finish

    dots = np.zeros((16, 16), np.uint8)
    dots[::4, ::4] = 255
    assert finish(dots, 4, "crop")[:, :, 0].tolist() == [[16] * 4] * 4
    edge = np.array([[0, 255], [0, 255]], np.uint8)
    assert finish(edge, 8, "crop")[0, :, 0].tolist() == [0, 0, 32, 96, 159, 223, 255, 255]


def test_percentile_intensity_clips_what_lies_beyond_the_percentiles_to_black_and_white(tmp_path):
    """Pixels below the lower percentile are black and above the upper white (not wrapped around uint8); a 16-bit PNG
    read as colour is its grey replicated, its depth kept."""
    from PIL import Image

    from fedsilo.data.imageops import normalize_standard, read_standard_image

    ramp = np.arange(100, dtype=np.uint8).reshape(10, 10)
    out = normalize_standard(ramp, 8, "percentile", (10.0, 90.0), "ramp.png")
    assert out[ramp < 10].tolist() == [0] * 10 and out[ramp > 89].tolist() == [255] * 10
    assert np.all(np.diff(out.ravel().astype(int)) >= 0)
    Image.fromarray(np.tile(np.array([0, 1000, 40000, 65535], np.uint16), (8, 2))).save(tmp_path / "deep.png")
    arr, depth = read_standard_image(tmp_path / "deep.png", grayscale=False)
    assert depth == 16 and arr.shape == (8, 8, 3) and arr[0, :4, 2].tolist() == [0, 1000, 40000, 65535]
    assert (arr == arr[:, :, :1]).all()


def test_stale_rules_name_an_edit_of_what_makes_the_arrays_and_nothing_else():
    """A site's card is refused for an edit of the settings that decide its arrays (image size, a rule of a source it
    reads), never for a current card: not for the decode processes, the quarantine threshold, the rules of a source
    it does not read, `sources` left at its default or spelled out, a setting fedsilo added or removed since."""
    import copy

    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.data.harmonize import harmonize_rules, stale_rules

    site = CXRDatasetParams(sources=("vinbigdata",), image_size=32)
    card = {"rules": harmonize_rules(site)}
    assert stale_rules(card, site) == []
    same = [site.model_copy(update={"workers": 8}), site.model_copy(update={"max_quarantine_fraction": 0.5}),
            site.model_copy(update={"chexpert": site.chexpert.model_copy(update={"uncertain": "one"})})]
    assert all(stale_rules(card, p) == [] for p in same)
    older = copy.deepcopy(card)
    del older["rules"]["vinbigdata"]["opacity_rule"]  # a nested setting added since the card was written
    older["rules"]["vinbigdata"]["retired_rule"] = "x"  # and one removed since
    older["rules"]["retired_top"] = 1
    assert stale_rules(older, site) == []
    assert stale_rules(card, site.model_copy(update={"image_size": 48})) == ["image_size: built with 32, now 48"]
    edited = site.model_copy(update={"vinbigdata": site.vinbigdata.model_copy(update={"opacity_rule": "any"})})
    assert stale_rules(card, edited) == ["vinbigdata.opacity_rule: built with 'majority', now 'any'"]
    # a benchmark's sources left at the default, or the same list written out
    pacs = BenchmarkDatasetParams(kind="pacs", image_size=16)
    listed = BenchmarkDatasetParams(kind="pacs", image_size=16, sources=pacs.source_list)
    assert stale_rules({"rules": harmonize_rules(pacs)}, listed) == stale_rules({"rules": harmonize_rules(listed)}, pacs) == []


def test_a_card_from_before_rules_were_recorded_is_never_stale_and_an_empty_setting_is_a_value():
    """stale_rules: a card written before harmonize recorded its ``rules`` (or with something else there) is not
    refused, whatever the params say now (its sources were not recorded either). _leaves: a nested empty dict is a
    value of its own, as a list is, so that a setting emptied or filled is compared, not dropped."""
    from fedsilo.data.harmonize import _leaves, stale_rules

    site = CXRDatasetParams(sources=("vinbigdata",), image_size=48)
    assert stale_rules({}, site) == stale_rules({"rules": None}, site) == stale_rules({"rules": ["image_size"]}, site) == []
    assert _leaves({"a": {}, "b": {"c": [1], "d": {"e": None}}}) == {"a": {}, "b.c": [1], "b.d.e": None}


def test_stale_rules_name_an_edit_of_a_table_of_ones_own_or_of_an_image_folders_classes():
    """The settings of a source of one's own decide the arrays too: a chest X-ray table's rules (its label values) and
    an image_folder dataset's class list, as the card records them (harmonize_rules), are compared."""
    from fedsilo.config import BenchmarkDatasetParams
    from fedsilo.config.data import CXRTableRules
    from fedsilo.data.harmonize import harmonize_rules, stale_rules

    mine = CXRDatasetParams(sources=("mine",), image_size=32, tables={"mine": CXRTableRules()})
    edited = mine.model_copy(update={"tables": {"mine": CXRTableRules(positive=("Opacity",))}})
    assert stale_rules({"rules": harmonize_rules(mine)}, edited) == ["tables.mine.positive: built with ['Lung Opacity'], now ['Opacity']"]
    derm = BenchmarkDatasetParams(kind="image_folder", sources=("derm",), image_size=16, classes=("benign", "malignant"))
    assert stale_rules({"rules": harmonize_rules(derm)}, derm.model_copy(update={"classes": ("malignant", "benign")})) == [
        "classes: built with ['benign', 'malignant'], now ['malignant', 'benign']"]
