"""CIFAR-100 (Krizhevsky 2009), the "python version" as distributed and as torchvision reads it:
``cifar-100-python/train`` and ``cifar-100-python/test``, Python pickles of ``data`` (N x 3072 uint8: 32 x 32 x 3 in
CHW order), ``fine_labels`` (0-99) and ``coarse_labels`` (0-19), with ``meta`` holding ``fine_label_names`` and
``coarse_label_names``. The 100 fine classes are the labels (as in FedeCouple's and CD2-pFed's tables); the class
list comes from ``meta`` when the copy has it. One domain, ``CIFAR-100``; subsets train / test."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import array_records, load_arrays, read_cifar_batch, records_frame
from fedsilo.data.sources.cifar10 import meta_names

DOMAIN = "CIFAR-100"
DOMAINS = (DOMAIN,)
# meta's fine_label_names in the official archive (alphabetical; used only when a copy lacks the meta file)
CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish", "forest",
    "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard",
    "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
    "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine", "possum",
    "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper",
    "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone",
    "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf",
    "woman", "worm",
)
FOLDER = "cifar-100-python"
# address and md5 as published with torchvision's CIFAR100 dataset (the archive unpacks to cifar-100-python/)
DOWNLOADS = [
    Remote("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz", "md5:eb9058c3a382ffc7106e4002c42a8d85", True),
]
__all__ = ["read_records", "load_container", "classes", "DOMAINS", "DOWNLOADS", "CLASSES"]
_SPLITS = (("train", "train"), ("test", "test"))


def _read(path: Path):
    return read_cifar_batch(path, "fine_labels")


def load_container(raw_dir: Path, container: str):
    return load_arrays(raw_dir, container, _read)[0]


def batch_folder(raw_dir: Path) -> Path:
    """The folder holding ``train`` / ``test`` (and ``meta``): ``cifar-100-python/`` anywhere below ``raw_dir``, or
    the shallowest folder with a ``meta`` file beside ``train`` or ``test``."""
    raw_dir = Path(raw_dir)
    cands = [d for d in [raw_dir, *(p for p in walk(raw_dir, "*") if p.is_dir())] if any((d / n).is_file() for n, _ in _SPLITS)]
    cands = [d for d in cands if d.name == FOLDER or (d / "meta").is_file()]
    if not cands:
        if any(walk(raw_dir, "train.bin")):
            raise LabelFileError(f"{raw_dir}: this is CIFAR-100's binary version (cifar-100-binary); fedsilo reads the python version (cifar-100-python.tar.gz)")
        raise LabelFileError(f"{raw_dir}: no CIFAR-100 files (expected {FOLDER}/train, {FOLDER}/test and {FOLDER}/meta)")
    return sorted(cands, key=lambda d: (len(d.parts), str(d)))[0]


def classes(raw_dir: Path) -> tuple[str, ...]:
    """``fine_label_names`` of ``meta`` (100 names), or :data:`CLASSES` when the copy has no meta file."""
    meta = batch_folder(raw_dir) / "meta"
    return meta_names(meta, "fine_label_names", len(CLASSES)) if meta.exists() else CLASSES


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    folder = batch_folder(raw_dir)
    names = classes(raw_dir)
    rows: list[dict] = []
    for name, subset in _SPLITS:
        f = folder / name
        if not f.is_file():
            continue
        rel = f.relative_to(raw_dir).as_posix()
        rows += array_records(rel, load_arrays(raw_dir, rel, _read)[1], subset, f"{DOMAIN}/{name}", classes=names)
    return records_frame(rows, DOMAIN)
