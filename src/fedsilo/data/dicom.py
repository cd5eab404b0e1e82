"""DICOM -> uint8 grayscale, following DESIGN §3.

Order of operations (PS3.3 C.11 pixel pipeline, as pydicom implements it):

1. decode the stored pixels (pydicom, with pylibjpeg / openjpeg plugins for JPEG and JPEG 2000 transfer syntaxes);
2. modality LUT (Rescale Slope/Intercept or a Modality LUT Sequence);
3. VOI LUT Sequence or Window Center/Width when present (``apply_voi_lut`` prefers the LUT);
4. map to [0, 1]: with ``intensity="bit_depth"`` over the range the previous step can produce (the VOI output
   range when a VOI was applied, else the stored bit depth passed through the rescale); with
   ``intensity="percentile"`` over robust percentiles of the image;
5. invert MONOCHROME1 so that bone is always bright;
6. uint8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedsilo.data.imageops import ImageDecodeError, decode_error, percentile_range, to_unit_range, unit_to_uint8


def _stored_range(ds: Any) -> tuple[float, float]:
    bits = int(ds.BitsStored)
    if int(ds.get("PixelRepresentation", 0)) == 0:
        lo, hi = 0.0, float(2**bits - 1)
    else:
        lo, hi = float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)
    return lo, hi


def _modality_range(ds: Any) -> tuple[float, float]:
    if "ModalityLUTSequence" in ds and ds.ModalityLUTSequence:
        depth = int(ds.ModalityLUTSequence[0].LUTDescriptor[2])
        return 0.0, float(2**depth - 1)
    lo, hi = _stored_range(ds)
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    a, b = lo * slope + intercept, hi * slope + intercept
    return (min(a, b), max(a, b))


def _voi_range(ds: Any) -> tuple[float, float]:
    """Output range of pydicom's apply_voi_lut for this dataset."""
    if "VOILUTSequence" in ds and ds.VOILUTSequence:
        depth = int(ds.VOILUTSequence[0].LUTDescriptor[2])
        return 0.0, float(2**depth - 1)
    # windowing maps onto the modality output range (pydicom's apply_windowing)
    return _modality_range(ds)


DICOM_SUFFIXES = {".dcm", ".dicom"}


def is_dicom_file(path: str | Path) -> bool:
    """DICOM by suffix or by its preamble ("DICM" at byte 128), as hospital exports often have no suffix."""
    path = Path(path)
    if path.suffix.lower() in DICOM_SUFFIXES:
        return True
    with open(path, "rb") as fh:
        head = fh.read(132)
    return len(head) == 132 and head[128:] == b"DICM"


def view_position(path: str | Path) -> str:
    """The View Position (0018,5101) a DICOM file's header records ("" when it has none; several values joined by
    ``\\``, as DICOM writes them), read without its pixels; a header that cannot be read is an
    :class:`ImageDecodeError` naming the file and why."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(str(path), stop_before_pixels=True, specific_tags=["ViewPosition"])
        value = ds.get("ViewPosition", "") or ""
    except InvalidDicomError as err:
        raise decode_error(path, err, "cannot read the DICOM header: ") from err
    except Exception as err:  # noqa: BLE001 - a damaged header (unknown VR, bad lengths): the decoder's reasons too
        raise decode_error(path, err, f"cannot read the DICOM header: {type(err).__name__}: ") from err
    if isinstance(value, (list, tuple)) or type(value).__name__ == "MultiValue":  # several values: DICOM's backslash
        return "\\".join(str(v).strip() for v in value)
    return str(value).strip()


def has_voi(ds: Any) -> bool:
    return bool(("VOILUTSequence" in ds and ds.VOILUTSequence) or "WindowCenter" in ds)


def dicom_to_uint8(
    path: str | Path,
    intensity: str = "bit_depth",
    percentiles: tuple[float, float] = (0.5, 99.5),
    ds: Any = None,
    frame: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode one DICOM file (``ds``: the file as pydicom read it already, else it is read here); of a multi-frame
    file, frame ``frame`` only (0: the first; radiographs carry one). Returns (HxW uint8, header facts). Raises
    ImageDecodeError on any failure."""
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    try:
        if ds is None:
            ds = pydicom.dcmread(str(path), defer_size=DEFER)
        arr = _frame_pixels(ds, path, frame)
    except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError) as err:
        raise decode_error(path, err, "cannot decode DICOM pixels: ") from err
    photometric = str(ds.get("PhotometricInterpretation", "")).upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise ImageDecodeError(f"{path}: photometric interpretation {photometric!r} is not a grayscale radiograph")
    if arr.ndim == 3:  # a multi-frame file decoded whole (an older pydicom): the frame asked for
        arr = arr[frame]
    if arr.ndim != 2 or min(arr.shape) < 8:
        raise ImageDecodeError(f"{path}: unexpected pixel array shape {arr.shape}")
    try:
        values = apply_modality_lut(arr, ds)
        voi = has_voi(ds)
        if voi:
            values = apply_voi_lut(values, ds, prefer_lut=True)
            lo, hi = _voi_range(ds)
        else:
            lo, hi = _modality_range(ds)
        if intensity == "percentile":
            lo, hi = percentile_range(values, *percentiles)
        unit = to_unit_range(values, lo, hi, path)
    except (ValueError, KeyError, TypeError) as err:
        raise decode_error(path, err, "intensity pipeline failed: ") from err
    if photometric == "MONOCHROME1":
        unit = 1.0 - unit
    facts = {
        "photometric": photometric,
        "bits_stored": int(ds.get("BitsStored", 0)),
        "transfer_syntax": str(ds.file_meta.get("TransferSyntaxUID", "")),
        "voi_applied": voi,
        "view_position": str(ds.get("ViewPosition", "") or ""),
        "rows": int(arr.shape[0]),
        "cols": int(arr.shape[1]),
    }
    return unit_to_uint8(unit), facts


def _frames(ds: Any) -> int:
    try:
        return int(ds.get("NumberOfFrames", 1) or 1)
    except (TypeError, ValueError):
        return 1


DEFER = "1 MB"  # elements larger than this (the pixel data) are read from the file when used, not with the header


def _frame_pixels(ds: Any, path: str | Path, frame: int) -> np.ndarray:
    """The decoded pixels of frame ``frame`` of the file ``ds`` was read from (read with its pixel data deferred):
    of a multi-frame file that frame only, read from the file alone (pydicom's ``pixel_array(path, index=...)``: a
    cine's other frames are neither read nor decoded); a frame the file lacks is an error."""
    from pydicom.pixels import pixel_array

    n = _frames(ds)
    if not 0 <= frame < n:
        raise ImageDecodeError(f"{path}: has {n} frame{'s' if n != 1 else ''}, no frame {frame}")
    if n > 1:
        return pixel_array(str(path), index=frame)  # YBR as RGB, as ds.pixel_array gives it
    return ds.pixel_array


def frame_count(path: str | Path) -> int:
    """How many frames a DICOM file holds (its header's NumberOfFrames; 1 when absent), from its header only; 1
    when the header cannot be read (the decoder then quarantines the file with the reason)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        return _frames(pydicom.dcmread(str(path), stop_before_pixels=True))
    except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError):
        return 1


def frame_indices(n: int, frames: str | int) -> list[int]:
    """The frames of an ``n``-frame file that ``frames`` (``OwnImageRules.frames`` of fedsilo.config) takes: ``first`` -> [0];
    ``all`` -> every one; a number m -> m frames evenly spaced from the first to the last (every frame when n <= m)."""
    if frames == "first" or n <= 1:
        return [0]
    if frames == "all" or n <= int(frames):
        return list(range(n))
    m = int(frames)
    return [0] if m == 1 else sorted({round(k * (n - 1) / (m - 1)) for k in range(m)})


WHOLE_SLIDE = "1.2.840.10008.5.1.4.1.1.77.1.6"  # VL Whole Slide Microscopy Image Storage
WHOLE_SLIDE_PROBLEM = "a whole-slide image (its tiles are not read)"  # as one picture: harmonize cuts it into patches


def dicom_image_problem(path: str | Path) -> str:
    """Why a DICOM file is no image fedsilo reads ("" when it is one, or when its header cannot be read: the decoder
    then quarantines it with the reason): a DICOM without pixel data (a structured report, a presentation state, a
    DICOMDIR, ...) or a whole-slide image (thousands of tiles: not one picture). Reads the header only."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(str(path), defer_size="1 KB")
    except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError):
        return ""
    return dataset_problem(ds)


def dataset_problem(ds: Any) -> str:
    """:func:`dicom_image_problem` of a header already read (``pydicom.dcmread(..., defer_size=...)``: the pixel
    data's tag must be in it)."""
    sop = ds.get("SOPClassUID", None) or ds.file_meta.get("MediaStorageSOPClassUID", None)
    name = getattr(sop, "name", "") or str(sop or "unknown SOP class")
    if not any(tag in ds for tag in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
        return f"a DICOM without pixels ({name})"
    if str(sop) == WHOLE_SLIDE:
        return WHOLE_SLIDE_PROBLEM
    return ""


def whole_slide_instance(path: str | Path) -> Optional[tuple[str, str, int]]:
    """Of a DICOM whole-slide image's instance (one file of the series: a pyramid level, the label, the overview):
    its series' UID, its flavour (the third value of ImageType: VOLUME, LABEL, OVERVIEW, THUMBNAIL; VOLUME where the
    header has none) and the pixels of its total matrix; None for any other file. Reads the header only."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(str(path), stop_before_pixels=True)
    except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError):
        return None
    sop = ds.get("SOPClassUID", None) or ds.file_meta.get("MediaStorageSOPClassUID", None)
    if str(sop) != WHOLE_SLIDE:
        return None
    kinds = list(ds.get("ImageType", None) or [])
    flavour = str(kinds[2]).upper() if len(kinds) > 2 else "VOLUME"
    width = int(ds.get("TotalPixelMatrixColumns", None) or ds.get("Columns", None) or 0)
    height = int(ds.get("TotalPixelMatrixRows", None) or ds.get("Rows", None) or 0)
    return str(ds.get("SeriesInstanceUID", "")), flavour, width * height


def dicom_to_rgb(path: str | Path, frame: int = 0) -> np.ndarray:
    """Decode one DICOM file of any photometric interpretation to uint8 (HxW for greyscale, HxWx3 for colour): a
    site's own images outside chest X-rays (a dermatology photograph, an ultrasound frame, a slide's snapshot).
    MONOCHROME1/2 go through :func:`dicom_to_uint8` (modality and VOI LUTs): over the VOI window where the header has
    one, else over the image's 0.5-99.5 percentiles (a CT or MR slice scaled over its whole stored bit depth would be
    almost flat). RGB and YBR are taken as pydicom gives them in RGB (YBR converted), PALETTE COLOR through its lookup
    table, more than 8 bits scaled to 8. Of a multi-frame file (an ultrasound cine), frame ``frame`` (default the
    first), the only one decoded. A constant image, and any failure, raise ImageDecodeError."""
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.pixels import apply_color_lut

    try:
        ds = pydicom.dcmread(str(path), defer_size=DEFER)
        photometric = str(ds.get("PhotometricInterpretation", "")).upper()
        if photometric in ("MONOCHROME1", "MONOCHROME2"):
            grey = dicom_to_uint8(path, "bit_depth" if has_voi(ds) else "percentile", ds=ds, frame=frame)[0]  # read once
            if grey.std() == 0:
                raise ImageDecodeError(f"{path}: constant image")
            return grey
        if photometric != "RGB" and not photometric.startswith("YBR") and photometric != "PALETTE COLOR":
            raise ImageDecodeError(f"{path}: photometric interpretation {photometric!r} is neither greyscale nor colour")
        arr = _frame_pixels(ds, path, frame)  # pydicom 3 gives YBR (native or compressed) as RGB: its as_rgb default
        if arr.ndim == 4:  # decoded whole (an older pydicom): the frame asked for
            arr = arr[frame]
        if photometric == "PALETTE COLOR":
            arr = apply_color_lut(arr, ds)
    except ImageDecodeError:
        raise
    except (InvalidDicomError, AttributeError, ValueError, RuntimeError, OSError, EOFError, KeyError, NotImplementedError) as err:
        raise decode_error(path, err, "cannot decode DICOM pixels: ") from err
    if arr.ndim != 3 or arr.shape[2] != 3 or min(arr.shape[:2]) < 8:
        raise ImageDecodeError(f"{path}: unexpected colour pixel array shape {arr.shape}")
    if arr.dtype != np.uint8:  # 16-bit colour, or a palette's 16-bit entries: scaled to 8 bits over their range
        bits = int(ds.RedPaletteColorLookupTableDescriptor[2]) if photometric == "PALETTE COLOR" else int(ds.get("BitsStored", 16) or 16)
        arr = np.clip(np.round(arr.astype(np.float64) * 255.0 / (2**bits - 1)), 0, 255).astype(np.uint8)
    if arr.std() == 0:
        raise ImageDecodeError(f"{path}: constant image")
    return np.ascontiguousarray(arr)
