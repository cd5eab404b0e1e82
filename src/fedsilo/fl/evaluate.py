"""External validation at a site: the model a site kept from a deployment (``model.pt``), scored on a labelled dataset
the site harmonized itself (a later export of its own, a hospital's images it holds under a data-sharing agreement,
a public set), with what a clinical reader asks of such a check:

- per domain and over all images: the images, the patients, the images per class;
- accuracy, and for a two-class task ROC AUC, sensitivity and specificity at the model's decision (the class of the
  larger probability, as the federation's accuracy counts it), positive and negative predictive values and the
  confusion matrix ``[[TN, FP], [FN, TP]]`` (the positive class is the contract's second, Lung Opacity for
  Chest-X-Ray-4); for more classes, each class's recall and the confusion matrix (rows: true class);
- 95 % intervals: Wilson score intervals for the proportions, and for the AUC a percentile interval from a
  bootstrap that resamples *patients* (the records' groups), not images, since a patient's images are not
  independent; a resample holding one class only has no AUC and is left out, counted (``one_class``);
- one row per image (id, domain, patient, label, prediction, class probabilities).

The dataset is read as harmonize wrote it, after checking that its arrays still hash to its card's sha256 and that
its contract (classes, image shape) is the model's; every image of it is scored (no split is needed: an external set
is all test).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import torch

from fedsilo.client.local import binary_auc, predict
from fedsilo.config import ConfigError, Params, TrainParams
from fedsilo.utils.io import file_sha256

__all__ = ["evaluate_site_model", "patient_bootstrap_auc", "wilson", "evaluation_markdown"]

Z95 = 1.959963984540054


def wilson(k: int, n: int) -> Optional[tuple[float, float]]:
    """The 95 % Wilson score interval of the proportion k / n (None when n is 0)."""
    if n == 0:
        return None
    p, z2 = k / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def patient_bootstrap_auc(y: np.ndarray, p: np.ndarray, groups: np.ndarray, n: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The AUC's 95 % percentile interval over ``n`` bootstrap samples of the patients (``groups``): each sample
    draws as many patients as there are, with replacement, and takes all their images. Samples with one class only
    have no AUC and are counted (``one_class``), not redrawn."""
    codes, uniq = pd.factorize(pd.Series(groups), sort=False)
    members = [np.flatnonzero(codes == g) for g in range(len(uniq))]
    rng = np.random.default_rng(seed)
    aucs, one_class = [], 0
    for _ in range(n):
        idx = np.concatenate([members[g] for g in rng.integers(0, len(members), size=len(members))])
        a = binary_auc(y[idx], p[idx])
        if np.isnan(a):
            one_class += 1
        else:
            aucs.append(a)
    if not aucs:
        return {"ci": None, "samples": 0, "one_class": one_class}
    lo, hi = np.percentile(aucs, [2.5, 97.5])
    return {"ci": [float(lo), float(hi)], "samples": len(aucs), "one_class": one_class}


def _metrics(rows: pd.DataFrame, classes: list[str], bootstrap: int, seed: int) -> dict[str, Any]:
    y, pred = rows["label"].to_numpy(), rows["predicted_index"].to_numpy()
    n, correct = len(rows), int((y == pred).sum())
    k = len(classes)
    confusion = [[int(((y == t) & (pred == q)).sum()) for q in range(k)] for t in range(k)]
    out: dict[str, Any] = {
        "images": n, "patients": int(rows["group"].nunique()),
        "by_class": {c: int((y == i).sum()) for i, c in enumerate(classes)},
        "accuracy": correct / n if n else None, "accuracy_ci": wilson(correct, n), "confusion": confusion,
    }
    if k == 2:
        (tn, fp), (fn, tp) = confusion
        prob = rows[f"prob.{classes[1]}"].to_numpy(dtype=float)
        auc = binary_auc(y, prob)
        out.update({
            "auc": None if np.isnan(auc) else auc,
            "auc_ci": patient_bootstrap_auc(y, prob, rows["group"].to_numpy(), bootstrap, seed) if not np.isnan(auc) else None,
            "sensitivity": tp / (tp + fn) if tp + fn else None, "sensitivity_ci": wilson(tp, tp + fn),
            "specificity": tn / (tn + fp) if tn + fp else None, "specificity_ci": wilson(tn, tn + fp),
            "ppv": tp / (tp + fp) if tp + fp else None, "npv": tn / (tn + fn) if tn + fn else None,
        })
    else:
        out["recall"] = {c: (confusion[i][i] / sum(confusion[i]) if sum(confusion[i]) else None) for i, c in enumerate(classes)}
    return out


def evaluate_site_model(params: Params, dataset: str, model_path: Path, root: Path = Path("."), bootstrap: int = 1000,
                        seed: int = 0, device: str = "cpu", batch_size: int = 256) -> tuple[dict[str, Any], pd.DataFrame]:
    """The evaluation of the model at ``model_path`` on every image of the harmonized ``dataset`` (see the module):
    the summary (per domain and ``all``) and one row per image."""
    from fedsilo.fl.deploy import load_site_model

    if dataset not in params.datasets:
        raise ConfigError(f"datasets.{dataset}: not defined in the site's params file")
    if bootstrap < 1:
        raise ConfigError(f"--bootstrap: {bootstrap}; at least 1 resample (1000 is usual)")
    folder = params.layout(root).harmonized(dataset)
    files = [folder / a for a in ("images.npy", "records.parquet", "card.json")]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"{missing[0]}: missing; run `fedsilo harmonize --dataset {dataset}` first")
    card = json.loads(files[2].read_text())
    changed = [f.name for f in files[:2] if file_sha256(f) != card["sha256"].get(f.name)]
    if changed:
        raise ConfigError(f"{folder}: {', '.join(changed)} changed after harmonize wrote card.json; re-run `fedsilo harmonize "
                          f"--dataset {dataset}` rather than editing the arrays")
    model, info = load_site_model(model_path, device)
    contract = info["deployment"]["contract"]
    classes = list(contract["classes"])
    if list(card["classes"]) != classes:
        raise ConfigError(f"datasets.{dataset}: its classes {list(card['classes'])} are not the model's {classes} (its deployment's contract)")
    if [int(s) for s in card["image_shape"]] != [int(s) for s in contract["image_shape"]]:
        raise ConfigError(f"datasets.{dataset}.image_size: the harmonized images are {tuple(card['image_shape'])}; the model "
                          f"takes {tuple(contract['image_shape'])} (its deployment's contract): harmonize at the federation's size")
    records = pd.read_parquet(files[1])
    images = np.load(files[0], mmap_mode="r")
    cfg = TrainParams.model_validate(info["deployment"]["train"])
    probs = []
    for i in range(0, len(images), 4096):  # the memory-mapped arrays a chunk at a time
        x = torch.from_numpy(np.array(images[i : i + 4096])).permute(0, 3, 1, 2).contiguous().to(device)
        probs.append(predict(model, x, batch_size, cfg).softmax(1).cpu().numpy())
    prob = np.concatenate(probs) if probs else np.zeros((0, len(classes)))
    rows = pd.DataFrame({"id": records["id"], "domain": records["domain"], "group": records["group"],
                         "label": records["label"].astype(int), "predicted_index": prob.argmax(1)})
    rows["label_name"] = [classes[i] for i in rows["label"]]
    rows["predicted"] = [classes[i] for i in rows["predicted_index"]]
    for k, c in enumerate(classes):
        rows[f"prob.{c}"] = prob[:, k]
    summary = {
        "dataset": dataset, "model": str(model_path), "round": info.get("round"), "site": info.get("site"),
        "federation": info["deployment"].get("name"), "method": info["deployment"]["method"]["key"],
        "classes": classes, "bootstrap": bootstrap, "seed": seed,
        "domains": {str(d): _metrics(g, classes, bootstrap, seed) for d, g in rows.groupby("domain", sort=False)},
        "all": _metrics(rows, classes, bootstrap, seed),
    }
    columns = ["id", "domain", "group", "label_name", "predicted", *[f"prob.{c}" for c in classes]]
    return summary, rows[columns].rename(columns={"group": "patient", "label_name": "label"})


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}"


def _ci(ci: Optional[list[float] | tuple[float, float]]) -> str:
    return "" if ci is None else f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"


def evaluation_markdown(summary: dict[str, Any]) -> str:
    """The summary as a table a reader takes in at once: one row per domain and one over all images."""
    two = len(summary["classes"]) == 2
    head = "| domain | images | patients | accuracy % | " + ("AUC % | sensitivity % | specificity % | PPV % | NPV % |" if two else "recall % by class |")
    lines = [f"# External validation: {summary['dataset']}", "",
             f"Model: {summary['model']} ({summary['method']}, federation {summary['federation']}, site {summary['site']}, "
             f"round {summary['round']}). Every image of the dataset scored; 95 % intervals in brackets (Wilson for "
             f"proportions; AUC: {summary['bootstrap']} bootstrap samples of the patients, seed {summary['seed']}). "
             + (f"Positive class: {summary['classes'][1]}." if two else ""), "", head,
             "|---|---|---|---|" + ("---|---|---|---|---|" if two else "---|")]
    for name, m in [*summary["domains"].items(), ("all", summary["all"])]:
        cells = [name, str(m["images"]), str(m["patients"]), _pct(m["accuracy"]) + _ci(m["accuracy_ci"])]
        if two:
            auc_ci = (m["auc_ci"] or {}).get("ci")
            cells += [_pct(m["auc"]) + _ci(auc_ci), _pct(m["sensitivity"]) + _ci(m["sensitivity_ci"]),
                      _pct(m["specificity"]) + _ci(m["specificity_ci"]), _pct(m["ppv"]), _pct(m["npv"])]
        else:
            cells.append(", ".join(f"{c} {_pct(r)}" for c, r in m["recall"].items()))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Confusion matrices (rows: true class, columns: predicted; " + ", ".join(summary["classes"]) + "):", ""]
    for name, m in [*summary["domains"].items(), ("all", summary["all"])]:
        lines.append(f"- {name}: {m['confusion']}")
    return "\n".join(lines) + "\n"
