"""The harmonize stage: raw sources -> one canonical dataset.

Output folder (``data/harmonized/<dataset>/``):
- ``records.parquet``: one row per kept image, row i <-> ``images.npy[i]``; columns ``id`` (``<source>/<source id>``),
  ``domain``, ``label``, ``original_label``, ``group`` (patient), ``view``, ``source_path``;
- ``images.npy``: uint8 N x H x W x C, memory-mappable (``np.load(..., mmap_mode="r")``);
- ``excluded.parquet``: every record the label rules excluded, with the reason;
- ``quarantine.csv``: kept records whose image could not be decoded (or is missing), with the error;
- ``card.json`` / ``card.md``: the data card: counts per domain and class, exclusions and quarantine by reason,
  the rules used, the sha256 of ``records.parquet`` and ``images.npy``.

A source whose quarantined fraction exceeds ``max_quarantine_fraction`` fails the stage, naming the files.
Everything is written to a temporary folder and renamed into place at the end.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.config import CXRDatasetParams
from fedsilo.data.imageops import ImageDecodeError, finish, normalize_standard, read_standard_image
from fedsilo.data.sources import source_module
from fedsilo.utils.io import atomic_dir, file_sha256, write_json


class HarmonizeError(RuntimeError):
    pass


def decode_one(args: tuple[str, str, int, str, str, tuple[float, float]]) -> np.ndarray:
    path, reader, size, square, intensity, pct = args
    if reader == "dicom":
        from fedsilo.data.dicom import dicom_to_uint8

        img, _ = dicom_to_uint8(path, intensity, pct)
    else:
        arr, depth = read_standard_image(path, grayscale=True)
        img = normalize_standard(arr, depth, intensity, pct)
    if img.std() == 0:
        raise ImageDecodeError(f"{path}: constant image")
    return finish(img, size, square)  # type: ignore[arg-type]


def _decode_safe(args: tuple) -> tuple[np.ndarray | None, str]:
    try:
        return decode_one(args), ""
    except ImageDecodeError as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - any decoder crash is a quarantine reason, reported with its type
        return None, f"{args[0]}: {type(err).__name__}: {err}"


def _decode_all(jobs: list[tuple], workers: int) -> list[tuple[np.ndarray | None, str]]:
    if workers <= 1 or len(jobs) < 16:
        return [_decode_safe(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_decode_safe, jobs, chunksize=max(1, len(jobs) // (workers * 8))))


def harmonize_cxr(params: CXRDatasetParams, raw_root: Path, out_dir: Path) -> dict[str, Any]:
    raw_root = Path(raw_root)
    workers = params.workers or os.cpu_count() or 1
    all_records = []
    for src in params.sources:
        raw_dir = raw_root / src
        if not raw_dir.is_dir():
            raise HarmonizeError(f"{raw_dir}: raw source folder missing (run `dvc repro fetch@{src}`)")
        rec = source_module(src).read_records(raw_dir, getattr(params, src))
        rec["source"] = src
        rec["abs_path"] = [str(raw_dir / p) if p else "" for p in rec["path"]]
        all_records.append(rec)
    records = pd.concat(all_records, ignore_index=True)
    records["id"] = records["source"] + "/" + records["id"]

    kept = records[records["excluded"] == ""].reset_index(drop=True)
    excluded = records[records["excluded"] != ""].reset_index(drop=True)
    jobs = [(p, r, params.image_size, params.square, params.intensity, params.percentiles) for p, r in zip(kept["abs_path"], kept["reader"])]
    results: list[tuple[np.ndarray | None, str]] = [(None, "")] * len(jobs)
    todo = [i for i, p in enumerate(kept["abs_path"]) if p]
    for i in range(len(jobs)):
        if not kept["abs_path"].iloc[i]:
            results[i] = (None, f"image file missing for {kept['id'].iloc[i]}")
    for i, res in zip(todo, _decode_all([jobs[i] for i in todo], workers)):
        results[i] = res
    errors = [e for _, e in results]
    ok = np.array([img is not None for img, _ in results], dtype=bool)

    quarantine = kept.loc[~ok, ["id", "domain", "path"]].copy()
    quarantine["error"] = [e for e, good in zip(errors, ok) if not good]
    for src in params.sources:
        n = int((kept["source"] == src).sum())
        q = int((quarantine["id"].str.startswith(src + "/")).sum())
        if n == 0:
            raise HarmonizeError(f"{src}: no image passes the label rules; check the raw files under {raw_root / src}")
        if q / n > params.max_quarantine_fraction:
            examples = "; ".join(quarantine.loc[quarantine["id"].str.startswith(src + "/"), "error"].head(3))
            raise HarmonizeError(
                f"{src}: {q} of {n} images could not be decoded ({q / n:.1%} > max_quarantine_fraction "
                f"{params.max_quarantine_fraction:.1%}); first errors: {examples}"
            )

    good = kept[ok].reset_index(drop=True)
    images = [img for img, _ in results if img is not None]
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        arr = np.lib.format.open_memmap(
            tmp / "images.npy", mode="w+", dtype=np.uint8, shape=(len(images),) + images[0].shape
        )
        for i, img in enumerate(images):
            arr[i] = img
        arr.flush()
        del arr
        table = good.rename(columns={"path": "source_path"})[
            ["id", "domain", "label", "original_label", "group", "view", "source_path"]
        ]
        table["group"] = table["domain"] + "/" + table["group"]
        table.to_parquet(tmp / "records.parquet", index=False)
        excluded[["id", "domain", "original_label", "view", "excluded"]].rename(columns={"excluded": "reason"}).to_parquet(
            tmp / "excluded.parquet", index=False
        )
        quarantine.to_csv(tmp / "quarantine.csv", index=False)
        card = _card(params, table, excluded, quarantine, tmp)
        write_json(tmp / "card.json", card)
        (tmp / "card.md").write_text(card_markdown(card))
    return card


def _card(params: CXRDatasetParams, table: pd.DataFrame, excluded: pd.DataFrame, quarantine: pd.DataFrame, folder: Path) -> dict[str, Any]:
    per_domain: dict[str, Any] = {}
    for dom in table["domain"].unique().tolist() + [d for d in excluded["domain"].unique() if d not in set(table["domain"])]:
        t = table[table["domain"] == dom]
        e = excluded[excluded["domain"] == dom]
        q = quarantine[quarantine["domain"] == dom]
        per_domain[dom] = {
            "images": int(len(t)),
            "by_class": {"Lung Opacity (1)": int((t["label"] == 1).sum()), "Normal (0)": int((t["label"] == 0).sum())},
            "patients": int(t["group"].nunique()),
            "excluded": int(len(e)),
            "excluded_by_reason": {k: int(v) for k, v in e["excluded"].value_counts().items()},
            "quarantined": int(len(q)),
            "quarantine_examples": q["error"].head(5).tolist(),
        }
    return {
        "dataset": params.kind,
        "task": "binary: 1 = Lung Opacity, 0 = Normal",
        "classes": ["Normal", "Lung Opacity"],
        "image_shape": list(np.load(folder / "images.npy", mmap_mode="r").shape[1:]),
        "total_images": int(len(table)),
        "domains": per_domain,
        "rules": params.model_dump(mode="json"),
        "sha256": {
            "records.parquet": file_sha256(folder / "records.parquet"),
            "images.npy": file_sha256(folder / "images.npy"),
        },
    }


def card_markdown(card: dict[str, Any]) -> str:
    lines = [
        f"# Data card: {card['dataset']}",
        "",
        f"Task: {card['task']}. Image shape {tuple(card['image_shape'])}, {card['total_images']} images kept.",
        "",
        "| domain | kept | Lung Opacity | Normal | patients | excluded | quarantined |",
        "|---|---|---|---|---|---|---|",
    ]
    for dom, d in card["domains"].items():
        lines.append(
            f"| {dom} | {d['images']} | {d['by_class']['Lung Opacity (1)']} | {d['by_class']['Normal (0)']} | "
            f"{d['patients']} | {d['excluded']} | {d['quarantined']} |"
        )
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
