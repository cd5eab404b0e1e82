"""Multi-frame DICOMs of a site's own (an ultrasound cine, a tomosynthesis series): ``frames`` of ``image_folder`` and
``image_table`` takes the first frame (default), every frame, or n evenly spaced ones, each an image of the file's
class and group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedsilo.config import BenchmarkDatasetParams, ConfigError, parse_params
from fedsilo.data.dicom import dicom_to_rgb, dicom_to_uint8, frame_indices
from fedsilo.data.harmonize import harmonize_benchmark, to_rgb_square
from fedsilo.data.imageops import ImageDecodeError
from tests.test_image_table import _colour_dicom


def _grey_cine(path: Path, frames: np.ndarray) -> None:
    """An uncompressed 8-bit MONOCHROME2 multi-frame DICOM (no VOI window: read over its percentiles)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.3.1"  # ultrasound multi-frame
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.NumberOfFrames, (ds.Rows, ds.Columns) = len(frames), frames.shape[1:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = np.ascontiguousarray(frames, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def test_frame_indices_take_the_first_every_or_n_evenly_spaced_frames():
    assert frame_indices(10, "first") == [0] and frame_indices(1, "all") == [0] and frame_indices(4, "all") == [0, 1, 2, 3]
    assert frame_indices(10, 4) == [0, 3, 6, 9] and frame_indices(3, 5) == [0, 1, 2] and frame_indices(10, 1) == [0]
    assert frame_indices(100, 3) == [0, 50, 99]  # the first, the middle and the last


def test_a_cines_frames_become_images_of_its_class_kept_together(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
    colour = np.stack([np.roll(base, 3 * k, axis=1) for k in range(5)])  # five distinct frames
    grey = rng.integers(0, 256, (4, 16, 16), dtype=np.uint8)
    root = tmp_path / "raw" / "clinic"
    _colour_dicom(root / "normal" / "cine.dcm", colour[0])  # a one-frame file: one image whatever ``frames`` says
    _grey_cine(root / "lesion" / "US0001", grey)  # no suffix: told by its preamble
    from pydicom import dcmread

    ds = dcmread(root / "normal" / "cine.dcm")  # the colour file rewritten with five distinct frames
    ds.NumberOfFrames, ds.PixelData = 5, colour.tobytes()
    ds.save_as(root / "normal" / "cine.dcm", enforce_file_format=True)
    for k in range(5):
        np.testing.assert_array_equal(dicom_to_rgb(root / "normal" / "cine.dcm", frame=k), colour[k])
    with pytest.raises(ImageDecodeError, match=r"cine\.dcm: has 5 frames, no frame 5"):
        dicom_to_rgb(root / "normal" / "cine.dcm", frame=5)
    from pydicom.pixels import convert_color_space

    ybr = tmp_path / "ybr.dcm"  # a YBR cine: each frame read alone from the file, converted to RGB
    ds.PhotometricInterpretation = "YBR_FULL"
    ds.PixelData = np.stack([convert_color_space(f, "RGB", "YBR_FULL") for f in colour]).tobytes()
    ds.save_as(ybr, enforce_file_format=True)
    for k in (0, 3):
        np.testing.assert_allclose(dicom_to_rgb(ybr, frame=k).astype(int), colour[k].astype(int), atol=2)

    def harmonized(frames, name):
        ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=16, workers=1,
                                    folders={"clinic": {"frames": frames, "group": None}})
        card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / name / "d", quiet=True)
        return card, pd.read_parquet(tmp_path / name / "d" / "records.parquet"), np.load(tmp_path / name / "d" / "images.npy")

    card, recs, images = harmonized("all", "all")
    assert card["domains"]["clinic"]["by_class"] == {"lesion": 4, "normal": 5} and card["domains"]["clinic"]["quarantined"] == 0
    ids = dict(zip(recs["id"], recs.index))
    for k in range(5):  # each frame decoded on its own, as the file's class, in the file's group
        np.testing.assert_array_equal(images[ids[f"clinic/normal/cine.dcm#frame{k}"]], to_rgb_square(colour[k], 16, "stretch"))
    for k in range(4):
        expected = dicom_to_uint8(root / "lesion" / "US0001", "percentile", frame=k)[0]
        np.testing.assert_array_equal(images[ids[f"clinic/lesion/US0001#frame{k}"]], to_rgb_square(expected, 16, "stretch"))
    assert recs.groupby("source_path")["group"].nunique().eq(1).all() and recs["group"].nunique() == 2
    assert not np.array_equal(images[ids["clinic/normal/cine.dcm#frame0"]], images[ids["clinic/normal/cine.dcm#frame1"]])

    card, recs, _ = harmonized(2, "two")  # the first and the last frame of each file
    assert sorted(recs["id"]) == ["clinic/lesion/US0001#frame0", "clinic/lesion/US0001#frame3",
                                  "clinic/normal/cine.dcm#frame0", "clinic/normal/cine.dcm#frame4"]
    card, recs, images = harmonized("first", "first")  # the default: one image per file, its first frame, ids as before
    assert sorted(recs["id"]) == ["clinic/lesion/US0001", "clinic/normal/cine.dcm"]
    np.testing.assert_array_equal(images[recs.index[recs["id"] == "clinic/normal/cine.dcm"][0]], to_rgb_square(colour[0], 16, "stretch"))

    # a table of the files' classes takes frames the same way
    (root / "labels.csv").write_text("path,label\nnormal/cine.dcm,normal\nlesion/US0001,lesion\n")
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("clinic",), image_size=16, workers=1, tables={"clinic": {"frames": 3}})
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / "table" / "d", quiet=True)
    assert card["domains"]["clinic"]["by_class"] == {"lesion": 3, "normal": 3}


def test_frames_is_refused_by_key_unless_first_all_or_a_positive_number():
    raw = {"sources": {"t": {"mode": "local", "reader": "image_folder", "path": "/nowhere"}},
           "datasets": {"d": {"kind": "image_folder", "sources": ["t"], "folders": {"t": {"frames": 0}}}},
           "experiments": {}, "methods": {},
           "pipeline": {"sources": ["t"], "datasets": ["d"], "splits": {}, "experiments": [], "methods": [], "seeds": [0]},
           "tracking": {"enabled": False}}
    with pytest.raises(ConfigError, match=r"datasets\.d\.folders\.t\.frames: .*0 is none of first, all or a number of frames"):
        parse_params(raw)
    raw["datasets"]["d"]["folders"]["t"]["frames"] = "every"
    with pytest.raises(ConfigError, match=r"datasets\.d\.folders\.t\.frames: .*'every' is none of first, all or a number"):
        parse_params(raw)
    raw["datasets"]["d"]["folders"]["t"]["frames"] = "All"  # spelt as the user likes
    assert parse_params(raw).datasets["d"].folders["t"].frames == "all"


def test_a_file_named_dcm_that_is_no_dicom_is_said_in_words_not_pydicoms_advice(tmp_path):
    """pydicom's "Use force=True to force reading" means nothing to a hospital: the quarantine reason says what the
    file is not, naming it once."""
    notes = tmp_path / "report.dcm"
    notes.write_text("clinical notes, not an image\n")
    with pytest.raises(ImageDecodeError) as err:
        dicom_to_uint8(notes)
    assert str(err.value) == (f"{notes}: cannot decode DICOM pixels: not a DICOM file: no 'DICM' marker after a 128-byte "
                              "preamble and no DICOM header at its start (another kind of file named .dcm, or one cut short)")
