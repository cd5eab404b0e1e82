"""Whole-slide images of a site's own cut into patches (``slides`` of ``image_folder`` / ``image_table``): the tissue
found, the grid at the resolution asked for, each patch an image of the slide's class and group; a slide without the
rules, without a resolution or without tissue excluded with the reason; a small TIFF still an image."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd
import pytest

pytest.importorskip("tiffslide")

import tifffile  # noqa: E402

from fedsilo.config import BenchmarkDatasetParams  # noqa: E402
from fedsilo.data import slides  # noqa: E402
from fedsilo.data.harmonize import harmonize_benchmark, to_rgb_square  # noqa: E402

SIDE, MPP0 = 2048, 0.25  # a 0.5 mm square scanned at 40x (0.25 um/px)


def _slide(path: Path, centre: tuple[int, int], radius: int, mpp: float | None = MPP0, seed: int = 0,
           hamamatsu: tuple[int, int] | None = None) -> np.ndarray:
    """A tiled, JPEG-compressed pyramidal TIFF (levels 1, 4, 16) of a stained disc of tissue on white glass; the
    resolution tags give ``mpp`` microns per pixel (None: no tags); ``hamamatsu``: the NDPI tags of a NanoZoomer scan
    (its format flag, its lens, and this offset of the scan's centre from the slide's centre in nanometres), which
    tiffslide reads as OpenSlide does. Returns level 0's pixels as written."""
    rng = np.random.default_rng(seed)
    img = np.full((SIDE, SIDE, 3), 238, np.uint8)
    yy, xx = np.mgrid[:SIDE, :SIDE]
    disc = (yy - centre[1]) ** 2 + (xx - centre[0]) ** 2 < radius**2
    img[disc] = (rng.integers(0, 50, (int(disc.sum()), 3)) + np.array([170, 70, 140])).astype(np.uint8)  # H&E pinks
    path.parent.mkdir(parents=True, exist_ok=True)
    res = (lambda d: {"resolution": (1e4 / (mpp * d), 1e4 / (mpp * d)), "resolutionunit": "CENTIMETER"}) if mpp else (lambda d: {})
    with tifffile.TiffWriter(path) as tif:
        opts = {"tile": (256, 256), "photometric": "rgb", "compression": "jpeg"}
        ndpi = [] if hamamatsu is None else [(271, "s", 0, "Hamamatsu", True), (65420, "I", 1, 1, True), (65421, "f", 1, 40.0, True),
                                             (65422, "i", 1, hamamatsu[0], True), (65423, "i", 1, hamamatsu[1], True)]
        tif.write(img, subifds=2, **opts, **res(1), extratags=ndpi)
        for d in (4, 16):
            tif.write(np.ascontiguousarray(img[::d, ::d]), subfiletype=1, **opts, **res(d))
    return img


def _dataset(tmp_path: Path, name: str, rules: dict, workers: int = 1, classes: tuple[str, ...] | None = None):
    ds = BenchmarkDatasetParams(kind="image_folder", sources=("lab",), image_size=16, workers=workers, max_quarantine_fraction=0.5,
                                folders={"lab": rules}, classes=classes)
    card = harmonize_benchmark(ds, tmp_path / "raw", tmp_path / name / "d", quiet=True)
    return card, pd.read_parquet(tmp_path / name / "d" / "records.parquet"), np.load(tmp_path / name / "d" / "images.npy")


def test_slides_are_cut_into_tissue_patches_of_their_class_and_group(tmp_path, monkeypatch):
    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)  # the test's slides are small files
    root = tmp_path / "raw" / "lab"
    _slide(root / "tumour" / "S1.tif", (900, 800), 500)
    _slide(root / "normal" / "S2.tif", (1300, 1200), 400, seed=1)
    _slide(root / "normal" / "S3_no_mpp.tif", (1000, 1000), 400, mpp=None)
    _slide(root / "normal" / "S4_blank.tif", (0, 0), 0)  # glass only
    _slide(root / "normal" / "S5_72dpi.tif", (1000, 1000), 400, mpp=1e4 / (72 / 2.54))  # a photo's 72 dpi: 352.8 um/px
    (root / "normal" / "S6_broken.svs").write_bytes(b"not a slide at all")
    tifffile.imwrite(root / "normal" / "S7_strip.tif", np.full((64, 20_001, 3), 200, np.uint8),  # no pyramid, 20,001 px wide
                     resolution=(1e4 / MPP0, 1e4 / MPP0), resolutionunit="CENTIMETER")
    patch = np.random.default_rng(2).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    assert cv2.imwrite(str(root / "normal" / "patch.png"), patch)
    tifffile.imwrite(root / "normal" / "small.tif", patch)  # a patch saved as TIFF: an image, not a slide

    # without slides rules, a slide is excluded naming the key (never decoded whole); the images are read
    card, recs, _ = _dataset(tmp_path, "none", {})
    assert sorted(recs["source_path"]) == ["normal/patch.png", "normal/small.tif"]
    assert card["domains"]["lab"]["excluded_by_reason"] == {
        "a whole-slide image (set datasets.d.folders.lab.slides to cut it into patches)": 7}

    # 0.5 um/px patches of 32 px: 64 level-0 pixels a side, read from level 0 (the pyramid's levels are coarser)
    rules = {"slides": {"mpp": 0.5, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000}}
    card, recs, images = _dataset(tmp_path, "all", rules)
    reasons = card["domains"]["lab"]["excluded_by_reason"]
    key = "datasets.d.folders.lab.slides"
    broken = next(r for r in reasons if r.startswith("a whole-slide image: unreadable (TiffFileError: "))
    assert reasons == {f"a whole-slide image: no plausible microns per pixel in its header (set {key}.slide_mpp)": 2,
                       f"a whole-slide image: no patch with 50% tissue or more ({key}.min_tissue)": 1, broken: 1,
                       "a whole-slide image: no reduced-resolution levels to find its tissue on (convert it to a pyramidal "
                       "TIFF, e.g. vips tiffsave <in> <out>.tif --tile --pyramid --compression jpeg)": 1}
    s1 = recs[recs["source_path"] == "tumour/S1.tif"]
    assert len(s1) > 100 and (s1["label"] == recs.loc[recs["source_path"] == "tumour/S1.tif", "label"].iloc[0]).all()
    assert s1["group"].nunique() == 1 and recs["group"].nunique() == 4  # S1, S2, patch.png, small.tif
    xy = s1["id"].str.extract(r"#x(\d+)y(\d+)$").astype(int).to_numpy()
    centres = xy + 32
    # every patch lies on the disc (half its area or more: its centre within the radius plus half a diagonal)
    assert (np.hypot(centres[:, 0] - 900, centres[:, 1] - 800) < 500 + 46).all()
    # and the grid cells wholly inside the disc are all taken
    inside = [(x, y) for x in range(0, SIDE - 63, 64) for y in range(0, SIDE - 63, 64)
              if all(np.hypot(x + dx - 900, y + dy - 800) < 500 for dx in (0, 64) for dy in (0, 64))]
    assert set(inside) <= {tuple(v) for v in xy}
    slide = slides._open(str(root / "tumour" / "S1.tif"))
    for row in s1.index[:: max(1, len(s1) // 5)]:  # each image is its region, read from the slide and resized
        x, y = (int(v) for v in recs.loc[row, "id"].rsplit("#x", 1)[1].split("y"))
        region = np.asarray(slide.read_region((x, y), 0, (64, 64), as_array=True))[..., :3]
        np.testing.assert_array_equal(images[row], to_rgb_square(region, 16, "stretch"))
    assert (recs.loc[recs["source_path"] == "normal/patch.png", "label"] == recs.loc[recs["source_path"] == "normal/S2.tif", "label"].iloc[0]).all()
    # decoded by two worker processes (forked after this process read the slides): the same pixels
    _, recs2, images2 = _dataset(tmp_path, "two_workers", rules, workers=2)
    assert recs2["id"].tolist() == recs["id"].tolist() and np.array_equal(images2, images)
    # patches finer than the scan are refused (they would be upsampled), naming the key
    card, _, _ = _dataset(tmp_path, "fine", {"slides": {"mpp": 0.1, "patch_px": 32}})
    assert card["domains"]["lab"]["excluded_by_reason"][f"a whole-slide image: a scan at 0.25 um/px, coarser than the patches' 0.1 um/px ({key}.mpp)"] == 4

    # at most max_patches per slide, evenly spaced in reading order (the first and the last tissue cell kept); a
    # resolution given for slides whose header has none; a coarser patch read from the pyramid level that fits
    few = {"slides": {"mpp": 2.0, "patch_px": 32, "max_patches": 7, "slide_mpp": MPP0}}
    card, recs, _ = _dataset(tmp_path, "few", few)
    counts = recs.groupby("source_path").size().to_dict()
    assert counts == {"normal/S2.tif": 7, "normal/S3_no_mpp.tif": 7, "normal/S5_72dpi.tif": 7, "tumour/S1.tif": 7,
                      "normal/patch.png": 1, "normal/small.tif": 1}
    plan, _, why = slides.plan_patches(root / "tumour" / "S1.tif", BenchmarkDatasetParams(
        kind="image_folder", sources=("lab",), folders={"lab": few}).folders["lab"].slides)
    assert why == "" and {p[2:] for p in plan} == {(1, 64, 64)}  # 256 level-0 px = 64 px of level 1 (4x down)
    everything, _, _ = slides.plan_patches(root / "tumour" / "S1.tif", BenchmarkDatasetParams(
        kind="image_folder", sources=("lab",), folders={"lab": {**few, "slides": {**few["slides"], "max_patches": 10_000}}}).folders["lab"].slides)
    assert plan[0] == everything[0] and plan[-1] == everything[-1] and len(everything) > 7


def test_a_small_tiff_is_an_image_and_a_large_one_a_slide(tmp_path, monkeypatch):
    tifffile.imwrite(tmp_path / "patch.tif", np.zeros((64, 64, 3), np.uint8))
    assert not slides.is_slide_file(tmp_path / "patch.tif") and slides.is_slide_file(tmp_path / "x.svs")
    _slide(tmp_path / "slide.tif", (900, 800), 500)
    tifffile.imwrite(tmp_path / "strip.tif", np.zeros((3, 8, 20_001), np.uint8), planarconfig="separate")  # planar RGB
    assert not slides.is_slide_file(tmp_path / "slide.tif")  # under SMALL_TIFF_BYTES: its header is not read
    # unless the rules cut slides: then a small biopsy's pyramidal TIFF is one, and a plain small TIFF still an image
    assert slides.is_slide_file(tmp_path / "slide.tif", small_too=True) and not slides.is_slide_file(tmp_path / "patch.tif", small_too=True)
    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)
    assert slides.is_slide_file(tmp_path / "slide.tif") and slides.is_slide_file(tmp_path / "strip.tif")
    assert not slides.is_slide_file(tmp_path / "patch.tif")  # tiled with levels, or over 20,000 px: neither
    assert slides.best_level([1.0, 4.0001, 16.0], 4.0) == 1 and slides.best_level([1.0, 4.0, 16.0], 3.9) == 0


def _square(x0: float, y0: float, x1: float, y1: float) -> list[list[float]]:
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]


def _share(x: int, y: int, box: tuple[float, float, float, float], side: int = 64) -> float:
    """The exact share of the patch at (x, y) an axis-aligned box covers."""
    w = max(0.0, min(x + side, box[2]) - max(x, box[0]))
    h = max(0.0, min(y + side, box[3]) - max(y, box[1]))
    return w * h / side**2


def test_region_annotations_label_each_patch(tmp_path):
    """QuPath GeoJSON and ASAP XML regions label the patches they cover by min_share (a region inside another, a hole,
    is what lies there); a patch outside takes the slide's class or is dropped; a slide without annotations keeps
    its class; an unknown annotation class stops harmonize naming the file and key; a bad or doubled file excludes
    its slide with the reason."""
    import json
    import shutil

    # no SMALL_TIFF_BYTES patch here: the rules cut slides, so these ~1 MB pyramidal TIFFs are slides by their header
    root = tmp_path / "raw" / "lab"
    _slide(root / "normal" / "S1.tif", (1024, 1024), 900)
    scan = (root / "normal" / "S1.tif").read_bytes()
    for k, name in enumerate(("normal/S2", "tumour/S3", "normal/S4", "normal/S5", "tumour/S1")):  # the same scan under other names
        (root / name).parent.mkdir(exist_ok=True)  # in distinct files (one byte past the TIFF's end): a copy is kept once
        (tmp_path / f"{name.replace('/', '_')}.tif").write_bytes(scan + bytes([k]))
    for name in ("normal/S2", "tumour/S3"):
        shutil.move(tmp_path / f"{name.replace('/', '_')}.tif", root / f"{name}.tif")
    tumour, hole, ignore = (500, 450, 1500, 1550), (760, 760, 1290, 1290), (1280, 1408, 1408, 1536)
    (root / "ann").mkdir()
    (root / "ann" / "S1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [_square(*tumour), _square(*hole)]},
         "properties": {"objectType": "annotation", "classification": {"name": "Tumor", "color": [200, 0, 0]}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [_square(*ignore)]},  # skipped: hides the tumour
         "properties": {"objectType": "annotation", "classification": {"name": "Ignore*"}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [_square(0, 0, 2048, 2048)]},  # a cell: no region
         "properties": {"objectType": "detection", "classification": {"name": "Tumor"}}},
        {"type": "Feature", "id": "PathCellObject", "geometry": {"type": "Polygon", "coordinates": [_square(0, 0, 2048, 2048)]},
         "properties": {"classification": {"name": "Tumor"}}},  # QuPath 0.2's cell: no objectType, its kind in the id
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [_square(0, 0, 2048, 2048)]},  # unclassified
         "properties": {"objectType": "annotation"}}]}))
    (root / "ann" / "normal").mkdir()
    coords = lambda b: "".join(f'<Coordinate Order="{k}" X="{x}" Y="{y}"/>' for k, (x, y) in enumerate(_square(*b)[:4]))  # noqa: E731
    (root / "ann" / "T9.geojson").write_text("[]")  # no slide of that name
    (root / "ann" / "normal" / "s2.xml").write_text(  # CAMELYON16's form: an exclusion (_2) inside a tumour (_0); S2's case-blind
        '<?xml version="1.0"?><ASAP_Annotations><Annotations>'
        f'<Annotation Name="Annotation 1" Type="Polygon" PartOfGroup="_2"><Coordinates>{coords(hole)}</Coordinates></Annotation>'
        f'<Annotation Name="Annotation 0" Type="Polygon" PartOfGroup="_0"><Coordinates>{coords(tumour)}</Coordinates></Annotation>'
        '<Annotation Name="Dot" Type="Dot" PartOfGroup="_0"><Coordinates><Coordinate Order="0" X="1" Y="1"/></Coordinates></Annotation>'
        '</Annotations></ASAP_Annotations>')
    regions = {"folder": "ann", "classes": {"_0": "tumour", "_2": "normal", "Tumor": "tumour"}, "skip": ["Ignore*"]}
    rules = {"skip": ["ann"], "slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "regions": regions}}
    card, recs, _ = _dataset(tmp_path, "regions", rules)
    tumour_label = recs.loc[recs["original_label"] == "Tumor", "label"].iloc[0]
    for name in ("S1", "S2"):
        rows = recs[recs["source_path"] == f"normal/{name}.tif"]
        xy = rows["id"].str.extract(r"#x(\d+)y(\d+)$").astype(int).to_numpy()
        hidden = np.array([_share(x, y, ignore, 128) if name == "S1" else 0.0 for x, y in xy])
        share = np.array([_share(x, y, tumour, 128) - _share(x, y, hole, 128) for x, y in xy]) - hidden
        is_tumour = (rows["label"] == tumour_label).to_numpy()
        assert is_tumour[share >= 0.6].all() and not is_tumour[share <= 0.4].any() and is_tumour.sum() > 25
        inside_hole = np.array([_share(x, y, hole, 128) == 1 for x, y in xy])
        assert inside_hole.sum() == 16 and not is_tumour[inside_hole].any()
        assert (hidden == 1).sum() == (name == "S1") and not is_tumour[hidden == 1].any()
    s2 = recs[recs["source_path"] == "normal/S2.tif"]
    assert set(s2["original_label"]) == {"_0", "_2", "normal"}  # the annotation's class, or the slide's class outside
    s3 = recs[recs["source_path"] == "tumour/S3.tif"]  # no annotation file: its slide's class
    assert len(s3) > 100 and set(s3["original_label"]) == {"tumour"} and (s3["label"] == tumour_label).all()
    # the slide without a file and the file without a slide are warned about; a source of slides alone is not warned
    # to have no group rule (each slide is its patches' group)
    assert card["warnings"] == [
        "1 of 3 slides have no annotation file (e.g. tumour/S3.tif: looked for its name with .geojson, .json, .xml or .ndpa in "
        "ann/); all their patches take their slide's class (datasets.d.folders.lab.slides.regions)",
        "1 annotation files match no slide (e.g. ann/T9.geojson): a file is named after its slide's file, with or without "
        "the slide's suffix"]
    # the contact sheet shows a class's patches from several slides before a second patch of one
    assert len({i.split("#")[0] for i in card["samples"]["ids"]["lab"]["tumour"]}) == 3
    # where each patch's class came from, in the records and counted in the card
    assert set(s3["label_from"]) == {"slide"} and set(s2["label_from"]) == {"region", "slide"}
    assert ((s2["label_from"] == "region") == (s2["original_label"] != "normal")).all()
    assert card["domains"]["lab"]["label_from"] == recs["label_from"].value_counts().to_dict()
    assert "## Where the slides' patches took their class" in (tmp_path / "regions" / "d" / "card.md").read_text()

    # outside: normal (CAMELYON16: every tumour outlined): a patch outside the regions is normal whatever its slide;
    # two slides of one name share a flat folder's file, two files of one slide, an unreadable file, a non-ASAP XML:
    # each slide excluded with the reason
    (root / "ann" / "S3.geojson").write_text("{not json")
    for name in ("normal/S4", "normal/S5", "tumour/S1"):
        shutil.move(tmp_path / f"{name.replace('/', '_')}.tif", root / f"{name}.tif")
    (root / "ann" / "S4.json").write_text("[]")
    (root / "ann" / "S4.tif.xml").write_text("<ASAP_Annotations/>")
    (root / "ann" / "S5.xml").write_text('<Slide><Region X="1"/></Slide>')  # an XML of no annotation tool read here
    camelyon = {**rules, "slides": {**rules["slides"], "regions": {**regions, "outside": "Normal"}}}
    card, recs, _ = _dataset(tmp_path, "outside", camelyon)
    key = "datasets.d.folders.lab.slides"
    reasons = card["domains"]["lab"]["excluded_by_reason"]
    assert reasons["a whole-slide image: 2 annotation files (ann/S4.json, ann/S4.tif.xml): keep one"] == 1
    assert reasons["a whole-slide image: its annotation file ann/S1.geojson is also the slide tumour/S1.tif's (mirror the "
                   f"slides' folders in {key}.regions.folder)"] == 1
    assert any(r.startswith("a whole-slide image: its annotation file S3.geojson cannot be read (JSONDecodeError") for r in reasons)
    assert any(r.startswith("a whole-slide image: its annotation file S5.xml cannot be read (ValueError: an XML whose "
                            "root is <Slide>, neither ASAP's") for r in reasons)
    assert set(recs["source_path"]) == {"normal/S2.tif"}
    assert set(recs["original_label"]) == {"_0", "_2", "Normal"} and (recs["label"] != tumour_label).sum() > 100
    assert set(recs.loc[recs["original_label"] == "Normal", "label_from"]) == {"outside"}

    # outside: drop keeps the annotated patches only; a slide without a file gives none
    drop = BenchmarkDatasetParams(kind="image_folder", sources=("lab",), classes=("normal", "tumour"), folders={
        "lab": {**rules, "slides": {**rules["slides"], "regions": {**regions, "outside": "drop"}}}}).folders["lab"].slides
    class_of = {"_0": "tumour", "_2": "normal"}.get
    plan, given, why = slides.plan_patches(root / "normal" / "S2.tif", drop, key, root / "ann" / "normal" / "s2.xml", class_of)
    assert why == "" and len(plan) == len(s2[s2["original_label"] != "normal"]) and {g[1] for g in given} == {"_0", "_2"}
    assert slides.plan_patches(root / "normal" / "S2.tif", drop, key, None, class_of)[2] == (
        f"no annotation file, and patches outside the regions are dropped ({key}.regions.outside)")

    # an annotation class the dataset does not have stops harmonize, naming the file and the key that maps it; ASAP's
    # _0 is no class 0; outside names a class or slide or drop
    (root / "ann" / "S3.geojson").write_text(json.dumps([{"type": "Feature", "properties": {"classification": {"name": "Stroma"}},
                                                           "geometry": {"type": "Polygon", "coordinates": [_square(*hole)]}}]))
    with pytest.raises(ValueError, match=r"S3\.geojson: annotation class 'Stroma' is not a class of this dataset .*"
                                         rf"{key}\.regions\.classes: \{{Stroma: <class>\}}"):
        _dataset(tmp_path, "unknown", rules, workers=2)
    with pytest.raises(ValueError, match=rf"lab/annotations: no such folder in the source \({key}\.regions\.folder: "):
        _dataset(tmp_path, "no_folder", {**rules, "slides": {**rules["slides"], "regions": {**regions, "folder": "annotations"}}})
    with pytest.raises(ValueError, match=rf"{key}\.regions\.outside: 'stroma' is none of slide, drop or a class"):
        _dataset(tmp_path, "bad_outside", {**rules, "slides": {**rules["slides"], "regions": {**regions, "outside": "stroma"}}})
    from fedsilo.data.sources.classmap import ClassMap

    zero = ClassMap(drop.regions.model_copy(update={"classes": {}}), "k", "annotation class", fold=slides.region_fold)
    with pytest.raises(ValueError, match="annotation class '_0' is not a class of this dataset"):
        zero.resolver(("0", "1"))("_0", "x.xml")


def test_ndp_view_annotations_are_placed_by_the_scans_offset_from_the_slide_centre(tmp_path):
    """Hamamatsu NDP.view's .ndpa (beside its scan, named <scan>.ndpa): coordinates in nanometres from the glass
    slide's centre, placed by the scan's XOffsetFromSlideCentre / YOffsetFromSlideCentre and microns per pixel; a
    closed freehand outline and a circle are regions, an open line, a pin and an untitled outline are not; a scan
    whose header has no offset cannot place them and is excluded with the reason."""
    import warnings

    warnings.filterwarnings("ignore", "hamamatsu-format metadata", UserWarning)  # tiffslide's note on every NDPI opened
    off = (-1_234_567, 765_432)
    root = tmp_path / "raw" / "lab"
    _slide(root / "normal" / "N1.tif", (1024, 1024), 900, hamamatsu=off)
    _slide(root / "normal" / "N2.tif", (1024, 1024), 900)  # no NDPI tags: its .ndpa cannot be placed

    def nm(x: float, y: float) -> tuple[int, int]:  # level-0 pixel -> NDP.view's nanometres from the slide's centre
        return round((x - SIDE / 2) * MPP0 * 1000 + off[0]), round((y - SIDE / 2) * MPP0 * 1000 + off[1])

    def outline(title: str, box: tuple[float, ...], closed: int = 1, kind: str = "AnnotateFreehand") -> str:
        points = "".join("<point><x>{}</x><y>{}</y></point>".format(*nm(x, y)) for x, y in _square(*box)[:4])
        return (f'<ndpviewstate id="{title or 0}"><title>{title}</title><coordformat>nanometers</coordformat><lens>40</lens>'
                f'<annotation type="freehand" displayname="{kind}"><closed>{closed}</closed><pointlist>{points}</pointlist>'
                '</annotation></ndpviewstate>')

    tumour, centre, radius = (512, 384, 1024, 1280), (1472, 1472), 256
    cx, cy = nm(*centre)
    ndpa = ('<?xml version="1.0" encoding="UTF-8" standalone="yes"?><annotations>' + outline("Tumor", tumour)
            + '<ndpviewstate id="9"><title>Necrosis</title><coordformat>nanometers</coordformat><annotation type="circle" '
            f'displayname="AnnotateCircle"><x>{cx}</x><y>{cy}</y><radius>{radius * MPP0 * 1000:.0f}</radius></annotation></ndpviewstate>'
            + outline("Tumor", (0, 0, 2048, 2048), closed=0, kind="AnnotateFreehandLine")  # a line: no area
            + outline("", (0, 0, 2048, 2048))  # no title: not read
            + f'<ndpviewstate id="7"><title>Tumor</title><annotation type="pin"><x>{cx}</x><y>{cy}</y></annotation></ndpviewstate>'
            + "</annotations>")
    (root / "normal" / "N1.tif.ndpa").write_text(ndpa)  # NDP.view's own name: the scan's file name + .ndpa
    (root / "normal" / "N2.ndpa").write_text(ndpa)
    regions = {"folder": None, "classes": {"Tumor": "tumour", "Necrosis": "necrosis"}}
    rules = {"slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "regions": regions}}
    (root / "tumour").mkdir()
    (root / "necrosis").mkdir()
    card, recs, _ = _dataset(tmp_path, "ndpa", rules, classes=("normal", "necrosis", "tumour"))
    xy = recs["id"].str.extract(r"#x(\d+)y(\d+)$").astype(int).to_numpy()
    label = recs["original_label"].to_numpy()
    in_tumour = np.array([_share(x, y, tumour, 128) for x, y in xy])
    assert (label[in_tumour == 1] == "Tumor").all() and (in_tumour == 1).sum() == 28 and not (label[in_tumour == 0] == "Tumor").any()
    gap = np.array([np.hypot(x + 64 - centre[0], y + 64 - centre[1]) for x, y in xy])  # patch centre to circle centre
    inside, outside = gap + 64 * np.sqrt(2) < radius, gap - 64 * np.sqrt(2) > radius  # wholly in, wholly out
    assert inside.sum() == 5 and (label[inside] == "Necrosis").all() and not (label[outside] == "Necrosis").any()
    assert set(label) == {"Tumor", "Necrosis", "normal"}  # the line and the pin labelled nothing
    reasons = card["domains"]["lab"]["excluded_by_reason"]
    assert reasons["a slide's region annotations"] == 2  # the .ndpa files beside their scans, each said to be one
    assert [r for r in reasons if "N2" in r] == [
        "a whole-slide image: its annotation file N2.ndpa cannot be read (ValueError: an NDP.view annotation is placed by "
        "its NDPI scan's offset from the slide centre (hamamatsu.XOffsetFromSlideCentre / YOffsetFromSlideCentre), which "
        "this slide's header does not give: is it the NDPI scan the annotation was drawn on?)"]


def test_ndpa_coordinates_use_each_axis_own_size_and_resolution(tmp_path):
    """On a scan wider than tall with coarser rows than columns, a point's x is placed by the width and the x
    resolution, its y by the height and the y resolution; micrometres are read as such."""
    frame = slides.SlideFrame(3000, 2000, 0.25, 0.5, (1_000_000.0, -2_000_000.0))
    box = [(100, 40), (300, 40), (300, 90), (100, 90)]  # pixels from the scan's centre
    pts = lambda scale: "".join(f"<point><x>{(1_000_000 + 250 * x) / scale:g}</x><y>{(-2_000_000 + 500 * y) / scale:g}</y></point>"  # noqa: E731
                                for x, y in box)
    (tmp_path / "s.ndpa").write_text(
        '<annotations><ndpviewstate id="1"><title>T</title><coordformat>nanometers</coordformat><annotation type="freehand">'
        f'<pointlist>{pts(1)}</pointlist></annotation></ndpviewstate><ndpviewstate id="2"><title>U</title><coordformat>'
        f'micrometers</coordformat><annotation type="freehand"><closed>1</closed><pointlist>{pts(1000)}</pointlist></annotation>'
        '</ndpviewstate></annotations>')
    regions = slides.read_regions(tmp_path / "s.ndpa", frame)
    want = np.array([(1500 + x, 1000 + y) for x, y in box], dtype=float)
    assert [name for name, _ in regions] == ["T", "U"] and all(np.allclose(rings[0], want) for _, rings in regions)


def test_an_ome_tiff_gives_its_microns_per_pixel_from_its_ome_xml(tmp_path):
    """A pyramidal OME-TIFF (what QuPath and bfconvert convert other formats to) has its resolution in its OME-XML,
    not in the tags tiffslide reads: read from there (in its unit), it is cut into patches like any slide."""
    img = np.full((SIDE, SIDE, 3), 238, np.uint8)
    img[512:1536, 512:1536] = (np.random.default_rng(6).integers(0, 50, (1024, 1024, 3)) + np.array([170, 70, 140])).astype(np.uint8)
    path = tmp_path / "raw" / "lab" / "tumour" / "S1.ome.tif"
    path.parent.mkdir(parents=True)
    (tmp_path / "raw" / "lab" / "normal").mkdir()
    with tifffile.TiffWriter(path, bigtiff=True) as tif:
        opts = {"tile": (256, 256), "photometric": "rgb", "compression": "jpeg"}
        tif.write(img, subifds=2, metadata={"axes": "YXS", "PhysicalSizeX": 250, "PhysicalSizeXUnit": "nm",
                                            "PhysicalSizeY": 0.5, "PhysicalSizeYUnit": "µm"}, **opts)
        for d in (4, 16):
            tif.write(np.ascontiguousarray(img[::d, ::d]), subfiletype=1, **opts)
    with slides.open_slide(str(path)) as slide:
        assert slide.properties["tiffslide.mpp-x"] is None  # tiffslide does not read it
        assert slides.ome_mpp(slide.properties) == (0.25, 0.5) and slides.level0_mpp(slide, None) == 0.25
        assert slides.slide_frame(slide, 0.25).mpp_y == 0.5
    rules = {"slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000}}
    _, recs, _ = _dataset(tmp_path, "ome", rules, classes=("normal", "tumour"))
    assert len(recs) == 64 and set(recs["source_path"]) == {"tumour/S1.ome.tif"}  # the 8 x 8 patches of its tissue


def test_region_raster_innermost_region_and_min_share():
    """The smaller of two overlapping regions is what lies there whatever the file's order; a class's share is the sum
    of its annotations'; a skipped annotation labels nothing."""
    xs, ys = np.arange(0, 640, 64), np.arange(0, 640, 64)
    big, small = _square(0, 0, 640, 640), _square(128, 128, 256, 256)
    cls = {"a": "tumour", "b": "normal", "c": "tumour", "s": None}.get
    for order in ([("a", [np.array(big)]), ("b", [np.array(small)])], [("b", [np.array(small)]), ("a", [np.array(big)])]):
        labels, named, share = slides.region_labels(order, cls, xs, ys, 64, 0.5)
        grid = np.array(labels, dtype=object).reshape(10, 10)
        assert (grid[2:4, 2:4] == "normal").all() and (grid[:2] == "tumour").all() and share.min() == 1.0
    halves = [("a", [np.array(_square(0, 0, 32, 640))]), ("c", [np.array(_square(32, 0, 64, 640))]),
              ("s", [np.array(_square(64, 0, 640, 640))])]
    labels, named, share = slides.region_labels(halves, cls, xs, ys, 64, 0.75)
    grid = np.array(labels, dtype=object).reshape(10, 10)
    assert (grid[:, 0] == "tumour").all() and (grid[:, 1:] == None).all()  # noqa: E711 - two halves of one class; skipped
    assert np.allclose(share.reshape(10, 10)[:, 0], 1.0)
    labels, _, _ = slides.region_labels([("a", [np.array(big)]), ("s", [np.array(small)])], cls, xs, ys, 64, 0.5)
    grid = np.array(labels, dtype=object).reshape(10, 10)
    assert (grid[2:4, 2:4] == None).all() and (grid[:2] == "tumour").all()  # noqa: E711 - a skipped region hides the tumour


def _dicom_level(path: Path, img: np.ndarray, mpp: float, series: tuple[str, str, str], flavour: str = "VOLUME",
                 tile: int = 256, origin_mm: tuple[float, float] = (0.0, 0.0)) -> None:
    """One instance of a DICOM whole-slide image (VL Whole Slide Microscopy Image, TILED_FULL, uncompressed RGB
    tiles): ``img`` at ``mpp`` microns per pixel, of the series ``(study, series, frame of reference)`` UIDs, its
    top-left pixel at ``origin_mm`` in the slide coordinate system, oriented as scanners write it (along a row the
    slide's Y decreases, down a column its X)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.sequence import Sequence
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    h, w = img.shape[:2]
    padded = np.full((-(-h // tile) * tile, -(-w // tile) * tile, 3), 255, np.uint8)
    padded[:h, :w] = img
    tiles = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile, 3).swapaxes(1, 2)
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.77.1.6"
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = series
    ds.Modality, ds.PatientID, ds.ContainerIdentifier, ds.Manufacturer = "SM", "P1", "S1", "fedsilo test"
    ds.ImageType = ["ORIGINAL", "PRIMARY", flavour, "NONE"]
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.Rows = ds.Columns = tile
    ds.NumberOfFrames = tiles.shape[0] * tiles.shape[1]
    ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = w, h
    ds.TotalPixelMatrixFocalPlanes = ds.NumberOfOpticalPaths = 1
    ds.DimensionOrganizationType = "TILED_FULL"
    ds.ImagedVolumeWidth, ds.ImagedVolumeHeight, ds.ImagedVolumeDepth = w * mpp / 1000, h * mpp / 1000, 0.001
    origin = Dataset()
    origin.XOffsetInSlideCoordinateSystem, origin.YOffsetInSlideCoordinateSystem = origin_mm
    ds.TotalPixelMatrixOriginSequence = Sequence([origin])
    ds.ImageOrientationSlide = [0, -1, 0, -1, 0, 0]
    ds.PatientName, ds.StudyID, ds.SeriesNumber, ds.InstanceNumber = "Test^Slide", "1", 1, 1
    ds.StudyDate, ds.StudyTime, ds.AccessionNumber, ds.ReferringPhysicianName = "20260101", "120000", "A1", ""
    ds.PatientBirthDate, ds.PatientSex = "", ""
    measures = Dataset()
    measures.PixelSpacing, measures.SliceThickness = [mpp / 1000, mpp / 1000], 0.001
    shared = Dataset()
    shared.PixelMeasuresSequence = Sequence([measures])
    ds.SharedFunctionalGroupsSequence = Sequence([shared])
    optical = Dataset()
    optical.OpticalPathIdentifier = "1"
    ds.OpticalPathSequence = Sequence([optical])
    ds.PixelData = np.ascontiguousarray(tiles).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def _z_stack(folder: Path, planes: list[np.ndarray], mpp: float, tile: int = 256, coarse_planes: int | None = None,
             second_path: list[np.ndarray] | None = None) -> None:
    """A DICOM whole-slide image of several focal planes 2 um apart (TILED_FULL: each plane's tiles row by row, then
    the next plane's), levels 1 and 4, in ``folder``; ``coarse_planes``: level 4 holds only that many (from 0 um);
    ``second_path``: the same planes of a second optical path (identifier "2"; the first is "1"), after the first's."""
    import pydicom
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence
    from pydicom.uid import generate_uid

    def tiles(x: np.ndarray) -> np.ndarray:
        h, w = x.shape[:2]
        pad = np.full((-(-h // tile) * tile, -(-w // tile) * tile, 3), 255, np.uint8)
        pad[:h, :w] = x
        return pad.reshape(pad.shape[0] // tile, tile, pad.shape[1] // tile, tile, 3).swapaxes(1, 2).reshape(-1, tile, tile, 3)

    uids = (generate_uid(), generate_uid(), generate_uid())
    for d in (1, 4):
        f = folder / f"L{d}.dcm"
        _dicom_level(f, np.ascontiguousarray(planes[0][::d, ::d]), mpp * d, uids, tile=tile)
        ds = pydicom.dcmread(f)
        kept = planes if d == 1 or coarse_planes is None else planes[:coarse_planes]
        stacks = [kept] if second_path is None else [kept, second_path[:len(kept)]]
        frames = np.concatenate([tiles(np.ascontiguousarray(p[::d, ::d])) for stack in stacks for p in stack])
        ds.NumberOfFrames, ds.TotalPixelMatrixFocalPlanes = len(frames), len(kept)
        if second_path is not None:
            second = Dataset()
            second.OpticalPathIdentifier = "2"
            ds.OpticalPathSequence = Sequence([ds.OpticalPathSequence[0], second])
            ds.NumberOfOpticalPaths = 2
        ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].SpacingBetweenSlices = 0.002
        ds.PixelData = frames.tobytes()
        ds.save_as(f)


def test_dicom_slides_openslide_refuses_are_read_through_wsidicom(tmp_path):
    """A z-stack of three focal planes whose coarser level keeps one plane only, and an RLE-compressed series
    (OpenSlide 4 refuses both) are read through wsidicom: the middle plane's pixels at level 0 and the nearest plane's
    at level 1, the RLE series' own, transparent past the edge; the thumbnail from the coarser level; harmonize cuts
    both into patches."""
    pytest.importorskip("openslide")
    pytest.importorskip("wsidicom")
    import openslide
    import pydicom
    from pydicom.uid import RLELossless, generate_uid

    rng = np.random.default_rng(4)
    root = tmp_path / "raw" / "lab"
    base = np.full((1024, 1024, 3), 238, np.uint8)
    planes = []
    for k in range(3):  # the same tissue, each plane its own pixels
        plane = base.copy()
        plane[200:800, 300:700] = rng.integers(60 + 40 * k, 100 + 40 * k, (600, 400, 3))
        planes.append(plane)
    _z_stack(root / "tumour" / "Z1", planes, MPP0, coarse_planes=1)
    uids = (generate_uid(), generate_uid(), generate_uid())
    for d in (1, 4):
        f = root / "tumour" / "R1" / f"L{d}.dcm"
        _dicom_level(f, np.ascontiguousarray(planes[2][::d, ::d]), MPP0 * d, uids)
        ds = pydicom.dcmread(f)
        ds.compress(RLELossless, encoding_plugin="pydicom")
        ds.save_as(f)
    (root / "normal").mkdir()
    for name, pixels, coarse, why in (("Z1", planes[1], planes[0], "TotalPixelMatrixFocalPlanes"), ("R1", planes[2], planes[2], "transfer syntax")):
        path = str(root / "tumour" / name / "L1.dcm")
        with pytest.raises(openslide.OpenSlideError, match=why):
            openslide.OpenSlide(path)
        with slides.open_slide(path) as slide:
            assert type(slide).__name__ == "WsiDicomSlide" and slide.level_downsamples == (1.0, 4.0)
            assert slide.properties["wsidicom.focal-plane-um"] == ("2.0" if name == "Z1" else "0.0")
            assert np.asarray(slide.read_region((1000, 990), 1, (16, 16)))[..., 3].min() == 0  # past the edge
            assert slide.get_thumbnail((2048, 2048)).size == (1024, 1024) and slide.get_thumbnail((256, 128)).size == (128, 128)
            np.testing.assert_array_equal(np.asarray(slide.get_thumbnail((256, 256))), coarse[::4, ::4])  # level 1, whole
        np.testing.assert_array_equal(slides.read_patch(path, (320, 256, 0, 64, 64)), pixels[256:320, 320:384])
        np.testing.assert_array_equal(slides.read_patch(path, (320, 256, 1, 16, 16)), coarse[::4, ::4][64:80, 80:96])
    rules = {"slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000}}
    card, recs, _ = _dataset(tmp_path, "wsidicom", rules, classes=("normal", "tumour"))
    assert recs.groupby("source_path").size().to_dict() == {"tumour/R1/L1.dcm": 12, "tumour/Z1/L1.dcm": 12}


def test_the_rules_choose_a_dicom_slides_focal_plane_and_optical_path(tmp_path, monkeypatch):
    """slides.focal_plane and slides.optical_path read that plane of that path (through wsidicom, as OpenSlide shows
    one path and no z-stack), at planning and at decoding alike; a slide without them is excluded saying which it
    has; a TIFF scan beside them is read as before, with a warning that the choice is a DICOM series'."""
    pytest.importorskip("openslide")
    pytest.importorskip("wsidicom")

    rng = np.random.default_rng(7)
    root = tmp_path / "raw" / "lab"
    base = np.full((1024, 1024, 3), 238, np.uint8)

    def plane(lo: int, left: int = 300) -> np.ndarray:  # stained tissue, its own pixels (green lo..lo+19)
        p = base.copy()
        green = rng.integers(lo, lo + 20, (600, 400))
        p[200:800, left:left + 400] = np.stack([green + 60, green, green + 30], axis=-1)
        return p

    # 0, 2, 4 um of two paths; on the second path's 4 um plane the tissue lies further right: its patches are found
    # on that plane's thumbnail, or they would show glass
    first, second = [plane(20 + 20 * k) for k in range(3)], [plane(100), plane(120), plane(140, left=560)]
    _z_stack(root / "tumour" / "Z1", first, MPP0, second_path=second)
    path = str(root / "tumour" / "Z1" / "L1.dcm")
    with slides.open_slide(path) as slide:  # the defaults: the middle plane of the first path
        assert (slide.properties["wsidicom.focal-plane-um"], slide.properties["wsidicom.optical-path"]) == ("2.0", "1")
    with slides.open_slide(path, 4.0, "2") as slide:
        assert slide.properties["wsidicom.optical-paths"] == "2"
        np.testing.assert_array_equal(np.asarray(slide.read_region((320, 256), 0, (64, 64)))[..., :3], second[2][256:320, 320:384])
    np.testing.assert_array_equal(slides.read_patch(path, (320, 256, 0, 64, 64), 0.0, None), first[0][256:320, 320:384])
    np.testing.assert_array_equal(slides.read_patch(path, (320, 256, 0, 64, 64), 2.0, "2"), second[1][256:320, 320:384])
    with pytest.raises(slides.SlideViewError, match=r"no focal plane at 3 um \(its planes of optical path '1': 0, 2, 4 um\)"):
        slides.open_slide(path, 3.0)
    with pytest.raises(slides.SlideViewError, match=r"no optical path '3' \(its paths: '1', '2'\)"):
        slides.open_slide(path, None, "3")

    monkeypatch.setattr(slides, "SMALL_TIFF_BYTES", 0)  # the test's TIFF slide is a small file
    _slide(root / "normal" / "S1.tif", (900, 800), 500)  # a TIFF-family scan: one plane, one path
    rules = {"slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "focal_plane": 4.0, "optical_path": 2}}
    card, recs, images = _dataset(tmp_path, "chosen", rules, classes=("normal", "tumour"))
    mine = (recs["source_path"] == "tumour/Z1/L1.dcm").to_numpy()
    assert mine.sum() == 16 and (recs["source_path"] == "normal/S1.tif").sum() > 0  # 4 x 4 cells of 128 level-0 px
    assert recs.loc[mine, "id"].str.extract(r"#x(\d+)y", expand=False).astype(int).min() >= 512  # on the right: 4 um's tissue
    green = np.median(images[mine][..., 1])  # the patches' green: the tissue's (min_tissue 0.5), resized
    assert 140 <= green <= 160  # the second path's 4 um plane (140..159), no other (its 2 um plane: 120..139)
    assert any("1 of 2 slides are no DICOM whole-slide images (e.g. normal/S1.tif): datasets.d.folders.lab.slides.focal_plane "
               "and datasets.d.folders.lab.slides.optical_path choose" in w for w in card["warnings"])
    rules["slides"]["focal_plane"] = 3.0
    card, recs, _ = _dataset(tmp_path, "missing", rules, classes=("normal", "tumour"))
    assert (recs["source_path"] == "tumour/Z1/L1.dcm").sum() == 0
    assert card["domains"]["lab"]["excluded_by_reason"][
        "a whole-slide image: no focal plane at 3 um (its planes of optical path '2': 0, 2, 4 um) "
        "(datasets.d.folders.lab.slides.focal_plane)"] == 1


def test_dicom_whole_slide_images_are_read_through_openslide(tmp_path, monkeypatch):
    """A DICOM whole-slide image (a folder of instances: three pyramid levels and a label) is one slide read through
    its largest level, the other instances excluded saying what they are; its patches are its pixels; region
    annotations are found by its folder's name; a series with no pyramid is excluded."""
    pytest.importorskip("openslide")
    import json

    from pydicom.uid import generate_uid

    root = tmp_path / "raw" / "lab"
    rng = np.random.default_rng(0)
    img = np.full((SIDE, SIDE, 3), 238, np.uint8)
    yy, xx = np.mgrid[:SIDE, :SIDE]
    disc = (yy - 1000) ** 2 + (xx - 900) ** 2 < 500**2
    img[disc] = (rng.integers(0, 50, (int(disc.sum()), 3)) + np.array([170, 70, 140])).astype(np.uint8)
    uids = (generate_uid(), generate_uid(), generate_uid())
    for k, d in enumerate((1, 4, 16)):  # files in no particular order: a PACS names them by UID
        _dicom_level(root / "tumour" / "S1" / f"{9 - k}.dcm", np.ascontiguousarray(img[::d, ::d]), MPP0 * d, uids)
    _dicom_level(root / "tumour" / "S1" / "label.dcm", img[:64, :96], 20.0, uids, flavour="LABEL")
    _dicom_level(root / "tumour" / "S3" / "label.dcm", img[:64, :96], 20.0, (generate_uid(),) * 3, flavour="LABEL")
    _dicom_level(root / "tumour" / "S1_moved" / "7.dcm", np.ascontiguousarray(img[::16, ::16]), MPP0 * 16, uids)  # strayed
    (root / "normal").mkdir()
    assert cv2.imwrite(str(root / "normal" / "patch.png"), img[900:940, 800:840])
    (root / "ann").mkdir()
    (root / "ann" / "S1.geojson").write_text(json.dumps([{"type": "Feature", "properties": {"classification": {"name": "normal"}},
                                                          "geometry": {"type": "Polygon", "coordinates": [_square(0, 0, 1024, 2048)]}}]))
    others = {"a pyramid level of a DICOM whole-slide image (read through its largest level)": 2,
              "a DICOM whole-slide image's label image (not read)": 1,
              "a DICOM whole-slide image's label image, none of its pyramid levels among the files read (a folder "
              "holding the series, or a table row naming one of its VOLUME files, reads it)": 1,
              "an instance of a DICOM whole-slide image in another folder than its largest level (keep a series in "
              "one folder)": 1,
              "class folder skipped (datasets.d.folders.lab.skip)": 1}  # the annotations' folder
    card, _, _ = _dataset(tmp_path, "none", {"skip": ["ann"]})
    assert card["domains"]["lab"]["excluded_by_reason"] == {
        **others, "a whole-slide image (set datasets.d.folders.lab.slides to cut it into patches)": 1}

    # 1 um/px patches of 32 px: 128 level-0 px, read from level 1 (4x down) and compared with its pixels as written
    rules = {"skip": ["ann"], "slides": {"mpp": 1.0, "patch_px": 32, "max_patches": 10_000}}
    card, recs, images = _dataset(tmp_path, "slides", rules, workers=2)
    assert card["domains"]["lab"]["excluded_by_reason"] == others
    s1 = recs[recs["source_path"] == "tumour/S1/9.dcm"]
    assert len(s1) > 20 and s1["group"].nunique() == 1
    level1 = img[::4, ::4]
    for row in s1.index[:: max(1, len(s1) // 6)]:
        x, y = (int(v) // 4 for v in recs.loc[row, "id"].rsplit("#x", 1)[1].split("y"))
        np.testing.assert_array_equal(images[row], to_rgb_square(level1[y:y + 32, x:x + 32], 16, "stretch"))
    # past the slide's edge OpenSlide gives transparent pixels: the patch shows the slide's background there, not black
    edge = slides.read_patch(str(root / "tumour" / "S1" / "9.dcm"), (SIDE - 16, 0, 0, 32, 32))
    assert (edge[:, :16] == 238).all() and (edge[:, 16:] == 255).all()
    # region annotations named after the series' folder: the left half is normal, the rest stays tumour
    regions = {**rules, "slides": {**rules["slides"], "regions": {"folder": "ann"}}}
    _, recs, _ = _dataset(tmp_path, "regions", regions)
    s1 = recs[recs["source_path"] == "tumour/S1/9.dcm"]
    x = s1["id"].str.extract(r"#x(\d+)y")[0].astype(int)
    assert set(s1.loc[x + 128 <= 1024, "original_label"]) == {"normal"} and set(s1.loc[x >= 1024, "original_label"]) == {"tumour"}


ORIGIN_MM = (20.0, 40.0)  # where the generated DICOM slides' top-left pixel lies on the glass


def _two_dicom_slides(root: Path) -> None:
    """Slides S1 and S2 under ``root/tumour``: each a DICOM series of two levels (full and a quarter) of a 1024 px
    square whose stained tissue fills rows and columns 128-896, its top-left pixel at ORIGIN_MM, a frame of
    reference of its own."""
    from pydicom.uid import generate_uid

    img = np.full((1024, 1024, 3), 238, np.uint8)
    img[128:896, 128:896] = (np.random.default_rng(0).integers(0, 50, (768, 768, 3)) + np.array([170, 70, 140])).astype(np.uint8)
    for name in ("S1", "S2"):
        uids = (generate_uid(), generate_uid(), generate_uid())
        for d in (1, 4):
            _dicom_level(root / "tumour" / name / f"L{d}.dcm", np.ascontiguousarray(img[::d, ::d]), MPP0 * d, uids, origin_mm=ORIGIN_MM)


def _slide_mm(col: float, row: float) -> list[float]:
    """Level-0 image coordinates (corner at 0, 0) of a slide of :func:`_two_dicom_slides` -> its slide coordinates (mm)."""
    mm = MPP0 / 1000
    return [ORIGIN_MM[0] - (row - 0.5) * mm, ORIGIN_MM[1] - (col - 0.5) * mm, 0.0]


def test_dicom_annotation_objects_label_a_dicom_slides_patches(tmp_path):
    """DICOM Microscopy Bulk Simple Annotations (made with highdicom) are found by the series they reference and
    placed on the slide: 3D coordinates (millimetres on the glass, through the level-0 image's origin and
    orientation) and 2D ones in a coarser level's pixels; an ellipse by its axes; an ignored class (nuclei inside the
    tumour) hides nothing, points enclose nothing; a group's class is its property type, or its label."""
    pytest.importorskip("openslide")
    hd = pytest.importorskip("highdicom")
    import pydicom
    from pydicom.sr.codedict import codes
    from pydicom.uid import generate_uid

    root = tmp_path / "raw" / "lab"
    _two_dicom_slides(root)
    for cls in ("normal", "necrosis"):
        (root / cls).mkdir()
    (root / "ann").mkdir()

    def group(number, label, meaning, shape, data):
        return hd.ann.AnnotationGroup(
            number=number, uid=generate_uid(), label=label, annotated_property_category=codes.SCT.MorphologicallyAbnormalStructure,
            annotated_property_type=hd.sr.CodedConcept("0", "99TEST", meaning), graphic_type=shape, graphic_data=data,
            algorithm_type=hd.ann.AnnotationGroupGenerationTypeValues.MANUAL)

    def save(source, kind, groups, name):
        ann = hd.ann.MicroscopyBulkSimpleAnnotations(
            source_images=[source], annotation_coordinate_type=kind, annotation_groups=groups, series_instance_uid=generate_uid(),
            series_number=2, sop_instance_uid=generate_uid(), instance_number=1, manufacturer="fedsilo test",
            manufacturer_model_name="test", software_versions="1", device_serial_number="1")
        ann.save_as(root / "ann" / name)

    # S1, in 3D, in two objects as a PACS keeps them: the pathologist's tumour (the left half's rows 128-768), and an
    # algorithm's nuclei (one covers 61 % of the top-left tissue patch) and their centroids (points)
    s1 = pydicom.dcmread(root / "tumour" / "S1" / "L1.dcm")
    box = lambda x0, y0, x1, y1: np.array([_slide_mm(x, y) for x, y in _square(x0, y0, x1, y1)[:4]])  # noqa: E731
    save(s1, "3D", [group(1, "Tumour outline", "Neoplasm", "POLYGON", [box(0, 128, 512, 768)])], "1.2.3.dcm")
    save(s1, "3D", [group(1, "nuclei", "Nucleus", "POLYGON", [box(138, 138, 238, 238)]),
                    group(2, "centroids", "Nucleus centre", "POINT", [np.array([_slide_mm(700, 700)])])], "1.2.4.dcm")
    # S2, in 2D in its level 1's pixels (a quarter of level 0's): a necrosis ellipse around (512, 512) whose half axes
    # are 448 px along x and 160 px along y at level 0
    s2_level1 = pydicom.dcmread(root / "tumour" / "S2" / "L4.dcm")
    axes = np.array([[16.0, 128.0], [240.0, 128.0], [128.0, 88.0], [128.0, 168.0]])
    save(s2_level1, "2D", [group(1, "necrosis", "Necrosis", "ELLIPSE", [axes])], "4.5.6.dcm")

    orphan = pydicom.dcmread(root / "ann" / "4.5.6.dcm")  # an object of a slide that is not in the source
    orphan.ReferencedSeriesSequence[0].SeriesInstanceUID = orphan.ReferencedImageSequence[0].ReferencedSOPInstanceUID = generate_uid()
    orphan.SOPInstanceUID = orphan.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    orphan.save_as(root / "ann" / "elsewhere.dcm")
    regions = {"folder": "ann", "classes": {"Neoplasm": "tumour"}, "ignore": ["Nucleus", "Nucleus centre"], "outside": "normal",
               "min_share": 0.99}
    rules = {"skip": ["ann"], "slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "regions": regions}}
    card, recs, _ = _dataset(tmp_path, "dicom_ann", rules, classes=("normal", "necrosis", "tumour"))
    assert card["warnings"] == ["1 DICOM annotation files annotate no slide read here (e.g. ann/elsewhere.dcm): one is matched "
                                "to its slide by the series or image it references"]
    xy = recs["id"].str.extract(r"#x(\d+)y(\d+)$").astype(int).to_numpy()
    s1_rows = (recs["source_path"] == "tumour/S1/L1.dcm").to_numpy()
    label = recs["original_label"].to_numpy()
    tumour = (xy[:, 0] < 512) & (xy[:, 1] >= 128) & (xy[:, 1] < 768)
    assert s1_rows.sum() == 36 and (s1_rows & tumour).sum() == 15 and (label[s1_rows & tumour] == "Neoplasm").all()  # the nucleus hid nothing
    assert (label[s1_rows & ~tumour] == "normal").all()
    u = (np.arange(17) / 16 * 128)[None, :]  # 17 x 17 points over each patch: the share the ellipse covers
    px, py = (xy[:, :1] + u)[:, :, None], (xy[:, 1:] + u)[:, None, :]
    covered = ((((px - 512) / 448) ** 2 + ((py - 512) / 160) ** 2) <= 1).mean(axis=(1, 2))
    s2_rows = (recs["source_path"] == "tumour/S2/L1.dcm").to_numpy()
    inside, outside = s2_rows & (covered == 1), s2_rows & (covered == 0)  # a row of 4 x 2 patches wholly inside
    assert inside.sum() == 8 and (label[inside] == "Necrosis").all() and (label[outside] == "normal").all()
    assert card["domains"]["lab"]["excluded_by_reason"]["a slide's region annotations"] == 3  # found by UID, said to be theirs

    # a group's class by its label; a DICOM annotation on a slide that is no DICOM cannot be placed
    with slides.open_slide(str(root / "tumour" / "S1" / "L1.dcm")) as slide:
        frame = slides.slide_frame(slide, MPP0, root / "tumour" / "S1" / "L1.dcm")
    assert [name for name, _ in slides.read_regions(root / "ann" / "1.2.4.dcm", frame, "label")] == ["nuclei"]
    with pytest.raises(ValueError, match="placed on the DICOM whole-slide image it references; this slide is not one"):
        slides.read_regions(root / "ann" / "1.2.3.dcm", frame._replace(dicom=None))
    # the image S2's 2D coordinates refer to gone: S2 is excluded saying which
    (root / "tumour" / "S2" / "L4.dcm").unlink()
    card, recs, _ = _dataset(tmp_path, "dicom_ann_gone", rules, classes=("normal", "necrosis", "tumour"))
    assert any(r.startswith("a whole-slide image: its annotation file 4.5.6.dcm cannot be read (ValueError: its 2D coordinates "
                            f"are in the pixels of the image {s2_level1.SOPInstanceUID}, which is not among the slide's files")
               for r in card["domains"]["lab"]["excluded_by_reason"])


def test_dicom_structured_reports_label_a_dicom_slides_patches(tmp_path, caplog):
    """A pathologist's regions as a DICOM Structured Report (a Measurement Report, TID 1500, made with highdicom) of a
    case's two slides: each planar ROI is a region of the slide it is drawn on, the report found by the series its
    evidence references and placed on each slide: a 3D polygon (millimetres on the glass), a closed 2D polyline in a
    coarser level's pixels, a circle in level 0's; a point encloses nothing; the class is the ROI's finding type, or
    its tracking identifier. A report of another template (a text report) referencing the slide is no annotation
    file."""
    pytest.importorskip("openslide")
    hd = pytest.importorskip("highdicom")
    import pydicom
    from pydicom.sr.codedict import codes
    from pydicom.uid import generate_uid

    root = tmp_path / "raw" / "lab"
    _two_dicom_slides(root)
    (root / "normal").mkdir()
    (root / "ann").mkdir()

    def roi(identifier: str, meaning: str, region) -> Any:
        return hd.sr.PlanarROIMeasurementsAndQualitativeEvaluations(
            tracking_identifier=hd.sr.TrackingIdentifier(uid=generate_uid(), identifier=identifier), referenced_region=region,
            finding_type=hd.sr.CodedConcept("0", "99TEST", meaning))

    def report(evidence, groups, name: str) -> None:
        observer = hd.sr.ObserverContext(observer_type=codes.DCM.Person,
                                         observer_identifying_attributes=hd.sr.PersonObserverIdentifyingAttributes(name="Path^Ologist"))
        content = hd.sr.MeasurementReport(observation_context=hd.sr.ObservationContext(observer_person_context=observer),
                                          procedure_reported=hd.sr.CodedConcept("1", "99TEST", "Slide review"), imaging_measurements=groups)
        hd.sr.Comprehensive3DSR(evidence=evidence, content=content, series_instance_uid=generate_uid(), series_number=3,
                                sop_instance_uid=generate_uid(), instance_number=1, manufacturer="fedsilo test").save_as(root / "ann" / name)

    # one report of the case's two slides. S1: the tumour in 3D (the left half's rows 128-768), and a point that
    # encloses nothing; S2: necrosis over its right half (columns 512-896) in its level 1's pixels (a quarter of level
    # 0's), and a circle of radius 100 around (256, 512) in level 0's pixels
    s1 = pydicom.dcmread(root / "tumour" / "S1" / "L1.dcm")
    tumour = np.array([_slide_mm(x, y) for x, y in _square(0, 128, 512, 768)])
    point = np.array([_slide_mm(700, 700)])
    s2, s2_level1 = (pydicom.dcmread(root / "tumour" / "S2" / f) for f in ("L1.dcm", "L4.dcm"))

    def source(ds) -> Any:
        return hd.sr.SourceImageForRegion(referenced_sop_class_uid=ds.SOPClassUID, referenced_sop_instance_uid=ds.SOPInstanceUID)

    necrosis = hd.sr.ImageRegion(hd.sr.GraphicTypeValues.POLYLINE, np.array(_square(128, 32, 224, 224), dtype=float), source(s2_level1),
                                 pixel_origin_interpretation="VOLUME")
    circle = hd.sr.ImageRegion(hd.sr.GraphicTypeValues.CIRCLE, np.array([[256.0, 512.0], [356.0, 512.0]]), source(s2),
                               pixel_origin_interpretation="VOLUME")
    report([s1, s2, s2_level1], [
        roi("Tumour outline", "Neoplasm", hd.sr.ImageRegion3D(hd.sr.GraphicTypeValues3D.POLYGON, tumour, s1.FrameOfReferenceUID)),
        roi("a nucleus", "Nucleus", hd.sr.ImageRegion3D(hd.sr.GraphicTypeValues3D.POINT, point, s1.FrameOfReferenceUID)),
        roi("necrosis 1", "Necrosis", necrosis), roi("a gland", "Gland", circle)], "case.dcm")
    text = pydicom.dcmread(root / "ann" / "case.dcm")  # a report of another template on S2 (a text report) is no annotation
    text.ContentTemplateSequence[0].TemplateIdentifier = "2000"  # Basic Diagnostic Imaging Report
    text.SOPInstanceUID = text.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    text.save_as(root / "ann" / "text.dcm")

    regions = {"folder": "ann", "classes": {"Neoplasm": "tumour"}, "ignore": ["Gland"], "outside": "normal", "min_share": 0.99}
    rules = {"skip": ["ann"], "slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "regions": regions}}
    card, recs, _ = _dataset(tmp_path, "dicom_sr", rules, classes=("normal", "necrosis", "tumour"))
    xy = recs["id"].str.extract(r"#x(\d+)y(\d+)$").astype(int).to_numpy()
    label = recs["original_label"].to_numpy()
    s1_rows = (recs["source_path"] == "tumour/S1/L1.dcm").to_numpy()
    inside = (xy[:, 0] < 512) & (xy[:, 1] >= 128) & (xy[:, 1] < 768)
    assert s1_rows.sum() == 36 and (s1_rows & inside).sum() == 15 and (label[s1_rows & inside] == "Neoplasm").all()
    assert (label[s1_rows & ~inside] == "normal").all()
    s2_rows = (recs["source_path"] == "tumour/S2/L1.dcm").to_numpy()
    right = xy[:, 0] >= 512
    assert s2_rows.sum() == 36 and (label[s2_rows & right] == "Necrosis").all() and (label[s2_rows & ~right] == "normal").all()
    assert (s2_rows & right).sum() == 18 and card["domains"]["lab"]["excluded_by_reason"]["a slide's region annotations"] == 1

    # the circle, in level 0's pixels; classes by tracking identifier; a report with no Measurement Report is refused
    with slides.open_slide(str(root / "tumour" / "S2" / "L1.dcm")) as slide:
        frame = slides.slide_frame(slide, MPP0, root / "tumour" / "S2" / "L1.dcm")
    (name, (ring,)), = [r for r in slides.read_regions(root / "ann" / "case.dcm", frame) if r[0] == "Gland"]
    assert np.allclose(np.hypot(np.asarray(ring)[:, 0] - 256, np.asarray(ring)[:, 1] - 512), 100)
    assert [n for n, _ in slides.read_regions(root / "ann" / "case.dcm", frame, "label")] == ["necrosis 1", "a gland"]  # S2's only
    assert slides.dicom_annotation_refs(root / "ann" / "case.dcm") >= {s1.SeriesInstanceUID, s2.SeriesInstanceUID, s2_level1.SOPInstanceUID}
    assert slides.dicom_annotation_refs(root / "ann" / "text.dcm") is None
    # an annotation object cut short in a copy: no annotation, said (its slide would be tiled without its regions)
    cut = tmp_path / "cut.dcm"
    whole = (root / "ann" / "case.dcm").read_bytes()
    cut.write_bytes(whole[:152])  # inside the length field of its file meta header's second element
    with caplog.at_level(logging.WARNING, logger="fedsilo.slides"):
        assert slides.dicom_annotation_refs(cut) is None
    assert f"{cut}: a DICOM file whose header cannot be read" in caplog.text
    with pytest.raises(ValueError, match="a Structured Report whose content is no Measurement Report"):
        slides.read_regions(root / "ann" / "text.dcm", frame)


def test_dicom_segmentations_label_a_dicom_slides_patches(tmp_path, monkeypatch):
    """A DICOM Segmentation (made with highdicom on the slide's level 1, a quarter of level 0's pixels) found by the
    series it references: its tumour segment labels the patches it covers, a necrosis segment inside it wins where it
    lies (the smaller region), an ignored nucleus segment hides nothing; decoded a few rows at a time, the same."""
    pytest.importorskip("openslide")
    hd = pytest.importorskip("highdicom")
    import pydicom
    from pydicom.sr.codedict import codes
    from pydicom.uid import generate_uid

    root = tmp_path / "raw" / "lab"
    img = np.full((1024, 1024, 3), 238, np.uint8)
    img[128:896, 128:896] = (np.random.default_rng(2).integers(0, 50, (768, 768, 3)) + np.array([170, 70, 140])).astype(np.uint8)
    uids = (generate_uid(), generate_uid(), generate_uid())
    for d in (1, 4):
        _dicom_level(root / "tumour" / "S1" / f"L{d}.dcm", np.ascontiguousarray(img[::d, ::d]), MPP0 * d, uids, origin_mm=(20.0, 40.0))
    for cls in ("normal", "necrosis"):
        (root / cls).mkdir()
    mask = np.zeros((256, 256), np.uint8)  # level 1's pixels: x 32-128 and y 32-192 are level 0's 128-512 and 128-768
    mask[32:192, 32:128] = 1
    mask[96:128, 64:96] = 2  # level 0's patch at (256, 384)
    nuclei = np.zeros((256, 256), np.uint8)
    nuclei[34:190, 34:126] = 1  # most of the tumour
    described = [hd.seg.SegmentDescription(
        segment_number=k, segment_label=label, segmented_property_category=codes.SCT.MorphologicallyAbnormalStructure,
        segmented_property_type=hd.sr.CodedConcept("0", "99TEST", meaning), algorithm_type=hd.seg.SegmentAlgorithmTypeValues.MANUAL)
        for k, label, meaning in ((1, "tumour region", "Neoplasm"), (2, "necrosis", "Necrosis"), (3, "nuclei", "Nucleus"))]
    level1 = pydicom.dcmread(root / "tumour" / "S1" / "L4.dcm")
    seg = hd.seg.Segmentation(
        source_images=[level1], pixel_array=np.stack([mask == 1, mask == 2, nuclei == 1], axis=-1).astype(np.uint8)[None],
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY, segment_descriptions=described,
        series_instance_uid=generate_uid(), series_number=3, sop_instance_uid=generate_uid(), instance_number=1,
        manufacturer="fedsilo test", manufacturer_model_name="test", software_versions="1", device_serial_number="1",
        tile_pixel_array=True, tile_size=(64, 64))
    (root / "ann").mkdir()
    seg.save_as(root / "ann" / "seg.dcm")
    regions = {"folder": "ann", "classes": {"Neoplasm": "tumour"}, "ignore": ["Nucleus"], "outside": "normal", "min_share": 0.9}
    rules = {"skip": ["ann"], "slides": {"mpp": 1.0, "patch_px": 32, "min_tissue": 0.5, "max_patches": 10_000, "regions": regions}}
    results = []
    for rows in (256, 48):  # the whole matrix at once, and 48 rows at a time
        monkeypatch.setattr(slides, "SEGMENTATION_ROWS", rows)
        card, recs, _ = _dataset(tmp_path, f"seg{rows}", rules, classes=("normal", "necrosis", "tumour"))
        results.append(recs.set_index("id")["original_label"])
    pd.testing.assert_series_equal(results[0], results[1])
    xy = np.array([tuple(map(int, i.split("#x")[1].split("y"))) for i in results[0].index])
    label = results[0].to_numpy()
    tumour = (xy[:, 0] >= 128) & (xy[:, 0] < 512) & (xy[:, 1] >= 128) & (xy[:, 1] < 768)
    necrosis = (xy[:, 0] == 256) & (xy[:, 1] == 384)
    assert len(label) == 36 and (label[necrosis] == "Necrosis").all()
    assert (label[tumour & ~necrosis] == "Neoplasm").all() and (tumour & ~necrosis).sum() == 14  # the nuclei hid nothing
    assert (label[~tumour] == "normal").all()
    assert card["domains"]["lab"]["excluded_by_reason"]["a slide's region annotations"] == 1


def test_imagescope_xml_layers_negative_regions_and_ellipses(tmp_path):
    """Aperio ImageScope's XML: a region's class is its Text, else its layer's Name; a negative region is cut out of
    what lies under it; an ellipse is read from its bounding box; a ruler (two vertices) and a nameless region are not
    regions."""
    vertices = lambda pts: "".join(f'<Vertex X="{x}" Y="{y}" Z="0"/>' for x, y in pts)  # noqa: E731
    square = lambda x0, y0, x1, y1: vertices([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])  # noqa: E731
    (tmp_path / "s.xml").write_text(
        '<Annotations MicronsPerPixel="0.25"><Annotation Id="1" Name="Tumor" Type="4"><Regions>'
        f'<Region Id="1" Type="0" Text="" NegativeROA="0"><Vertices>{square(0, 0, 640, 640)}</Vertices></Region>'
        f'<Region Id="2" Type="0" Text="" NegativeROA="1"><Vertices>{square(64, 64, 192, 192)}</Vertices></Region>'
        f'<Region Id="3" Type="4" Text="" NegativeROA="0"><Vertices>{vertices([(0, 0), (600, 600)])}</Vertices></Region>'
        '</Regions></Annotation><Annotation Id="2" Name=""><Regions>'
        f'<Region Id="1" Type="2" Text="Necrosis" NegativeROA="0"><Vertices>{vertices([(320, 320), (576, 576)])}</Vertices></Region>'
        f'<Region Id="2" Type="0" Text="" NegativeROA="0"><Vertices>{square(0, 0, 64, 64)}</Vertices></Region>'
        '</Regions></Annotation></Annotations>')
    regions = slides.read_regions(tmp_path / "s.xml")
    assert [name for name, _ in regions] == ["Tumor", None, "Necrosis"]
    ellipse = regions[2][1][0]
    assert len(ellipse) == 256 and np.allclose(np.hypot(ellipse[:, 0] - 448, ellipse[:, 1] - 448), 128)
    xs = ys = np.arange(0, 640, 64)
    labels, named, _ = slides.region_labels(regions, {"Tumor": "tumour", "Necrosis": "necrosis"}.get, xs, ys, 64, 0.5)
    grid = np.array(labels, dtype=object).reshape(10, 10)
    assert (grid[1:3, 1:3] == None).all() and grid[0, 0] == "tumour" and grid[9, 9] == "tumour"  # noqa: E711 - cut out
    assert (grid[6:8, 6:8] == "necrosis").all() and grid[5, 5] == "tumour"  # the ellipse's inner cells; its bounding box's corner not


def test_scanline_fill_matches_point_in_polygon():
    """fill_rings takes exactly the cells whose centre lies inside (matplotlib's test of each centre), holes out."""
    from matplotlib.path import Path as Polygon

    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 2 * np.pi, 3000))
    r = 40 + 15 * rng.uniform(size=t.size)
    ring = np.c_[60 + r * np.cos(t), 50 + r * np.sin(t)]  # a ragged star, partly off the raster
    hole = np.c_[60 + 10 * np.cos(t[::30]), 50 + 10 * np.sin(t[::30])]
    mask = slides.fill_rings([ring, hole], (90, 130))
    yy, xx = np.mgrid[:90, :130]
    centres = np.c_[xx.ravel() + 0.5, yy.ravel() + 0.5]
    expected = Polygon(ring).contains_points(centres) & ~Polygon(hole).contains_points(centres)
    assert mask.sum() > 3000 and np.array_equal(mask, expected.reshape(90, 130))


def test_tissue_mask_keeps_glass_out():
    """Glass with JPEG chroma noise and a speck of dust is no tissue; on exactly grey glass (Otsu's threshold 0) the
    tissue is the stained disc and nothing else."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:256, :256]
    disc = (yy - 128) ** 2 + (xx - 128) ** 2 < 60**2
    noisy = cv2.GaussianBlur(np.clip(236 + rng.normal(0, 14, (256, 256, 3)), 0, 255).astype(np.uint8), (0, 0), 2)
    noisy[40:46, 40:46] = (120, 90, 60)  # a speck of dust
    ok, jpeg = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, 60])  # the scanner's JPEG: blocky chroma noise
    noisy = cv2.imdecode(jpeg, cv2.IMREAD_COLOR)
    assert ok and slides.tissue_mask(noisy).mean() < 0.005  # Otsu alone splits the noise: 12 % of the glass
    grey = np.full((256, 256, 3), 238, np.uint8)
    grey[disc] = (200, 110, 170)
    mask = slides.tissue_mask(grey)
    assert (mask == disc).mean() > 0.995
