"""A harmonized dataset's contact sheet (``samples.png`` beside its data card): a few images of every domain and
class as harmonize wrote them, so a data team sees at a glance what the label rules and the decoder made of its
files (a MONOCHROME1 radiograph left inverted, a window that flattens, a class folder mapped to the wrong class, a
site's stain) before anything trains on them.

One row per domain, one block of ``per_class`` tiles per class (the first images of that domain and class in
``records.parquet``'s order, which is the harmonize order: deterministic, one per group first: several patients or
slides before a second image of any one); an empty slot is mid-grey. At most
``MAX_CLASSES`` classes are shown (the first of the class list; the card says so). Names are drawn in ASCII (accents
dropped; a name in another script as ``domain 2`` / ``class 3``, card.md listing them in order). The PNG is written with
OpenCV (no timestamp: the same data and OpenCV build give the same bytes; another OpenCV may draw the text otherwise).
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd

MAX_CLASSES = 12
TILE = 64  # pixels per shown image (larger images are shrunk, smaller ones enlarged)
FONT = cv2.FONT_HERSHEY_SIMPLEX


def per_class_for(n_classes: int) -> int:
    """Images per class and domain: 4 for a binary task, fewer as classes grow (a sheet stays ~16 tiles wide)."""
    return max(1, min(4, 16 // max(1, min(n_classes, MAX_CLASSES))))


def _tile(img: np.ndarray) -> np.ndarray:
    rgb = np.repeat(img, 3, axis=2) if img.shape[2] == 1 else img
    interp = cv2.INTER_AREA if rgb.shape[0] > TILE else cv2.INTER_NEAREST
    return cv2.resize(np.ascontiguousarray(rgb), (TILE, TILE), interpolation=interp)


_LATIN = str.maketrans({"ß": "ss", "ø": "o", "Ø": "O", "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L",
                        "đ": "d", "Đ": "D", "þ": "th", "Þ": "Th", "ð": "d", "Ð": "D", "ı": "i"})


def shown_name(name: str, fallback: str) -> str:
    """A name as the sheet can draw it: OpenCV's Hershey fonts are ASCII (OpenCV 4 draws '?' for every other byte),
    so accents are dropped (``Tumör`` -> ``Tumor``, ``Straße`` -> ``Strasse``) and a name mostly in another script
    becomes ``fallback`` (``domain 2``, counted from 1: card.md lists the rows and columns by name, in order)."""
    spelled = name.translate(_LATIN)  # letters NFKD does not take apart (ß, ø, æ, ł, ...)
    folded = unicodedata.normalize("NFKD", spelled).encode("ascii", "ignore").decode("ascii").strip()
    letters = sum(1 for ch in name if ch.isalnum())
    kept = sum(1 for ch in folded if ch.isalnum())
    return folded if folded and kept * 2 >= letters else fallback


def _text(canvas: np.ndarray, text: str, x: int, y: int, width: int) -> None:
    """``text`` at (x, baseline y), shortened with '..' to fit ``width`` pixels."""
    scale, thick = 0.4, 1
    while text and cv2.getTextSize(text, FONT, scale, thick)[0][0] > width:
        text = text[:-3] + ".." if len(text) > 3 else text[:-1]
    cv2.putText(canvas, text, (x, y), FONT, scale, (0, 0, 0), thick, cv2.LINE_AA)


def spread_over_groups(rows: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``rows`` (indices in harmonize order) with the first row of each group first, in order, then the others: a
    class's tiles show several patients or slides before a second image of any one (a slide's 200 patches would
    otherwise fill them all)."""
    if rows.size == 0:
        return rows
    _, first = np.unique(groups[rows], return_index=True)
    leaders = rows[np.sort(first)]
    return np.concatenate([leaders, rows[~np.isin(rows, leaders)]])


def write_contact_sheet(path: Path, table: pd.DataFrame, images: Any, classes: list[str]) -> dict[str, Any]:
    """Write the sheet of ``images`` (N x H x W x C uint8, row i <-> ``table`` row i: domain, label, id) to ``path``;
    returns what the card records: the file, images per class, the classes shown and the ids of each tile."""
    shown = list(classes)[:MAX_CLASSES]
    k = per_class_for(len(classes))
    domains = list(dict.fromkeys(table["domain"]))
    label_w, head_h, gap = 120, 22, 6
    block = k * TILE + gap
    canvas = np.full((head_h + len(domains) * (TILE + gap), label_w + len(shown) * block, 3), 255, np.uint8)
    for c, name in enumerate(shown):
        _text(canvas, shown_name(name, f"class {c + 1}"), label_w + c * block, head_h - 7, block - gap)
    ids: dict[str, dict[str, list[str]]] = {}
    labels = table["label"].to_numpy()
    groups = table["group"].astype(str).to_numpy() if "group" in table.columns else table["id"].astype(str).to_numpy()
    for r, dom in enumerate(domains):
        y = head_h + r * (TILE + gap)
        _text(canvas, shown_name(str(dom), f"domain {r + 1}"), 4, y + TILE // 2 + 4, label_w - 8)
        mine = np.flatnonzero(table["domain"].to_numpy() == dom)
        ids[str(dom)] = {}
        for c, name in enumerate(shown):
            rows = spread_over_groups(mine[labels[mine] == c], groups)[:k]
            ids[str(dom)][name] = [str(table["id"].iloc[i]) for i in rows]
            for j in range(k):
                x = label_w + c * block + j * TILE
                canvas[y:y + TILE, x:x + TILE] = _tile(images[rows[j]]) if j < len(rows) else 128
    if not cv2.imwrite(str(path), canvas[:, :, ::-1]):
        raise OSError(f"cannot write {path}")
    return {"file": path.name, "per_class": k, "classes_shown": shown, "tile_px": TILE, "ids": ids}
