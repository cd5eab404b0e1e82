"""Offline mirrors of the benchmark sources, in each source's real raw layout and file formats.

Digits are rendered glyphs (OpenCV Hershey fonts) with random scale, shift, rotation and stroke width; each digit
source has its own look, as the real ones do: MNIST white-on-black 28 px, USPS thick 16 px strokes in [-1, 1]
LIBSVM, SVHN coloured house-number crops with neighbouring digits, SynthDigits varied fonts and gradients, MNIST-M
MNIST strokes blended over colour texture. Object benchmarks draw one class-specific shape per image (circle,
square, triangle, ...) in a domain-specific rendering: product photo on white (amazon), cluttered scene
(caltech), soft high-resolution photo (dslr), noisy colour-cast webcam, flat cartoon with outlines, line sketch,
blurred painting with brush strokes, infographic with text bars, quickdraw scribble. The class is learnable from
the shape (Office-31's 31 classes: the shape and a hue band); the domain shifts the pixel statistics.

Every writer is deterministic in ``MirrorParams.seed`` and writes ``per_class`` images per class, domain and official
subset.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

from fedsilo.config import MirrorParams

FONTS = (
    cv2.FONT_HERSHEY_SIMPLEX,
    cv2.FONT_HERSHEY_DUPLEX,
    cv2.FONT_HERSHEY_COMPLEX,
    cv2.FONT_HERSHEY_TRIPLEX,
    cv2.FONT_HERSHEY_PLAIN,
)


def _rng(source: str, seed: int, *extra: object) -> np.random.Generator:
    h = int(hashlib.sha256(f"{source}/{'/'.join(map(str, extra))}".encode()).hexdigest()[:8], 16)
    return np.random.default_rng([seed, h])


# --------------------------------------------------------------------------- digits
def glyph(rng: np.random.Generator, digit: int, size: int, font: int, thickness: int, scale: float, angle: float) -> np.ndarray:
    """A white digit on black, float32 [0, 1], size x size, centred with jitter."""
    big = size * 4
    canvas = np.zeros((big, big), np.uint8)
    fs = big / 36.0 * scale
    (w, h), _ = cv2.getTextSize(str(digit), font, fs, thickness * 4)
    org = (int((big - w) / 2 + rng.normal(0, big * 0.03)), int((big + h) / 2 + rng.normal(0, big * 0.03)))
    cv2.putText(canvas, str(digit), org, font, fs, 255, thickness * 4, cv2.LINE_AA)
    m = cv2.getRotationMatrix2D((big / 2, big / 2), angle, 1.0)
    canvas = cv2.warpAffine(canvas, m, (big, big))
    return cv2.resize(canvas, (size, size), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0


def _smooth_noise(rng: np.random.Generator, size: int, channels: int, cells: int = 4) -> np.ndarray:
    small = rng.uniform(0, 1, (cells, cells, channels)).astype(np.float32)
    return cv2.resize(small, (size, size), interpolation=cv2.INTER_CUBIC).reshape(size, size, channels).clip(0, 1)


def digit_image(source: str, rng: np.random.Generator, d: int) -> np.ndarray:
    """uint8 image of digit ``d`` in ``source``'s style: H x W (grey) or H x W x 3."""
    if source == "mnist":
        g = glyph(rng, d, 28, cv2.FONT_HERSHEY_SIMPLEX, int(rng.integers(2, 4)), rng.uniform(0.8, 1.0), rng.normal(0, 10))
        return (g * 255).astype(np.uint8)
    if source == "usps":
        g = glyph(rng, d, 16, cv2.FONT_HERSHEY_DUPLEX, 3, rng.uniform(1.0, 1.15), rng.normal(0, 6))
        return (cv2.GaussianBlur(g, (0, 0), 0.6) * 255).astype(np.uint8)
    if source == "svhn":
        bg = rng.uniform(0, 1, 3)
        fg = 1.0 - bg + rng.normal(0, 0.1, 3)
        g = glyph(rng, d, 32, FONTS[int(rng.integers(0, 2))], 2, rng.uniform(0.8, 1.0), rng.normal(0, 5))
        for side in (-1, 1):  # neighbouring house-number digits cut by the crop
            if rng.random() < 0.6:
                n = glyph(rng, int(rng.integers(0, 10)), 32, FONTS[0], 2, 0.9, 0)
                g = np.maximum(g, np.roll(n, side * 22, axis=1) * (np.arange(32)[None, :] * side > (5 if side > 0 else -27)))
        img = bg[None, None, :] * (1 - g[..., None]) + fg[None, None, :] * g[..., None]
        img = img + 0.25 * (_smooth_noise(rng, 32, 3) - 0.5) + rng.normal(0, 0.04, img.shape)
        return (cv2.GaussianBlur(img.clip(0, 1).astype(np.float32), (0, 0), 0.7) * 255).astype(np.uint8)
    if source == "synthdigits":
        g = glyph(rng, d, 32, FONTS[int(rng.integers(0, len(FONTS)))], int(rng.integers(1, 4)), rng.uniform(0.7, 1.05), rng.normal(0, 15))
        a, b = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        ramp = np.linspace(0, 1, 32, dtype=np.float32)[None, :, None]
        bg = a[None, None, :] * (1 - ramp) + b[None, None, :] * ramp
        fg = rng.uniform(0, 1, 3)
        while np.abs(fg - bg.mean((0, 1))).sum() < 0.9:
            fg = rng.uniform(0, 1, 3)
        img = bg * (1 - g[..., None]) + fg[None, None, :] * g[..., None]
        return ((img + rng.normal(0, 0.02, img.shape)).clip(0, 1) * 255).astype(np.uint8)
    if source == "mnist_m":
        g = glyph(rng, d, 32, cv2.FONT_HERSHEY_SIMPLEX, int(rng.integers(2, 4)), rng.uniform(0.7, 0.9), rng.normal(0, 10))
        tex = _smooth_noise(rng, 32, 3, cells=int(rng.integers(3, 8))) * 0.7 + rng.uniform(0, 0.3, 3)
        img = np.abs(tex - g[..., None])  # MNIST-M: |patch - digit|
        return (img.clip(0, 1) * 255).astype(np.uint8)
    raise KeyError(source)


def _digit_sets(source: str, p: MirrorParams, subsets: tuple[str, ...]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for subset in subsets:
        rng = _rng(source, p.seed, subset)
        labels = np.repeat(np.arange(10), p.per_class)
        rng.shuffle(labels)
        out[subset] = (np.stack([digit_image(source, rng, int(d)) for d in labels]), labels)
    return out


def _idx_bytes(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    return header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def write_mnist(out: Path, p: MirrorParams) -> None:
    raw = out / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for subset, prefix in (("train", "train"), ("test", "t10k")):
        x, y = _digit_sets("mnist", p, (subset,))[subset]
        (raw / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(x), mtime=0))
        (raw / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(y.astype(np.uint8)), mtime=0))


def write_usps(out: Path, p: MirrorParams) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for subset, name in (("train", "usps.bz2"), ("test", "usps.t.bz2")):
        x, y = _digit_sets("usps", p, (subset,))[subset]
        lines = []
        for img, lab in zip(x, y):
            vals = img.reshape(-1).astype(np.float64) / 255.0 * 2.0 - 1.0
            lines.append(f"{int(lab) + 1} " + " ".join(f"{i + 1}:{v:.6f}" for i, v in enumerate(vals)))
        (out / name).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def _write_mat(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    from scipy.io import savemat

    savemat(path, {"X": np.ascontiguousarray(x.transpose(1, 2, 3, 0)), "y": y.reshape(-1, 1).astype(np.uint8)}, do_compression=False)


def write_svhn(out: Path, p: MirrorParams) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for subset in ("train", "test"):
        x, y = _digit_sets("svhn", p, (subset,))[subset]
        _write_mat(out / f"{subset}_32x32.mat", x, np.where(y == 0, 10, y))  # SVHN writes 0 as 10


def write_synthdigits(out: Path, p: MirrorParams) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for subset in ("train", "test"):
        x, y = _digit_sets("synthdigits", p, (subset,))[subset]
        _write_mat(out / f"synth_{subset}_32x32.mat", x, y)


def write_mnist_m(out: Path, p: MirrorParams) -> None:
    base = out / "mnist_m"
    for subset in ("train", "test"):
        x, y = _digit_sets("mnist_m", p, (subset,))[subset]
        folder = base / f"mnist_m_{subset}"
        folder.mkdir(parents=True)
        lines = []
        for i, (img, lab) in enumerate(zip(x, y)):
            name = f"{i:08d}.png"
            cv2.imwrite(str(folder / name), img[:, :, ::-1])
            lines.append(f"{name} {int(lab)}")
        (base / f"mnist_m_{subset}_labels.txt").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- objects
def _shape_mask(rng: np.random.Generator, k: int, size: int) -> np.ndarray:
    """Filled mask (uint8 0/255) of shape class ``k`` with random centre, scale and rotation."""
    m = np.zeros((size, size), np.uint8)
    c = np.array([size / 2, size / 2]) + rng.normal(0, size * 0.05, 2)
    r = size * rng.uniform(0.24, 0.34)
    rot = rng.uniform(0, 2 * np.pi) if k not in (6,) else rng.normal(0, 0.15)

    def poly(n: int, radius: np.ndarray | float, phase: float = 0.0) -> np.ndarray:
        t = np.arange(n) * 2 * np.pi / n + phase + rot
        rr = np.broadcast_to(np.asarray(radius, dtype=float), t.shape)
        return np.stack([c[0] + rr * np.cos(t), c[1] + rr * np.sin(t)], 1).astype(np.int32)

    if k == 0:  # circle
        cv2.circle(m, tuple(c.astype(int)), int(r), 255, -1)
    elif k == 1:  # square
        cv2.fillPoly(m, [poly(4, r, np.pi / 4)], 255)
    elif k == 2:  # triangle
        cv2.fillPoly(m, [poly(3, r * 1.1)], 255)
    elif k == 3:  # plus / cross
        w = r * 0.35
        for a in (0, np.pi / 2):
            ca, sa = np.cos(rot + a), np.sin(rot + a)
            pts = np.array([[-r, -w], [r, -w], [r, w], [-r, w]]) @ np.array([[ca, sa], [-sa, ca]]) + c
            cv2.fillPoly(m, [pts.astype(np.int32)], 255)
    elif k == 4:  # ring
        cv2.circle(m, tuple(c.astype(int)), int(r), 255, -1)
        cv2.circle(m, tuple(c.astype(int)), int(r * 0.55), 0, -1)
    elif k == 5:  # five-pointed star
        cv2.fillPoly(m, [poly(10, np.tile([r * 1.1, r * 0.45], 5))], 255)
    elif k == 6:  # three horizontal bars
        for j in (-1, 0, 1):
            ca, sa = np.cos(rot), np.sin(rot)
            pts = np.array([[-r, -r * 0.13], [r, -r * 0.13], [r, r * 0.13], [-r, r * 0.13]]) + [0, j * r * 0.6]
            cv2.fillPoly(m, [(pts @ np.array([[ca, sa], [-sa, ca]]) + c).astype(np.int32)], 255)
    elif k == 7:  # diamond (elongated)
        t = rot
        pts = np.array([[0, -r * 1.2], [r * 0.6, 0], [0, r * 1.2], [-r * 0.6, 0]]) @ np.array([[np.cos(t), np.sin(t)], [-np.sin(t), np.cos(t)]]) + c
        cv2.fillPoly(m, [pts.astype(np.int32)], 255)
    elif k == 8:  # hexagon
        cv2.fillPoly(m, [poly(6, r)], 255)
    elif k == 9:  # crescent
        cv2.circle(m, tuple(c.astype(int)), int(r), 255, -1)
        off = np.array([np.cos(rot), np.sin(rot)]) * r * 0.5
        cv2.circle(m, tuple((c + off).astype(int)), int(r * 0.85), 0, -1)
    else:
        raise KeyError(k)
    return m


def object_image(style: str, rng: np.random.Generator, k: int, size: int, color: np.ndarray | None = None) -> np.ndarray:
    """uint8 RGB size x size image of shape class ``k`` rendered in ``style``; the object's colour is random unless
    ``color`` (RGB in [0, 1]) is given."""
    mask = _shape_mask(rng, k, size)
    fm = mask.astype(np.float32)[..., None] / 255.0
    edge = cv2.morphologyEx(mask, cv2.MORPH_GRADIENT, np.ones((3, 3), np.uint8)).astype(np.float32)[..., None] / 255.0
    drawn = rng.uniform(0.1, 0.9, 3).astype(np.float32)  # drawn either way: the other mirrors' streams stay as they were
    color = drawn if color is None else np.asarray(color, np.float32)
    if style in ("sketch", "quickdraw"):
        thick = 1 if style == "sketch" else 2
        line = cv2.dilate((edge[..., 0] * 255).astype(np.uint8), np.ones((thick, thick), np.uint8)).astype(np.float32) / 255.0
        if style == "quickdraw":
            line = np.roll(line, int(rng.integers(-2, 3)), axis=int(rng.integers(0, 2)))
        img = np.ones((size, size, 3), np.float32) * (1 - line[..., None])
        img += rng.normal(0, 0.02 if style == "sketch" else 0.0, img.shape)
    elif style in ("cartoon", "clipart"):
        bg = np.ones(3, np.float32) * rng.uniform(0.85, 1.0)
        sat = np.zeros(3, np.float32)
        sat[int(rng.integers(0, 3))] = 1.0
        fill = 0.35 * color + 0.65 * sat
        outline = cv2.dilate((edge[..., 0] * 255).astype(np.uint8), np.ones((3, 3), np.uint8)).astype(np.float32)[..., None] / 255.0
        img = bg * (1 - fm) + fill * fm
        img = img * (1 - outline)
    elif style in ("art_painting", "painting"):
        bg = _smooth_noise(rng, size, 3, cells=5) * 0.6 + 0.2
        img = bg * (1 - fm) + (color * 0.8 + 0.1) * fm
        for _ in range(int(size / 4)):  # brush strokes
            p0 = rng.integers(0, size, 2)
            p1 = (p0 + rng.normal(0, size / 10, 2)).astype(int)
            cv2.line(img, tuple(int(v) for v in p0), tuple(int(v) for v in p1), tuple(float(v) for v in rng.uniform(0, 1, 3)), 1)
        img = cv2.GaussianBlur(img, (0, 0), size / 90)
    elif style == "infograph":
        img = np.ones((size, size, 3), np.float32)
        small = cv2.resize(mask, (size // 2, size // 2), interpolation=cv2.INTER_AREA).astype(np.float32)[..., None] / 255.0
        y0, x0 = int(rng.integers(0, size // 4)), int(rng.integers(0, size // 4))
        img[y0 : y0 + size // 2, x0 : x0 + size // 2] = img[y0 : y0 + size // 2, x0 : x0 + size // 2] * (1 - small) + color * small
        for j in range(int(rng.integers(3, 7))):  # text-like bars
            yy = int(size * 0.65 + j * size * 0.06) % size
            cv2.line(img, (int(size * 0.1), yy), (int(size * rng.uniform(0.4, 0.9)), yy), (0.2, 0.2, 0.2), 1)
    else:  # photographs: amazon, caltech, dslr, webcam, photo, real
        if style == "amazon":
            bg = np.ones((size, size, 3), np.float32)
        elif style == "caltech":
            bg = _smooth_noise(rng, size, 3, cells=6)
            for _ in range(4):  # clutter
                cv2.circle(bg, tuple(int(v) for v in rng.integers(0, size, 2)), int(size * 0.08), tuple(float(v) for v in rng.uniform(0, 1, 3)), -1)
        else:
            bg = _smooth_noise(rng, size, 3, cells=3) * 0.5 + 0.25
        shade = np.linspace(1.15, 0.75, size, dtype=np.float32)[:, None, None]
        img = bg * (1 - fm) + (color * shade) * fm
        if style == "dslr":
            img = cv2.GaussianBlur(img, (0, 0), size / 200) + rng.normal(0, 0.01, img.shape)
        elif style == "webcam":
            img = img * np.array([1.1, 0.95, 0.8], np.float32) + rng.normal(0, 0.06, img.shape)
        elif style == "real":
            img = img + rng.normal(0, 0.02, img.shape)
        else:
            img = img + rng.normal(0, 0.03, img.shape)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def _save(path: Path, rgb: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    params = [cv2.IMWRITE_JPEG_QUALITY, 92] if path.suffix == ".jpg" else []
    if not cv2.imwrite(str(path), rgb[:, :, ::-1], params):
        raise OSError(f"cannot write {path}")


def write_office_caltech10(out: Path, p: MirrorParams) -> None:
    """The benchmark repository's naming: ``images/<amazon|caltech10|dslr|webcam>/<class>/<file>.jpg``."""
    from fedsilo.data.sources.office_caltech10 import CLASSES

    folders = {"amazon": "amazon", "caltech": "caltech10", "dslr": "dslr", "webcam": "webcam"}
    for domain, folder in folders.items():
        rng = _rng("office_caltech10", p.seed, domain)
        for k, cls in enumerate(CLASSES):
            for i in range(p.per_class):
                name = f"frame_{i + 1:04d}.jpg" if domain != "caltech" else f"{k + 1:03d}_{i + 1:04d}.jpg"
                _save(out / "images" / folder / cls / name, object_image(domain, rng, k, p.image_px))


def office31_colour(rng: np.random.Generator, k: int) -> np.ndarray:
    """Office-31 has more classes than the mirror has shapes: class ``k`` is shape ``k % 10`` in hue band ``k // 10``
    (four bands; saturated, so a domain's colour cast does not move a hue into the next band)."""
    import colorsys

    hue = ((k // 10) + rng.uniform(0.2, 0.8)) / 4.0
    return np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.6, 0.9)), np.float32)


def write_office31(out: Path, p: MirrorParams) -> None:
    """``domain_adaptation_images.tar.gz`` unpacked: ``<amazon|dslr|webcam>/images/<class>/frame_NNNN.jpg``."""
    from fedsilo.data.sources.office31 import CLASSES, DOMAINS

    for domain in DOMAINS:
        rng = _rng("office31", p.seed, domain)
        for k, cls in enumerate(CLASSES):
            for i in range(p.per_class):
                img = object_image(domain, rng, k % 10, p.image_px, office31_colour(rng, k))
                _save(out / domain / "images" / cls / f"frame_{i + 1:04d}.jpg", img)


def write_pacs(out: Path, p: MirrorParams) -> None:
    """``PACS/kfold/<domain>/<class>/<file>`` (sketches as PNG) with the official ``pacs_label/*_kfold.txt`` lists."""
    from fedsilo.data.sources.pacs import CLASSES, DOMAINS

    for domain in DOMAINS:
        rng = _rng("pacs", p.seed, domain)
        lists: dict[str, list[str]] = {"train": [], "crossval": [], "test": []}
        n = 0
        for k, cls in enumerate(CLASSES):
            for i in range(2 * p.per_class):
                n += 1
                name = f"pic_{n:03d}.{'png' if domain == 'sketch' else 'jpg'}"
                _save(out / "PACS" / "kfold" / domain / cls / name, object_image(domain, rng, k, p.image_px))
                line = f"{domain}/{cls}/{name} {k + 1}"
                lists["train" if i < p.per_class else "crossval"].append(line)
                lists["test"].append(line)
        for tag, lines in lists.items():
            path = out / "PACS" / "pacs_label" / f"{domain}_{tag}_kfold.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines) + "\n")


DOMAINNET_EXTRA_CLASSES = ("aircraft_carrier", "zigzag")  # outside the 10-class subset: exercises the exclusion


def write_domainnet(out: Path, p: MirrorParams) -> None:
    """Unpacked per-domain zips ``<domain>/<class>/<domain>_<k>_<n>.jpg`` plus ``<domain>_{train,test}.txt``."""
    from fedsilo.data.sources.domainnet import CLASSES, DOMAINS

    all_classes = sorted(CLASSES + DOMAINNET_EXTRA_CLASSES)
    for domain in DOMAINS:
        rng = _rng("domainnet", p.seed, domain)
        lists: dict[str, list[str]] = {"train": [], "test": []}
        for cls in all_classes:
            k = CLASSES.index(cls) if cls in CLASSES else int(rng.integers(0, 10))
            for i in range(2 * p.per_class):
                name = f"{domain}_{all_classes.index(cls):03d}_{i + 1:06d}.jpg"
                _save(out / domain / cls / name, object_image(domain, rng, k, p.image_px))
                lists["train" if i < p.per_class else "test"].append(f"{domain}/{cls}/{name} {all_classes.index(cls)}")
        for subset, lines in lists.items():
            (out / f"{domain}_{subset}.txt").write_text("\n".join(lines) + "\n")


def tissue_patch(rng: np.random.Generator, k: int, px: int, stain: tuple[float, float]) -> np.ndarray:
    """uint8 RGB px x px H&E-like patch of tissue class ``k``: eosin-pink stroma texture whose grain and the count and
    size of the haematoxylin-purple nuclei follow the class; ``stain`` shifts the two stains' hues (a centre's look)."""
    grain = 2 + (k % 3) * 3
    eosin = np.array([0.92, 0.62 + stain[0], 0.78], np.float32)
    haem = np.array([0.45 + stain[1], 0.28, 0.62], np.float32)
    tex = _smooth_noise(rng, px, 1, cells=grain)[..., 0:1]
    img = (0.55 + 0.45 * tex) * eosin
    if k == 1:  # background: almost white
        img = np.full((px, px, 3), 0.95, np.float32) + 0.02 * tex
    n = int((4 + 9 * k) * (px / 64) ** 2)
    radius = max(1, int(px * (0.02 + 0.012 * (k % 4))))
    mask = np.zeros((px, px), np.uint8)
    for _ in range(n if k != 1 else 0):
        c = (int(rng.integers(0, px)), int(rng.integers(0, px)))
        cv2.ellipse(mask, c, (radius, max(1, int(radius * rng.uniform(0.5, 1.0)))), float(rng.uniform(0, 180)), 0, 360, 255, -1)
    m = cv2.GaussianBlur(mask, (0, 0), 0.8).astype(np.float32)[..., None] / 255
    img = img * (1 - m) + haem * m + rng.normal(0, 0.02, (px, px, 3))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def write_kather_crc(out: Path, p: MirrorParams) -> None:
    """The unpacked Zenodo zips: ``NCT-CRC-HE-100K/<class>/<class>-<8 letters>.tif`` and ``CRC-VAL-HE-7K/...``, the two
    centres stained a little differently."""
    from fedsilo.data.sources.kather_crc import CLASSES, NCT, VAL

    for domain, stain in ((NCT, (0.0, 0.0)), (VAL, (-0.08, 0.1))):
        rng = _rng("kather_crc", p.seed, domain)
        for k, cls in enumerate(CLASSES):
            for _ in range(p.per_class):
                name = "".join(chr(ord("A") + int(v)) for v in rng.integers(0, 26, 8))
                _save(out / domain / cls / f"{cls}-{name}.tif", tissue_patch(rng, k, p.image_px, stain))


def write_image_folder(out: Path, p: MirrorParams, name: str = "image_folder") -> None:
    """What a pathology department's own patches look like to ``reader: image_folder`` at its defaults (layout
    ``class``): one folder per tissue class, named by Kather's codes in the department's lower case (``tum/``, ``str/``;
    matched to kather_crc's classes loosely), the patches in one folder per slide below it
    (``<class>/<slide>/<slide>_<x>_<y>.png``: ``group: folder`` keeps a slide's patches together), a slide's patches
    spread over several classes, a ``README.txt`` beside the class folders and a Windows ``Thumbs.db`` in one of them.
    The stain is drawn from the seed and the source's name (each department its own look)."""
    from fedsilo.data.sources.kather_crc import CLASSES

    rng = _rng(f"image_folder/{name}", p.seed)
    stain = (float(rng.uniform(-0.1, 0.1)), float(rng.uniform(-0.1, 0.12)))
    slides = [f"S{int(v):05d}" for v in rng.choice(100000, 4, replace=False)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.txt").write_text("H&E patches, 0.5 um/px, one folder per tissue class, one folder per slide below it\n")
    for k, cls in enumerate(CLASSES):
        for i in range(p.per_class):
            slide = slides[(i + k) % len(slides)]
            x, y = 224 * i, 224 * int(rng.integers(0, 200))
            _save(out / cls.lower() / slide / f"{slide}_{x}_{y}.png", tissue_patch(rng, k, p.image_px, stain))
    (out / CLASSES[0].lower() / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + bytes(60))


def write_image_table(out: Path, p: MirrorParams, name: str = "image_table") -> None:
    """What a pathology archive's patch list looks like to ``reader: image_table`` at its defaults: ``labels.csv``
    with ``path`` (``patches/<slide>/<slide>_<n>.png``) and ``label`` (Kather's class codes as the archive types them:
    any case, a stray space), plus a ``patient`` and a ``slide`` column (``patient: patient`` keeps a patient's slides
    together); one row with a blank label, one naming a patch the folder lacks. Stained by the seed and the source's
    name."""
    from fedsilo.data.sources.kather_crc import CLASSES

    rng = _rng(f"image_table/{name}", p.seed)
    stain = (float(rng.uniform(-0.1, 0.1)), float(rng.uniform(-0.1, 0.12)))
    slides = [f"T{int(v):04d}" for v in rng.choice(10000, 6, replace=False)]
    lines = ["path,label,patient,slide"]
    n = 0
    for k, cls in enumerate(CLASSES):
        for i in range(p.per_class):
            slide = slides[(i + 2 * k) % len(slides)]
            n += 1
            rel = f"patches/{slide}/{slide}_{n:05d}.png"
            _save(out / rel, tissue_patch(rng, k, p.image_px, stain))
            label = (cls.lower() if i % 2 else f" {cls}") if i % 3 else cls
            lines.append(f"{rel},{label},P{slides.index(slide) // 2},{slide}")
    blank = f"patches/{slides[0]}/{slides[0]}_{n + 1:05d}.png"
    _save(out / blank, tissue_patch(rng, 0, p.image_px, stain))
    lines.append(f"{blank},,P0,{slides[0]}")
    lines.append(f"patches/{slides[1]}/{slides[1]}_{n + 2:05d}.png,TUM,P0,{slides[1]}")  # the patch was never exported
    (out / "labels.csv").write_text("\n".join(lines) + "\n")


WRITERS: dict[str, Callable[[Path, MirrorParams], None]] = {
    "mnist": write_mnist,
    "svhn": write_svhn,
    "usps": write_usps,
    "synthdigits": write_synthdigits,
    "mnist_m": write_mnist_m,
    "office_caltech10": write_office_caltech10,
    "kather_crc": write_kather_crc,
    "pacs": write_pacs,
    "domainnet": write_domainnet,
    "office31": write_office31,
    "image_folder": write_image_folder,  # the mirror of a source of your own with reader: image_folder
    "image_table": write_image_table,  # ... and with reader: image_table
}
