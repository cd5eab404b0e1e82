"""External validation at a site: the model a site kept from a deployment (``model.pt``), scored on a labelled dataset
the site harmonized itself (a later export of its own, a hospital's images it holds under a data-sharing agreement,
a public set), with what a clinical reader asks of such a check:

- per domain and over all images: the images, the patients, the images per class;
- accuracy, and for a two-class task ROC AUC, sensitivity and specificity at the model's decision (the class of the
  larger probability, as the federation's accuracy counts it), positive and negative predictive values and the
  confusion matrix ``[[TN, FP], [FN, TP]]`` (the positive class is the contract's second: Lung Opacity for
  Chest-X-Ray-4); for more classes, each class's recall and the confusion matrix (rows: true class);
- 95 % percentile intervals for each of them from one bootstrap that resamples *patients* (the records' groups),
  not images, since a patient's images are not independent: each sample draws, with replacement, as many patients
  as there are, so the share of each class varies as it does between samples of a population (prevalence is part of
  the uncertainty of accuracy, PPV and NPV); a sample that lacks a class leaves the values that need it (AUC, that
  class's recall, a predictive value without a prediction of its class) out of the percentiles, and their count is
  reported (``lacking``). Where a class has fewer than two patients no interval is given. A proportion at 0 or 1
  (every image of its denominator one way: 0 of 16 positives found) has no spread under any bootstrap; its interval
  is then the exact (Clopper-Pearson) one on the denominator's patients, [0, 1 - 0.025^(1/m)] or [0.025^(1/m), 1];
- one row per image (id, domain, patient, label, prediction, class probabilities).

The dataset is read as harmonize wrote it, after checking that its arrays still hash to its card's sha256 and that
its contract (classes, image shape) is the model's; every image of it is scored (no split is needed: an external set
is all test). The card's warnings (a table without patient ids makes each image its own patient) come along.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from fedsilo.client.local import binary_auc, predict_probabilities
from fedsilo.config import ConfigError, Params, TrainParams
from fedsilo.config.errors import not_defined

__all__ = ["evaluate_site_model", "patient_bootstrap", "evaluation_markdown"]

CHUNK = 4096  # images read from the memory-mapped array at a time
MIN_PATIENTS = 2  # per stratum, for an interval


def _weighted_auc(bins: np.ndarray, pos: np.ndarray, w: np.ndarray, n_bins: int) -> float:
    """The Mann-Whitney AUC of images weighted by ``w`` (a bootstrap's draw counts), ties counting one half; ``bins``
    are the images' ranks among the distinct scores."""
    wp = np.bincount(bins[pos], weights=w[pos], minlength=n_bins)
    wn = np.bincount(bins[~pos], weights=w[~pos], minlength=n_bins)
    total = wp.sum() * wn.sum()
    if total == 0:
        return float("nan")
    below = np.cumsum(wn) - wn
    return float((wp * (below + 0.5 * wn)).sum() / total)


def patient_bootstrap(y: np.ndarray, pred: np.ndarray, prob: Optional[np.ndarray], groups: np.ndarray, n_classes: int,
                      samples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """95 % percentile intervals of accuracy, per-class recall and, for two classes, the AUC (``prob``: the positive
    class's probability) and the predictive values (``ppv``, ``npv``), over ``samples`` bootstrap samples of the
    patients (see the module); ``lacking``: per value, the samples left out for lacking what it needs. None for each
    where a class has fewer than :data:`MIN_PATIENTS` patients."""
    codes, _ = pd.factorize(pd.Series(groups), sort=False)
    n_groups = int(codes.max()) + 1 if len(codes) else 0

    def per(mask: np.ndarray) -> np.ndarray:  # per patient, how many of its images the mask holds
        return np.bincount(codes, weights=mask.astype(float), minlength=n_groups)

    correct, total = per(y == pred), per(np.ones_like(y, dtype=bool))
    hits = [per((y == c) & (pred == c)) for c in range(n_classes)]
    sizes = [per(y == c) for c in range(n_classes)]
    called = [per(pred == c) for c in range(n_classes)]
    few = [c for c in range(n_classes) if (sizes[c] > 0).sum() < MIN_PATIENTS] if n_classes == 2 else []
    if n_groups < MIN_PATIENTS or few:
        which = "with an image of each class" if n_classes == 2 else "in all"
        return {"samples": 0, "why": f"fewer than {MIN_PATIENTS} patients {which}"}
    if prob is not None:
        _, bins = np.unique(prob, return_inverse=True)
        n_bins, pos = int(bins.max()) + 1, y == 1
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {"accuracy": [], **{f"recall.{c}": [] for c in range(n_classes)}}
    if n_classes == 2:
        draws.update(auc=[], ppv=[], npv=[])

    def ratio(a: float, b: float) -> float:
        return float(a / b) if b else float("nan")

    for _ in range(samples):
        count = np.bincount(rng.integers(0, n_groups, size=n_groups), minlength=n_groups).astype(float)
        draws["accuracy"].append(ratio(count @ correct, count @ total))
        for c in range(n_classes):
            draws[f"recall.{c}"].append(ratio(count @ hits[c], count @ sizes[c]))
        if n_classes == 2:
            draws["ppv"].append(ratio(count @ hits[1], count @ called[1]))
            draws["npv"].append(ratio(count @ hits[0], count @ called[0]))
            if prob is not None:
                draws["auc"].append(_weighted_auc(bins, pos, count[codes], n_bins))
    out: dict[str, Any] = {"samples": samples, "lacking": {}}
    for k, v in draws.items():
        v = np.asarray(v, dtype=float)
        kept = v[~np.isnan(v)]
        if len(kept) < len(v):
            out["lacking"][k] = int(len(v) - len(kept))
        out[k] = [float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5))] if len(kept) else None
    return out


def exact_at_bound(x: int, patients: int) -> Optional[list[float]]:
    """The Clopper-Pearson 95 % interval of a proportion observed at 0 or at 1 (``x`` = 0 or all) over ``patients``
    patients: [0, 1 - 0.025^(1/m)] or [0.025^(1/m), 1]; None elsewhere (the bootstrap's interval stands)."""
    if patients < 1 or x not in (0, 1):
        return None
    edge = 0.025 ** (1.0 / patients)
    return [0.0, 1.0 - edge] if x == 0 else [edge, 1.0]


def _metrics(rows: pd.DataFrame, classes: list[str], bootstrap: int, seed: int) -> dict[str, Any]:
    y, pred = rows["label"].to_numpy(), rows["predicted_index"].to_numpy()
    n, correct = len(rows), int((y == pred).sum())
    k = len(classes)
    confusion = [[int(((y == t) & (pred == q)).sum()) for q in range(k)] for t in range(k)]
    prob = rows[f"prob.{classes[1]}"].to_numpy(dtype=float) if k == 2 else None
    groups = rows["group"].to_numpy()
    ci = patient_bootstrap(y, pred, prob, groups, k, bootstrap, seed)

    def interval(key: str, value: Optional[float], among: np.ndarray) -> Optional[list[float]]:
        """The bootstrap's interval, or the exact one where the value sits at 0 or 1 (``among``: the images of the
        denominator, whose patients count)."""
        if not ci["samples"] or value is None:
            return ci.get(key)
        exact = exact_at_bound(int(value) if value in (0, 1) else -1, int(pd.unique(groups[among]).size))
        return exact if exact is not None else ci.get(key)

    accuracy = correct / n if n else None
    out: dict[str, Any] = {
        "images": n, "patients": int(rows["group"].nunique()),
        "by_class": {c: int((y == i).sum()) for i, c in enumerate(classes)},
        "accuracy": accuracy, "accuracy_ci": interval("accuracy", accuracy, np.ones(n, dtype=bool)), "confusion": confusion,
        "bootstrap": {"samples": ci["samples"], **({"why_none": ci["why"]} if "why" in ci else {}),
                      **({"lacking": ci["lacking"]} if ci.get("lacking") else {})},
    }
    if k == 2:
        (tn, fp), (fn, tp) = confusion
        auc = binary_auc(y, prob)
        sens = tp / (tp + fn) if tp + fn else None
        spec = tn / (tn + fp) if tn + fp else None
        ppv = tp / (tp + fp) if tp + fp else None
        npv = tn / (tn + fn) if tn + fn else None
        out.update({
            "auc": None if np.isnan(auc) else auc, "auc_ci": ci.get("auc"),
            "sensitivity": sens, "sensitivity_ci": interval("recall.1", sens, y == 1),
            "specificity": spec, "specificity_ci": interval("recall.0", spec, y == 0),
            "ppv": ppv, "ppv_ci": interval("ppv", ppv, pred == 1), "npv": npv, "npv_ci": interval("npv", npv, pred == 0),
        })
    else:
        out["recall"] = {c: (confusion[i][i] / sum(confusion[i]) if sum(confusion[i]) else None) for i, c in enumerate(classes)}
        out["recall_ci"] = {c: interval(f"recall.{i}", out["recall"][c], y == i) for i, c in enumerate(classes)}
    return out


def _trained_on(params: Params, dataset: str, root: Path, info: dict[str, Any], card: dict[str, Any]) -> Optional[str]:
    """The site whose training data ``dataset`` is, by fingerprint (each split file of it this params file names, as
    built, against the deployment's sites, and a newcomer's onboarded model's own), or None: a model scored on the
    images it trained on is no external validation. ``card``: the dataset's, its arrays just checked."""
    from fedsilo.fl.site import recorded_fingerprint

    known = {str(s.get("fingerprint")): str(s.get("name")) for s in info["deployment"].get("sites", [])}
    if info.get("fingerprint"):  # a newcomer's onboarded model: the site's own split
        known[str(info["fingerprint"])] = str(info.get("site"))
    layout = params.layout(root)
    for name, ex in params.experiments.items():
        if ex.dataset != dataset or not layout.split(name).exists():
            continue
        fingerprint = recorded_fingerprint(card, layout.split(name))  # a split of several clients matches no site's
        if fingerprint in known:
            return known[fingerprint]
    return None


def evaluate_site_model(params: Params, dataset: str, model_path: Path, root: Path = Path("."), bootstrap: int = 1000,
                        seed: int = 0, device: str = "cpu", batch_size: int = 256, quiet: bool = True) -> tuple[dict[str, Any], pd.DataFrame]:
    """The evaluation of the model at ``model_path`` on every image of the harmonized ``dataset`` (see the module):
    the summary (per domain and ``all``) and one row per image; the images scored shown as progress unless ``quiet``."""
    from fedsilo.data.cards import refuse_changed_arrays
    from fedsilo.data.harmonize import refuse_stale_rules
    from fedsilo.fl.deploy import load_site_model

    if dataset not in params.datasets:
        raise not_defined("datasets", dataset, params)
    if bootstrap < 1:
        raise ConfigError(f"--bootstrap: {bootstrap}; at least 1 resample (1000 is usual)")
    folder = params.layout(root).harmonized(dataset)
    files = [folder / a for a in ("images.npy", "records.parquet", "card.json")]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"{missing[0]}: missing; run `fedsilo harmonize --dataset {dataset}` first")
    card = json.loads(files[2].read_text())
    refuse_changed_arrays(folder, card, f"re-run `fedsilo harmonize --dataset {dataset}`")
    refuse_stale_rules(card, params.datasets[dataset], folder, dataset, f"`fedsilo harmonize --dataset {dataset}`")  # settings edited since
    model, info = load_site_model(model_path, device)
    trained_on = _trained_on(params, dataset, root, info, card)  # said in the summary, its title and by the CLI
    contract = info["deployment"]["contract"]
    classes = list(contract["classes"])
    if list(card["classes"]) != classes:
        raise ConfigError(f"datasets.{dataset}: its classes {list(card['classes'])} are not the model's {classes} (its deployment's contract)")
    (h, _, ch), (mh, _, mch) = ([int(v) for v in card["image_shape"]], [int(v) for v in contract["image_shape"]])
    if h != mh:
        raise ConfigError(f"datasets.{dataset}.image_size: the harmonized images are {h} px; the model takes {mh} px "
                          "(its deployment's contract): harmonize at the federation's size")
    if ch != mch:
        raise ConfigError(f"datasets.{dataset}: its images have {ch} channel(s), the model's {mch} (its deployment's "
                          f"contract): a dataset of the kind the federation trained on")
    records = pd.read_parquet(files[1])
    images = np.load(files[0], mmap_mode="r")
    cfg = TrainParams.model_validate(info["deployment"]["train"])
    prob = predict_probabilities(model, images, device, batch_size, cfg=cfg, chunk=CHUNK, desc=f"evaluate {dataset}", quiet=quiet)
    prob = prob if len(prob) else np.zeros((0, len(classes)))
    rows = pd.DataFrame({"id": records["id"], "domain": records["domain"], "group": records["group"],
                         "label": records["label"].astype(int), "predicted_index": prob.argmax(1)})
    rows["label_name"] = [classes[i] for i in rows["label"]]
    rows["predicted"] = [classes[i] for i in rows["predicted_index"]]
    for k, c in enumerate(classes):
        rows[f"prob.{c}"] = prob[:, k]
    summary = {
        "dataset": dataset, "model": str(model_path), "round": info.get("round"), "site": info.get("site"),
        "federation": info["deployment"].get("federation"), "method": info["deployment"]["method"]["key"],
        "classes": classes, "bootstrap": bootstrap, "seed": seed, "warnings": list(card.get("warnings", [])),
        "trained_on": trained_on,
        "domains": {str(d): _metrics(g, classes, bootstrap, seed) for d, g in rows.groupby("domain", sort=False)},
        "all": _metrics(rows, classes, bootstrap, seed),
    }
    columns = ["id", "domain", "group", "label_name", "predicted", *[f"prob.{c}" for c in classes]]
    return summary, rows[columns].rename(columns={"group": "patient", "label_name": "label"})


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}"


def _ci(ci: Optional[list[float]]) -> str:
    return "" if ci is None else f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"


def evaluation_markdown(summary: dict[str, Any]) -> str:
    """The summary as a table a reader takes in at once: one row per domain and one over all images."""
    classes = summary["classes"]
    two = len(classes) == 2
    per_class = " | ".join(f"{c}" for c in classes)
    head = f"| domain | images | patients | {per_class} | accuracy % | " + (
        "AUC % | sensitivity % | specificity % | PPV % | NPV % |" if two else "recall % by class |")
    whose = f"site {summary['site']}" if summary["site"] else "the federation's model"  # a site's kept model, or final_model.pt
    title = (f"# Evaluation on the data {summary['trained_on']} trained on (not an external validation): {summary['dataset']}"
             if summary.get("trained_on") else f"# External validation: {summary['dataset']}")
    lines = [title, "",
             f"Model: {summary['model']} ({summary['method']}, federation {summary['federation']}, {whose}, "
             f"round {summary['round']}). Every image of the dataset scored; "
             + (f"95 % intervals in parentheses, from {summary['bootstrap']} bootstrap samples of the patients (seed "
                f"{summary['seed']}; a proportion at 0 or 100 %: the exact interval on its patients)"
                if any(m["bootstrap"]["samples"] for m in [*summary["domains"].values(), summary["all"]]) else "no intervals (below)")
             + (f". Positive class: {classes[1]}; sensitivity, specificity, PPV and NPV at the model's decision." if two else "."),
             "", head, "|---|---|---|" + "---|" * len(classes) + "---|" + ("---|---|---|---|---|" if two else "---|")]
    for name, m in [*summary["domains"].items(), ("all", summary["all"])]:
        cells = [name, str(m["images"]), str(m["patients"]), *[str(m["by_class"][c]) for c in classes],
                 _pct(m["accuracy"]) + _ci(m["accuracy_ci"])]
        if two:
            cells += [_pct(m["auc"]) + _ci(m["auc_ci"]), _pct(m["sensitivity"]) + _ci(m["sensitivity_ci"]),
                      _pct(m["specificity"]) + _ci(m["specificity_ci"]), _pct(m["ppv"]) + _ci(m["ppv_ci"]),
                      _pct(m["npv"]) + _ci(m["npv_ci"])]
        else:
            cells.append(", ".join(f"{c} {_pct(r)}{_ci(m['recall_ci'][c])}" for c, r in m["recall"].items()))
        lines.append("| " + " | ".join(cells) + " |")
    none = [f"{name}: {m['bootstrap']['why_none']}" for name, m in [*summary["domains"].items(), ("all", summary["all"])]
            if "why_none" in m["bootstrap"]]
    if none:
        lines += ["", "No interval for " + "; ".join(none) + "."]
    lines += ["", "Confusion matrices (rows: true class, columns: predicted; " + ", ".join(classes) + "):", ""]
    for name, m in [*summary["domains"].items(), ("all", summary["all"])]:
        lines.append(f"- {name}: {m['confusion']}")
    if summary.get("warnings"):
        lines += ["", "## Warnings (from the dataset's card)", ""] + [f"- {w}" for w in summary["warnings"]]
    return "\n".join(lines) + "\n"
