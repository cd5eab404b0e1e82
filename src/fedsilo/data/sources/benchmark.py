"""Helpers shared by the multi-domain benchmark sources (digits, Office-Caltech-10, PACS, DomainNet).

A benchmark record has the CXR record columns (``fedsilo.data.sources.base``) plus ``subset``: the dataset's own
partition the image belongs to (``train``, ``test``, ``val``) or empty when the distribution has none. ``label`` is the
index of the class in the dataset's canonical class list, ``original_label`` the source's own label (class folder
name or numeric label), ``group`` is the image itself (no patient structure), ``view`` is empty.

Images come either as files (``reader = image``, ``path`` relative to the raw folder) or as rows of an array
container (``reader = array``, ``path = <container>#<row>``: an idx, ``.mat``, LIBSVM or pickle file). :func:`load_arrays`
parses a container once per process and returns its images and labels, so the label pass of ``read_records`` and the
pixel pass of harmonize share one read.
"""

from __future__ import annotations

import bz2
import gzip
import pickle
import re
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from fedsilo.config import loose_name
from fedsilo.data.sources.base import LabelFileError, finalize, is_hidden, show, walk

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff")


def norm_name(name: str) -> str:
    """Folder names compared loosely (:func:`fedsilo.config.loose_name`): case, spaces, dashes, underscores and
    Unicode normalization do not matter."""
    return loose_name(name)


def list_lines(path: Path, expected: str) -> Iterator[tuple[int, str, str, str]]:
    """(line number, first field, second field, the line) of a two-field list file (``<file> <label>``: MNIST-M's
    labels, PACS's kfold lists, DomainNet's split lists); blank lines are skipped, any other field count is an error
    naming the file, the line and ``expected``."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise LabelFileError(f"{path}: line {n}: expected {expected}, got {line!r}")
        yield n, parts[0], parts[1], line


def records_frame(rows: list[dict], domain: str) -> pd.DataFrame:
    cols = ["id", "label", "original_label", "group", "view", "path", "reader", "excluded", "subset"]
    df = pd.DataFrame(rows, columns=cols)
    if df.empty:
        return finalize(df, domain)
    df["group"] = df["group"].where(df["group"].astype(bool), df["id"])
    return finalize(df, domain)


def find_dirs(root: Path, aliases: dict[str, str], must_contain_dirs: bool = True) -> dict[str, Path]:
    """Canonical name -> the shallowest folder below ``root`` whose name is one of its aliases (loosely compared)
    and that holds sub-folders (class folders). ``aliases`` maps a normalized alias to the canonical name. Hidden
    folders (``__MACOSX``, dot folders) and what they hold are never candidates."""
    found: dict[str, Path] = {}
    for p in sorted(walk(root, "*"), key=lambda q: (len(q.relative_to(root).parts), str(q))):
        if not p.is_dir():
            continue
        canon = aliases.get(norm_name(p.name))
        if canon is None or canon in found:
            continue
        if must_contain_dirs and not any(c.is_dir() and not is_hidden(c.name) for c in p.iterdir()):
            continue
        found[canon] = p
    return found


def no_domain_folder(raw_dir: Path, aliases: dict[str, str], dataset: str, expected: str) -> LabelFileError:
    """The error for a copy in which :func:`find_dirs` found no domain folder (``expected``: their names): where
    folders of the domains' names are there but hold no class folder (images straight in ``<domain>/``), it says so
    instead of "no domain folder"."""
    bare = find_dirs(raw_dir, aliases, must_contain_dirs=False)
    if bare:
        return LabelFileError(f"{raw_dir}: the {dataset} domain folders {', '.join(p.name for p in bare.values())} hold "
                              f"no class folder: each domain's images go in a folder per class, <domain>/<class>/<image>")
    return LabelFileError(f"{raw_dir}: no {dataset} domain folder ({expected})")


def class_root(domain_dir: Path) -> Path:
    """The folder that holds a domain's class folders: ``<domain>/images/`` in Office-31's layout, else the domain
    folder itself."""
    return domain_dir / "images" if (domain_dir / "images").is_dir() else domain_dir


def fedbn_split_lists(raw_dir: Path, domain: str, aliases: dict[str, str]) -> dict[str, str]:
    """``<class folder>/<file>`` -> ``train`` / ``test`` from FedBN's split lists ``<site>_train.pkl`` /
    ``<site>_test.pkl`` (a pickled (paths, labels) pair each; Office-Caltech-10 and DomainNet), for the domain the
    site name maps to through ``aliases`` (normalized name -> domain); empty when the domain has none."""
    out: dict[str, str] = {}
    for subset in ("train", "test"):
        hits = [p for p in walk(raw_dir, f"*_{subset}.pkl") if aliases.get(norm_name(p.stem[: -len(subset) - 1])) == domain]
        if not hits:
            continue
        try:
            paths, _ = np.load(hits[0], allow_pickle=True)
        except (ValueError, OSError, EOFError) as err:
            raise LabelFileError(f"{hits[0]}: cannot read FedBN split list: {err}") from err
        for path in paths:
            parts = Path(str(path)).parts
            if len(parts) >= 2:
                out[f"{parts[-2]}/{parts[-1]}"] = subset
    return out


def require_every_class(rows: list[dict], classes: Sequence[str], where: Path, dataset: str, files: str = "images") -> None:
    """Refuses a domain's records (:func:`class_folder_records`) that lack a class: a site without one would be scored
    on a task it cannot learn, and the copy read as a smaller task without a word."""
    have = {r["label"] for r in rows}
    absent = [c for k, c in enumerate(classes) if k not in have]
    if absent:
        raise LabelFileError(f"{where}: no images for {len(absent)} of the {len(classes)} {dataset} classes "
                             f"({', '.join(absent)}): each class is a folder <class>/ of {files}")


def class_folder_records(
    domain_dir: Path,
    raw_dir: Path,
    domain: str,
    classes: Sequence[str],
    class_aliases: dict[str, str],
    subset_of: dict[str, str] | None = None,
) -> list[dict]:
    """One record per image file in ``domain_dir/<class>/`` (hidden files such as macOS's ``._*`` twins and
    ``.DS_Store`` are not images). Class folders are matched loosely through ``class_aliases`` (normalized alias ->
    canonical class); an unknown class folder is an error naming it."""
    rows: list[dict] = []
    index = {c: i for i, c in enumerate(classes)}
    base = class_root(domain_dir)
    for cdir in sorted(p for p in base.iterdir() if p.is_dir() and not is_hidden(p.name)):
        canon = class_aliases.get(norm_name(cdir.name))
        if canon is None:
            raise LabelFileError(f"{cdir}: class folder {cdir.name!r} is not a class of this dataset (classes: {', '.join(classes)})")
        for f in walk(cdir, "*"):
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                rel = f.relative_to(raw_dir).as_posix()
                key = f"{cdir.name}/{f.name}"
                rows.append(
                    {
                        "id": f"{domain}/{f.relative_to(base).as_posix()}",
                        "label": index[canon],
                        "original_label": cdir.name,
                        "group": "",
                        "view": "",
                        "path": rel,
                        "reader": "image",
                        "excluded": "",
                        "subset": (subset_of or {}).get(key, ""),
                    }
                )
    return rows


def array_records(
    container: str,
    labels: np.ndarray,
    subset: str,
    id_prefix: str,
    original: Iterable | None = None,
    classes: Sequence[str] | None = None,
    label_file: str | None = None,
) -> list[dict]:
    """One record per row of an array container. ``labels`` are indices into ``classes`` (default: the digits 0-9);
    a label outside them is an error naming the file that holds the labels (``label_file``, default the container),
    the row and the label as the file stores it."""
    labels = np.asarray(labels).astype(np.int64).ravel()
    orig = list(original) if original is not None else labels.tolist()
    n = len(classes) if classes is not None else 10
    bad = np.flatnonzero((labels < 0) | (labels >= n))
    if bad.size:
        what = "a digit 0-9" if classes is None else f"one of the {n} classes (0-{n - 1})"
        raise LabelFileError(f"{label_file or container}: label {show(orig[bad[0]])} at row {bad[0]} is not {what}")
    return [
        {
            "id": f"{id_prefix}/{i}",
            "label": int(y),
            "original_label": str(o),
            "group": "",
            "view": "",
            "path": f"{container}#{i}",
            "reader": "array",
            "excluded": "",
            "subset": subset,
        }
        for i, (y, o) in enumerate(zip(labels, orig))
    ]


# --------------------------------------------------------------------------- array containers
def _open_maybe_compressed(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    return open(path, "rb")


def read_idx(path: Path) -> np.ndarray:
    """An idx file (MNIST's format), gzipped or not: magic 0x00 0x00 <type 0x08> <ndim>, big-endian sizes, uint8 data."""
    try:
        with _open_maybe_compressed(path) as f:
            data = f.read()
    except (OSError, EOFError) as err:
        raise LabelFileError(f"{path}: cannot read: {err}") from err
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise LabelFileError(f"{path}: not an unsigned-byte idx file (bad magic number)")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    start = 4 + 4 * ndim
    n = int(np.prod(dims))
    if len(data) - start != n:
        raise LabelFileError(f"{path}: truncated idx file ({len(data) - start} of {n} bytes)")
    return np.frombuffer(data, dtype=np.uint8, offset=start).reshape(dims)


def read_libsvm_digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """USPS as LIBSVM distributes it (and torchvision reads it): ``<label 1..10> <i>:<v> ...`` with 256 features in
    [-1, 1]; missing features are 0. Returns (uint8 N x 16 x 16, the raw labels 1..10)."""
    images, labels = [], []
    try:
        with _open_maybe_compressed(path) as f:
            for n, line in enumerate(f, 1):
                parts = line.decode().split()
                if not parts:
                    continue
                vec = np.zeros(256, np.float32)
                for tok in parts[1:]:
                    i, _, v = tok.partition(":")
                    k = int(i) - 1
                    if not 0 <= k < 256:
                        raise LabelFileError(f"{path}: line {n}: feature index {i} outside 1..256")
                    vec[k] = float(v)
                labels.append(int(float(parts[0])))
                images.append(vec)
    except (OSError, EOFError, ValueError) as err:
        raise LabelFileError(f"{path}: cannot parse as LIBSVM: {err}") from err
    arr = np.clip(np.round((np.stack(images) + 1.0) / 2.0 * 255.0), 0, 255).astype(np.uint8).reshape(-1, 16, 16)
    return arr, np.asarray(labels, np.int64)


def read_mat_digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """SVHN / SynthDigits ``*_32x32.mat``: ``X`` 32 x 32 x 3 x N uint8, ``y`` N x 1 (SVHN writes digit 0 as 10)."""
    from scipy.io import loadmat

    try:
        m = loadmat(path)
    except (OSError, ValueError, NotImplementedError) as err:
        raise LabelFileError(f"{path}: cannot read .mat: {err}") from err
    for key in ("X", "y"):
        if key not in m:
            raise LabelFileError(f"{path}: missing variable {key!r}")
    x = np.asarray(m["X"])
    if x.ndim != 4 or x.shape[2] != 3:
        raise LabelFileError(f"{path}: variable 'X' has shape {x.shape}, expected 32 x 32 x 3 x N")
    return np.ascontiguousarray(x.transpose(3, 0, 1, 2)), np.asarray(m["y"]).astype(np.int64).ravel()


def read_pickle_pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """FedBN's pre-processed digits: a pickle of (images uint8 N x 28 x 28 [x 3], labels). Pickles run code when
    loaded: only point fedsilo at files you trust."""
    try:
        obj = np.load(path, allow_pickle=True)
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as err:
        raise LabelFileError(f"{path}: cannot read pickle: {err}") from err
    if len(obj) != 2:
        raise LabelFileError(f"{path}: expected a pair (images, labels), got {type(obj).__name__} of length {len(obj)}")
    images, labels = np.asarray(obj[0]), np.asarray(obj[1]).astype(np.int64).ravel()
    if images.shape[0] != labels.shape[0]:
        raise LabelFileError(f"{path}: {images.shape[0]} images but {labels.shape[0]} labels")
    return images.astype(np.uint8), labels


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: the CIFAR batches are Python pickles, and a pickle may
    otherwise run any code when loaded. Python 2's ``numpy.core`` module paths are mapped to numpy 2's."""

    ALLOWED = {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if module.startswith("numpy.core"):
            module = "numpy._core" + module[len("numpy.core"):]
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only numpy arrays and plain containers)")
        return super().find_class(module, name)


def read_python_pickle(path: Path) -> dict:
    """A CIFAR ``python version`` pickle (written by Python 2's cPickle) as a dict with ``str`` keys."""
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(f, encoding="latin1").load()
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, pickle.UnpicklingError) as err:
        raise LabelFileError(f"{path}: cannot read as a CIFAR python pickle: {type(err).__name__}: {err}") from err
    if not isinstance(obj, dict):
        raise LabelFileError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """A CIFAR-10 / CIFAR-100 python batch: ``data`` N x 3072 uint8 rows (the 1024 red, then green, then blue values
    of a 32 x 32 image, row-major) and the labels under ``label_key`` (``labels`` / ``fine_labels``). Returns
    (uint8 N x 32 x 32 x 3, labels)."""
    d = read_python_pickle(path)
    for key in ("data", label_key):
        if key not in d:
            raise LabelFileError(f"{path}: missing key {key!r} (have: {', '.join(sorted(d))})")
    data = np.asarray(d["data"])
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise LabelFileError(f"{path}: 'data' is {data.dtype} {data.shape}, expected uint8 N x 3072 (32 x 32 x 3 rows in CHW order)")
    labels = np.asarray(d[label_key]).ravel()
    if labels.shape[0] != data.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise LabelFileError(f"{path}: {labels.shape[0]} {label_key} ({labels.dtype}) for {data.shape[0]} images")
    return np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)), labels.astype(np.int64)


def _read_container(p: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels as stored) of one container; an idx image file takes its labels from the sibling
    ``*-labels-idx1-ubyte`` file."""
    name = p.name.lower()
    if "idx3-ubyte" in name:
        lab = p.with_name(p.name.replace("images-idx3", "labels-idx1"))
        if not lab.exists():
            raise LabelFileError(f"{lab}: label file missing next to {p.name}")
        images, labels = read_idx(p), read_idx(lab)
        if images.shape[0] != labels.shape[0]:
            raise LabelFileError(f"{lab}: {labels.shape[0]} labels for {images.shape[0]} images in {p.name}")
        return images, labels.astype(np.int64)
    if name.endswith(".mat"):
        return read_mat_digits(p)
    if name.endswith(".pkl"):
        return read_pickle_pair(p)
    if "usps" in name:
        return read_libsvm_digits(p)
    raise LabelFileError(f"{p}: unknown array container")


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float, size: int, read: Callable[[Path], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return read(Path(path))


def load_arrays(
    raw_dir: Path, container: str, read: Callable[[Path], tuple[np.ndarray, np.ndarray]] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(images N x H x W [x C] uint8, labels as the container stores them) of one container, read once per process
    by ``read`` (default: by the file's name: idx, ``.mat``, LIBSVM, FedBN pickle)."""
    p = Path(raw_dir) / container
    st = p.stat()
    return _load_cached(str(p), st.st_mtime, st.st_size, read or _read_container)


def load_container(raw_dir: Path, container: str) -> np.ndarray:
    """The image array of one container (N x H x W or N x H x W x C, uint8)."""
    return load_arrays(raw_dir, container)[0]


def fedbn_digit_records(raw_dir: Path, folder: str, domain: str) -> list[dict] | None:
    """FedBN's pre-processed layout ``<folder>/partitions/train_part{0..9}.pkl`` + ``<folder>/test.pkl``, or None
    when the raw folder does not hold it."""
    hits = sorted(p for p in walk(raw_dir, "test.pkl") if norm_name(p.parent.name) == norm_name(folder))
    if not hits:
        return None
    base = hits[0].parent
    rows: list[dict] = []
    parts = sorted((base / "partitions").glob("train_part*.pkl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    for part in parts:
        rel = part.relative_to(raw_dir).as_posix()
        rows += array_records(rel, load_arrays(raw_dir, rel)[1], "train", f"{domain}/train/{part.stem}")
    rel = hits[0].relative_to(raw_dir).as_posix()
    rows += array_records(rel, load_arrays(raw_dir, rel)[1], "test", f"{domain}/test")
    return rows


def find_files(raw_dir: Path, patterns: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for pat in patterns:
        out += walk(raw_dir, pat)
    return out
