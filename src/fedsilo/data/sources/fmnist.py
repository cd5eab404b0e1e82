"""Fashion-MNIST (Xiao et al. 2017), idx files like MNIST's: ``{train,t10k}-images-idx3-ubyte[.gz]`` and
``{train,t10k}-labels-idx1-ubyte[.gz]`` (28 x 28 grey, labels 0-9), in torchvision's ``FashionMNIST/raw/`` or the
zalandoresearch repository's ``data/fashion/`` or anywhere below the raw folder. One domain, ``Fashion-MNIST``;
subsets train / test. Grey images stay one channel unless the dataset asks for ``channels: rgb``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.download import Remote
from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import array_records, load_arrays, load_container, records_frame

DOMAIN = "Fashion-MNIST"
DOMAINS = (DOMAIN,)
# the class names of the dataset's README (and torchvision's FashionMNIST.classes); the idx files carry none
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_BASE = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"  # torchvision's address
DOWNLOADS = [  # md5s as published with torchvision's FashionMNIST dataset
    Remote(_BASE + "train-images-idx3-ubyte.gz", "FashionMNIST/raw/train-images-idx3-ubyte.gz", "md5:8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    Remote(_BASE + "train-labels-idx1-ubyte.gz", "FashionMNIST/raw/train-labels-idx1-ubyte.gz", "md5:25c81989df183df01b3e8a0aad5dffbe"),
    Remote(_BASE + "t10k-images-idx3-ubyte.gz", "FashionMNIST/raw/t10k-images-idx3-ubyte.gz", "md5:bef4ecab320f06d8554ea6380940ec79"),
    Remote(_BASE + "t10k-labels-idx1-ubyte.gz", "FashionMNIST/raw/t10k-labels-idx1-ubyte.gz", "md5:bb300cfdad3c16e7a12a480ee83cd310"),
]
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS", "CLASSES"]


def images_file(raw_dir: Path, stem: str) -> Path | None:
    """The shallowest ``<stem>[.gz]`` below ``raw_dir``, the gzipped copy first."""
    hits = [p for p in walk(raw_dir, f"{stem}*") if p.is_file() and p.name in (stem, stem + ".gz")]
    hits.sort(key=lambda p: (len(p.relative_to(raw_dir).parts), p.suffix != ".gz", str(p)))
    return hits[0] if hits else None


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows: list[dict] = []
    for prefix, subset in (("train", "train"), ("t10k", "test")):
        img = images_file(raw_dir, f"{prefix}-images-idx3-ubyte")
        if img is None:
            continue
        rel = img.relative_to(raw_dir).as_posix()
        labels = rel.replace("images-idx3", "labels-idx1")
        rows += array_records(rel, load_arrays(raw_dir, rel)[1], subset, f"{DOMAIN}/{subset}", classes=CLASSES, label_file=labels)
    if not rows:
        raise LabelFileError(f"{raw_dir}: no Fashion-MNIST files (expected FashionMNIST/raw/{{train,t10k}}-images-idx3-ubyte.gz and the labels beside them)")
    return records_frame(rows, DOMAIN)
