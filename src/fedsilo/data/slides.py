"""Whole-slide images of a site's own (a pathology department's scans) cut into patches, as the field's slide
pipelines do: a slide is read through tiffslide (Aperio ``.svs``, Hamamatsu ``.ndpi``, Leica ``.scn``, Ventana
``.bif``, and generic tiled pyramidal TIFF) or OpenSlide (a DICOM whole-slide image: a series of files in one folder,
one entry per series kept by :func:`one_entry_per_dicom_slide`; wsidicom where OpenSlide refuses the series:
:class:`WsiDicomSlide`), its tissue found on a thumbnail (the saturation channel, median-blurred,
thresholded by Otsu's method: background glass is unsaturated), a grid of square patches laid over it at the
resolution asked for (``slides.mpp`` microns per pixel, ``slides.patch_px`` pixels a side), and the cells whose
tissue fraction reaches ``slides.min_tissue`` kept, at most ``slides.max_patches`` per slide, evenly spaced in
reading order. Each patch is an image of the slide's class (its class folder, or its table row) and group (the
slide, or the patient ``group`` / ``patient`` names), so a slide's patches never straddle a split; its id is
``<file>#x<X>y<Y>`` (its top-left corner in level-0 pixels). Each patch is read from the pyramid level nearest
its resolution (never a coarser one) and resized to the dataset's ``image_size`` with the other images.

With ``slides.regions`` a patch is labelled from the slide's region annotations instead (:func:`read_regions`:
QuPath's GeoJSON export, ASAP's XML as CAMELYON16 ships it, Aperio ImageScope's XML, Hamamatsu NDP.view's ``.ndpa``
placed on its NDPI scan by the scan's header): the polygons are drawn on a raster aligned with the patch
grid (:data:`REGION_SUBCELLS` cells a side per patch), the larger regions first so that a region drawn inside another
(an ASAP exclusion inside a tumour, a QuPath annotation inside its parent) is what lies there, and a patch takes the
class whose regions cover ``regions.min_share`` of it or more; a patch no class covers enough takes the slide's own
class or is dropped (``regions.outside``). The tissue rule applies first: glass inside an annotation is no patch.

A slide is found by its suffix, or for ``.tif`` / ``.tiff`` by being tiled with reduced-resolution levels or larger
than :data:`LARGE_TIFF_PX` pixels (a patch saved as TIFF stays an image). Without ``slides`` rules a slide is
excluded with the reason (it is never decoded whole: a 100,000-pixel-wide scan would need tens of GB).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd

from fedsilo.data.dicom import is_dicom_file, whole_slide_instance
from fedsilo.data.imageops import ImageDecodeError

log = logging.getLogger("fedsilo.slides")

SLIDE_SUFFIXES = (".svs", ".ndpi", ".scn", ".bif")
PLAUSIBLE_MPP = (0.05, 20.0)  # microns per pixel a slide scanner writes; outside it a header's value is a photo's dpi
LARGE_TIFF_PX = 20_000  # a single-level TIFF wider or taller than this is a slide, not a patch
SMALL_TIFF_BYTES = 8 * 2**20  # a .tif smaller than this is an image, whatever its header says (no header is read)
MIN_TISSUE_SATURATION = 16  # of 255: blurred saturation below this is glass, whatever Otsu's threshold says
THUMBNAIL_PX = 2048  # the longer side of the thumbnail the tissue is found on
REGION_SUBCELLS = 8  # a patch's side in cells of the raster the region annotations are drawn on
REGION_RASTER_CELLS = 16_000_000  # at most this many raster cells per slide (fewer per patch on a very fine grid)
REGION_FILE_SUFFIXES = (".geojson", ".json", ".xml", ".ndpa")  # QuPath's GeoJSON, ASAP's / ImageScope's XML, NDP.view's
FOCAL_PLANE_UM = 0.01  # slides.focal_plane matches a z-stack's plane within this (headers write decimal um)
NDPA_MICRONS = {"nanometers": 1e-3, "micrometers": 1.0, "millimeters": 1e3}  # an NDP.view coordformat's unit in microns
DICOM_ANNOTATIONS = "1.2.840.10008.5.1.4.1.1.91.1"  # Microscopy Bulk Simple Annotations Storage (a DICOM slide's regions)
DICOM_SEGMENTATION = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage (a DICOM slide's regions as masks)
# Structured Reports whose Measurement Report (TID 1500) outlines a slide's regions as planar ROIs (TID 1410): Enhanced,
# Comprehensive and Comprehensive 3D SR (only the last holds 3D coordinates)
DICOM_SR = ("1.2.840.10008.5.1.4.1.1.88.22", "1.2.840.10008.5.1.4.1.1.88.33", "1.2.840.10008.5.1.4.1.1.88.34")
SEGMENTATION_ROWS = 256  # rows of a segmentation's total pixel matrix decoded at a time (a full-resolution one is huge)
QUPATH_02_NOT_REGIONS = ("PathDetectionObject", "PathCellObject", "PathTileObject")
ASAP_SHAPES = ("Polygon", "Spline", "Rectangle")  # ASAP annotation types that enclose an area (a Spline by its points)
INSTALL_HINT = ("whole-slide images are read with tiffslide (DICOM ones with OpenSlide and wsidicom, their annotation "
                "objects with highdicom): in fedsilo's checkout, "
                "pip install -e '.[slides]' -c constraints.txt")


def is_slide_file(path: Path, small_too: bool = False) -> bool:
    """A whole-slide image by its suffix, or a ``.tif`` / ``.tiff`` that is tiled with reduced-resolution levels or
    very large (its header only is read; one that cannot be read is no slide: the image decoder then reports it).
    A ``.tif`` under :data:`SMALL_TIFF_BYTES` is an image without its header read (a patch dataset's 100,000 TIFF
    patches are not opened twice) unless ``small_too``: where the rules cut slides (``slides`` set), a small biopsy's
    or a test export's pyramidal TIFF is a slide too."""
    suffix = path.suffix.lower()
    if suffix in SLIDE_SUFFIXES:
        return True
    if suffix not in (".tif", ".tiff"):
        return False
    try:
        if path.stat().st_size < SMALL_TIFF_BYTES and not small_too:  # a patch or a photograph saved as TIFF
            return False
    except OSError:
        return False
    try:
        import tifffile
    except ImportError:  # tiffslide (fedsilo[slides]) brings tifffile; without it, a very large TIFF by its size
        from PIL import Image

        try:
            with Image.open(path) as im:
                return max(im.size) > LARGE_TIFF_PX
        except Image.DecompressionBombError:  # Pillow's own refusal of a huge picture: a slide
            return True
        except Exception:  # noqa: BLE001 - not a TIFF Pillow reads: the image decoder says why
            return False
    try:
        with tifffile.TiffFile(path) as tif:
            page = tif.pages.first
            levels = len(tif.series[0].levels) if tif.series else 1
            return bool(page.is_tiled and levels > 1) or max(page.imagewidth, page.imagelength) > LARGE_TIFF_PX
    except Exception:  # noqa: BLE001 - not a TIFF tifffile reads: the image decoder says why
        return False


def _tiffslide() -> Any:
    try:
        import tiffslide
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return tiffslide


class WsiDicomSlide:
    """A DICOM whole-slide image OpenSlide 4 refuses (a transfer syntax it lacks: RLE, JPEG-LS, ...; several focal
    planes) read through wsidicom, with the part of OpenSlide's interface the patch planner and reader use:
    ``dimensions``, ``level_count``, ``level_downsamples`` (the mean of the width and height ratios, as OpenSlide's),
    ``properties`` (microns per pixel, and which focal plane and optical path are read), ``get_thumbnail``,
    ``read_region`` (a level-0 location; RGBA, transparent past the edge as OpenSlide's). A z-stack is read at
    ``focal_plane`` (um, as the header gives it; default its middle plane, of an even number the lower of the two
    middle ones; on each coarser level the plane nearest it), several optical paths at ``optical_path`` (default the
    first by identifier; the planes are that path's own, and a coarser level without it is left out); a plane or path
    level 0 lacks raises :class:`SlideViewError`. The series is the files of ``path``'s folder that share its
    SeriesInstanceUID, less the pyramid levels whose downsample is no power of two (wsidicom refuses a pyramid holding
    one; the others serve)."""

    def __init__(self, path: str, focal_plane: Optional[float] = None, optical_path: Optional[str] = None):
        import pydicom

        try:
            from wsidicom import WsiDicom
        except ImportError as err:
            raise ImportError(INSTALL_HINT) from err

        heads = {}
        for f in sorted(Path(path).parent.iterdir()):
            if f.is_file() and is_dicom_file(f):
                heads[f] = pydicom.dcmread(str(f), stop_before_pixels=True, specific_tags=[
                    "SeriesInstanceUID", "ImageType", "TotalPixelMatrixColumns"])
        mine = str(heads[Path(path)].get("SeriesInstanceUID", ""))
        series = {f: h for f, h in heads.items() if str(h.get("SeriesInstanceUID", "")) == mine}
        volume = {f: int(h.get("TotalPixelMatrixColumns", 0) or 0) for f, h in series.items()
                  if len(h.get("ImageType", None) or []) < 3 or str(h.ImageType[2]).upper() == "VOLUME"}
        widest = max(volume.values())
        files = [f for f in series if f not in volume or (volume[f] > 0 and abs(math.log2(widest / volume[f])
                                                                                 - round(math.log2(widest / volume[f]))) < 0.01)]
        self._wsi = WsiDicom.open(files)
        levels = sorted(self._wsi.levels, key=lambda lvl: lvl.level)  # level 0 first
        paths = sorted(str(p) for p in levels[0].optical_paths)
        if optical_path is not None and optical_path not in paths:
            self.close()
            raise SlideViewError("optical_path", f"no optical path {optical_path!r} (its paths: {', '.join(map(repr, paths))})")
        self._path = optical_path if optical_path is not None else paths[0]
        # the (path, plane) grid may be sparse: the planes are the chosen path's, and a coarser level without the
        # path is left out of the pyramid (the others serve)
        self._levels = [lvl for k, lvl in enumerate(levels) if k == 0 or self._path in lvl.focal_planes_by_optical_path]
        base = self._levels[0]
        self.dimensions = (int(base.size.width), int(base.size.height))
        self.level_count = len(self._levels)
        self.level_downsamples = tuple((self.dimensions[0] / lvl.size.width + self.dimensions[1] / lvl.size.height) / 2
                                       for lvl in self._levels)
        planes = self._planes(base)
        if focal_plane is None:
            self._z = planes[(len(planes) - 1) // 2]
        else:
            near = min(planes, key=lambda z: abs(z - focal_plane))
            if abs(near - focal_plane) > FOCAL_PLANE_UM:
                self.close()
                raise SlideViewError("focal_plane", f"no focal plane at {focal_plane:g} um (its planes"
                                     + (f" of optical path {self._path!r}" if len(paths) > 1 else "")
                                     + f": {', '.join(f'{z:g}' for z in planes)} um)")
            self._z = near
        self.properties = {"openslide.mpp-x": str(self._wsi.mpp.width), "openslide.mpp-y": str(self._wsi.mpp.height),
                           "wsidicom.focal-plane-um": str(self._z), "wsidicom.optical-path": str(self._path),
                           "wsidicom.focal-planes": str(len(planes)), "wsidicom.optical-paths": str(len(paths))}

    def _planes(self, lvl: Any) -> list[float]:
        """The focal planes a level holds of the optical path read."""
        return sorted(lvl.focal_planes_by_optical_path[self._path])

    def _plane(self, lvl: Any) -> float:
        return min(self._planes(lvl), key=lambda z: abs(z - self._z))

    def get_thumbnail(self, size: tuple[int, int]) -> Any:
        """The slide within ``size``, its aspect kept and never enlarged, as OpenSlide's: the coarsest level at least
        that large read whole (at its plane nearest the one read) on white, and resized."""
        from PIL import Image

        scale = min(size[0] / self.dimensions[0], size[1] / self.dimensions[1], 1.0)
        fit = (max(1, round(self.dimensions[0] * scale)), max(1, round(self.dimensions[1] * scale)))
        k = max(k for k, lvl in enumerate(self._levels) if k == 0 or (lvl.size.width >= fit[0] and lvl.size.height >= fit[1]))
        lvl = self._levels[k]
        whole = self.read_region((0, 0), k, (lvl.size.width, lvl.size.height))
        canvas = Image.new("RGB", whole.size, "white")
        canvas.paste(whole, mask=whole)
        return canvas if canvas.size == fit else canvas.resize(fit, Image.Resampling.LANCZOS)

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> Any:
        from PIL import Image

        lvl = self._levels[level]
        x = int(location[0] * lvl.size.width // self.dimensions[0])  # the level's own pixels
        y = int(location[1] * lvl.size.height // self.dimensions[1])
        out = Image.new("RGBA", (int(size[0]), int(size[1])), (0, 0, 0, 0))
        w, h = min(int(size[0]), lvl.size.width - x), min(int(size[1]), lvl.size.height - y)
        if w > 0 and h > 0:  # wsidicom refuses a region past the edge: what lies there stays transparent
            region = self._wsi.read_region((x, y), lvl.level, (w, h), z=self._plane(lvl), path=self._path)
            out.paste(region.convert("RGBA"), (0, 0))
        return out

    def close(self) -> None:
        self._wsi.close()

    def __enter__(self) -> "WsiDicomSlide":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SlideViewError(ValueError):
    """A DICOM slide lacks the focal plane or optical path ``slides.<field>`` asks for (the slide is excluded with
    the message)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def slide_view(rules: Any) -> tuple[Optional[float], Optional[str]]:
    """The focal plane and optical path a dataset's slide rules read (``slides.focal_plane`` / ``optical_path``;
    (None, None): the defaults, or no rules)."""
    return (None, None) if rules is None else (rules.focal_plane, rules.optical_path)


def open_slide(path: str, focal_plane: Optional[float] = None, optical_path: Optional[str] = None) -> Any:
    """A slide opened with its reader: OpenSlide for a DICOM whole-slide image (any instance of the series: it finds
    the others in the file's folder), or wsidicom where OpenSlide refuses the series (:class:`WsiDicomSlide`: a
    transfer syntax OpenSlide lacks, several focal planes) or a focal plane or optical path is asked for (OpenSlide
    refuses a z-stack, and of several optical paths shows one it cannot be told); tiffslide for the TIFF family (one plane and path: ``focal_plane``
    and ``optical_path`` are for DICOM slides). All give OpenSlide's interface. A series neither reads raises with
    both readers' reasons."""

    if is_dicom_file(path) and (focal_plane is not None or optical_path is not None):
        try:
            return WsiDicomSlide(path, focal_plane, optical_path)
        except (ImportError, SlideViewError):
            raise
        except Exception as err:  # noqa: BLE001 - the slide is then excluded with the reason
            raise ValueError(f"wsidicom (which reads a chosen focal plane or optical path): {type(err).__name__}: {err}") from err
    if is_dicom_file(path):
        try:
            import openslide
        except ImportError as err:
            raise ImportError(INSTALL_HINT) from err
        try:
            return openslide.OpenSlide(path)
        except openslide.OpenSlideError as refused:
            try:
                return WsiDicomSlide(path)
            except ImportError:
                raise
            except Exception as err:  # noqa: BLE001 - the slide is then excluded with both readers' reasons
                raise ValueError(f"OpenSlide: {refused}; wsidicom: {type(err).__name__}: {err}") from err
    return _tiffslide().TiffSlide(path)


@functools.lru_cache(maxsize=8)
def _open(path: str, focal_plane: Optional[float] = None, optical_path: Optional[str] = None) -> Any:
    """An open slide, kept per process while its patches are decoded one after another. A forked worker starts
    with an empty cache (below): open files inherited from the parent share one read position, and tiles read
    through them by several processes at once come out wrong."""
    return open_slide(path, focal_plane, optical_path)


def one_entry_per_dicom_slide(entries: list[dict], raw_dir: Path) -> list[dict]:
    """A DICOM whole-slide image is a series of files in one folder (a pyramid level per file, a label, an
    overview): of the scanned ``entries`` (``path`` below ``raw_dir``, ``reader``, ``reason``) its largest VOLUME
    instance stays the slide's entry (OpenSlide reads the pyramid through it, from that file's folder) and every other
    instance of the series, in that folder or another, is excluded saying what it is; a series of which no VOLUME
    instance is among the entries is excluded whole."""
    from collections import defaultdict

    series: dict[str, list[tuple[int, str, int, Path]]] = defaultdict(list)
    for k, e in enumerate(entries):
        if e.get("reader") != "slide" or e["reason"] or not e["path"]:
            continue
        path = Path(raw_dir) / e["path"]
        info = whole_slide_instance(path) if is_dicom_file(path) else None
        if info is not None:
            series[info[0] or str(path)].append((k, info[1], info[2], path.parent))
    for members in series.values():
        volumes = [m for m in members if m[1] == "VOLUME"]
        keep = max(volumes, key=lambda m: m[2]) if volumes else None
        for k, flavour, _, folder in members:
            if keep is not None and k == keep[0]:
                continue
            if keep is None:
                why = (f"a DICOM whole-slide image's {flavour.lower()} image, none of its pyramid levels among the files "
                       "read (a folder holding the series, or a table row naming one of its VOLUME files, reads it)")
            elif folder != keep[3]:  # OpenSlide reads a series from the folder of the file it opens
                why = "an instance of a DICOM whole-slide image in another folder than its largest level (keep a series in one folder)"
            elif flavour == "VOLUME":
                why = "a pyramid level of a DICOM whole-slide image (read through its largest level)"
            else:
                why = f"a DICOM whole-slide image's {flavour.lower()} image (not read)"
            entries[k] = {**entries[k], "reason": why}
    return entries


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_open.cache_clear)


OME_MICRONS = {"µm": 1.0, "um": 1.0, "micron": 1.0, "nm": 1e-3, "pm": 1e-6, "mm": 1e3, "cm": 1e4, "m": 1e6}


def ome_mpp(properties: Any) -> Optional[tuple[float, float]]:
    """Microns per pixel along x and y from an OME-TIFF's OME-XML (its first image's ``Pixels`` ``PhysicalSizeX`` /
    ``PhysicalSizeY`` in their units, microns by default): what QuPath and Bio-Formats' ``bfconvert`` write into the
    pyramidal OME-TIFFs they convert other formats to, and which tiffslide does not read. None where the description is
    no OME-XML or gives no size."""
    text = str(properties.get("tiff.ImageDescription") or "")
    if "<OME" not in text[:2000]:
        return None
    try:
        root = ET.fromstring(text.encode("utf-8") if text.lstrip().startswith("<?xml") else text)
    except ET.ParseError:
        return None
    pixels = next((e for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return None
    sizes = []
    for axis in ("X", "Y"):
        value, unit = pixels.get(f"PhysicalSize{axis}"), (pixels.get(f"PhysicalSize{axis}Unit") or "µm").strip()
        try:
            sizes.append(float(value) * OME_MICRONS[unit])  # type: ignore[arg-type]
        except (TypeError, ValueError, KeyError):
            return None
    return sizes[0], sizes[1]


def level0_mpp(slide: Any, fallback: Optional[float]) -> Optional[float]:
    """Microns per level-0 pixel from the slide's header (tiffslide's ``mpp-x``, an OME-TIFF's OME-XML: :func:`ome_mpp`)
    where it is one a scanner writes (:data:`PLAUSIBLE_MPP`; a TIFF saved at 72 dpi says 352.8), else ``fallback``."""
    mpp = slide.properties.get("tiffslide.mpp-x", slide.properties.get("openslide.mpp-x"))
    try:
        mpp = float(mpp) if mpp is not None else None
    except (TypeError, ValueError):
        mpp = None
    if mpp is None:
        mpp = (ome_mpp(slide.properties) or (None, None))[0]
    return mpp if mpp is not None and PLAUSIBLE_MPP[0] <= mpp <= PLAUSIBLE_MPP[1] else fallback


def best_level(downsamples: Any, wanted: float) -> int:
    """The coarsest level whose downsample is at most ``wanted`` (1 % leeway: a level of 4.0001 serves 4)."""
    fits = [k for k, d in enumerate(downsamples) if float(d) <= wanted * 1.01]
    return max(fits, key=lambda k: float(downsamples[k])) if fits else 0


def tissue_mask(thumbnail: np.ndarray) -> np.ndarray:
    """Boolean tissue mask of an RGB thumbnail: saturation, median-blurred (7 px), above Otsu's threshold and at
    least :data:`MIN_TISSUE_SATURATION`. The floor keeps glass out where Otsu finds nothing to split but glass and
    its JPEG noise (a slide with a speck of dust, or none, and glass that is exactly grey, an uncompressed scan's,
    which gives a threshold of 0); all False on a thumbnail of glass alone."""
    import cv2

    sat = cv2.cvtColor(np.ascontiguousarray(thumbnail[..., :3], dtype=np.uint8), cv2.COLOR_RGB2HSV)[..., 1]
    sat = cv2.medianBlur(sat, 7)
    thr, _ = cv2.threshold(sat, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    return sat > max(thr, MIN_TISSUE_SATURATION - 1)


Region = tuple[Optional[str], list[np.ndarray]]  # an annotation's class (None: it hides, labelling nothing) and its rings (exterior, then holes), level-0 px


def _ring(points: Any, where: str) -> np.ndarray:
    """A polygon ring as an (n, 2) float array of level-0 pixels, or the error naming ``where``."""
    try:
        arr = np.asarray(points, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: coordinates that are not numbers") from None
    if arr.ndim != 2 or arr.shape[1] < 2 or len(arr) < 3 or not np.isfinite(arr).all():
        raise ValueError(f"{where}: a ring needs three or more finite (x, y) points")
    return arr[:, :2]


def _geojson_polygons(geometry: Any, where: str) -> list[list[np.ndarray]]:
    """The polygons (rings) of a GeoJSON geometry: Polygon, MultiPolygon, a GeometryCollection of them; a point or a
    line encloses no area and gives none."""
    if not isinstance(geometry, dict):
        return []
    kind = geometry.get("type")
    if kind == "Polygon":
        return [[_ring(r, where) for r in geometry.get("coordinates") or []]]
    if kind == "MultiPolygon":
        return [[_ring(r, where) for r in poly] for poly in geometry.get("coordinates") or []]
    if kind == "GeometryCollection":
        return [p for g in geometry.get("geometries") or [] for p in _geojson_polygons(g, where)]
    return []


def _number(text: Optional[str], where: str) -> float:
    try:
        return float((text or "").replace(",", "."))
    except ValueError:
        raise ValueError(f"{where}: coordinates that are not numbers") from None


def _imagescope_regions(root: ET.Element) -> list[Region]:
    """The regions of an Aperio ImageScope XML (``<Annotations>``: one ``Annotation`` layer per class, its
    ``Region``s' ``Vertex`` points in level-0 pixels). A region's class is its ``Text`` where set, else its layer's
    ``Name``; a region with neither is not read. A negative region (``NegativeROA="1"``, cut out of its layer) is read
    with no class: it labels nothing and hides what lies under it. An ellipse (``Type="2"``: two vertices, the corners
    of its bounding box) becomes a 256-point polygon; any other region is the polygon of its vertices, and one of
    fewer than three (a ruler, an arrow) encloses no area and is not read."""
    out: list[Region] = []
    for n, layer in enumerate(root.iter("Annotation")):
        layer_name = (layer.get("Name") or "").strip()
        for m, region in enumerate(layer.iter("Region")):
            negative = (region.get("NegativeROA") or "0").strip() == "1"
            name = (region.get("Text") or "").strip() or layer_name
            if not name and not negative:
                continue
            where = f"layer {layer.get('Id') or n} region {region.get('Id') or m} ({name or 'negative'})"
            points = [[_number(v.get("X"), where), _number(v.get("Y"), where)] for v in region.iter("Vertex")]
            if (region.get("Type") or "").strip() == "2" and len(points) == 2:  # an ellipse in its bounding box
                (x0, y0), (x1, y1) = points
                t = np.linspace(0, 2 * np.pi, 256, endpoint=False)
                points = np.c_[(x0 + x1) / 2 + abs(x1 - x0) / 2 * np.cos(t), (y0 + y1) / 2 + abs(y1 - y0) / 2 * np.sin(t)]
            elif len(points) < 3:
                continue
            out.append((None if negative else name, [_ring(points, where)]))
    return out


class SlideFrame(NamedTuple):
    """Where a slide's level-0 pixels lie on the glass, for annotations drawn in physical units (NDP.view's): its
    size in pixels, microns per pixel along x and y, and the scan's centre's offset from the slide's centre in
    nanometres (Hamamatsu's ``XOffsetFromSlideCentre`` / ``YOffsetFromSlideCentre``; None: the header has none)."""

    width: int
    height: int
    mpp_x: float
    mpp_y: float
    offset_nm: Optional[tuple[float, float]]
    dicom: Optional[str] = None  # a DICOM whole-slide image's level-0 instance (the file the slide is read through)


def slide_frame(slide: Any, mpp0: float, path: Optional[Path] = None) -> SlideFrame:
    """An open slide's :class:`SlideFrame` (``mpp0``: its microns per level-0 pixel, :func:`level0_mpp`; the y
    resolution from the header where it gives a plausible one, else ``mpp0``; ``path``: the file it was opened from,
    kept where it is a DICOM whole-slide image's instance)."""

    props = slide.properties

    def number(*keys: str) -> Optional[float]:
        for key in keys:
            try:
                return float(props[key])
            except (KeyError, TypeError, ValueError):
                continue
        return None

    mpp_y = number("tiffslide.mpp-y", "openslide.mpp-y")
    if mpp_y is None:
        mpp_y = (ome_mpp(props) or (None, None))[1]
    if mpp_y is None or not PLAUSIBLE_MPP[0] <= mpp_y <= PLAUSIBLE_MPP[1]:
        mpp_y = mpp0
    off = (number("hamamatsu.XOffsetFromSlideCentre"), number("hamamatsu.YOffsetFromSlideCentre"))
    width, height = slide.dimensions
    return SlideFrame(int(width), int(height), float(mpp0), float(mpp_y),
                      None if off[0] is None or off[1] is None else (off[0], off[1]),
                      str(path) if path is not None and is_dicom_file(path) else None)


def _ndpa_regions(root: ET.Element, frame: Optional[SlideFrame]) -> list[Region]:
    """The regions of a Hamamatsu NDP.view annotation file (``<annotations>``: one ``ndpviewstate`` per annotation,
    its class the ``title``). Its coordinates are physical (``coordformat``: nanometres as NDP.view writes them, or
    micro- / millimetres) and measured from the centre of the glass slide, so they are placed on the scan by its
    header (``frame``): pixel = (coordinate - the scan's offset from the slide centre) / microns per pixel + half the
    scan's size. A closed freehand outline or a rectangle (``type="freehand"``, ``closed`` not 0) is a polygon; a
    circle (``x``, ``y``, ``radius``) a 256-point polygon; an open freehand line, a pin or a linear measure encloses no
    area and is not read; an annotation with no title is not read."""
    if frame is None or frame.offset_nm is None:
        raise ValueError("an NDP.view annotation is placed by its NDPI scan's offset from the slide centre "
                         "(hamamatsu.XOffsetFromSlideCentre / YOffsetFromSlideCentre), which this slide's header "
                         "does not give: is it the NDPI scan the annotation was drawn on?")
    off_x, off_y = (v / 1000 for v in frame.offset_nm)  # microns
    out: list[Region] = []
    for n, view in enumerate(root.iter("ndpviewstate")):
        title = (view.findtext("title") or "").strip()
        ann = view.find("annotation")
        if not title or ann is None:
            continue
        where = f"annotation {view.get('id') or n} ({title})"
        unit = (view.findtext("coordformat") or "nanometers").strip().lower()
        if unit not in NDPA_MICRONS:
            raise ValueError(f"{where}: coordformat {unit!r}, not one of {', '.join(NDPA_MICRONS)}")
        um = NDPA_MICRONS[unit]

        def pixels(x: Any, y: Any, um: float = um) -> np.ndarray:
            x = np.asarray(x, dtype=np.float64) * um
            y = np.asarray(y, dtype=np.float64) * um
            return np.c_[(x - off_x) / frame.mpp_x + frame.width / 2, (y - off_y) / frame.mpp_y + frame.height / 2]

        kind = (ann.get("type") or "").strip().lower()
        if kind == "circle":
            cx, cy, r = (_number(ann.findtext(tag), where) for tag in ("x", "y", "radius"))
            t = np.linspace(0, 2 * np.pi, 256, endpoint=False)
            ring = pixels(cx + r * np.cos(t), cy + r * np.sin(t))
        elif kind == "freehand" and (ann.findtext("closed") or "1").strip() != "0":
            points = [[_number(p.findtext("x"), where), _number(p.findtext("y"), where)] for p in ann.iter("point")]
            if len(points) < 3:
                continue
            arr = np.asarray(points)
            ring = pixels(arr[:, 0], arr[:, 1])
        else:
            continue
        out.append((title, [_ring(ring, where)]))
    return out


EVIDENCE = ("CurrentRequestedProcedureEvidenceSequence", "PertinentOtherEvidenceSequence")  # what an SR references


def dicom_annotation_refs(path: Path) -> Optional[set[str]]:
    """The UIDs a DICOM Microscopy Bulk Simple Annotations or Segmentation file references (the series of its
    ``ReferencedSeriesSequence`` and the images of its ``ReferencedImageSequence``), or a Structured Report whose
    content is a Measurement Report (TID 1500: the series and images of its evidence sequences), read from its header
    alone; None for any other file (another DICOM, a report of another template such as a text report, one that
    cannot be read, not a DICOM)."""
    import pydicom

    try:
        if not is_dicom_file(path):
            return None
    except OSError:  # unreadable: the slide readers name it where it is a slide
        return None
    try:
        ds = pydicom.dcmread(str(path), specific_tags=["SOPClassUID", "ReferencedSeriesSequence", "ReferencedImageSequence",
                                                       "ContentTemplateSequence", *EVIDENCE])
    except Exception as err:  # noqa: BLE001 - a DICOM whose header does not parse: said, since it may be a slide's regions
        log.warning("%s: a DICOM file whose header cannot be read (%s: %s): not read as an annotation object; a slide "
                    "whose regions it holds is tiled without them", path, type(err).__name__, err)
        return None
    sop = str(ds.get("SOPClassUID", None) or ds.file_meta.get("MediaStorageSOPClassUID", None))
    if sop not in (DICOM_ANNOTATIONS, DICOM_SEGMENTATION, *DICOM_SR):
        return None
    if sop in DICOM_SR and [str(t.get("TemplateIdentifier", "")) for t in ds.get("ContentTemplateSequence", None) or []] != ["1500"]:
        return None
    series = list(ds.get("ReferencedSeriesSequence", None) or [])
    for key in EVIDENCE if sop in DICOM_SR else ():  # per study, its series, each with its instances
        series += [s for study in ds.get(key, None) or [] for s in study.get("ReferencedSeriesSequence", None) or []]
    refs = {str(item.get("SeriesInstanceUID", "")) for item in series}
    refs |= {str(item.get("ReferencedSOPInstanceUID", "")) for item in ds.get("ReferencedImageSequence", None) or []}
    refs |= {str(i.get("ReferencedSOPInstanceUID", "")) for s in series for i in s.get("ReferencedSOPSequence", None) or []}
    return refs - {""}


def dicom_annotation_index(root: Path) -> dict[str, list[Path]]:
    """Every DICOM annotation file below ``root`` by each UID it references (:func:`dicom_annotation_refs`)."""
    from fedsilo.data.sources.base import walk

    index: dict[str, list[Path]] = {}
    for f in walk(root):
        refs = dicom_annotation_refs(f) if f.is_file() else None
        for uid in sorted(refs or ()):
            index.setdefault(uid, []).append(f)
    return index


def _ellipse(axes: np.ndarray) -> np.ndarray:
    """A 256-point polygon of the ellipse DICOM gives by the end points of its major and then its minor axis."""
    centre = (axes[0] + axes[1]) / 2
    t = np.linspace(0, 2 * np.pi, 256, endpoint=False)[:, None]
    return centre + np.cos(t) * (axes[1] - axes[0]) / 2 + np.sin(t) * (axes[3] - axes[2]) / 2


def _on_dicom_slide(frame: Optional[SlideFrame], what: str) -> tuple[Any, Any]:
    """highdicom and the level-0 header of the DICOM whole-slide image ``frame`` was read through, for a DICOM object
    (``what``) placed on it: the install hint where highdicom is missing, a ValueError where the slide is no DICOM one."""
    import pydicom

    try:
        import highdicom as hd
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    if frame is None or frame.dicom is None:
        raise ValueError(f"a DICOM {what} is placed on the DICOM whole-slide image it references; this slide is not one")
    return hd, pydicom.dcmread(frame.dicom, stop_before_pixels=True)


def _pixels_2d(frame: SlideFrame, level0: Any, ref: str) -> Callable[[np.ndarray], np.ndarray]:
    """Level-0 pixels from 2D coordinates in the total pixel matrix of the slide's image ``ref`` (its level 0 or a
    coarser level, scaled), found among the slide's files; a ValueError naming the image where it is not there."""
    import pydicom

    from fedsilo.data.sources.base import walk

    image = level0 if ref == str(level0.SOPInstanceUID) else None
    for f in ([] if image is not None else walk(Path(str(frame.dicom)).parent)):
        if f.is_file() and is_dicom_file(f):
            ds = pydicom.dcmread(str(f), stop_before_pixels=True, specific_tags=[
                "SOPInstanceUID", "TotalPixelMatrixColumns", "TotalPixelMatrixRows", "ImageType"])
            if str(ds.get("SOPInstanceUID", "")) == ref:
                image = ds
                break
    if image is None:
        raise ValueError(f"its 2D coordinates are in the pixels of the image {ref}, which is not among the slide's "
                         f"files ({Path(str(frame.dicom)).parent.name}/)")
    flavour = list(image.get("ImageType", None) or [])[2:3]
    if flavour and str(flavour[0]) not in ("VOLUME", "THUMBNAIL"):  # a label or overview photograph is not the pyramid
        raise ValueError(f"its 2D coordinates are in the pixels of the image {ref}, the slide's {flavour[0]} image, not "
                         "a level of its pyramid")
    scale = np.array([frame.width / int(image.TotalPixelMatrixColumns), frame.height / int(image.TotalPixelMatrixRows)])
    return lambda points: np.asarray(points, dtype=np.float64)[:, :2] * scale


def _pixels_3d(hd: Any, level0: Any, frame_of_reference: str) -> Callable[[np.ndarray], np.ndarray]:
    """Level-0 pixels from the slide coordinate system's millimetres, through the level-0 image's origin,
    orientation and pixel spacing (highdicom); a ValueError where the frame of reference is not the slide's."""
    if frame_of_reference != str(level0.get("FrameOfReferenceUID", "")):
        raise ValueError("3D coordinates in another frame of reference than the slide's (FrameOfReferenceUID)")
    to_image = hd.spatial.ReferenceToImageTransformer.for_image(level0, for_total_pixel_matrix=True)
    return lambda points: to_image(np.asarray(points, dtype=np.float64))[:, :2]


def _dicom_regions(path: Path, frame: Optional[SlideFrame], dicom_class: str) -> list[Region]:
    """The regions of a DICOM Microscopy Bulk Simple Annotations file (read with highdicom), placed on the DICOM
    whole-slide image it annotates (``frame.dicom``: the slide's level-0 instance). Each annotation group's class is
    its annotated property type's meaning (``dicom_class: property_type``, the coded concept: ``Neoplasm``) or its
    label (``label``: the group's free text). Coordinates: ``2D`` are the total pixel matrix's of the image the file
    references (a coarser level's scaled to level 0; the file's pixel origin must be the volume's); ``3D`` are the
    slide coordinate system's millimetres, mapped into the level-0 pixels by highdicom from that instance's origin,
    orientation and pixel spacing (the frame of reference must be the slide's). POLYGON and RECTANGLE are polygons,
    an ELLIPSE (its two axes' end points) a 256-point polygon; POINT and POLYLINE annotations enclose no area."""
    hd, level0 = _on_dicom_slide(frame, "annotation file")
    assert frame is not None
    ann = hd.ann.annread(str(path))
    kind = str(ann.AnnotationCoordinateType)
    if kind == "2D":
        if str(getattr(ann, "PixelOriginInterpretation", "VOLUME")) != "VOLUME":
            raise ValueError(f"2D coordinates relative to each frame (PixelOriginInterpretation "
                             f"{ann.PixelOriginInterpretation}), not to the total pixel matrix")
        to_pixels = _pixels_2d(frame, level0, str(ann.ReferencedImageSequence[0].ReferencedSOPInstanceUID))
    elif kind == "3D":
        to_pixels = _pixels_3d(hd, level0, str(getattr(ann, "FrameOfReferenceUID", "")))
    else:
        raise ValueError(f"AnnotationCoordinateType {kind!r}, neither 2D nor 3D")
    out: list[Region] = []
    for group in ann.get_annotation_groups():
        name = (group.label if dicom_class == "label" else group.annotated_property_type.meaning).strip()
        shape = group.graphic_type.value
        if not name or shape not in ("POLYGON", "RECTANGLE", "ELLIPSE"):
            continue
        where = f"annotation group {group.number} ({name})"
        for points in group.get_graphic_data(kind):
            pixels = to_pixels(points)
            out.append((name, [_ring(_ellipse(pixels) if shape == "ELLIPSE" else pixels, where)]))
    return out


def _sr_regions(path: Path, frame: Optional[SlideFrame], dicom_class: str) -> list[Region]:
    """The regions of a DICOM Structured Report whose content is a Measurement Report (TID 1500; read with
    highdicom): each planar ROI measurement group (TID 1410) is a region, placed on the DICOM whole-slide image it
    annotates (``frame.dicom``). Its class is the meaning of its finding type (``dicom_class: property_type``, the
    coded concept: ``Neoplasm``) or its tracking identifier (``label``: the group's free text). An ROI in 2D (SCOORD)
    is in the total pixel matrix of the image it references (a coarser level's scaled to level 0; relative to one
    frame, PixelOriginInterpretation FRAME, is refused); in 3D (SCOORD3D) in the slide coordinate system's
    millimetres, mapped as a Bulk Simple Annotations object's (its frame of reference must be the slide's). A closed
    POLYLINE and a POLYGON are polygons, an ELLIPSE (its two axes' end points) and a CIRCLE (its centre and a point on
    it) 256-point polygons; POINT, MULTIPOINT, an open POLYLINE and an ROI given as a segment of a Segmentation
    (read as that Segmentation) enclose no area here. A report may cover several slides (its evidence lists their
    series): an ROI on another one's image or frame of reference is that slide's, and passed over here."""
    hd, level0 = _on_dicom_slide(frame, "Structured Report")
    assert frame is not None
    sr = hd.sr.srread(str(path))
    report = sr.content  # highdicom parses a TID 1500 document's content as its Measurement Report
    if not isinstance(report, hd.sr.MeasurementReport):
        raise ValueError("a Structured Report whose content is no Measurement Report (TID 1500)")
    # what the report's evidence lists: each image's series (an ROI on another slide's image is that slide's)
    series_of = {str(i.ReferencedSOPInstanceUID): str(s.SeriesInstanceUID) for key in EVIDENCE for study in sr.get(key, None) or []
                 for s in study.get("ReferencedSeriesSequence", None) or [] for i in s.get("ReferencedSOPSequence", None) or []}
    others = set(series_of.values()) - {str(level0.SeriesInstanceUID)}  # the other slides the report covers, if any
    out: list[Region] = []
    placed: dict[str, Callable[[np.ndarray], np.ndarray]] = {}  # per referenced image (2D) or frame of reference (3D)
    for n, group in enumerate(report.get_planar_roi_measurement_groups(), 1):
        roi = group.roi
        if roi is None:
            continue
        if dicom_class == "label":
            name = str(group.tracking_identifier or "").strip()
        else:
            name = group.finding_type.meaning.strip() if group.finding_type is not None else ""
        shape = roi.graphic_type.value
        points = np.asarray(roi.value, dtype=np.float64)
        closed = shape == "POLYLINE" and len(points) > 3 and np.allclose(points[0], points[-1])
        if not name or shape not in ("POLYGON", "ELLIPSE", "CIRCLE") and not closed:
            continue
        where = f"planar ROI {n} ({name})"
        if isinstance(roi, hd.sr.ImageRegion3D):
            uid = str(roi.ReferencedFrameOfReferenceUID)
            if uid != str(level0.get("FrameOfReferenceUID", "")) and others:
                continue  # on another slide of the report's
            to_pixels = placed.get(uid) or placed.setdefault(uid, _pixels_3d(hd, level0, uid))
        else:
            images = [c for c in roi.get("ContentSequence", None) or [] if c.get("ValueType") == "IMAGE"]
            if not images:
                raise ValueError(f"{where}: a 2D region without the image it is drawn on (no IMAGE content item under it)")
            ref = images[0].ReferencedSOPSequence[0]
            origin = roi.get("PixelOriginInterpretation", None)
            if origin is None and "ReferencedFrameNumber" in ref or origin not in (None, "VOLUME"):
                raise ValueError(f"{where}: 2D coordinates relative to one frame (PixelOriginInterpretation {origin or 'absent'}, "
                                 f"frame {ref.get('ReferencedFrameNumber', '-')}), not to the total pixel matrix")
            uid = str(ref.ReferencedSOPInstanceUID)
            if series_of.get(uid) in others:
                continue  # an image of another slide of the report's
            to_pixels = placed.get(uid) or placed.setdefault(uid, _pixels_2d(frame, level0, uid))
        if shape == "CIRCLE":  # drawn where it is given (its centre, a point on it), then placed
            t = np.linspace(0, 2 * np.pi, 256, endpoint=False)[:, None]
            points = points[0] + np.linalg.norm(points[1] - points[0]) * np.c_[np.cos(t), np.sin(t)]
        pixels = to_pixels(points)
        out.append((name, [_ring(_ellipse(pixels) if shape == "ELLIPSE" else pixels, where)]))
    return out


class SegmentationMask:
    """A DICOM Segmentation of a DICOM whole-slide image (read with highdicom), as its segments' class names
    (``names``: per segment, its property type's meaning or its label, ``dicom_class``) and :meth:`sample`, which
    tells for level-0 points which segments hold them. The segmentation's total pixel matrix is placed on the slide
    through both images' origin, orientation and pixel spacing (highdicom's transformers): it may be coarser than level
    0 or cover it at another offset, not be rotated against it. It is decoded :data:`SEGMENTATION_ROWS` rows at a time
    (only the rows sampled), so a full-resolution one of a large slide fits in memory. A FRACTIONAL segment holds a
    pixel from 0.5 up."""

    def __init__(self, path: Path, frame: Optional[SlideFrame], dicom_class: str):
        hd, level0 = _on_dicom_slide(frame, "segmentation")
        self._seg = hd.seg.segread(str(path))
        if str(self._seg.get("FrameOfReferenceUID", "")) != str(level0.get("FrameOfReferenceUID", "")):
            raise ValueError("a segmentation in another frame of reference than the slide's (FrameOfReferenceUID)")
        if "TotalPixelMatrixRows" not in self._seg:
            raise ValueError("a segmentation with no total pixel matrix (not tiled like a slide)")
        self.numbers = list(self._seg.segment_numbers)
        described = [self._seg.get_segment_description(n) for n in self.numbers]
        self.names = [(d.segment_label if dicom_class == "label" else d.segmented_property_type.meaning).strip() for d in described]
        self.shape = (int(self._seg.TotalPixelMatrixRows), int(self._seg.TotalPixelMatrixColumns))
        to_mm = hd.spatial.ImageToReferenceTransformer.for_image(level0, for_total_pixel_matrix=True)
        to_seg = hd.spatial.ReferenceToImageTransformer.for_image(self._seg, for_total_pixel_matrix=True)
        o, ex, ey = to_seg(to_mm(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])))[:, :2]
        ax, ay = ex - o, ey - o  # one level-0 pixel along x and along y, in the segmentation's pixels
        if abs(ax[1]) > 1e-6 * abs(ax[0]) or abs(ay[0]) > 1e-6 * abs(ay[1]) or ax[0] <= 0 or ay[1] <= 0:
            raise ValueError("a segmentation rotated or flipped against its slide (its orientation differs)")
        self._x = (float(ax[0]), float(o[0]))  # segmentation column = x * scale + offset
        self._y = (float(ay[1]), float(o[1]))
        self._fractional = str(self._seg.SegmentationType) == "FRACTIONAL"

    def without(self, ignored: set[str], fold: Callable[[str], str]) -> "SegmentationMask":
        """This segmentation less the segments whose class (folded by ``fold``) is in ``ignored`` (``regions.ignore``)."""
        keep = [k for k, name in enumerate(self.names) if fold(name) not in ignored]
        self.numbers, self.names = [self.numbers[k] for k in keep], [self.names[k] for k in keep]
        return self

    def sample(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Boolean (len(ys), len(xs), segments): which segments hold each level-0 point (x, y); a point off the
        segmentation is in none."""
        u = np.floor(np.asarray(xs, dtype=np.float64) * self._x[0] + self._x[1]).astype(np.int64)
        v = np.floor(np.asarray(ys, dtype=np.float64) * self._y[0] + self._y[1]).astype(np.int64)
        out = np.zeros((len(v), len(u), len(self.numbers)), dtype=bool)
        if not self.numbers:  # every segment ignored
            return out
        cols = (u >= 0) & (u < self.shape[1])
        rows = np.flatnonzero((v >= 0) & (v < self.shape[0]))
        if not cols.any() or rows.size == 0:
            return out
        c0, c1 = int(u[cols].min()), int(u[cols].max()) + 1
        for start in range(int(v[rows].min()) // SEGMENTATION_ROWS * SEGMENTATION_ROWS, int(v[rows].max()) + 1, SEGMENTATION_ROWS):
            here = rows[(v[rows] >= start) & (v[rows] < start + SEGMENTATION_ROWS)]
            if here.size == 0:
                continue
            stop = min(start + SEGMENTATION_ROWS, self.shape[0])
            block = self._seg.get_total_pixel_matrix(row_start=start, row_end=stop, column_start=c0, column_end=c1,
                                                     segment_numbers=self.numbers, as_indices=True)
            block = block >= 0.5 if self._fractional else block > 0
            out[np.ix_(here, np.flatnonzero(cols))] = block[np.ix_(v[here] - start, u[cols] - c0)]
        return out


def _sop_class(path: Path) -> str:
    """A DICOM file's SOP class UID from its header ("" for a file that cannot be read as DICOM)."""
    import pydicom

    try:
        if not is_dicom_file(path):
            return ""
        ds = pydicom.dcmread(str(path), specific_tags=["SOPClassUID"])
    except Exception:  # noqa: BLE001 - a file that cannot be read has no SOP class
        return ""
    return str(ds.get("SOPClassUID", None) or ds.file_meta.get("MediaStorageSOPClassUID", None) or "")


def is_segmentation(path: Path) -> bool:
    """A DICOM Segmentation (by its header's SOP class)."""
    return _sop_class(path) == DICOM_SEGMENTATION


def read_regions(path: Path, frame: Optional[SlideFrame] = None, dicom_class: str = "property_type") -> list[Region]:
    """The classified areas of one slide's annotation file, in level-0 pixels: ``[(class name, [exterior, hole,
    ...]), ...]``. A ``.geojson`` / ``.json`` is QuPath's export (a FeatureCollection, a Feature or a list of
    Features; the class is ``properties.classification.name``; detections, cells and tiles, ``objectType`` other than
    ``annotation`` or QuPath 0.2's ``id`` naming them, are not regions); an ``.xml`` is ASAP's (``Annotation``
    elements of type Polygon, Spline or Rectangle, the class their ``PartOfGroup``, the points their ``Coordinate``s
    in ``Order``) or Aperio ImageScope's (:func:`_imagescope_regions`); an ``.ndpa`` is Hamamatsu NDP.view's, placed
    by the slide's ``frame`` (:func:`_ndpa_regions`); a DICOM file is a Microscopy Bulk Simple Annotations object
    (:func:`_dicom_regions`) or a Structured Report's Measurement Report (:func:`_sr_regions`), placed on the DICOM
    whole-slide image it annotates, its classes as ``dicom_class`` says. An annotation
    without a class is not read; one with too few or non-numeric points, or a file of none of these forms, is a
    ValueError."""

    if is_dicom_file(path):
        return (_sr_regions if _sop_class(path) in DICOM_SR else _dicom_regions)(path, frame, dicom_class)
    out: list[Region] = []
    if path.suffix.lower() in (".xml", ".ndpa"):
        root = ET.parse(path).getroot()
        if root.tag == "annotations":
            return _ndpa_regions(root, frame)
        if path.suffix.lower() == ".ndpa":
            raise ValueError(f"an .ndpa whose root is <{root.tag}>, not NDP.view's <annotations>")
        if root.tag == "Annotations":
            return _imagescope_regions(root)
        if root.tag != "ASAP_Annotations":
            raise ValueError(f"an XML whose root is <{root.tag}>, neither ASAP's <ASAP_Annotations>, Aperio "
                             "ImageScope's <Annotations> nor NDP.view's <annotations>")
        for n, ann in enumerate(root.iter("Annotation")):
            group = (ann.get("PartOfGroup") or "").strip()
            if ann.get("Type", "Polygon") not in ASAP_SHAPES or group in ("", "None"):
                continue
            where = f"annotation {ann.get('Name') or n} ({group})"
            coords = sorted(ann.iter("Coordinate"), key=lambda c: _number(c.get("Order") or "0", where))
            points = [[_number(c.get("X"), where), _number(c.get("Y"), where)] for c in coords]
            out.append((group, [_ring(points, where)]))
        return out
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and data.get("type") == "FeatureCollection":
        features = data.get("features")
    elif isinstance(data, dict) and data.get("type") == "Feature":
        features = [data]
    else:
        features = data
    if not isinstance(features, list):
        raise ValueError("not a GeoJSON FeatureCollection, Feature or list of Features (QuPath's export)")
    for n, feature in enumerate(features):
        if not isinstance(feature, dict):
            raise ValueError(f"feature {n}: not a GeoJSON Feature")
        props = feature.get("properties") or {}
        if str(props.get("objectType", "annotation")).lower() != "annotation" or feature.get("id") in QUPATH_02_NOT_REGIONS:
            continue  # QuPath's detections, cells and tiles (0.2 names them by the feature's id, later by objectType)
        cls = props.get("classification")
        name = cls.get("name") if isinstance(cls, dict) else cls
        if name is None or not str(name).strip():
            continue
        for rings in _geojson_polygons(feature.get("geometry"), f"feature {n} ({name})"):
            if rings:
                out.append((str(name).strip(), rings))
    return out


def annotation_file(slide: Path, rel: str, raw_dir: Path, regions: Any,
                    listings: Optional[dict[Any, Any]] = None) -> tuple[tuple[Path, ...], str]:
    """One slide's annotation file (``regions.folder``, or beside the slide; named after the slide's file with or
    without its suffix, or by its path below the source's folder; a DICOM whole-slide image, a folder of files, after
    its folder; found case-blind when no name matches exactly: ``n1.xml`` for ``N1.tif``) or, for a DICOM whole-slide
    image, every DICOM annotation object referencing its series or its level-0 image, anywhere in ``regions.folder``
    or, with none, in the source's folder (a pathologist's regions and an algorithm's nuclei are separate objects:
    their regions are read together); ``()`` and "" for none, or why it is ambiguous (two files by name, a file by
    name beside DICOM annotation objects). ``listings``: each folder's case-blind listing and the DICOM annotation
    objects by the UIDs they reference, kept across the slides of one source."""
    import pydicom

    from fedsilo.data.sources.tables import FoldedFiles

    listings = listings if listings is not None else {}
    folder = slide.parent if regions.folder is None else raw_dir / regions.folder
    rel_path = Path(rel)
    instance = slide
    if is_dicom_file(slide):  # the series' folder names the slide: S1/level0.dcm -> S1.geojson (beside: S1/S1.geojson)
        rel_path = rel_path.parent
        slide = slide.parent / slide.parent.name
    stems = [slide.stem, slide.name]
    if regions.folder is not None and rel_path.parent != Path("."):
        stems += [str(rel_path.with_suffix("")), str(rel_path)]
    names = {f"{stem}{suffix}" for stem in stems for suffix in REGION_FILE_SUFFIXES}
    found = sorted({folder / n for n in names if (folder / n).is_file()} - {slide}, key=str)
    if not found and folder.is_dir():  # as a table's paths are found: case and Unicode normalization aside
        listing = listings.setdefault(folder, FoldedFiles(folder))
        found = sorted({folder / hit for hit in (listing.find(n) for n in names) if hit} - {slide}, key=str)
    if instance is not slide:  # a DICOM slide: the annotation objects that reference it, wherever they lie
        root = raw_dir if regions.folder is None else folder
        key = ("dicom annotations", root)
        if key not in listings:
            listings[key] = dicom_annotation_index(root) if root.is_dir() else {}
        head = pydicom.dcmread(str(instance), stop_before_pixels=True, specific_tags=["SeriesInstanceUID", "SOPInstanceUID"])
        uids = {str(head.get("SeriesInstanceUID", "")), str(head.get("SOPInstanceUID", ""))} - {""}
        objects = sorted({f for uid in uids for f in listings[key].get(uid, [])} - set(found), key=str)
        if objects and found:
            return (), (f"an annotation file by its name ({', '.join(str(f.relative_to(raw_dir)) for f in found)}) and DICOM "
                        f"annotation objects referencing it ({', '.join(str(f.relative_to(raw_dir)) for f in objects)}): "
                        "keep one kind")
        if objects:
            return tuple(objects), ""
    if len(found) > 1:
        return (), f"{len(found)} annotation files ({', '.join(str(f.relative_to(raw_dir)) for f in found)}): keep one"
    return tuple(found), ""


def fill_rings(rings: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """Boolean (rows, cols) mask of the raster cells whose centre (``j + 0.5``, ``i + 0.5``) lies inside the polygon
    ``rings`` (raster units; its exterior and holes, by the even-odd rule), by scanlines: each edge's crossings of
    the rows' centre lines, sorted per row and paired, fill the cells between them (a cell on an edge's left is
    inside, on its right not). Linear in the crossings: a brush annotation of 20,000 vertices fills in milliseconds."""
    rows_n, cols_n = shape
    a = np.concatenate(rings)
    b = np.concatenate([np.roll(r, -1, axis=0) for r in rings])  # each ring closed: its last point back to its first
    lo, hi = np.minimum(a[:, 1], b[:, 1]), np.maximum(a[:, 1], b[:, 1])
    first = np.clip(np.ceil(lo - 0.5), 0, rows_n).astype(np.int64)  # the rows whose centre c has lo <= c < hi
    last = np.clip(np.ceil(hi - 0.5), 0, rows_n).astype(np.int64)
    count = np.maximum(last - first, 0)
    mask = np.zeros(shape, dtype=bool)
    if count.sum() == 0:
        return mask
    edge = np.repeat(np.arange(len(a)), count)
    row = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    centre = row + 0.5
    x = a[edge, 0] + (centre - a[edge, 1]) * (b[edge, 0] - a[edge, 0]) / (b[edge, 1] - a[edge, 1])
    order = np.lexsort((x, row))
    row, x = row[order], x[order]
    cells = np.clip(np.ceil(x - 0.5), 0, cols_n).astype(np.int64)  # the first cell whose centre is at or right of x
    diff = np.zeros((rows_n, cols_n + 1), np.int32)
    np.add.at(diff, (row[0::2], cells[0::2]), 1)  # every row has an even number of crossings: paired in order
    np.add.at(diff, (row[1::2], cells[1::2]), -1)
    return np.cumsum(diff, axis=1)[:, :cols_n] > 0


def region_labels(regions: list[Region], class_of: Callable[[str], Optional[str]], xs: np.ndarray, ys: np.ndarray,
                  step: int, min_share: float,
                  masks: Sequence["SegmentationMask"] = ()) -> tuple[list[Optional[str]], list[Optional[str]], np.ndarray]:
    """Per grid cell (row by row over ``ys`` x ``xs``, cells ``step`` level-0 pixels a side): the dataset class its
    regions give (None: no class covers ``min_share`` of it), the annotation class that covers most of it among that
    class's, and the covered share. ``class_of``: an annotation's class -> the dataset's (None: skipped; a skipped
    region labels nothing and hides what lies under it, as an ``Ignore*`` region inside a tumour does). The polygons,
    and the segments of ``masks`` (DICOM segmentations, sampled at the raster's cell centres), are drawn larger first
    on a raster of :data:`REGION_SUBCELLS` cells a side per grid cell (fewer when the grid is very fine), so the
    innermost region is what lies where regions overlap."""
    nx, ny = len(xs), len(ys)
    sub = max(1, min(REGION_SUBCELLS, int(math.sqrt(REGION_RASTER_CELLS / max(1, nx * ny)))))
    q = step / sub  # level-0 pixels per raster cell
    names = sorted({name for name, _ in regions if name is not None and class_of(name) is not None}
                   | {name for m in masks for name in m.names if class_of(name) is not None})
    ids = {name: k + 1 for k, name in enumerate(names)}  # 0: no region; -1: a skipped one
    raster = np.zeros((ny * sub, nx * sub), np.int16 if len(ids) < 2**15 - 1 else np.int32)

    def area(rings: list[np.ndarray]) -> float:
        shoelace = [abs(float(np.dot(r[:, 0], np.roll(r[:, 1], -1)) - np.dot(r[:, 1], np.roll(r[:, 0], -1)))) / 2 for r in rings]
        return shoelace[0] - sum(shoelace[1:])

    layers: list[tuple[float, int, Any]] = [(area(rings), ids.get(name, -1), rings) for name, rings in regions]
    centres_x, centres_y = (np.arange(nx * sub) + 0.5) * q, (np.arange(ny * sub) + 0.5) * q
    for m in masks:  # a segment: the raster cells whose centre it holds
        held = m.sample(centres_x, centres_y)
        layers += [(float(held[..., k].sum()) * q * q, ids.get(name, -1), held[..., k]) for k, name in enumerate(m.names)]
    for _, rid, shape in sorted(layers, key=lambda t: -t[0]):
        if isinstance(shape, np.ndarray) and shape.dtype == bool:
            raster[shape] = rid
            continue
        rings = shape
        scaled = [r / q for r in rings]  # raster units: cell (i, j) spans [j, j + 1) x [i, i + 1), its centre at + 0.5
        lo = np.maximum(np.floor(scaled[0].min(0)).astype(int), 0)
        hi = np.minimum(np.ceil(scaled[0].max(0)).astype(int), [raster.shape[1], raster.shape[0]])
        if (hi <= lo).any():
            continue  # wholly off the grid
        inside = fill_rings([r - lo for r in scaled], (int(hi[1] - lo[1]), int(hi[0] - lo[0])))
        raster[lo[1]:hi[1], lo[0]:hi[0]][inside] = rid
    cells = raster.reshape(ny, sub, nx, sub)
    share_of = {name: (cells == ids[name]).mean(axis=(1, 3)).ravel() for name in names}
    targets = sorted({class_of(n) for n in names}, key=str)
    if not targets:
        return [None] * (nx * ny), [None] * (nx * ny), np.zeros(nx * ny)
    by_class = np.stack([sum(share_of[n] for n in names if class_of(n) == t) for t in targets])
    best = by_class.argmax(0)
    share = by_class[best, np.arange(nx * ny)]
    labels: list[Optional[str]] = [targets[b] if s >= min_share else None for b, s in zip(best, share)]
    named = np.full(nx * ny, None, dtype=object)  # per labelled cell, its class's annotation covering most of it
    for t, cls in enumerate(targets):
        own = [n for n in names if class_of(n) == cls]
        here = (best == t) & (share >= min_share)
        named[here] = np.array(own, dtype=object)[np.stack([share_of[n] for n in own]).argmax(0)[here]]
    return labels, named.tolist(), share


def plan_patches(path: Path, rules: Any, key: str = "slides", annotations: Union[None, Path, tuple[Path, ...]] = (),
                 class_of: Optional[Callable[[str], Optional[str]]] = None,
                 outside: Optional[str] = None) -> tuple[list[tuple[int, int, int, int, int]], list[Optional[tuple[str, str, str]]], str]:
    """The patches of one slide: ``[(x, y, level, w, h), ...]`` (top-left corner in level-0 pixels, the level read
    and the region's size at that level), per patch None (the slide's class) or ``(class, annotation class,
    "region")`` its region annotations give (``(class, outside, "outside")`` where ``regions.outside`` names the class) (``rules.regions``: ``annotations`` the slide's file or None, ``class_of`` an
    annotation's name -> the dataset's class, ``outside`` the class ``regions.outside`` names: :func:`outside_class`),
    and "" or why the slide gives none (no plausible microns per pixel, a
    scan coarser than the patches, no reduced-resolution level to find the tissue on, smaller than a patch, no tissue,
    no annotated patch where the others are dropped). ``key``: the rules' dotted key, for the reasons. The slide is
    opened here and closed again (never kept open in this process: the decoding workers it forks read their own), at
    the focal plane and optical path the rules name (:func:`slide_view`)."""
    with open_slide(str(path), *slide_view(rules)) as slide:
        mpp0 = level0_mpp(slide, rules.slide_mpp)
        if mpp0 is None:
            return [], [], f"no plausible microns per pixel in its header (set {key}.slide_mpp)"
        if rules.mpp < mpp0 * 0.99:  # a patch finer than the scan would be upsampled: detail that is not there
            return [], [], f"a scan at {mpp0:.3g} um/px, coarser than the patches' {rules.mpp:g} um/px ({key}.mpp)"
        width, height = slide.dimensions
        side0 = rules.patch_px * rules.mpp / mpp0  # a patch's side in level-0 pixels
        if side0 > min(width, height):
            return [], [], f"smaller than one patch ({rules.patch_px} px at {rules.mpp:g} um/px)"
        if slide.level_count == 1 and max(width, height) > LARGE_TIFF_PX:  # the thumbnail would decode the whole scan
            return [], [], ("no reduced-resolution levels to find its tissue on (convert it to a pyramidal TIFF, e.g. "
                        "vips tiffsave <in> <out>.tif --tile --pyramid --compression jpeg)")
        level = best_level(slide.level_downsamples, rules.mpp / mpp0)
        down = float(slide.level_downsamples[level])
        read = max(1, round(side0 / down))
        thumb = np.asarray(slide.get_thumbnail((THUMBNAIL_PX, THUMBNAIL_PX)).convert("RGB"))
        frame = slide_frame(slide, mpp0, path)
    mask = tissue_mask(thumb).astype(np.float64)
    sy, sx = mask.shape[0] / height, mask.shape[1] / width
    integral = np.pad(mask.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    step = int(round(side0))
    xs, ys = np.arange(0, width - step + 1, step), np.arange(0, height - step + 1, step)
    x0, x1 = np.floor(xs * sx).astype(int), np.maximum(np.floor(xs * sx).astype(int) + 1, np.ceil((xs + step) * sx).astype(int))
    y0, y1 = np.floor(ys * sy).astype(int), np.maximum(np.floor(ys * sy).astype(int) + 1, np.ceil((ys + step) * sy).astype(int))
    x1, y1 = np.minimum(x1, mask.shape[1]), np.minimum(y1, mask.shape[0])
    area = (y1 - y0)[:, None] * (x1 - x0)[None, :]
    inside = integral[y1][:, x1] - integral[y0][:, x1] - integral[y1][:, x0] + integral[y0][:, x0]
    frac = inside / np.maximum(area, 1)
    keep = frac >= rules.min_tissue
    if not keep.any():
        return [], [], f"no patch with {rules.min_tissue:.0%} tissue or more ({key}.min_tissue)"
    given: list[Optional[tuple[str, str, str]]] = [None] * keep.size
    regions = rules.regions
    if regions is not None:
        assert class_of is not None
        drop = regions.outside == "drop"
        files = (annotations,) if isinstance(annotations, Path) else tuple(annotations or ())
        if not files and drop:
            return [], [], f"no annotation file, and patches outside the regions are dropped ({key}.regions.outside)"
        if files:
            drawn, masks = [], []
            ignored = {region_fold(name) for name in regions.ignore}
            for file in files:  # a DICOM slide's annotation objects and segmentations, read together
                try:
                    if is_segmentation(file):
                        masks.append(SegmentationMask(file, frame, regions.dicom_class).without(ignored, region_fold))
                    else:
                        drawn += read_regions(file, frame, regions.dicom_class)
                except (OSError, ValueError, RuntimeError, ET.ParseError, AttributeError, IndexError, KeyError) as err:
                    return [], [], f"its annotation file {file.name} cannot be read ({type(err).__name__}: {err})"
            drawn = [r for r in drawn if r[0] is None or region_fold(r[0]) not in ignored]
            labels, named, _ = region_labels(drawn, class_of, xs, ys, step, regions.min_share, masks)
            given = [(c, n, "region") if c is not None and n is not None else None for c, n in zip(labels, named)]
            if drop:
                keep &= np.array([g is not None for g in given], dtype=bool).reshape(keep.shape)
                if not keep.any():
                    return [], [], (f"no tissue patch its regions cover by {regions.min_share:.0%} or more, and the others "
                                    f"are dropped ({key}.regions)")
        if outside is not None:  # outside every region: the class outside names
            given = [g if g is not None else (outside, regions.outside, "outside") for g in given]
    rows, cols = np.nonzero(keep)  # reading order: row by row
    if rows.size > rules.max_patches:
        pick = np.unique(np.round(np.linspace(0, rows.size - 1, rules.max_patches)).astype(int))
        rows, cols = rows[pick], cols[pick]
    return ([(int(xs[c]), int(ys[r]), level, read, read) for r, c in zip(rows, cols)],
            [given[int(r) * len(xs) + int(c)] for r, c in zip(rows, cols)], "")


def read_patch(path: str, patch: tuple[int, int, int, int, int], focal_plane: Optional[float] = None,
               optical_path: Optional[str] = None) -> np.ndarray:
    """The RGB pixels of one patch (``plan_patches``' tuple) at its level, uint8 HxWx3, of the focal plane and
    optical path it was planned on (:func:`slide_view`)."""
    x, y, level, w, h = (int(v) for v in patch)
    try:
        slide = _open(str(path), focal_plane, optical_path)
        if type(slide).__module__.startswith("tiffslide"):  # straight to an array
            arr = np.asarray(slide.read_region((x, y), level, (w, h), as_array=True))
        else:  # OpenSlide: an RGBA picture, transparent where no tile was scanned (a sparse series) or past the edge
            region = slide.read_region((x, y), level, (w, h))
            arr = np.asarray(region)
            if (arr[..., 3] < 255).any():  # onto the slide's background, as OpenSlide's own thumbnails are
                from PIL import Image

                background = "#" + str(slide.properties.get("openslide.background-color") or "FFFFFF")
                canvas = Image.new("RGB", region.size, background)
                canvas.paste(region, mask=region)
                arr = np.asarray(canvas)
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001 - a slide's tile that cannot be decoded: quarantined with the reason
        raise ImageDecodeError(f"{path}: cannot read the patch at ({x}, {y}): {type(err).__name__}: {err}") from err
    arr = arr[..., :3]
    if arr.std() == 0:
        raise ImageDecodeError(f"{path}#x{x}y{y}: constant patch")
    return np.ascontiguousarray(arr, dtype=np.uint8)


def region_fold(name: str) -> str:
    """An annotation class as it is matched to the dataset's classes: case and surrounding spaces aside only (ASAP's
    ``_0`` is no class ``0``, as the class folders' looser rule would make it)."""
    return str(name).strip().casefold()


def outside_class(regions: Any, classes: tuple[str, ...], key: str) -> Optional[str]:
    """The dataset class ``regions.outside`` names (None for ``slide`` / ``drop``), or the error naming the key."""
    from fedsilo.data.sources.base import LabelFileError

    if regions is None or regions.outside in ("slide", "drop"):
        return None
    found = next((c for c in classes if region_fold(c) == region_fold(regions.outside)), None)
    if found is None:
        raise LabelFileError(f"{key}.regions.outside: {regions.outside!r} is none of slide, drop or a class of this dataset "
                             f"({', '.join(classes)})")
    return found


def plan_or_reason(args: tuple[Path, Any, str, tuple[Path, ...], tuple[str, ...]]) -> tuple[list[tuple[int, int, int, int, int]], list[Optional[tuple[str, str, str]]], str]:
    """:func:`plan_patches` of one slide, ``(path, rules, key, annotation files (none: ()), the dataset's classes)``, a
    slide its reader cannot open giving its reason (a harmonize worker's job, and ``site predict``'s); an annotation
    class that is none of the dataset's ``classes`` stops harmonize (LabelFileError, naming the file)."""
    from fedsilo.data.sources.base import LabelFileError
    from fedsilo.data.sources.classmap import ClassMap

    path, rules, key, annotations, classes = args
    class_of = None
    if rules.regions is not None:
        ignore = f"{key}.regions.ignore"
        classmap = ClassMap(rules.regions, f"{key}.regions", "annotation class", fold=region_fold,
                            hint=lambda v: f" (which hides what lies under it), or read it not at all with {ignore}: [{v}]")
        class_of = functools.partial(classmap.resolver(classes), where=", ".join(map(str, annotations)) or str(path))
    try:
        return plan_patches(path, rules, key, annotations, class_of, outside_class(rules.regions, classes, key))
    except (ImportError, LabelFileError):
        raise
    except SlideViewError as err:  # the plane or path asked for: the slide is excluded saying which it has
        return [], [], f"{err} ({key}.{err.field})"
    except Exception as err:  # noqa: BLE001 - a slide tiffslide cannot read is excluded with the reason, as any bad file
        return [], [], f"unreadable ({type(err).__name__}: {err})"


def expand_slides(rec: pd.DataFrame, raw_dir: Path, rules: Any, key: str, quiet: bool = False, workers: int = 1,
                  classes: tuple[str, ...] = (), warnings: Optional[list[str]] = None) -> pd.DataFrame:
    """``rec`` (a source of your own's records) with each kept slide's row replaced by one row per patch
    (:func:`plan_patches`, on ``workers`` processes: a thumbnail per slide): id ``<id>#x<X>y<Y>``, column ``patch``,
    the slide's group and subset, and its class, or with ``rules.regions`` the class its region annotations give
    (``original_label`` then the annotation's class, and a column ``label_from``: ``region``, ``outside`` or
    ``slide``; ``classes``: the dataset's, in label order); a slide that gives
    no patch stays one excluded row with the reason. Without ``rules`` (no ``slides`` set) every kept slide is
    excluded, naming the key that cuts it into patches. With region annotations, ``warnings`` gets a line for slides
    without an annotation file and for annotation files no slide found (a misspelt name reads as no annotation)."""
    from fedsilo.data.sources.base import LabelFileError, explode_records, walk
    from fedsilo.utils.progress import Progress
    from fedsilo.utils.workers import worker_pool

    slides = np.flatnonzero((rec["reader"] == "slide").to_numpy() & (rec["excluded"] == "").to_numpy())
    if slides.size == 0:
        return rec
    rec = rec.copy()
    if rules is None:
        rec.loc[rec.index[slides], "excluded"] = f"a whole-slide image (set {key}.slides to cut it into patches)"
        return rec
    outside_class(rules.regions, tuple(classes), f"{key}.slides")  # a class outside names must be the dataset's
    if rules.regions is not None and rules.regions.folder is not None and not (raw_dir / rules.regions.folder).is_dir():
        raise LabelFileError(f"{raw_dir / rules.regions.folder}: no such folder in the source ({key}.slides.regions.folder: "
                             f"{rules.regions.folder!r}; null: each annotation file beside its slide)")
    files: dict[int, tuple[Path, ...]] = {}  # each slide's annotation files (none, or no regions: ())
    ambiguous: dict[int, str] = {}  # slides excluded before planning: two files, or a file another slide finds too
    owners: dict[Path, list[int]] = {}
    listings: dict[Any, Any] = {}
    for i in map(int, slides):
        found, why = ((), "") if rules.regions is None else annotation_file(
            raw_dir / str(rec["path"].iloc[i]), str(rec["path"].iloc[i]), raw_dir, rules.regions, listings)
        files[i] = found
        if why:
            ambiguous[i] = why
        for f in found:
            owners.setdefault(f, []).append(i)
    for found, users in owners.items():  # two slides of one name in a flat annotations folder: neither is labelled by it
        if len(users) > 1 and _sop_class(found) not in DICOM_SR:  # a Structured Report may cover a case's slides
            for i in users:
                other = next(str(rec["path"].iloc[j]) for j in users if j != i)
                ambiguous[i] = (f"its annotation file {found.relative_to(raw_dir)} is also the slide {other}'s" + (
                    " (it references both)" if dicom_annotation_refs(found) is not None else
                    f" (mirror the slides' folders in {key}.slides.regions.folder)"))
    if rules.regions is not None and warnings is not None:
        bare = [str(rec["path"].iloc[i]) for i, f in files.items() if not f and i not in ambiguous]
        where = f"in {rules.regions.folder}/" if rules.regions.folder is not None else "beside it"
        if bare:
            what = {"slide": "take their slide's class", "drop": "are dropped"}.get(rules.regions.outside, f"are {rules.regions.outside}")
            warnings.append(f"{len(bare)} of {len(slides)} slides have no annotation file (e.g. {bare[0]}: looked for its "
                            f"name with .geojson, .json, .xml or .ndpa {where}" + (", or DICOM annotation objects referencing it"
                            if is_dicom_file(raw_dir / bare[0]) else "") + f"); all their patches {what} ({key}.slides.regions)")
        if rules.regions.folder is not None:
            unused = [f for f in walk(raw_dir / rules.regions.folder)
                      if f.is_file() and f.suffix.lower() in REGION_FILE_SUFFIXES and f not in owners]
            if unused:
                warnings.append(f"{len(unused)} annotation files match no slide (e.g. {unused[0].relative_to(raw_dir)}): "
                                "a file is named after its slide's file, with or without the slide's suffix")
        for index in (v for k, v in listings.items() if isinstance(k, tuple) and k[0] == "dicom annotations"):
            stray = sorted({f for files in index.values() for f in files} - set(owners), key=str)
            if stray:
                warnings.append(f"{len(stray)} DICOM annotation files annotate no slide read here (e.g. "
                                f"{stray[0].relative_to(raw_dir)}): one is matched to its slide by the series or image it "
                                "references")
    view = slide_view(rules)
    if warnings is not None and view != (None, None):  # a TIFF-family scan holds one plane and path
        asked = [f"{key}.slides.{f}" for f, v in zip(("focal_plane", "optical_path"), view) if v is not None]
        other = [str(rec["path"].iloc[i]) for i in map(int, slides) if not is_dicom_file(raw_dir / str(rec["path"].iloc[i]))]
        if other:
            warnings.append(f"{len(other)} of {len(slides)} slides are no DICOM whole-slide images (e.g. {other[0]}): "
                            f"{' and '.join(asked)} {'choose' if len(asked) > 1 else 'chooses'} among a DICOM series' planes "
                            "and paths; these are read at the one their reader gives")
    for i, why in ambiguous.items():
        rec.loc[rec.index[i], "excluded"] = f"a whole-slide image: {why}"
    if owners:  # an annotation file beside its slide was listed as a file of the source: say whose it is
        paths = {raw_dir / str(p): k for k, p in enumerate(rec["path"])}
        for found in owners:
            if found in paths and rec["reader"].iloc[paths[found]] != "slide":
                rec.loc[rec.index[paths[found]], "excluded"] = "a slide's region annotations"
    todo = [i for i in map(int, slides) if i not in ambiguous]
    jobs = [(raw_dir / str(rec["path"].iloc[i]), rules, f"{key}.slides", files[i], tuple(classes)) for i in todo]
    pool = worker_pool(min(workers, len(jobs))) if workers > 1 and len(jobs) > 1 else None
    plans: dict[int, list[tuple[int, int, int, int, int]]] = {}
    given: dict[int, list[Optional[tuple[str, str, str]]]] = {}
    patches = 0
    bar = Progress(len(todo), f"slides {key.rsplit('.', 1)[-1]}", "slide", quiet=quiet)
    try:
        for i, (plan, labels, why) in zip(todo, pool.map(plan_or_reason, jobs) if pool is not None else map(plan_or_reason, jobs)):
            if why:
                rec.loc[rec.index[i], "excluded"] = f"a whole-slide image: {why}"
            plans[i], given[i], patches = plan, labels, patches + len(plan)
            bar.update(info=f"{patches} patches")
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    out = explode_records(rec, [plans.get(i) or None for i in range(len(rec))], "patch", lambda p: f"#x{p[0]}y{p[1]}")
    flat = [g for i in range(len(rec)) for g in (given.get(i) if plans.get(i) else [None])]
    labelled = np.array([g is not None for g in flat], dtype=bool)
    if labelled.any():  # patches their regions label: the class the annotations give, the annotation's name
        index = {c: k for k, c in enumerate(classes)}
        out.loc[labelled, "label"] = [index[g[0]] for g in flat if g is not None]
        out.loc[labelled, "original_label"] = [g[1] for g in flat if g is not None]
    if rules.regions is not None:  # where each patch's class came from: its regions, the outside class, its slide
        out["label_from"] = [g[2] if g is not None else ("slide" if p is not None else "") for g, p in zip(flat, out["patch"])]
    return out
