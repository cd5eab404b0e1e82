"""Offline mirrors of the single-domain datasets, in each distribution's real raw layout and file formats.

- CIFAR-10: ``cifar-10-batches-py/`` with ``data_batch_1..5``, ``test_batch`` and ``batches.meta``, Python pickles
  (protocol 2, as Python 2 wrote them) of ``data`` (N x 3072 uint8, CHW rows), ``labels``, ``filenames``,
  ``batch_label``; the training images are dealt over the five batches.
- CIFAR-100: ``cifar-100-python/`` with ``train``, ``test`` (``fine_labels``, ``coarse_labels``) and ``meta``
  (``fine_label_names``, ``coarse_label_names``). The mirror's coarse label is ``fine // 5``: CIFAR-100's real
  superclass assignment is not reproduced (fedsilo does not read it).
- Fashion-MNIST: torchvision's ``FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``.
- EMNIST: the unpacked ``gzip.zip``: ``gzip/emnist-byclass-{train,test}-{images-idx3,labels-idx1}-ubyte.gz``
  (images stored transposed, as NIST stores them) and ``gzip/emnist-byclass-mapping.txt``.
- CINIC-10: ``{train,valid,test}/<class>/`` PNGs named like the archive's (``cifar10-<split>-<n>.png`` and
  ``n<synset>_<n>.png``).
- FEMNIST: LEAF's ``data/femnist/data/{train,test}/all_data_<k>_niid_1_keep_0_{train,test}_9.json`` (``-t sample``:
  every writer in both, 90 % / 10 % of its images), pixels as grey / 255 with dark ink on white, labels 0-61. Each
  writer has a hand of its own (font, stroke, slant, size), so the writers differ as real ones do.

Images are synthetic and learnable: CIFAR, CINIC-10 and Fashion-MNIST draw class ``k``'s shape (``k % 10``; for
CIFAR-100 the colour band ``k // 10`` too) over a textured (CIFAR, CINIC) or black (Fashion-MNIST) background; EMNIST
renders the class's character. ``MirrorParams.per_class`` images per class and official subset; deterministic in
``MirrorParams.seed``.
"""

from __future__ import annotations

import colorsys
import gzip
import pickle
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

from fedsilo.config import MirrorParams
from fedsilo.data.mirror.benchmarks import FONTS, _idx_bytes, _rng, _save, _shape_mask, _smooth_noise, glyph

COARSE_NAMES = (
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables", "household_electrical_devices",
    "household_furniture", "insects", "large_carnivores", "large_man-made_outdoor_things", "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores", "medium_mammals", "non-insect_invertebrates", "people", "reptiles",
    "small_mammals", "trees", "vehicles_1", "vehicles_2",
)


def colour_object(rng: np.random.Generator, k: int, n_classes: int, size: int = 32) -> np.ndarray:
    """uint8 RGB size x size: shape ``k % 10`` over smooth texture; with more than 10 classes the foreground hue
    band is ``k // 10`` (so 100 classes stay learnable), else a random hue."""
    fm = _shape_mask(rng, k % 10, size).astype(np.float32)[..., None] / 255.0
    hue = ((k // 10) + rng.uniform(0.1, 0.9)) / 10.0 if n_classes > 10 else rng.uniform(0, 1)
    fg = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0)), np.float32)
    bg = _smooth_noise(rng, size, 3, cells=int(rng.integers(2, 6))) * 0.5 + 0.1
    img = bg * (1 - fm) + fg * fm + rng.normal(0, 0.03, (size, size, 3))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def grey_object(rng: np.random.Generator, k: int, size: int = 28) -> np.ndarray:
    """uint8 size x size: class ``k``'s shape in a grey level over black, a little texture (Fashion-MNIST's look)."""
    fm = _shape_mask(rng, k, size).astype(np.float32) / 255.0
    tex = _smooth_noise(rng, size, 1, cells=4)[..., 0] * 0.4 + rng.uniform(0.5, 0.6)
    return (np.clip(fm * tex, 0, 1) * 255).astype(np.uint8)


def _labels(rng: np.random.Generator, n_classes: int, per_class: int) -> np.ndarray:
    y = np.repeat(np.arange(n_classes), per_class)
    rng.shuffle(y)
    return y


def _pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _cifar_rows(images: np.ndarray) -> np.ndarray:
    """N x 32 x 32 x 3 -> N x 3072 rows in CHW order (CIFAR's 'data')."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), -1))


def _colour_subset(source: str, p: MirrorParams, subset: str, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The labels and 32 px colour images of one CIFAR-style subset, drawn from the (source, seed, subset) stream."""
    rng = _rng(source, p.seed, subset)
    y = _labels(rng, n_classes, p.per_class)
    return y, np.stack([colour_object(rng, int(k), n_classes) for k in y])


def write_cifar10(out: Path, p: MirrorParams) -> None:
    from fedsilo.data.sources.cifar10 import CLASSES, FOLDER

    base = out / FOLDER
    for subset in ("train", "test"):
        y, x = _colour_subset("cifar10", p, subset, len(CLASSES))
        names = [f"{CLASSES[k]}_s_{i + 1:06d}.png" for i, k in enumerate(y)]
        if subset == "test":
            batches = [("test_batch", "testing batch 1 of 1", np.arange(len(y)))]
        else:
            batches = [(f"data_batch_{b + 1}", f"training batch {b + 1} of 5", np.arange(b, len(y), 5)) for b in range(5)]
        for name, label, idx in batches:
            _pickle(base / name, {"batch_label": label, "labels": [int(v) for v in y[idx]], "data": _cifar_rows(x[idx]), "filenames": [names[i] for i in idx]})
    n_max = max(len(range(b, 10 * p.per_class, 5)) for b in range(5))
    _pickle(base / "batches.meta", {"num_cases_per_batch": n_max, "label_names": list(CLASSES), "num_vis": 3072})
    (base / "readme.html").write_text("<html><body>fedsilo offline mirror of cifar-10-batches-py (synthetic images)</body></html>\n")


def write_cifar100(out: Path, p: MirrorParams) -> None:
    from fedsilo.data.sources.cifar100 import CLASSES, FOLDER

    base = out / FOLDER
    for subset in ("train", "test"):
        y, x = _colour_subset("cifar100", p, subset, len(CLASSES))
        _pickle(base / subset, {
            "filenames": [f"{CLASSES[k]}_s_{i + 1:06d}.png" for i, k in enumerate(y)],
            "batch_label": f"{'training' if subset == 'train' else 'testing'} batch 1 of 1",
            "fine_labels": [int(v) for v in y],
            "coarse_labels": [int(v) // 5 for v in y],
            "data": _cifar_rows(x),
        })
    _pickle(base / "meta", {"fine_label_names": list(CLASSES), "coarse_label_names": list(COARSE_NAMES)})
    (base / "file.txt~").write_text("")


def _write_idx_pair(folder: Path, images_name: str, x: np.ndarray, y: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / images_name).write_bytes(gzip.compress(_idx_bytes(x), mtime=0))
    (folder / images_name.replace("images-idx3", "labels-idx1")).write_bytes(gzip.compress(_idx_bytes(y.astype(np.uint8)), mtime=0))


def write_fmnist(out: Path, p: MirrorParams) -> None:
    for subset, prefix in (("train", "train"), ("test", "t10k")):
        rng = _rng("fmnist", p.seed, subset)
        y = _labels(rng, 10, p.per_class)
        x = np.stack([grey_object(rng, int(k)) for k in y])
        _write_idx_pair(out / "FashionMNIST" / "raw", f"{prefix}-images-idx3-ubyte.gz", x, y)


def emnist_char(rng: np.random.Generator, ch: str) -> np.ndarray:
    """uint8 28 x 28 upright character, white on black."""
    g = glyph(rng, ch, 28, FONTS[int(rng.integers(0, 3))], int(rng.integers(2, 4)), rng.uniform(0.75, 0.95), rng.normal(0, 8))
    return (cv2.GaussianBlur(g, (0, 0), 0.5) * 255).astype(np.uint8)


def write_emnist(out: Path, p: MirrorParams) -> None:
    from fedsilo.data.sources.emnist import CLASSES, SPLIT

    folder = out / "gzip"
    for subset in ("train", "test"):
        rng = _rng("emnist", p.seed, subset)
        y = _labels(rng, len(CLASSES), p.per_class)
        upright = np.stack([emnist_char(rng, CLASSES[int(k)]) for k in y])
        _write_idx_pair(folder, f"emnist-{SPLIT}-{subset}-images-idx3-ubyte.gz", upright.transpose(0, 2, 1), y)  # stored transposed
    (folder / f"emnist-{SPLIT}-mapping.txt").write_text("".join(f"{i} {ord(c)}\n" for i, c in enumerate(CLASSES)))


# WordNet-style ids for the mirror's ImageNet-like file names (cosmetic: the reader takes the class from the folder)
_SYNSETS = ("n02691156", "n02958343", "n01503061", "n02121808", "n02430045", "n02084071", "n01639765", "n02374451", "n04194289", "n04490091")


def write_cinic10(out: Path, p: MirrorParams) -> None:
    from fedsilo.data.sources.cinic10 import CLASSES

    for split in ("train", "valid", "test"):
        rng = _rng("cinic10", p.seed, split)
        for k, cls in enumerate(CLASSES):
            for i in range(p.per_class):
                name = f"cifar10-{split}-{k * 1000 + i}.png" if i % 2 == 0 else f"{_SYNSETS[k]}_{k * 1000 + i}.png"
                _save(out / split / cls / name, colour_object(rng, k, len(CLASSES)))


def write_femnist(out: Path, p: MirrorParams) -> None:
    """16 writers (LEAF's ``f<hsf>_<n>`` ids) of 2 x ``per_class`` to 5 x ``per_class`` characters each, digits as
    common as in NIST's forms; 8 writers per JSON file, as LEAF writes fewer, larger files."""
    import json

    from fedsilo.data.sources.emnist import CLASSES

    folder = out / "data" / "femnist" / "data"
    rng = _rng("femnist", p.seed, "writers")
    writers = [f"f{1000 + 37 * i:04d}_{int(rng.integers(0, 100)):02d}" for i in range(16)]
    weights = np.array([4.0] * 10 + [1.0] * 52)
    for k in range(0, len(writers), 8):
        parts: dict[str, dict] = {"train": {}, "test": {}}
        for w in writers[k : k + 8]:
            hand = _rng("femnist", p.seed, w)
            font, thick = FONTS[int(hand.integers(0, 3))], int(hand.integers(2, 4))
            slant, scale = hand.normal(0, 12), hand.uniform(0.7, 0.95)
            n = int(hand.integers(2 * p.per_class, 5 * p.per_class + 1))
            ys = hand.choice(len(CLASSES), size=n, p=weights / weights.sum())
            xs = []
            for y in ys:
                g = glyph(hand, CLASSES[int(y)], 28, font, thick, scale * hand.uniform(0.9, 1.1), slant + hand.normal(0, 4))
                ink = cv2.GaussianBlur(g, (0, 0), 0.5)
                xs.append(np.round(1.0 - ink, 6).ravel().tolist())  # LEAF's grey / 255: white paper, dark ink
            n_train = max(1, int(0.9 * n))
            order = hand.permutation(n)
            for side, idx in (("train", sorted(order[:n_train])), ("test", sorted(order[n_train:]))):
                parts[side][w] = {"x": [xs[i] for i in idx], "y": [int(ys[i]) for i in idx]}
        for side, data in parts.items():
            users = list(data)
            doc = {"users": users, "num_samples": [len(data[u]["y"]) for u in users], "user_data": data}
            path = folder / side / f"all_data_{k // 8}_niid_1_keep_0_{side}_9.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))


WRITERS: dict[str, Callable[[Path, MirrorParams], None]] = {
    "cifar10": write_cifar10,
    "cifar100": write_cifar100,
    "fmnist": write_fmnist,
    "emnist": write_emnist,
    "cinic10": write_cinic10,
    "femnist": write_femnist,
}
