"""The harmonize stage: raw sources -> one canonical dataset (``harmonize_dataset`` dispatches on ``kind``).

``chest_xray4`` (``harmonize_cxr``): DICOM / JPEG / PNG radiographs -> grey uint8, the label rules of each source.
Benchmarks (``harmonize_benchmark``: ``digits5``, ``office_caltech10``, ``pacs``, ``domainnet10``, ``kather_crc``, and
pFedDIL's ``digit10`` and ``office31``): every image -> RGB uint8 ``image_size`` x ``image_size`` (grey digits replicated to
three channels, as FedBN does), label = index in the dataset's class list, the distribution's own train / test / val
partition kept in ``subset``. Sources are relabelled to the dataset's class list by class name; a source class the
dataset lacks is excluded with its reason (``digit10`` keeps EMNIST ByClass's digits 0-9, not its letters).
Single-domain datasets (``cifar10``, ``cifar100``, ``fmnist``, ``emnist``, ``cinic10``) go the same way but keep the
data's own channels (grey: 1) unless ``channels: rgb``; their class list comes from the distribution where it carries
one.

Output folder (``data/harmonized/<dataset>/``):
- ``records.parquet``: one row per kept image, row i <-> ``images.npy[i]``; columns ``id`` (``<source>/<source id>``),
  ``domain``, ``label``, ``original_label``, ``group`` (patient; the image itself for benchmarks), ``view``,
  ``source_path``, ``subset``, ``writer`` where the source names one (FEMNIST), and ``label_from`` where slides'
  region annotations label patches (``region``, ``outside``, ``slide``);
- ``images.npy``: uint8 N x H x W x C, memory-mappable (``np.load(..., mmap_mode="r")``);
- ``excluded.parquet``: every record the label rules excluded, with the reason;
- ``quarantine.csv``: kept records whose image could not be decoded (or is missing), with the error;
- ``card.json`` / ``card.md``: the data card: counts per domain and class, exclusions and quarantine by reason,
  the rules used, the sha256 of ``records.parquet`` and ``images.npy``;
- ``samples.png``: the contact sheet (:mod:`fedsilo.data.contact_sheet`): the first images of every domain and class
  as harmonized, shown in ``card.md``, their ids in ``card.json``.

A source (CXR) or domain (benchmarks) whose quarantined fraction exceeds ``max_quarantine_fraction`` fails the
stage, naming the first files and errors.
Everything is written to a temporary folder and renamed into place at the end.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import pandas as pd

from fedsilo.config import CXR_SOURCES, DATASET_SOURCES, BenchmarkDatasetParams, CXRDatasetParams
from fedsilo.data.contact_sheet import write_contact_sheet
from fedsilo.data.imageops import (
    ImageDecodeError,
    decode_error,
    finish,
    normalize_standard,
    read_standard_image,
    resize_area,
    square,
)
from fedsilo.data.slides import expand_slides, slide_view
from fedsilo.data.sources import cxr_table, image_folder, image_table, source_module
from fedsilo.data.sources.base import LabelFileError, explode_records
from fedsilo.utils.io import atomic_dir, file_sha256, write_json
from fedsilo.utils.progress import Progress
from fedsilo.utils.workers import worker_pool


class HarmonizeError(RuntimeError):
    pass


def to_square(img: np.ndarray, size: int, how: str, rgb: bool = True) -> np.ndarray:
    """uint8 HxW or HxWxC (C = 1, 3, 4) -> uint8 size x size x C, C = 3 (grey replicated, alpha dropped) or, with
    ``rgb=False``, the image's own 1 or 3; ``how``: stretch | crop | pad."""
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 1 and rgb:
        img = np.repeat(img, 3, axis=2)
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    elif img.shape[2] not in (1, 3):
        raise ImageDecodeError(f"unsupported channel count {img.shape[2]}")
    if how != "stretch":
        img = square(img, how)  # type: ignore[arg-type]
    out = resize_area(img, size)
    if out.ndim == 2:
        out = out[:, :, None]
    return np.ascontiguousarray(out, dtype=np.uint8)


def to_rgb_square(img: np.ndarray, size: int, how: str) -> np.ndarray:
    """uint8 HxW or HxWxC (C = 1, 3, 4) -> uint8 size x size x 3; ``how``: stretch | crop | pad."""
    return to_square(img, size, how, rgb=True)


def decode_one(args: tuple) -> np.ndarray:
    """One image file to the dataset's uint8 square: ``(path, reader, size, square, intensity, percentiles[,
    where])``; ``where``: the frame of a multi-frame DICOM (``dicom_rgb``; default the first), or a slide's patch
    (``slide``: ``(x, y, level, w, h)`` and the slide's ``(focal plane, optical path)``,
    :func:`fedsilo.data.slides.read_patch`)."""
    path, reader, size, square, intensity, pct, *rest = args
    if reader == "rgb":
        arr, _ = read_standard_image(path, grayscale=False)
        if arr.dtype != np.uint8:
            arr = (arr.astype(np.float64) / 257.0).round().astype(np.uint8)  # 16-bit PNG -> 8 bit
        return to_rgb_square(arr, size, square)
    if reader == "slide":  # a patch of a site's own whole-slide image: (x, y, level, w, h)
        from fedsilo.data.slides import read_patch

        if not rest or rest[0] is None:  # a slide itself is never decoded whole (tens of GB)
            raise ImageDecodeError(f"{path}: a whole-slide image, not one picture (harmonize cuts slides into patches: slides)")
        return to_rgb_square(read_patch(path, rest[0], *(rest[1] if len(rest) > 1 else ())), size, square)
    if reader == "dicom_rgb":  # a site's own DICOM beside the benchmark images: grey or colour, to RGB
        from fedsilo.data.dicom import dicom_to_rgb

        return to_rgb_square(dicom_to_rgb(path, frame=int(rest[0]) if rest else 0), size, square)
    if reader == "dicom":
        from fedsilo.data.dicom import dicom_to_uint8

        img, _ = dicom_to_uint8(path, intensity, pct)
    else:
        arr, depth = read_standard_image(path, grayscale=True)
        img = normalize_standard(arr, depth, intensity, pct, path)
    if img.std() == 0:
        raise ImageDecodeError(f"{path}: constant image")
    return finish(img, size, square)  # type: ignore[arg-type]


def _decode_safe(args: tuple) -> tuple[np.ndarray | None, str]:
    try:
        return decode_one(args), ""
    except ImageDecodeError as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - any decoder crash is a quarantine reason, reported with its type
        return None, str(decode_error(args[0], err, f"{type(err).__name__}: "))


def iter_decoded(jobs: list[tuple], workers: int, domains: Optional[list[str]] = None, desc: str = "harmonize",
                 quiet: bool = False) -> Iterator[tuple[np.ndarray | None, str]]:
    """Decode every job (in worker processes when there are enough), yielding (image or None, error) in job order as
    they come, showing images done and images/s per domain (``domains[i]`` is job i's; jobs of a domain are
    contiguous). A domain's jobs go to the workers once the previous domain's are done, and its clock starts then:
    decoding ahead across domains made a small domain's images/s the pool's whole lead (25,000 images/s for 39
    DICOMs). A caller that stores each image as it comes holds a few in memory, not the dataset."""
    domains = domains if domains is not None else [""] * len(jobs)
    runs = [(dom, len(list(group))) for dom, group in itertools.groupby(domains)]  # contiguous (domain, count)
    pool: Optional[ProcessPoolExecutor] = None
    bar: Optional[Progress] = None
    try:
        if workers > 1 and len(jobs) >= 16:
            pool = worker_pool(workers)
        start = 0
        for dom, n in runs:
            bar = Progress(n, f"{desc} {dom}".rstrip(), "image", quiet=quiet)  # before the domain's first decode
            part = jobs[start:start + n]
            results = pool.map(_decode_safe, part, chunksize=max(1, min(64, n // (workers * 8)))) if pool else map(_decode_safe, part)
            for res in results:
                bar.update(1)  # counted before it is handed on: the last one too, whatever the caller does next
                yield res
            bar.close()
            bar, start = None, start + n
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:  # a caller that stops early (a refusal, Ctrl-C) does not wait for the remaining decodes
            pool.shutdown(wait=True, cancel_futures=True)


def decode_all(jobs: list[tuple], workers: int, domains: Optional[list[str]] = None, desc: str = "harmonize",
               quiet: bool = False) -> list[tuple[np.ndarray | None, str]]:
    """:func:`iter_decoded`'s results as one list (a few files: ``fedsilo predict``, the bench)."""
    return list(iter_decoded(jobs, workers, domains, desc, quiet))


class ImageSpool:
    """Harmonized images written straight into the output's ``images.npy`` (inside the atomic write's temporary
    folder) as they are decoded, slot ``i`` = kept record ``i``: harmonize holds a few images in memory, not the dataset
    (a hospital's 100k radiographs at 224 px are 5 GB; RGB benchmarks three times that). Every image must have the
    first one's shape (a grey image silently broadcast into three channels would hide a mixed dataset). ``finish``
    keeps the given slots, moving them down in place and shrinking the file: no second copy on disk."""

    def __init__(self, folder: Path, capacity: int, name: str):
        self.path, self.capacity, self.name = Path(folder) / "images.npy", capacity, name
        self.arr: Optional[np.ndarray] = None
        self.first = ""

    def put(self, i: int, img: np.ndarray, image_id: str) -> None:
        if self.arr is None:
            self.arr = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.uint8, shape=(self.capacity,) + img.shape)
            self.first = image_id
        elif img.shape != self.arr.shape[1:]:
            raise HarmonizeError(f"{self.name}: image of {image_id} is {img.shape}, the first ({self.first}) is {self.arr.shape[1:]}")
        self.arr[i] = img

    def decode_into(self, slot_jobs: list[tuple[int, tuple]], ids: pd.Series, errors: list[str], ok: np.ndarray,
                    workers: int, domains: list[str], desc: str, quiet: bool) -> None:
        """Decode each (slot, job) (:func:`iter_decoded`) into its slot as it comes; ``ok[slot]`` says it did,
        ``errors[slot]`` why not; ``ids`` names the slots' records (for the shape refusal)."""
        for (i, _), (img, err) in zip(slot_jobs, iter_decoded([j for _, j in slot_jobs], workers, domains, desc, quiet)):
            if img is None:
                errors[i] = err
            else:
                self.put(i, img, str(ids.iloc[i]))
                ok[i] = True

    def finish(self, rows: np.ndarray) -> None:
        """Keep the slots ``rows`` (ascending), in order, as the whole array: each moved down to its place (a slot
        only ever moves to a lower one, so nothing is overwritten before it is read), the header rewritten for the
        new count and the file cut after the last kept image."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.arr is None or not len(rows):
            raise HarmonizeError(f"{self.name}: no image survived the label rules and decoding")
        for k, r in enumerate(rows):
            if r != k:
                self.arr[k] = self.arr[r]
        self.arr.flush()
        row_bytes = int(np.prod(self.arr.shape[1:]))
        self.arr = None
        if len(rows) < self.capacity:
            _shrink_npy(self.path, len(rows), row_bytes)


def _shrink_npy(path: Path, n: int, row_bytes: int) -> None:
    """Rewrite a C-order uint8 ``.npy``'s header for its first ``n`` rows (the same header length, padded with spaces
    as numpy pads it, so the data stays where it is) and cut the file after them."""
    with open(path, "r+b") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
        prefix = 8 + (2 if version == (1, 0) else 4)  # magic string, version, header length
        text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": (n,) + tuple(shape[1:])})
        room = offset - prefix
        if len(text) + 1 > room:  # cannot happen: fewer rows never need a longer header
            raise HarmonizeError(f"{path}: the header for {n} rows does not fit")
        f.seek(prefix)
        f.write((text + " " * (room - len(text) - 1) + "\n").encode("latin1"))
        f.truncate(offset + n * row_bytes)


COPY_REASON = "a byte-identical copy of another of the source's files (kept once)"


def _digests(raw_dir: Path, paths: list[str]) -> dict[str, str]:
    """sha256 of the files (posix paths relative to ``raw_dir``) whose size another of them shares (no other can be
    its copy): from fetch's manifest, which records every fetched file's, where it lists the file at its present size;
    else (a folder read in place, a file changed or added since the fetch) hashed here."""
    from fedsilo.data.fetch import manifest_files

    listed = manifest_files(raw_dir) or {}
    sizes = {p: (raw_dir / p).stat().st_size for p in paths if (raw_dir / p).is_file()}
    counts = Counter(sizes.values())
    return {p: (listed[p]["sha256"] if p in listed and listed[p].get("bytes") == n else file_sha256(raw_dir / p))
            for p, n in sizes.items() if counts[n] > 1}


def copies_among(raw_dir: Path, paths: list[str]) -> dict[str, str]:
    """Each of ``paths`` (relative to ``raw_dir``) that is a byte-identical copy of an earlier one in path order,
    mapped to that first file (:func:`_digests`: fetch's manifest hashes where they hold)."""
    first: dict[str, str] = {}
    copy_of: dict[str, str] = {}
    for path, digest in sorted(_digests(raw_dir, paths).items()):
        if digest in first:
            copy_of[path] = first[digest]
        else:
            first[digest] = path
    return copy_of


def exclude_copies(rec: pd.DataFrame, raw_dir: Path, label: str) -> tuple[pd.DataFrame, Optional[str]]:
    """A source of your own's records with every kept file that is a byte-identical copy of another kept file (a
    study exported twice, an image reached through a symbolic link and its target, a patient's image filed under two
    names) excluded as :data:`COPY_REASON`, the first in path order kept; and a warning saying how many, one example,
    and how many copies were in another group (the same image would have been on both sides of a split), in another
    domain, or had another class than the file kept (None when there are none). The frames or patches of one file share its path and
    are no copies of each other. ``label``: the source's name in the warning."""
    kept = ((rec["excluded"] == "") & (rec["path"] != "")).to_numpy()
    paths = sorted(pd.unique(rec.loc[kept, "path"]))
    copy_of = copies_among(raw_dir, paths) if len(paths) > 1 else {}
    if not copy_of:
        return rec, None
    one = rec[kept].drop_duplicates("path").set_index("path")  # a file's class, group and domain (its first row's)
    other = {col: sum(one.at[c, col] != one.at[f, col] for c, f in copy_of.items()) for col in ("group", "label", "domain")}
    rec = rec.copy()
    rec.loc[kept & rec["path"].isin(list(copy_of)).to_numpy(), "excluded"] = COPY_REASON
    example = next(iter(sorted(copy_of.items())))
    warning = (f"{label}: {len(copy_of)} files are byte-identical copies of another of its files (e.g. {example[0]} = "
               f"{example[1]}); each image is kept once")
    if other["group"]:
        warning += (f"; {other['group']} of the copies {'was' if other['group'] == 1 else 'were'} in another group than the "
                    "file kept (the same image would have been on both sides of a split)")
    if other["domain"]:
        warning += f"; {other['domain']} in another domain (site) than the file kept"
    if other["label"]:
        warning += f"; {other['label']} had another class than the file kept: check the labels"
    return rec, warning


def public_copies(rec: pd.DataFrame, raw_dir: Path, label: str, mode: str, key: str) -> tuple[pd.DataFrame, Optional[str]]:
    """A public benchmark source's records, its byte-identical files handled as ``datasets.<d>.copies`` says
    (``mode``: keep, group or exclude), and a warning with their count (None when there are none). Only files that
    are one image each are compared (not the arrays of CIFAR or MNIST, whose rows share their file). ``group`` joins a
    copy to its first file's group where both have the same domain and class; a copy in another domain or of another
    class keeps its own group, and the warning says how many."""
    kept = ((rec["excluded"] == "") & (rec["path"] != "")).to_numpy()
    counts = rec.loc[kept, "path"].value_counts()
    paths = sorted(counts.index[counts == 1])
    copy_of = copies_among(raw_dir, paths) if len(paths) > 1 else {}
    if not copy_of:
        return rec, None
    one = rec[kept & rec["path"].isin(paths).to_numpy()].set_index("path")
    alike = {c: f for c, f in copy_of.items() if one.at[c, "domain"] == one.at[f, "domain"] and one.at[c, "label"] == one.at[f, "label"]}
    example = next(iter(sorted(copy_of.items())))
    text = f"{label}: {len(copy_of)} files are byte-identical copies of another of its files (e.g. {example[0]} = {example[1]})"
    rec = rec.copy()
    rows = kept & rec["path"].isin(list(copy_of)).to_numpy()
    if mode == "exclude":
        rec.loc[rows, "excluded"] = COPY_REASON
        return rec, text + "; each image is kept once (copies: exclude)"
    if mode == "group":
        group_of = one["group"].to_dict()
        at = kept & rec["path"].isin(list(alike)).to_numpy()
        rec.loc[at, "group"] = [group_of[alike[p]] for p in rec.loc[at, "path"]]
        rest = len(copy_of) - len(alike)
        return rec, text + ("; each joins its first file's group (copies: group), so a split keeps them on one side"
                            + (f"; {rest} in another domain or class keep their own" if rest else ""))
    return rec, text + (f"; kept as separate images, as the papers' loaders keep them: an image and its copy may land on both "
                        f"sides of a split ({key}.copies: group keeps each on one side, exclude keeps each image once)")


def fetched_copy_note(raw_dir: Path, src: str) -> str:
    """What a reader's error about ``raw_dir`` should add: the folder is fetch's copy of a source of the user's (its
    manifest's origin), where the fix belongs before fetching again; "" for a download or a mirror."""
    manifest = _manifest(raw_dir)
    if manifest is None or manifest.get("mode") != "local":
        return ""
    return (f" ({raw_dir} is what `fedsilo fetch --source {src}` copied from {manifest.get('origin')}, sources.{src}.path: "
            "correct a file there, then fetch again; a params key named above is set in the params file, without a fetch)")


def fetched_from(raw_root: Path, sources: Any, changed: Optional[dict[str, list[str]]] = None,
                 manifests: Optional[dict[str, Optional[dict[str, Any]]]] = None) -> dict[str, dict[str, Any]]:
    """Per source, how fetch got its raw files (its manifest's ``mode`` and ``origin``: an offline mirror, the user's
    folder, the download's addresses) and what they held (``files``, ``bytes``, ``sha256``: the source's entry of
    ``data/fingerprints/<dataset>.json``, from its manifest), for the data card and a run's metrics.json and MLflow
    tags: which raw files a dataset was made from, beside the hashes of the arrays made; with ``changed``
    (:func:`changed_since_fetch`), the files of a source that no longer are what its manifest describes
    (``changed_since_fetch``: the fingerprint is not of what was read). A source without a manifest (made by hand) is
    left out. ``manifests``: the sources' manifests as :func:`fetch_warnings` read them (else read here)."""
    from fedsilo.data.fetch import files_fingerprint

    manifests = _manifests(raw_root, sources, manifests)
    out = {}
    for src in sources:
        m = manifests[src]
        if m is None:
            continue
        try:  # a manifest written by hand may list no files, or not as fetch writes them: its origin is still said
            held = files_fingerprint(m["files"])
        except (KeyError, TypeError, AttributeError):
            held = {}
        out[src] = {"mode": str(m.get("mode", "")), "origin": str(m.get("origin", "")), **held}
        if (changed or {}).get(src):
            out[src]["changed_since_fetch"] = changed[src]
    return out


# files of a source where edits are made (its label tables and lists): hashed again, not only sized, by changed_since_fetch
TABLE_SUFFIXES = (".csv", ".tsv", ".txt", ".json", ".xml", ".xlsx", ".xls", ".parquet", ".pkl", ".yaml", ".yml", ".geojson")


def changed_since_fetch(raw_root: Path, sources: Any, manifests: Optional[dict[str, Optional[dict[str, Any]]]] = None) -> dict[str, list[str]]:
    """Per source, the files of its fetched copy (``data/raw/<source>``) that are no longer what fetch wrote and its
    manifest (and so the dataset's fingerprint) describes: removed, of another size, or, for a table
    (:data:`TABLE_SUFFIXES`: where edits are made), of other content at the same size. A stat per file and a hash
    per table: an image rewritten at its own size is not seen (`dvc status` sees it). Sources without a manifest are
    passed over."""
    manifests = _manifests(raw_root, sources, manifests)
    out: dict[str, list[str]] = {}
    for src in sources:
        raw_dir = Path(raw_root) / src
        files = (manifests[src] or {}).get("files")
        if not isinstance(files, dict):
            continue
        said = []
        for rel, was in sorted(files.items()):
            try:
                size = (raw_dir / rel).stat().st_size
            except OSError:
                said.append(f"{rel} (removed)")
                continue
            if size != was.get("bytes"):
                said.append(f"{rel} ({size} bytes; fetched {was.get('bytes')})")
            elif rel.lower().endswith(TABLE_SUFFIXES) and "sha256" in was and file_sha256(raw_dir / rel) != was["sha256"]:
                said.append(f"{rel} (edited)")
        if said:
            out[src] = said
    return out


def _manifests(raw_root: Path, sources: Any, read: Optional[dict[str, Optional[dict[str, Any]]]] = None) -> dict[str, Optional[dict[str, Any]]]:
    """Each source's fetch manifest (:func:`_manifest`), from ``read`` where it holds the source: a large source's
    manifest (CheXpert's: 224k files) is parsed once a harmonize, not once a check."""
    return {src: (read[src] if read is not None and src in read else _manifest(Path(raw_root) / src)) for src in sources}


def fetch_warnings(raw_root: Path, sources: Any) -> tuple[list[str], dict[str, list[str]], dict[str, Optional[dict[str, Any]]]]:
    """What harmonize says of its sources' files before reading them (the data card's warnings): a folder of one's own
    edited since its fetch (:func:`edited_since_fetch`), and a fetched copy changed since (:func:`changed_since_fetch`,
    also returned for :func:`fetched_from`, with the manifests read)."""
    manifests = _manifests(raw_root, sources)
    changed = changed_since_fetch(raw_root, sources, manifests)
    said = [f"data/raw/{s}: {len(f)} file(s) are not what fetch wrote ({', '.join(f[:3])}{', ...' if len(f) > 3 else ''}): "
            f"the arrays are made from them, not from what the fetch manifest and the dataset's fingerprint describe; "
            f"fetch again (`dvc repro fetch@{s}`) or put them back (`dvc checkout fetch@{s}`)" for s, f in changed.items()]
    return [*edited_since_fetch(raw_root, sources, manifests), *said], changed, manifests


def edited_since_fetch(raw_root: Path, sources: Any, manifests: Optional[dict[str, Optional[dict[str, Any]]]] = None) -> list[str]:
    """Per source fetched from a folder of one's own (``mode: local``), a warning where a file at the top of that
    folder (a label table, a list of files: where edits are made) differs from what the fetch copied (its manifest's
    size and sha256; a file only touched or copied again with the same content does not count), or was added or
    removed since: harmonize reads the fetched copy, so the change is not in what it writes. Hidden files (a Mac's
    ``.DS_Store``, an editor's lock file ``~$...``) are passed over, and the folder's image tree is not walked."""
    from fedsilo.data.fetch import MANIFEST
    from fedsilo.utils.io import file_sha256

    manifests = _manifests(raw_root, sources, manifests)
    out = []
    for src in sources:
        raw_dir = Path(raw_root) / src
        rec = manifests[src]
        origin = Path(str((rec or {}).get("origin", "")))
        if rec is None or rec.get("mode") != "local" or not origin.is_dir():
            continue
        # what the copy holds, and the archives of the folder fetch unpacked into it (DomainNet's zips: their size)
        fetched, files = (raw_dir / MANIFEST).stat().st_mtime, {**(rec.get("files") or {}), **(rec.get("unpacked") or {})}
        try:
            top = {e.name: e for e in os.scandir(origin) if e.is_file() and not e.name.startswith((".", "~$"))}
        except OSError:
            continue
        said = []
        for name, e in sorted(top.items()):
            was = files.get(name)
            if was is None:
                said.append(f"{name} added")
            elif e.stat().st_size != was.get("bytes") or (e.stat().st_mtime > fetched and "sha256" in was
                                                            and file_sha256(Path(e.path)) != was["sha256"]):
                said.append(f"{name} changed")
        said += [f"{name} removed" for name in sorted(files) if "/" not in name and not name.startswith((".", "~$")) and name not in top]
        if said:
            out.append(f"{src}: {origin} differs from its fetched copy ({', '.join(said[:3])}{', ...' if len(said) > 3 else ''}): "
                       f"harmonize read the copy, {raw_dir}; fetch again to take the change (`fedsilo fetch --source {src}`, or "
                       f"`dvc repro -f fetch@{src}`)")
    return out


def _manifest(raw_dir: Path) -> dict[str, Any] | None:
    """The fetch manifest of a source's raw folder, or None where it has none (not fetched) or it does not read."""
    import json

    from fedsilo.data.fetch import MANIFEST

    try:
        rec = json.loads((Path(raw_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def read_source(src: str, raw_dir: Path, rules: Any = None) -> pd.DataFrame:
    """A built-in source's records (its reader's ``read_records``); an error about a local source's files names the
    user's folder too, not only fetch's copy of it."""
    try:
        return source_module(src).read_records(raw_dir, rules)
    except LabelFileError as err:
        raise LabelFileError(f"{err}{fetched_copy_note(raw_dir, src)}") from None


def cxr_records(params: CXRDatasetParams, raw_root: Path, name: str, quiet: bool = True) -> tuple[pd.DataFrame, list[str]]:
    """Every record of a chest X-ray dataset's sources (kept or excluded, with its source and absolute path) and the
    warnings the rules call for; ``name`` is the dataset's key in params (for messages)."""
    raw_root = Path(raw_root)
    all_records, warnings = [], []
    for src in params.sources:
        raw_dir = raw_root / src
        if not raw_dir.is_dir():
            raise HarmonizeError(f"{raw_dir}: raw source folder missing (run `fedsilo fetch --source {src}`, or `dvc repro fetch@{src}` "
                                 "once it is in pipeline.sources)")
        if src in params.own_sources():  # a hospital's own export and its label table
            notes: list[str] = []
            try:
                rec = cxr_table.read_records(raw_dir, params.rules(src), params.domain_of(src), f"datasets.{name}.tables.{src}",
                                             quiet, notes)
            except LabelFileError as err:  # it names the fetched copy: the file to correct is the original
                raise LabelFileError(f"{err}{fetched_copy_note(raw_dir, src)}") from None
            warnings += [f"{src} ({params.domain_of(src)}): {note}" for note in notes]
            rules = params.rules(src)
            patients = rules.patient or rules.dicom_match  # matched by their headers: each image's PatientID is its group
            for missing, warning in ((patients, cxr_table.NO_PATIENT_WARNING), (rules.view or rules.dicom_view or None, cxr_table.NO_VIEW_WARNING)):
                if missing is None:
                    warnings.append(f"{src} ({params.domain_of(src)}) {warning}")
            rec, copies = exclude_copies(rec, raw_dir, f"{src} ({params.domain_of(src)})")
            warnings += [copies] if copies else []
        else:
            rec = read_source(src, raw_dir, params.rules(src))
        rec["source"] = src
        rec["abs_path"] = [str(raw_dir / p) if p else "" for p in rec["path"]]
        all_records.append(rec)
    records = pd.concat(all_records, ignore_index=True)
    records["id"] = records["source"] + "/" + records["id"]
    return records, warnings


def harmonize_cxr(params: CXRDatasetParams, raw_root: Path, out_dir: Path, quiet: bool = False) -> dict[str, Any]:
    raw_root = Path(raw_root)
    workers = params.workers or os.cpu_count() or 1
    records, warnings = cxr_records(params, raw_root, Path(out_dir).name, quiet)
    said, changed, manifests = fetch_warnings(raw_root, params.source_list)
    warnings += said
    kept = records[records["excluded"] == ""].reset_index(drop=True)
    excluded = records[records["excluded"] != ""].reset_index(drop=True)
    jobs = [(p, r, params.image_size, params.square, params.intensity, params.percentiles) for p, r in zip(kept["abs_path"], kept["reader"])]
    errors = [""] * len(jobs)
    ok = np.zeros(len(jobs), dtype=bool)
    todo = [i for i, p in enumerate(kept["abs_path"]) if p]
    for i in range(len(jobs)):
        if not kept["abs_path"].iloc[i]:
            errors[i] = f"image file missing for {kept['id'].iloc[i]}"
    doms = [str(kept["domain"].iloc[i]) for i in todo]
    with atomic_dir(Path(out_dir)) as tmp:
        spool = ImageSpool(tmp, len(jobs), Path(out_dir).name)
        spool.decode_into([(i, jobs[i]) for i in todo], kept["id"], errors, ok, workers, doms, f"harmonize {Path(out_dir).name}", quiet)

        quarantine = kept.loc[~ok, ["id", "domain", "path"]].copy()
        quarantine["error"] = [e for e, good in zip(errors, ok) if not good]
        for src in params.sources:
            if not (kept["source"] == src).any():
                reasons = excluded.loc[excluded["source"] == src, "excluded"].value_counts().head(5)
                why = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or "no record"
                raise HarmonizeError(f"{src}: no image passes the label rules (excluded: {why}); check the raw files under "
                                     f"{raw_root / src}" + (f" and datasets.{Path(out_dir).name}.tables.{src}" if src in params.own_sources() else ""))
        _check_quarantine(kept["source"], kept.loc[~ok, "source"], quarantine, params.max_quarantine_fraction, f"raw files under {raw_root}",
                          f"datasets.{Path(out_dir).name}.max_quarantine_fraction")

        good = kept[ok].reset_index(drop=True)
        table = good.rename(columns={"path": "source_path"})[["id", "domain", "label", "original_label", "group", "view", "source_path", "subset"]]
        table["group"] = table["domain"] + "/" + table["group"]
        spool.finish(np.flatnonzero(ok))
        return write_dataset(
            tmp, table, excluded, quarantine,
            {"dataset": Path(out_dir).name, "kind": params.kind, "task": "binary: 1 = Lung Opacity, 0 = Normal", "classes": ["Normal", "Lung Opacity"],
             "rules": harmonize_rules(params),
             "sources": fetched_from(raw_root, params.sources, changed, manifests), **({"warnings": warnings} if warnings else {})},
        )


def write_dataset(tmp: Path, table: pd.DataFrame, excluded: pd.DataFrame, quarantine: pd.DataFrame, meta: dict[str, Any]) -> dict[str, Any]:
    """Write the rest of a harmonized folder beside its ``images.npy`` (:class:`ImageSpool`), inside the temporary
    folder of the atomic write (``tmp``): records.parquet, excluded.parquet, quarantine.csv, samples.png, the card."""
    table.reset_index(drop=True).to_parquet(tmp / "records.parquet", index=False)
    excluded[["id", "domain", "original_label", "view", "excluded"]].rename(columns={"excluded": "reason"}).to_parquet(
        tmp / "excluded.parquet", index=False
    )
    quarantine.to_csv(tmp / "quarantine.csv", index=False)
    samples = write_contact_sheet(tmp / "samples.png", table.reset_index(drop=True), np.load(tmp / "images.npy", mmap_mode="r"),
                                  list(meta["classes"]))
    card = _card({**meta, "samples": samples}, table, excluded, quarantine, tmp)
    write_json(tmp / "card.json", card)
    (tmp / "card.md").write_text(card_markdown(card))
    return card


def _check_quarantine(units: pd.Series, quarantine_units: pd.Series, quarantine: pd.DataFrame, limit: float, raw_hint: str,
                      key: str = "max_quarantine_fraction") -> None:
    """Fail when any unit (source or domain) has more than ``limit`` of its images quarantined, naming each such file
    with its error (up to ten: nothing is written, so the message is where to look them up)."""
    for unit in units.unique():
        n = int((units == unit).sum())
        q_mask = quarantine_units == unit
        q = int(q_mask.sum())
        if q / n > limit:
            bad = quarantine.loc[q_mask.to_numpy()]
            examples = "; ".join(f"{p}: {e}" for p, e in zip(bad["path"].head(10), bad["error"].head(10)))
            raise HarmonizeError(
                f"{unit}: {q} of {n} images could not be decoded ({q / n:.1%} > {key} {limit:.1%}): {examples}"
                + (f"; and {q - 10} more" if q > 10 else "") + f" ({raw_hint}; raise {key} to quarantine them and go on)"
            )


def _cap(frame: pd.DataFrame, cap: int | None, seed: int) -> pd.DataFrame:
    """At most ``cap`` rows per (domain, subset), drawn with ``seed`` from the rows sorted by id."""
    if cap is None:
        return frame
    parts = []
    for _, g in frame.groupby(["domain", "subset"], sort=True):
        g = g.sort_values("id")
        if len(g) > cap:
            rng = np.random.default_rng([seed, len(g)])
            g = g.iloc[np.sort(rng.choice(len(g), cap, replace=False))]
        parts.append(g)
    return pd.concat(parts).sort_index() if parts else frame


DIGITS = tuple(str(d) for d in range(10))
# Kinds whose class list is not simply their first source's: every source's labels are mapped to it by class name,
# and a source's class outside it is excluded (Digit-10 keeps EMNIST ByClass's digits, not its 52 letters).
KIND_CLASSES: dict[str, tuple[str, ...]] = {"digit10": DIGITS}


def source_classes(mod: Any, raw_dir: Path) -> list[str]:
    """The class names a source's labels index: the list the distribution carries (CIFAR's meta files, EMNIST's
    mapping), else the module's ``CLASSES``, else the digits 0-9."""
    if hasattr(mod, "classes"):
        return list(mod.classes(raw_dir))
    return list(getattr(mod, "CLASSES", DIGITS))


def to_dataset_classes(rec: pd.DataFrame, names: list[str], classes: list[str], kind: str) -> pd.DataFrame:
    """A source's records relabelled from its class list ``names`` to the dataset's ``classes`` by class name; a
    record whose class the dataset lacks is excluded with the reason ``class not in <kind>``."""
    if list(names) == list(classes):
        return rec
    index = {c: i for i, c in enumerate(classes)}
    lookup = np.array([index.get(n, -1) for n in names], dtype=np.int64)
    rec = rec.copy()
    kept = (rec["excluded"] == "").to_numpy()
    labels = rec["label"].to_numpy()
    new = np.where(kept, lookup[np.clip(labels, 0, len(names) - 1)], labels)
    dropped = kept & (new < 0)
    rec["label"] = np.where(dropped, -1, new)
    rec.loc[dropped, "excluded"] = f"class not in {kind}"
    return rec


def benchmark_records(params: BenchmarkDatasetParams, raw_root: Path, name: str = "",
                      quiet: bool = True) -> tuple[pd.DataFrame, list[str], dict[str, Any], list[str]]:
    """Every record of a benchmark dataset's sources (its ``domains`` only), the dataset's classes, the source
    modules that read them and the warnings the rules call for. Sources of your own (``reader: image_folder`` or
    ``image_table``) are read after the public ones, whose class list (the first public source's, unless the kind has
    its own) they map to; a ``kind: image_folder`` dataset's classes are its ``classes`` or its sources' sorted class
    names. ``name`` is the
    dataset's key in params (for messages); unless ``quiet``, the scan of each source of your own shows its progress."""
    raw_root = Path(raw_root)
    frames: dict[str, pd.DataFrame] = {}
    modules = {}
    classes: list[str] = list(KIND_CLASSES.get(params.kind, ()))
    for src in params.source_list:
        if not (raw_root / src).is_dir():
            raise HarmonizeError(f"{raw_root / src}: raw source folder missing (run `fedsilo fetch --source {src}`, or "
                                 f"`dvc repro fetch@{src}` once it is in pipeline.sources)")
    own = params.own_sources()
    warnings_public: list[str] = []
    for src in params.source_list:
        if src in own:
            continue
        raw_dir = raw_root / src
        mod = modules[src] = source_module(src)
        rec = read_source(src, raw_dir)
        names = source_classes(mod, raw_dir)
        classes = classes or names  # the first source's class list is the dataset's unless the kind has its own
        rec = to_dataset_classes(rec, names, classes, params.kind)
        rec, copies = public_copies(rec, raw_dir, src, params.copies, f"datasets.{name or '<dataset>'}")
        warnings_public += [copies] if copies else []
        rec["source"] = src
        frames[src] = rec
        lacking = [d for d in getattr(mod, "DOMAINS", ()) if d not in set(rec["domain"])]
        if lacking and params.domains is None:  # a copy without a domain would make a federation of fewer sites unsaid
            held = [d for d in mod.DOMAINS if d not in lacking]
            raise HarmonizeError(f"{src}: {raw_dir} holds no images of the domain{'s' * (len(lacking) > 1)} "
                                 f"{', '.join(lacking)} (of {', '.join(mod.DOMAINS)}): put {'them' if len(lacking) > 1 else 'it'} "
                                 f"back in your copy, or keep the domains it holds: datasets.{name or '<dataset>'}.domains: "
                                 f"[{', '.join(held)}]")
    if not classes and params.kind != "image_folder":  # a kind's own sources only (a deployed site): the kind's classes
        classes = list(getattr(source_module(DATASET_SOURCES[params.kind][0]), "CLASSES", DIGITS))
    keys = {src: params.rules_key(src, name) for src in own}
    scans, maps = {}, {}
    scan_notes: list[str] = []  # the readers' own warnings (a header match's patients)
    for src in own:
        if params.reader_of(src) == "image_table":
            scans[src] = image_table.scan(raw_root / src, params.rules(src), params.domain_of(src), keys[src], quiet,
                                          scan_notes)
            maps[src] = image_table.table_classes(params.rules(src), keys[src])
        else:
            scans[src] = image_folder.scan(raw_root / src, params.rules(src), params.domain_of(src), keys[src], params.domains, quiet)
            maps[src] = image_folder.folder_classes(raw_root / src, params.rules(src), keys[src])
    if not classes:  # kind image_folder: its own list, or its sources' class names as torchvision's ImageFolder sorts them
        names = set().union(*(image_folder.class_names(scans[s], maps[s]) for s in own))
        for s in own:
            if params.reader_of(s) == "image_table":
                names |= image_table.declared_classes(params.rules(s), maps[s])
        classes = list(params.classes or image_folder.one_spelling(names))
        if len(classes) < 2:
            raise HarmonizeError(f"{name or params.kind}: its sources name {len(classes)} class ({', '.join(classes)}); "
                                 f"a classification task needs two or more (list them in datasets.{name or '<dataset>'}.classes, "
                                 "or check the sources' class folders / label columns)")
    warnings = warnings_public + scan_notes
    for src in own:
        table = params.reader_of(src) == "image_table"
        rec = image_folder.read_records(scans[src], maps[src], classes, check_groups=not table)
        rec, copies = exclude_copies(rec, raw_root / src, src)  # before a file's frames or patches: one row per file
        warnings += [copies] if copies else []
        if params.rules(src).frames != "first":  # a multi-frame DICOM's frames, each an image of the file's class and group
            rec = expand_frames(rec, raw_root / src, params.rules(src).frames, keys[src], quiet)
        rec = expand_slides(rec, raw_root / src, params.rules(src).slides, keys[src], quiet,  # patches, or excluded
                            workers=params.workers or os.cpu_count() or 1, classes=tuple(classes), warnings=warnings)
        theirs = set(rec["domain"])
        for other, frame in frames.items():
            clash = sorted(d for d in theirs if d.casefold() in {x.casefold() for x in frame["domain"]})
            if clash:
                raise HarmonizeError(f"{src}: domain {clash[0]!r} is also a domain of {other}; every source forms domains of "
                                     f"its own (set {keys[src]}.domain" + (")" if table else ", or rename its domain folder)"))
        rec["source"] = src
        frames[src] = rec
        named = src if set(theirs) == {src} else f"{src} ({', '.join(sorted(theirs))})"
        kept_rows = rec[rec["excluded"] == ""]
        all_patches = "patch" in rec.columns and len(kept_rows) > 0 and kept_rows["patch"].notna().all()
        if table and params.rules(src).patient is None and params.rules(src).matched is None:  # matched: the headers' patients
            warnings.append(f"{named} {image_table.NO_PATIENT_WARNING}")
        elif not table and params.rules(src).group is None and not all_patches:  # a slide's patches: the slide's group
            warnings.append(f"{named} {image_folder.NO_GROUP_WARNING}")
        if not table and params.domain_of(src) is None and len(theirs) == 1 and params.domains is None:
            warnings.append(f"{src} has one domain folder, {min(theirs)!r}: if it only wraps the sites' folders (an "
                            f"archive's top-level folder), set {keys[src]}.root: {min(theirs)}")
    records = pd.concat([frames[s] for s in params.source_list], ignore_index=True)
    if params.domains:
        unknown = sorted(set(params.domains) - set(records["domain"]))
        if unknown:
            raise HarmonizeError(f"domains: {unknown} not found in the raw data (have: {sorted(records['domain'].unique())})")
        records = records[records["domain"].isin(params.domains)].reset_index(drop=True)
    records["id"] = records["source"] + "/" + records["id"]
    return records, classes, modules, warnings


def expand_frames(rec: pd.DataFrame, raw_dir: Path, frames: Union[str, int], key: str, quiet: bool = False) -> pd.DataFrame:
    """``rec`` (a source of your own's records) with each kept multi-frame DICOM's row repeated for every frame
    ``frames`` takes (:func:`~fedsilo.data.dicom.frame_indices`): id ``<id>#frame<k>`` (k from 0), column ``frame``,
    the file's class, group and subset (the frames of one file stay on one side of every split). Other rows keep
    their id, with no frame (the first). Reads each DICOM's header only."""
    from fedsilo.data.dicom import frame_count, frame_indices

    dicoms = np.flatnonzero((rec["reader"] == "dicom").to_numpy() & (rec["excluded"] == "").to_numpy())
    counts = np.ones(len(rec), dtype=np.int64)
    bar = Progress(len(dicoms), f"frames {key.rsplit('.', 1)[-1]}", "file", quiet=quiet)
    for i in dicoms:
        counts[i] = frame_count(raw_dir / str(rec["path"].iloc[i]))
        bar.update()
    bar.close()
    return explode_records(rec, [frame_indices(int(n), frames) if n > 1 else None for n in counts], "frame", "#frame{}".format)


def harmonize_benchmark(params: BenchmarkDatasetParams, raw_root: Path, out_dir: Path, quiet: bool = False) -> dict[str, Any]:
    raw_root = Path(raw_root)
    workers = params.workers or os.cpu_count() or 1
    records, classes, modules, warnings = benchmark_records(params, raw_root, Path(out_dir).name, quiet)
    said, changed, manifests = fetch_warnings(raw_root, params.source_list)
    warnings += said
    excluded = records[records["excluded"] != ""].reset_index(drop=True)
    kept = _cap(records[records["excluded"] == ""], params.max_per_domain, params.sample_seed).reset_index(drop=True)

    rgb = getattr(params, "channels", "rgb") == "rgb"
    hints = {s: f" (the path its row names through {params.rules_key(s, Path(out_dir).name)}.path_format "
                f"{params.rules(s).path_format!r})" for s in params.own_sources()
             if params.reader_of(s) == "image_table" and params.rules(s).path_format != "{}"}
    errors = [""] * len(kept)
    ok = np.zeros(len(kept), dtype=bool)
    file_jobs: list[tuple[int, tuple]] = []
    with atomic_dir(Path(out_dir)) as tmp:  # nothing of it is left if anything below fails
        spool = ImageSpool(tmp, len(kept), Path(out_dir).name)
        frame_of = kept["frame"].fillna(0).astype(int).tolist() if "frame" in kept.columns else [0] * len(kept)
        patch_of = kept["patch"].tolist() if "patch" in kept.columns else [None] * len(kept)
        for i, (src, path, reader) in enumerate(zip(kept["source"], kept["path"], kept["reader"])):
            raw_dir = raw_root / src
            if not path:
                errors[i] = f"image file missing for {kept['id'].iloc[i]}" + hints.get(src, "")
            elif reader == "array":
                container, _, row = path.rpartition("#")
                try:
                    arr = modules[src].load_container(raw_dir, container)
                    img = arr[int(row)]
                    if img.std() == 0:
                        raise ImageDecodeError(f"{container}#{row}: constant image")
                    spool.put(i, to_square(np.asarray(img, np.uint8), params.image_size, params.square, rgb), str(kept["id"].iloc[i]))
                    ok[i] = True
                except (ImageDecodeError, IndexError) as err:
                    errors[i] = str(err)
            elif reader == "slide":  # a patch of a whole-slide image of your own (fedsilo.data.slides)
                view = slide_view(getattr(params.rules(src), "slides", None))  # the focal plane and path it was planned on
                file_jobs.append((i, (str(raw_dir / path), "slide", params.image_size, params.square, "", (0.0, 100.0), patch_of[i], view)))
            else:
                decoder = "dicom_rgb" if reader == "dicom" else "rgb"  # a DICOM of your own, or any image file
                file_jobs.append((i, (str(raw_dir / path), decoder, params.image_size, params.square, "", (0.0, 100.0), frame_of[i])))
        doms = [str(kept["domain"].iloc[i]) for i, _ in file_jobs]
        spool.decode_into(file_jobs, kept["id"], errors, ok, workers, doms, f"harmonize {Path(out_dir).name}", quiet)
        quarantine = kept.loc[~ok, ["id", "domain", "path"]].copy()
        quarantine["error"] = [e for e, good in zip(errors, ok) if not good]
        _check_quarantine(kept["domain"], quarantine["domain"], quarantine, params.max_quarantine_fraction, f"raw files under {raw_root}",
                          f"datasets.{Path(out_dir).name}.max_quarantine_fraction")
        spool.finish(np.flatnonzero(ok))
        return _write_benchmark(params, Path(out_dir).name, tmp, kept, ok, classes, excluded, quarantine, warnings,
                                fetched_from(raw_root, params.source_list, changed, manifests))


def _write_benchmark(params: BenchmarkDatasetParams, name: str, tmp: Path, kept: pd.DataFrame, ok: np.ndarray,
                     classes: list[str], excluded: pd.DataFrame, quarantine: pd.DataFrame, warnings: list[str],
                     fetched: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The rest of benchmark dataset ``name``'s folder (:func:`write_dataset`) for its kept, decoded records, with its
    card's task."""
    good = kept[ok].reset_index(drop=True)
    columns = ["id", "domain", "label", "original_label", "group", "view", "source_path", "subset"]
    if "writer" in good.columns:  # FEMNIST's writers (only a dataset whose records name them has the column)
        good = good.assign(writer=good["writer"].fillna("").astype(str))
        columns.append("writer")
    if "label_from" in good.columns:  # slides with region annotations: where each patch's class came from
        good = good.assign(label_from=good["label_from"].fillna("").astype(str))
        columns.append("label_from")
    table = good.rename(columns={"path": "source_path"})[columns]
    tasks = {
        "digits5": "10 digit classes", "office_caltech10": "10 object classes", "pacs": "7 object classes",
        "domainnet10": "the 10-class DomainNet subset", "cifar10": "10 object classes", "cifar100": "100 object classes",
        "fmnist": "10 clothing classes", "emnist": "62 character classes (ByClass: digits, upper- and lower-case letters)",
        "cinic10": "10 object classes (CIFAR-10's)", "digit10": "10 digit classes (EMNIST: its digits only)",
        "office31": "31 office object classes",
        "femnist": "62 character classes (LEAF's FEMNIST: digits, upper- and lower-case letters; one writer per record)",
        "kather_crc": "9 colorectal tissue classes (H&E patches, two centres)",
        "image_folder": f"{len(classes)} classes of your own",
    }
    return write_dataset(  # the task names the kind and its classes only: a federation's sites compare it (contract)
        tmp, table, excluded, quarantine,
        {"dataset": name, "kind": params.kind, "task": tasks[params.kind], "classes": classes,
         "rules": harmonize_rules(params),
         "sources": fetched, **({"warnings": warnings} if warnings else {})},
    )


def preview_dataset(params: CXRDatasetParams | BenchmarkDatasetParams, raw_root: Path, name: str, quiet: bool = True) -> dict[str, Any]:
    """What harmonize would keep, exclude and find missing, from the label files alone (no image is decoded, nothing
    is written): per domain the rows read, the images kept by class, the exclusions by reason and the kept rows whose
    file the raw folder lacks; the rules' warnings; and ``would_fail``, harmonize's own refusals that the label files
    already decide (a source or domain with nothing kept, or more files missing than ``max_quarantine_fraction``).
    Seconds where harmonize takes minutes (more with ``dicom_view``, which opens each DICOM's header, with
    ``frames``, which reads each DICOM's frame count, with ``slides``, which reads each slide's thumbnail to plan
    its patches, and for a source of your own read in place without fetch's manifest, whose files of equal size are
    hashed to find copies): for trying label rules."""
    if isinstance(params, CXRDatasetParams):
        records, warnings = cxr_records(params, raw_root, name, quiet)
        classes = ["Normal", "Lung Opacity"]
        kept = records[records["excluded"] == ""]
    else:
        records, classes, _, warnings = benchmark_records(params, raw_root, name, quiet)
        kept = _cap(records[records["excluded"] == ""], params.max_per_domain, params.sample_seed)
    warnings = [*warnings, *fetch_warnings(raw_root, params.source_list)[0]]
    unit = "source" if isinstance(params, CXRDatasetParams) else "domain"  # what harmonize checks, as it checks it
    fails = []
    for u in dict.fromkeys(records[unit]):
        k = kept[kept[unit] == u]
        if k.empty:
            fails.append(f"{u}: no image passes the label rules")
        elif (k["path"] == "").mean() > params.max_quarantine_fraction:
            fails.append(f"{u}: {int((k['path'] == '').sum())} of {len(k)} kept rows name no file, more than "
                         f"max_quarantine_fraction {params.max_quarantine_fraction:.1%} (before any undecodable file)")
    domains: dict[str, Any] = {}
    for dom in dict.fromkeys(records["domain"]):
        rows, k = records[records["domain"] == dom], kept[kept["domain"] == dom]
        reasons = rows.loc[rows["excluded"] != "", "excluded"].value_counts()
        domains[str(dom)] = {
            "rows": int(len(rows)),
            "kept": int(len(k)),
            "by_class": {c: int((k["label"] == i).sum()) for i, c in enumerate(classes)},
            "excluded": int(reasons.sum()),
            "excluded_by_reason": {str(r): int(n) for r, n in reasons.items()},
            "missing_files": int((k["path"] == "").sum()),
            "missing_examples": k.loc[k["path"] == "", "id"].head(3).tolist(),
        }
    return {"dataset": name, "domains": domains, "warnings": warnings, "would_fail": fails}


def harmonize_rules(params: CXRDatasetParams | BenchmarkDatasetParams) -> dict[str, Any]:
    """The dataset's settings a harmonized folder was built with, as its card records them (``rules``): what a later
    reader compares with the params of now (:func:`stale_rules`)."""
    if isinstance(params, CXRDatasetParams):
        return {**params.model_dump(mode="json", exclude={"tables"}), **({"tables": params.table_rules_used()} if params.own_sources() else {})}
    own = params.own_sources()
    return {**params.model_dump(mode="json", exclude={"folders", "tables"} | ({"classes"} if params.kind != "image_folder" else set())),
            **({"own_sources": {s: {"reader": params.reader_of(s), **params.rules(s).model_dump(mode="json")} for s in own}} if own else {})}


# how harmonize runs, not what it writes: a change of these leaves the arrays as they are
NOT_IN_THE_ARRAYS = ("workers", "max_quarantine_fraction")


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested settings dict as dotted paths to its values (an empty dict, a list: a value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stale_rules(card: dict[str, Any], params: CXRDatasetParams | BenchmarkDatasetParams) -> list[str]:
    """The settings of ``datasets.<d>`` whose values differ from those the harmonized card records (``rules``), as
    ``<dotted key>: built with X, now Y``: the settings that decide the arrays, of the sources the dataset reads (a
    public source's rules when it is not among them, the decode processes and the quarantine threshold do not count).
    Only settings both sides hold are compared: one added to fedsilo since the card was written, or removed since,
    is not an edit of the site's (the code that reads it changed with it). Empty for a card written before ``rules``
    were recorded."""
    built = card.get("rules")
    if not isinstance(built, dict):
        return []
    now = harmonize_rules(params)
    used = set(params.source_list)
    unused = {s for s in (*CXR_SOURCES, *DATASET_SOURCES.get(params.kind, ())) if s not in used}  # rules of sources not read
    if built.get("sources") is None:  # a benchmark's default: every source of its kind
        built = {**built, "sources": list(DATASET_SOURCES.get(str(built.get("kind")), ()))}
    now = {**now, "sources": list(params.source_list)}

    def comparable(rules: dict[str, Any]) -> dict[str, Any]:
        return _leaves({k: v for k, v in rules.items() if k not in NOT_IN_THE_ARRAYS and k not in unused})

    was, is_ = comparable(built), comparable(now)
    return [f"{k}: built with {was[k]!r}, now {is_[k]!r}" for k in sorted(set(was) & set(is_)) if was[k] != is_[k]]


def refuse_stale_rules(card: dict[str, Any], params: CXRDatasetParams | BenchmarkDatasetParams, folder: Path,
                       dataset: str, rerun: str) -> None:
    """ConfigError when the harmonized ``folder`` (its ``card``) was built with other settings than ``datasets.<dataset>``
    (``params``) has now (:func:`stale_rules`), naming each and ``rerun``, the commands that build it again."""
    from fedsilo.config import ConfigError

    stale = stale_rules(card, params)
    if stale:
        raise ConfigError(f"{folder}: harmonized with other settings than datasets.{dataset} has now ({'; '.join(stale)}); "
                          f"rerun {rerun}")


def harmonize_dataset(params: CXRDatasetParams | BenchmarkDatasetParams, raw_root: Path, out_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """Harmonize one dataset into ``out_dir``, holding its lock: a second harmonize of the same folder (two
    terminals, `dvc repro` beside a command) would remove this one's arrays in progress as an interrupted write's
    leftover; it is refused at once, naming who harmonizes."""
    from fedsilo.utils.locks import beside, held

    out_dir = Path(out_dir)
    with held(beside(out_dir), lambda who: HarmonizeError(f"{out_dir.name}: already being harmonized into {out_dir} by "
                                                          f"{who}; wait for it to end or stop it, then harmonize again")):
        if isinstance(params, CXRDatasetParams):
            return harmonize_cxr(params, raw_root, out_dir, quiet)
        return harmonize_benchmark(params, raw_root, out_dir, quiet)


def _card(meta: dict[str, Any], table: pd.DataFrame, excluded: pd.DataFrame, quarantine: pd.DataFrame, folder: Path) -> dict[str, Any]:
    classes = list(meta["classes"])
    per_domain: dict[str, Any] = {}
    for dom in table["domain"].unique().tolist() + [d for d in excluded["domain"].unique() if d not in set(table["domain"])]:
        t = table[table["domain"] == dom]
        e = excluded[excluded["domain"] == dom]
        q = quarantine[quarantine["domain"] == dom]
        per_domain[dom] = {
            "images": int(len(t)),
            "by_class": {c: int((t["label"] == k).sum()) for k, c in enumerate(classes)},
            "by_subset": {(s or "(none)"): int(n) for s, n in t["subset"].value_counts().sort_index().items()},
            "groups": int(t["group"].nunique()),
            "excluded": int(len(e)),
            "excluded_by_reason": {k: int(v) for k, v in e["excluded"].value_counts().items()},
            "quarantined": int(len(q)),
            "quarantine_examples": q["error"].head(5).tolist(),
            **({"label_from": {k: int(v) for k, v in t["label_from"].value_counts().items() if k}}
               if "label_from" in t.columns and (t["label_from"] != "").any() else {}),
        }
    return {
        "dataset": meta["dataset"],  # its name in params (datasets.<name>), the folder's
        "kind": meta["kind"],
        "task": meta["task"],
        "classes": classes,
        "image_shape": list(np.load(folder / "images.npy", mmap_mode="r").shape[1:]),
        "total_images": int(len(table)),
        "domains": per_domain,
        "rules": meta["rules"],
        **({"sources": meta["sources"]} if meta.get("sources") else {}),  # which copy: mirror, the user's folder, a download
        **({"warnings": list(meta["warnings"])} if meta.get("warnings") else {}),
        **({"samples": meta["samples"]} if meta.get("samples") else {}),
        "sha256": {
            "records.parquet": file_sha256(folder / "records.parquet"),
            "images.npy": file_sha256(folder / "images.npy"),
        },
    }


def card_markdown(card: dict[str, Any]) -> str:
    classes = card["classes"]
    lines = [
        f"# Data card: {card['dataset']}" + (f" (kind {card['kind']})" if card.get("kind", card["dataset"]) != card["dataset"] else ""),
        "",
        f"Task: {card['task']}. Image shape {tuple(card['image_shape'])}, {card['total_images']} images kept.",
        "",
        *(["Fetched: " + "; ".join(f"{s} ({v['mode']}) from {v['origin']}" for s, v in card["sources"].items()) + ".", ""]
          if card.get("sources") else []),
        "| domain | kept | " + " | ".join(classes) + " | subsets | groups | excluded | quarantined |",
        "|---|---|" + "---|" * len(classes) + "---|---|---|---|",
    ]
    for dom, d in card["domains"].items():
        subsets = ", ".join(f"{k} {v}" for k, v in d["by_subset"].items())
        lines.append(
            f"| {dom} | {d['images']} | " + " | ".join(str(d["by_class"][c]) for c in classes)
            + f" | {subsets} | {d['groups']} | {d['excluded']} | {d['quarantined']} |"
        )
    lines += ["", "Groups are patients for chest X-rays, and single images for the benchmarks unless a source of your own "
              "names them (image_folder's group rule, image_table's patient column)."]
    if card.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in card["warnings"]]
    if card.get("samples"):
        sm = card["samples"]
        more = (f"; the first {len(sm['classes_shown'])} of the {len(classes)} classes" if len(sm["classes_shown"]) < len(classes) else "")
        lines += ["", "## Samples", "", f"The first {sm['per_class']} images of each domain (rows: "
                  f"{', '.join(sm['ids'])}) and class (columns: {', '.join(sm['classes_shown'])}) as harmonize wrote "
                  f"them{more} (their ids: card.json, samples.ids):", "", f"![samples]({sm['file']})"]
    froms = {dom: d["label_from"] for dom, d in card["domains"].items() if d.get("label_from")}
    if froms:
        lines += ["", "## Where the slides' patches took their class", "",
                  "region: its region annotations; outside: the regions' outside class; slide: its slide's class "
                  "(records.parquet, label_from)", ""]
        lines += [f"- {dom}: " + ", ".join(f"{k} {v}" for k, v in sorted(f.items())) for dom, f in froms.items()]
    lines += ["", "## Exclusions by reason", ""]
    for dom, d in card["domains"].items():
        reasons = ", ".join(f"{k}: {v}" for k, v in d["excluded_by_reason"].items()) or "none"
        lines.append(f"- {dom}: {reasons}")
    lines += ["", "## Quarantine", ""]
    for dom, d in card["domains"].items():
        if d["quarantined"]:
            lines.append(f"- {dom}: {d['quarantined']} (e.g. {d['quarantine_examples'][0]})")
    if not any(d["quarantined"] for d in card["domains"].values()):
        lines.append("- none")
    return "\n".join(lines) + "\n"
