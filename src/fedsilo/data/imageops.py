"""Pixel pipeline shared by every source: raw pixels -> normalized uint8 square image.

DICOM (DESIGN §3): modality LUT (rescale slope/intercept) -> VOI LUT or window when present -> scale to [0, 1]
using the stored bit depth (or robust percentiles) -> invert MONOCHROME1 -> uint8 -> centre crop / pad to a
square -> resize with area interpolation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import cv2
import numpy as np


class ImageDecodeError(RuntimeError):
    """A file that cannot be decoded into a usable image; harmonize quarantines it."""


def decode_error(path: str | Path, err: BaseException, what: str = "") -> ImageDecodeError:
    """``<path>: <what><err>`` with the path named once: the copy a decoder puts in its own message (PIL's ``cannot
    identify image file '<path>'``, an OSError's file name) is left out."""
    text = err.strerror if isinstance(err, OSError) and err.filename is not None and err.strerror else str(err)
    if type(err).__name__ == "InvalidDicomError" and "force=True" in text:  # pydicom's advice is for programmers
        text = ("not a DICOM file: no 'DICM' marker after a 128-byte preamble and no DICOM header at its start (another "
                "kind of file named .dcm, or one cut short)")
    name = str(path)
    for form in (repr(name), f'"{name}"', name):
        text = text.replace(f": {form}", "").replace(f" {form}", "").replace(form, "")
    text = text.strip(" :") or type(err).__name__
    return ImageDecodeError(f"{path}: {what}{text}")


def to_unit_range(
    arr: np.ndarray, lo: float, hi: float, path: str | Path
) -> np.ndarray:
    """Pixels over [lo, hi] to [0, 1]; an empty range (a constant image under the percentile rule, a DICOM window of
    width 0) is an ImageDecodeError naming ``path``, the file quarantined."""
    arr = arr.astype(np.float32)
    if hi <= lo:
        raise ImageDecodeError(f"{path}: degenerate intensity range [{lo}, {hi}] (a constant image, or a window of width 0)")
    return np.clip((arr - lo) / (hi - lo), 0.0, 1.0)


def percentile_range(arr: np.ndarray, lo_pct: float, hi_pct: float) -> tuple[float, float]:
    lo, hi = np.percentile(arr, [lo_pct, hi_pct])
    if hi <= lo:  # flat image: fall back to min/max so a constant image is reported, not divided by zero
        lo, hi = float(arr.min()), float(arr.max())
    return float(lo), float(hi)


def unit_to_uint8(unit: np.ndarray) -> np.ndarray:
    return np.round(unit * 255.0).astype(np.uint8)


def square(img: np.ndarray, how: Literal["crop", "pad"]) -> np.ndarray:
    h, w = img.shape[:2]
    if h == w:
        return img
    if how == "crop":
        s = min(h, w)
        top, left = (h - s) // 2, (w - s) // 2
        return img[top : top + s, left : left + s]
    s = max(h, w)
    out = np.zeros((s, s) + img.shape[2:], dtype=img.dtype)
    top, left = (s - h) // 2, (s - w) // 2
    out[top : top + h, left : left + w] = img
    return out


def resize_area(img: np.ndarray, size: int) -> np.ndarray:
    if img.shape[0] == size and img.shape[1] == size:
        return img
    # area averaging when shrinking, linear when either side grows (a non-square input is stretched to a square)
    interp = cv2.INTER_AREA if min(img.shape[:2]) >= size else cv2.INTER_LINEAR
    out = cv2.resize(img, (size, size), interpolation=interp)
    if img.ndim == 3 and out.ndim == 2:
        out = out[:, :, None]
    return out


def finish(img_u8: np.ndarray, size: int, how: Literal["crop", "pad"]) -> np.ndarray:
    """uint8 HxW(xC) -> uint8 size x size x C."""
    if img_u8.ndim == 2:
        img_u8 = img_u8[:, :, None]
    out = resize_area(square(img_u8, how), size)
    if out.ndim == 2:
        out = out[:, :, None]
    return np.ascontiguousarray(out)


def read_standard_image(path: str | Path, grayscale: bool) -> tuple[np.ndarray, int]:
    """Read a JPEG/PNG. Returns (pixels, bit_depth); 16-bit PNGs keep their depth."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                arr = np.asarray(im, dtype=np.uint32)
                depth = 16
                if not grayscale:
                    arr = np.repeat(arr[:, :, None], 3, axis=2)
                return arr, depth
            im = im.convert("L" if grayscale else "RGB")
            return np.asarray(im), 8
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise decode_error(path, err) from err


def normalize_standard(
    arr: np.ndarray, depth: int, intensity: str, percentiles: tuple[float, float], path: str | Path
) -> np.ndarray:
    """JPEG/PNG pixels -> uint8, with the same intensity rule as DICOMs."""
    if intensity == "percentile":
        lo, hi = percentile_range(arr, *percentiles)
    else:
        lo, hi = 0.0, float(2**depth - 1)
    if depth == 8 and intensity == "bit_depth":
        return arr.astype(np.uint8)
    return unit_to_uint8(to_unit_range(arr, lo, hi, path))
