"""A site's trained model on new images: each file harmonized exactly as the site's training images were (the same
decoder, intensity rule, squaring and size, from the site's own params file), then scored by the model the site kept
from a deployment (``model.pt``: :func:`fedsilo.fl.deploy.load_site_model`).

A file that cannot be read is reported on its row (its error), as harmonize quarantines it; the others are scored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch

from fedsilo.config import BenchmarkDatasetParams, ConfigError, CXRDatasetParams, Params, TrainParams
from fedsilo.data.dicom import is_dicom_file
from fedsilo.data.slides import is_slide_file
from fedsilo.data.sources.image_folder import file_reader

__all__ = ["image_files", "predict_images"]

def image_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, and every file under the folders named (sorted; hidden files and folders left out, as the
    sources' readers leave them: :func:`~fedsilo.data.sources.base.walk`)."""
    from fedsilo.data.sources.base import walk

    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += [f for f in walk(p) if f.is_file()]
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder")
    if not out:
        raise ConfigError("no image file given (name files or folders that hold them)")
    return out


def _decoder(params: Params, experiment: str, contract: dict[str, Any]):
    """The harmonize job of one file for the site's dataset, checked against the model's contract."""
    if experiment not in params.experiments:
        raise ConfigError(f"experiments.{experiment}: not defined in the site's params file")
    name = params.experiments[experiment].dataset
    ds = params.datasets[name]
    h, _, channels = contract["image_shape"]
    if ds.image_size != h:
        raise ConfigError(f"datasets.{name}.image_size: {ds.image_size}; the model takes {h} px images (its deployment's contract)")
    # a whole-slide image is never decoded whole: its row says so (harmonize cuts slides into patches: ``slides``)
    if isinstance(ds, CXRDatasetParams) and channels == 1:
        def job(path: Path) -> tuple:
            reader = "slide" if is_slide_file(path) else "dicom" if is_dicom_file(path) else "standard"
            return (str(path), reader, ds.image_size, ds.square, ds.intensity, ds.percentiles)
    elif isinstance(ds, BenchmarkDatasetParams) and channels == 3:
        def job(path: Path) -> tuple:  # as harmonize reads a site's own files: a DICOM grey or colour, to RGB
            kind = file_reader(path)[0]
            reader = {"dicom": "dicom_rgb", "slide": "slide"}.get(kind, "rgb")
            return (str(path), reader, ds.image_size, ds.square, "", (0.0, 100.0))
    else:
        raise ConfigError(f"datasets.{name}: kind {ds.kind} with {channels}-channel images: predict reads image files of "
                          "chest_xray4 (grayscale) and the multi-domain benchmarks (RGB)")
    return job, ds.workers or os.cpu_count() or 1


def predict_images(params: Params, experiment: str, model_path: Path, files: list[Path], device: str = "cpu",
                   batch_size: int = 64, quiet: bool = False) -> pd.DataFrame:
    """One row per file: ``path``, ``predicted`` (a class name of the contract), ``prob.<class>`` for each class,
    ``error`` (empty where the file was read). The files are harmonized with the site's dataset options
    (``experiments.<experiment>.dataset``), which must give the image shape the model was trained on."""
    from fedsilo.client.local import predict
    from fedsilo.data.harmonize import decode_all
    from fedsilo.fl.deploy import load_site_model

    model, info = load_site_model(model_path, device)
    contract = info["deployment"]["contract"]
    classes = list(contract["classes"])
    job, workers = _decoder(params, experiment, contract)
    # harmonize's own decoding: worker processes, images/s shown, a file that fails is its row's error
    decoded = decode_all([job(f) for f in files], workers, desc="predict: harmonize", quiet=quiet)
    images = [img for img, _ in decoded]
    rows = pd.DataFrame({"path": [str(f) for f in files], "predicted": "", "error": [e for _, e in decoded]})
    for c in classes:
        rows[f"prob.{c}"] = np.nan
    read = [i for i, img in enumerate(images) if img is not None]
    if read:
        x = torch.from_numpy(np.stack([images[i] for i in read])).permute(0, 3, 1, 2).contiguous().to(device)
        probs = predict(model, x, batch_size, TrainParams.model_validate(info["deployment"]["train"])).softmax(1).cpu().numpy()
        for k, c in enumerate(classes):
            rows.loc[read, f"prob.{c}"] = probs[:, k]
        rows.loc[read, "predicted"] = [classes[j] for j in probs.argmax(1)]
    return rows[["path", "predicted", *[f"prob.{c}" for c in classes], "error"]]
