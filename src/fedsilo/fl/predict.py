"""A site's trained model on new images: each file harmonized exactly as the site's training images were (the same
decoder, intensity rule, squaring and size, from the site's own params file), then scored by the model the site kept
from a deployment (``model.pt``: :func:`fedsilo.fl.deploy.load_site_model`).

A file that cannot be read is reported on its row (its error), as harmonize quarantines it; the others are scored.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from fedsilo.config import BenchmarkDatasetParams, ConfigError, CXRDatasetParams, Params, TrainParams
from fedsilo.config.errors import not_defined
from fedsilo.data.dicom import is_dicom_file
from fedsilo.data.slides import is_slide_file
from fedsilo.data.sources.image_folder import file_reader

__all__ = ["image_files", "predict_images"]

CHUNK = 4096  # images scored on the device at a time


def image_files(paths: Iterable[str | Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The files named, and the image files under the folders named (sorted; hidden files and folders left out, as
    the sources' readers leave them: :func:`~fedsilo.data.sources.base.walk`), and the other files under those folders
    with why they are left out (a label table, a DICOM report: what the image_folder reader leaves out,
    :func:`~fedsilo.data.sources.image_folder.file_reader`). A file named is always scored: its row says what is
    wrong with it."""
    from fedsilo.data.sources.base import walk
    from fedsilo.data.sources.image_folder import file_reader

    out: list[Path] = []
    left: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if p.is_dir():
            for f in walk(p):
                if f.is_file():
                    reader, why = file_reader(f)
                    if reader:
                        out.append(f)
                    else:
                        left.append((f, why))
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder")
    if not out:
        said = f": {len(left)} file(s) under the folders, none an image ({left[0][0]}: {left[0][1]})" if left else ""
        raise ConfigError(f"--images: no image file given (name files or folders that hold them){said}")
    return out, left


def _decoder(params: Params, experiment: str, contract: dict[str, Any]):
    """The harmonize job of one file for the site's dataset, checked against the model's contract."""
    if experiment not in params.experiments:
        raise not_defined("experiments", experiment, params)
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
        cuts = any(ds.rules(s).slides is not None for s in ds.own_sources())  # a small pyramidal TIFF is a slide too

        def job(path: Path) -> tuple:  # as harmonize reads a site's own files: a DICOM grey or colour, to RGB
            kind = file_reader(path, cuts)[0]
            reader = {"dicom": "dicom_rgb", "slide": "slide"}.get(kind, "rgb")
            return (str(path), reader, ds.image_size, ds.square, "", (0.0, 100.0))
    else:
        raise ConfigError(f"datasets.{name} (kind {ds.kind}): the model takes {channels}-channel images (its deployment's "
                          "contract), which predict reads with a dataset of the kind it was trained on: chest_xray4's rules for "
                          "a grey model, a benchmark kind (image_folder, image_table, ...) for an RGB one; name an experiment "
                          "whose dataset is of that kind (--experiment)")
    return job, ds.workers or os.cpu_count() or 1


def _slide_rules(params: Params, experiment: str) -> tuple[Any, str]:
    """How the site's dataset cuts its slides into patches (``slides`` of its sources of your own; their region
    annotations aside: a prediction labels nothing), and the key that says it; (None, why) when no source has the
    rules, or when two sources cut them differently."""
    name = params.experiments[experiment].dataset
    ds = params.datasets[name]
    if not isinstance(ds, BenchmarkDatasetParams):
        return None, f"datasets.{name}: a chest X-ray dataset scores no whole-slide image"
    found = {s: ds.rules(s).slides for s in ds.own_sources() if ds.rules(s).slides is not None}
    cuts = {r.model_copy(update={"regions": None}).model_dump_json(): (s, r) for s, r in found.items()}
    if not cuts:
        return None, f"set datasets.{name}.folders.<source>.slides (or tables) to score its tissue patches"
    if len(cuts) > 1:
        return None, f"the sources {', '.join(sorted(found))} of datasets.{name} cut slides differently: make their slides rules one"
    source, rules = next(iter(cuts.values()))
    return rules.model_copy(update={"regions": None}), f"{ds.rules_key(source, name)}.slides"


def another_sites_model(params: Params, experiment: str, info: dict[str, Any], model_path: Path, root: Path) -> str | None:
    """What to say when a model another site kept (its own part learned that site's data) scores this site's
    images: said, not refused (a hospital may mean to compare), naming both sites; None where it is this site's, or
    either site is unknown."""
    owner = info.get("site")
    split = params.layout(root).split(experiment) if experiment in params.experiments else None
    if owner is None or split is None or not split.is_file():
        return None
    try:
        here = str(json.loads(split.read_text())["clients"][0]["name"])
    except (ValueError, KeyError, IndexError):
        return None  # not a site's split: nothing to compare with
    if here == str(owner):
        return None
    return (f"{model_path} is the model site {owner} kept (its own part learned {owner}'s data), not this site's "
            f"({here}): its scores are not those of {here}'s model")


def predict_images(params: Params, experiment: str, model_path: Path, files: list[Path], device: str = "cpu",
                   batch_size: int = 64, quiet: bool = False, root: Path = Path("."),
                   warn: Callable[[str], None] | None = None) -> pd.DataFrame:
    """One row per file: ``path``, ``predicted`` (a class name of the contract), ``prob.<class>`` for each class,
    ``error`` (empty where the file was read). The files are harmonized with the site's dataset options
    (``experiments.<experiment>.dataset``), which must give the image shape the model was trained on.

    A whole-slide image (of an RGB dataset whose sources cut slides: ``slides``) is cut into tissue patches as
    harmonize cuts the site's own (:func:`fedsilo.data.slides.plan_patches`, the same rules), each patch a row
    ``<file>#x<X>y<Y>`` with its ``slide``, and the slide's row gets the patches' mean probabilities (``predicted``
    their argmax) and its ``patches`` count: mean pooling, the plain slide-level aggregate. A DICOM whole-slide image
    given as its folder is one slide (its other instances are rows saying what they are). Without slides the
    ``slide`` and ``patches`` columns are left out."""
    from fedsilo.data.harmonize import decode_all
    from fedsilo.data.slides import one_entry_per_dicom_slide, plan_or_reason, slide_view
    from fedsilo.fl.deploy import load_site_model

    model, info = load_site_model(model_path, device)
    note = another_sites_model(params, experiment, info, model_path, Path(root))
    if note:  # on stderr: stdout may be the CSV of scores
        (warn or (lambda m: print(f"warning: {m}", file=sys.stderr)))(note)
    contract = info["deployment"]["contract"]
    classes = list(contract["classes"])
    job, workers = _decoder(params, experiment, contract)
    jobs = [job(f) for f in files]
    paths, slide_of, errors = [str(f) for f in files], [""] * len(files), [""] * len(files)
    slides = [i for i, j in enumerate(jobs) if j[1] == "slide"]
    if slides:
        entries = [{"path": paths[i], "reader": "slide", "reason": ""} for i in slides]
        entries = one_entry_per_dicom_slide(entries, Path("/"))
        rules, key = _slide_rules(params, experiment)
        for i, e in zip(slides, entries):
            errors[i] = e["reason"] or ("" if rules is not None else f"a whole-slide image: {key}")
            if errors[i]:
                continue
            plan, _, why = plan_or_reason((Path(paths[i]), rules, key, (), tuple(classes)))
            errors[i] = f"a whole-slide image: {why}" if why else ""
            for patch in plan:
                jobs.append((*jobs[i][:6], patch, slide_view(rules)))
                paths.append(f"{paths[i]}#x{patch[0]}y{patch[1]}")
                slide_of.append(paths[i])
                errors.append("")
    todo = [k for k in range(len(jobs)) if not (jobs[k][1] == "slide" and len(jobs[k]) == 6)]  # a slide: its patches
    # harmonize's own decoding: worker processes, images/s shown, a file that fails is its row's error
    decoded = dict(zip(todo, decode_all([jobs[k] for k in todo], workers, desc="predict: harmonize", quiet=quiet)))
    images = [decoded[k][0] if k in decoded else None for k in range(len(jobs))]
    rows = pd.DataFrame({"path": paths, "predicted": "", "slide": slide_of, "patches": pd.array([pd.NA] * len(jobs), "Int64"),
                         "error": [decoded[k][1] if k in decoded else errors[k] for k in range(len(jobs))]})
    for c in classes:
        rows[f"prob.{c}"] = np.nan
    read = [i for i, img in enumerate(images) if img is not None]
    if read:
        from fedsilo.client.local import predict_probabilities

        probs = predict_probabilities(model, [images[i] for i in read], device, batch_size, chunk=CHUNK, desc="predict: score",
                                      quiet=quiet, cfg=TrainParams.model_validate(info["deployment"]["train"]))
        for k, c in enumerate(classes):
            rows.loc[read, f"prob.{c}"] = probs[:, k]
        rows.loc[read, "predicted"] = [classes[j] for j in probs.argmax(1)]
    prob_cols = [f"prob.{c}" for c in classes]
    for i in slides:  # the slide's row: its patches' mean probabilities
        mine = rows["slide"] == paths[i]
        if rows.loc[i, "error"] == "" and mine.any():
            scored = rows.loc[mine & (rows["error"] == ""), prob_cols]
            rows.loc[i, "patches"] = int(len(scored))
            if len(scored):
                mean = scored.to_numpy(dtype=float).mean(0)
                rows.loc[i, prob_cols] = mean
                rows.loc[i, "predicted"] = classes[int(mean.argmax())]
            else:
                rows.loc[i, "error"] = "a whole-slide image: none of its patches could be read"
    columns = ["path", "predicted", *prob_cols, "error"]
    return rows[columns[:1] + (["slide", "patches"] if slides else []) + columns[1:]]
