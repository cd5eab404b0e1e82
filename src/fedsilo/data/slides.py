"""Whole-slide images of a site's own (a pathology department's scans) cut into patches, as the field's slide
pipelines do: a slide is read through tiffslide (Aperio ``.svs``, Hamamatsu ``.ndpi``, Leica ``.scn``, Ventana
``.bif``, and generic tiled pyramidal TIFF), its tissue found on a thumbnail (the saturation channel, median-blurred,
thresholded by Otsu's method: background glass is unsaturated), a grid of square patches laid over it at the
resolution asked for (``slides.mpp`` microns per pixel, ``slides.patch_px`` pixels a side), and the cells whose
tissue fraction reaches ``slides.min_tissue`` kept, at most ``slides.max_patches`` per slide, evenly spaced in
reading order. Each patch is an image of the slide's class (its class folder, or its table row) and group (the
slide, or the patient ``group`` / ``patient`` names), so a slide's patches never straddle a split; its id is
``<file>#x<X>y<Y>`` (its top-left corner in level-0 pixels). Each patch is read from the pyramid level nearest
its resolution (never a coarser one) and resized to the dataset's ``image_size`` with the other images.

A slide is found by its suffix, or for ``.tif`` / ``.tiff`` by being tiled with reduced-resolution levels or larger
than :data:`LARGE_TIFF_PX` pixels (a patch saved as TIFF stays an image). Without ``slides`` rules a slide is
excluded with the reason (it is never decoded whole: a 100,000-pixel-wide scan would need tens of GB).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from fedsilo.data.imageops import ImageDecodeError

SLIDE_SUFFIXES = (".svs", ".ndpi", ".scn", ".bif")
PLAUSIBLE_MPP = (0.05, 20.0)  # microns per pixel a slide scanner writes; outside it a header's value is a photo's dpi
LARGE_TIFF_PX = 20_000  # a single-level TIFF wider or taller than this is a slide, not a patch
SMALL_TIFF_BYTES = 8 * 2**20  # a .tif smaller than this is an image, whatever its header says (no header is read)
THUMBNAIL_PX = 2048  # the longer side of the thumbnail the tissue is found on
INSTALL_HINT = "whole-slide images are read with tiffslide: in fedsilo's checkout, pip install -e '.[slides]' -c constraints.txt"


def is_slide_file(path: Path) -> bool:
    """A whole-slide image by its suffix, or a ``.tif`` / ``.tiff`` that is tiled with reduced-resolution levels or
    very large (its header only is read; one that cannot be read is no slide: the image decoder then reports it)."""
    suffix = path.suffix.lower()
    if suffix in SLIDE_SUFFIXES:
        return True
    if suffix not in (".tif", ".tiff"):
        return False
    try:
        if path.stat().st_size < SMALL_TIFF_BYTES:  # a patch or a photograph saved as TIFF: not worth opening
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


@functools.lru_cache(maxsize=8)
def _open(path: str) -> Any:
    """An open slide, kept per process while its patches are decoded one after another. A forked worker starts
    with an empty cache (below): open files inherited from the parent share one read position, and tiles read
    through them by several processes at once come out wrong."""
    return _tiffslide().TiffSlide(path)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_open.cache_clear)


def level0_mpp(slide: Any, fallback: Optional[float]) -> Optional[float]:
    """Microns per level-0 pixel from the slide's header (tiffslide's ``mpp-x``) where it is one a scanner writes
    (:data:`PLAUSIBLE_MPP`; a TIFF saved at 72 dpi says 352.8), else ``fallback``."""
    mpp = slide.properties.get("tiffslide.mpp-x")
    try:
        mpp = float(mpp) if mpp is not None else None
    except (TypeError, ValueError):
        mpp = None
    return mpp if mpp is not None and PLAUSIBLE_MPP[0] <= mpp <= PLAUSIBLE_MPP[1] else fallback


def best_level(downsamples: Any, wanted: float) -> int:
    """The coarsest level whose downsample is at most ``wanted`` (1 % leeway: a level of 4.0001 serves 4)."""
    fits = [k for k, d in enumerate(downsamples) if float(d) <= wanted * 1.01]
    return max(fits, key=lambda k: float(downsamples[k])) if fits else 0


def tissue_mask(thumbnail: np.ndarray) -> np.ndarray:
    """Boolean tissue mask of an RGB thumbnail: saturation, median-blurred (7 px), above Otsu's threshold; all
    False when the thumbnail holds no colour to tell tissue from glass (Otsu's threshold below 8 of 255)."""
    import cv2

    sat = cv2.cvtColor(np.ascontiguousarray(thumbnail[..., :3], dtype=np.uint8), cv2.COLOR_RGB2HSV)[..., 1]
    sat = cv2.medianBlur(sat, 7)
    thr, mask = cv2.threshold(sat, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    if thr < 8:
        return np.zeros(sat.shape, dtype=bool)
    return mask > 0


def plan_patches(path: Path, rules: Any, key: str = "slides") -> tuple[list[tuple[int, int, int, int, int]], str]:
    """The patches of one slide: ``[(x, y, level, w, h), ...]`` (top-left corner in level-0 pixels, the level read
    and the region's size at that level), and "" or why the slide gives none (no plausible microns per pixel, a scan
    coarser than the patches, no reduced-resolution level to find the tissue on, smaller than a patch, no tissue).
    ``key``: the rules' dotted key, for the reasons. The slide is opened here and closed again (never kept open in
    this process: the decoding workers it forks read their own)."""
    with _tiffslide().TiffSlide(str(path)) as slide:
        mpp0 = level0_mpp(slide, rules.slide_mpp)
        if mpp0 is None:
            return [], f"no plausible microns per pixel in its header (set {key}.slide_mpp)"
        if rules.mpp < mpp0 * 0.99:  # a patch finer than the scan would be upsampled: detail that is not there
            return [], f"a scan at {mpp0:.3g} um/px, coarser than the patches' {rules.mpp:g} um/px ({key}.mpp)"
        width, height = slide.dimensions
        side0 = rules.patch_px * rules.mpp / mpp0  # a patch's side in level-0 pixels
        if side0 > min(width, height):
            return [], f"smaller than one patch ({rules.patch_px} px at {rules.mpp:g} um/px)"
        if slide.level_count == 1 and max(width, height) > LARGE_TIFF_PX:  # the thumbnail would decode the whole scan
            return [], ("no reduced-resolution levels to find its tissue on (convert it to a pyramidal TIFF, e.g. "
                        "vips tiffsave <in> <out>.tif --tile --pyramid --compression jpeg)")
        level = best_level(slide.level_downsamples, rules.mpp / mpp0)
        down = float(slide.level_downsamples[level])
        read = max(1, round(side0 / down))
        thumb = np.asarray(slide.get_thumbnail((THUMBNAIL_PX, THUMBNAIL_PX)).convert("RGB"))
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
    rows, cols = np.nonzero(frac >= rules.min_tissue)  # reading order: row by row
    if rows.size == 0:
        return [], f"no patch with {rules.min_tissue:.0%} tissue or more ({key}.min_tissue)"
    if rows.size > rules.max_patches:
        pick = np.unique(np.round(np.linspace(0, rows.size - 1, rules.max_patches)).astype(int))
        rows, cols = rows[pick], cols[pick]
    return [(int(xs[c]), int(ys[r]), level, read, read) for r, c in zip(rows, cols)], ""


def read_patch(path: str, patch: tuple[int, int, int, int, int]) -> np.ndarray:
    """The RGB pixels of one patch (``plan_patches``' tuple) at its level, uint8 HxWx3."""
    x, y, level, w, h = (int(v) for v in patch)
    try:
        arr = np.asarray(_open(str(path)).read_region((x, y), level, (w, h), as_array=True))
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001 - a slide's tile that cannot be decoded: quarantined with the reason
        raise ImageDecodeError(f"{path}: cannot read the patch at ({x}, {y}): {type(err).__name__}: {err}") from err
    arr = arr[..., :3]
    if arr.std() == 0:
        raise ImageDecodeError(f"{path}#x{x}y{y}: constant patch")
    return np.ascontiguousarray(arr, dtype=np.uint8)


def _plan_safe(args: tuple[Path, Any, str]) -> tuple[list[tuple[int, int, int, int, int]], str]:
    """:func:`plan_patches` of one slide, a slide tiffslide cannot read giving its reason (a worker's job)."""
    path, rules, key = args
    try:
        return plan_patches(path, rules, key)
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001 - a slide tiffslide cannot read is excluded with the reason, as any bad file
        return [], f"unreadable ({type(err).__name__}: {err})"


def expand_slides(rec: pd.DataFrame, raw_dir: Path, rules: Any, key: str, quiet: bool = False, workers: int = 1) -> pd.DataFrame:
    """``rec`` (a source of your own's records) with each kept slide's row replaced by one row per patch
    (:func:`plan_patches`, on ``workers`` processes: a thumbnail per slide): id ``<id>#x<X>y<Y>``, column ``patch``,
    the slide's class, group and subset; a slide that gives no patch stays one excluded row with the reason. Without
    ``rules`` (no ``slides`` set) every kept slide is excluded, naming the key that cuts it into patches."""
    from concurrent.futures import ProcessPoolExecutor

    from fedsilo.data.sources.base import explode_records
    from fedsilo.utils.progress import Progress

    slides = np.flatnonzero((rec["reader"] == "slide").to_numpy() & (rec["excluded"] == "").to_numpy())
    if slides.size == 0:
        return rec
    rec = rec.copy()
    if rules is None:
        rec.loc[rec.index[slides], "excluded"] = f"a whole-slide image (set {key}.slides to cut it into patches)"
        return rec
    jobs = [(raw_dir / str(rec["path"].iloc[i]), rules, f"{key}.slides") for i in slides]
    pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs))) if workers > 1 and len(jobs) > 1 else None
    plans: dict[int, list[tuple[int, int, int, int, int]]] = {}
    patches = 0
    bar = Progress(len(slides), f"slides {key.rsplit('.', 1)[-1]}", "slide", quiet=quiet)
    try:
        for i, (plan, why) in zip(slides, pool.map(_plan_safe, jobs) if pool is not None else map(_plan_safe, jobs)):
            plans[int(i)], patches = plan, patches + len(plan)
            if why:
                rec.loc[rec.index[i], "excluded"] = f"a whole-slide image: {why}"
            bar.update(info=f"{patches} patches")
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return explode_records(rec, [plans.get(i) or None for i in range(len(rec))], "patch", lambda p: f"#x{p[0]}y{p[1]}")
