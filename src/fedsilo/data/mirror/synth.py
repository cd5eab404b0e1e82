"""Synthetic chest radiographs for the offline mirrors.

An image is drawn in display convention (air dark, bone bright) in [0, 1]: a torso, two lung fields with ribs, a
mediastinum and spine, a diaphragm. A positive (Lung Opacity) image carries one or two soft bright blobs inside a
lung field, large enough to survive resizing to 32 px: the label is learnable. Each source has its own acquisition
style (contrast curve, exposure, noise, blur, collimation border, burned-in marker), so domains differ the way real
sites do while sharing the opacity signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Style:
    gamma: float = 1.0  # contrast curve applied in display space
    exposure: float = 0.0  # additive offset
    contrast: float = 1.0
    noise: float = 0.02
    blur: float = 0.0  # gaussian sigma in pixels (at 160 px)
    border: float = 0.0  # fraction of the edge that is collimated black
    marker: bool = False  # burned-in laterality marker
    opacity_gain: float = 1.0


STYLES: dict[str, Style] = {
    "chexpert": Style(gamma=0.85, contrast=1.05, noise=0.025, blur=0.6, marker=True),
    "openi": Style(gamma=1.25, exposure=-0.04, contrast=0.9, noise=0.015, border=0.07),
    "rsna": Style(gamma=1.0, exposure=0.05, contrast=0.85, noise=0.035, blur=1.0),
    "vinbigdata": Style(gamma=0.7, exposure=-0.02, contrast=1.15, noise=0.02, marker=True, opacity_gain=0.9),
    "cxr_table": Style(gamma=1.1, exposure=0.02, contrast=1.0, noise=0.03, blur=0.8, border=0.03),  # a hospital's export
}


def _gauss_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    if sigma <= 0:
        return img
    import cv2

    return cv2.GaussianBlur(img, (0, 0), sigmaX=sigma)


def frontal(rng: np.random.Generator, size: int, opacity: bool, style: Style) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    cx = 0.5 + rng.normal(0, 0.02)
    img = np.full((size, size), 0.06, np.float32)
    torso = ((xx - cx) / 0.46) ** 2 + ((yy - 0.58) / 0.55) ** 2 < 1.0
    img[torso] = 0.55
    lung_w, lung_h = 0.15 + rng.normal(0, 0.01), 0.30 + rng.normal(0, 0.015)
    lungs = []
    for side in (-1, 1):
        lx = cx + side * (0.19 + rng.normal(0, 0.01))
        ly = 0.50 + rng.normal(0, 0.015)
        mask = ((xx - lx) / lung_w) ** 2 + ((yy - ly) / lung_h) ** 2 < 1.0
        img[mask] = 0.2
        lungs.append((lx, ly))
    ribs = 0.07 * (np.sin(yy * 2 * np.pi * 9 + rng.uniform(0, 6.28)) > 0.55)
    img += np.where(img < 0.3, ribs, 0.0).astype(np.float32)
    spine = np.abs(xx - cx) < 0.045
    img[spine & torso] = 0.8
    heart = ((xx - cx - 0.05) / (0.12 + rng.normal(0, 0.01))) ** 2 + ((yy - 0.62) / 0.14) ** 2 < 1.0
    img[heart] = np.maximum(img[heart], 0.62)
    diaphragm = (yy > 0.78 + 0.05 * np.cos((xx - cx) * 6)) & torso
    img[diaphragm] = 0.6
    if opacity:
        for _ in range(rng.integers(1, 3)):
            lx, ly = lungs[rng.integers(0, 2)]
            bx, by = lx + rng.normal(0, 0.04), ly + rng.normal(0, 0.08)
            s = rng.uniform(0.06, 0.1)
            amp = rng.uniform(0.3, 0.42) * style.opacity_gain
            img += (amp * np.exp(-(((xx - bx) ** 2 + (yy - by) ** 2) / (2 * s * s)))).astype(np.float32)
    return _acquire(rng, img, style)


def lateral(rng: np.random.Generator, size: int, style: Style) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.full((size, size), 0.06, np.float32)
    body = ((xx - 0.5) / 0.38) ** 2 + ((yy - 0.55) / 0.5) ** 2 < 1.0
    img[body] = 0.5
    lung = ((xx - 0.47) / 0.22) ** 2 + ((yy - 0.48) / 0.3) ** 2 < 1.0
    img[lung] = 0.25
    img[(np.abs(xx - 0.78) < 0.05) & body] = 0.8  # spine at the back
    return _acquire(rng, img, style)


def _acquire(rng: np.random.Generator, img: np.ndarray, style: Style) -> np.ndarray:
    size = img.shape[0]
    img = _gauss_blur(img, style.blur * size / 160)
    img = np.clip(img * style.contrast + style.exposure, 0, 1) ** style.gamma
    img = img + rng.normal(0, style.noise, img.shape).astype(np.float32)
    if style.border > 0:
        b = int(style.border * size)
        img[:b] = img[-b:] = 0.0
        img[:, :b] = img[:, -b:] = 0.0
    if style.marker:
        m = max(3, size // 20)
        img[m : 3 * m, size - 3 * m : size - 2 * m] = 0.97
    return np.clip(img, 0.0, 1.0).astype(np.float32)
