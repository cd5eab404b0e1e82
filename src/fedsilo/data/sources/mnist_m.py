"""MNIST-M (Ganin & Lempitsky 2015) as its authors distribute it (``mnist_m.tar.gz``): ``mnist_m/mnist_m_train/*.png``
and ``mnist_m/mnist_m_test/*.png`` (32 x 32 RGB) with ``mnist_m_{train,test}_labels.txt`` (``<file> <digit>`` per
line), or FedBN's ``MNIST_M/partitions/*.pkl`` + ``MNIST_M/test.pkl``. No scriptable public address exists, so
``download`` needs ``files``. Domain ``MNIST-M`` of Digits-Five."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedsilo.data.sources.base import LabelFileError, walk
from fedsilo.data.sources.benchmark import fedbn_digit_records, list_lines, load_container, records_frame

DOMAIN = "MNIST-M"
DOMAINS = (DOMAIN,)
DOWNLOADS: list = []
__all__ = ["read_records", "load_container", "DOMAINS", "DOWNLOADS"]


def read_labels(path: Path) -> list[tuple[str, int, str]]:
    out = []
    for n, name, label, _ in list_lines(path, "'<file> <digit>'"):
        try:
            y = int(label)
        except ValueError:
            raise LabelFileError(f"{path}: line {n}: label {label!r} is not a digit") from None
        if not 0 <= y <= 9:
            raise LabelFileError(f"{path}: line {n}: label {y} is not a digit 0-9")
        out.append((name, y, label))
    return out


def read_records(raw_dir: Path, rules: object = None) -> pd.DataFrame:
    raw_dir = Path(raw_dir)
    rows = fedbn_digit_records(raw_dir, "MNIST_M", DOMAIN)
    if rows is None:
        rows = []
        for subset in ("train", "test"):
            labs = walk(raw_dir, f"mnist_m_{subset}_labels.txt")
            if not labs:
                continue
            folder = labs[0].parent / f"mnist_m_{subset}"
            if not folder.is_dir():
                raise LabelFileError(f"{labs[0]}: image folder {folder.name}/ missing next to it")
            for name, y, orig in read_labels(labs[0]):
                f = folder / name
                rows.append(
                    {
                        "id": f"{DOMAIN}/{subset}/{name}", "label": y, "original_label": orig, "group": "", "view": "",
                        "path": f.relative_to(raw_dir).as_posix() if f.exists() else "", "reader": "image",
                        "excluded": "", "subset": subset,
                    }
                )
        if not rows:
            raise LabelFileError(f"{raw_dir}: no MNIST-M files (expected mnist_m/mnist_m_test_labels.txt + mnist_m_test/ or FedBN's MNIST_M/test.pkl)")
    return records_frame(rows, DOMAIN)
