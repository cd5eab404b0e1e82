"""The report stage: results -> tables (markdown, CSV, LaTeX) and figures (PNG) under
``results/report/<experiment>/``:
- ``<experiment>_accuracy.{md,csv,tex}``: a row per method, a column per domain plus Avg; each cell is the mean
  +- std over seeds (sample std, ddof = 1) of the final per-client test accuracy (%); Avg is each seed's mean over
  domains, then mean +- std over seeds; the best mean of each column is bold. Binary tasks get the same table for
  AUC; a client whose test split holds one class has no AUC: its cell and the Avg it would enter read "n/a" (with a
  note and a logged warning), never a mean over fewer domains. With one seed a cell is that seed's value and the
  caption says n = 1 (no "± 0.0": one run has no spread), and the std columns are empty.
- ``<experiment>_accuracy_best_val.{md,csv}`` when the split scored a validation set (``n_val``): the same table at
  each run's round of best mean validation accuracy (FedBN's model selection), with the round picked per run; the
  vs-paper table uses it where the published table's ``selection`` is ``best_validation``;
- ``<experiment>_standard_errors.{md,csv}``: each domain's test-set size and the binomial standard error of its
  accuracy, sqrt(p (1 - p) / n) in points at the mean accuracy p, and the Avg's (domains independent), so that a
  reader sees when a difference between methods or against the paper is inside the sampling noise of the test set;
- ``<experiment>_curves.png``: the Avg over domains per round (the accuracy tables' Avg; F²DC's Fig. 5), one line per method (mean over seeds);
- ``<experiment>_<method>_domains.png``: per-domain accuracy per round for each method (where the clients span
  several domains);
- ``<experiment>_bytes.png``: bytes sent per round (up + down) per method; the accuracy page's first communication
  table gives the MiB all clients send per round (up + down), averaged over every round (silent rounds included);
- ``<experiment>_communication.{md,csv}`` and ``<experiment>_communication.png`` (pFedDB Fig. 4, Table 3's Param and
  Ratio): per method the MiB uploaded per client per federated round, measured from the engine's payloads (rounds
  with no upload, such as pFedDB's Phase 1 or Single, are not averaged in), the ratio to the backbone's parameter
  bytes, and the saving against FedAvg's upload;
  the training GFLOPs of a round (the last, counted by ``torch.utils.flop_counter``) and its training seconds
  (F²DC Table 4);
- ``<experiment>_collapse.{md,csv}``: per method the effective rank of the final representations' covariance (mean
  over clients and seeds), and with FedAvg and F²DC both run ``<experiment>_fig1_spectrum.png``: the singular
  values of the first client's representation covariance (F²DC Fig. 1);
- with ``target_accuracy``: ``<experiment>_time_to_accuracy.{md,csv}`` (FedeCouple Table VII: rounds, training
  seconds and MiB per client until the mean accuracy first reaches the target); when ``published`` names a
  ``time_to_accuracy`` entry, ``<experiment>_time_to_accuracy_vs_paper.{md,csv}`` sets the paper's rounds, MB and
  minutes beside ours (its target must equal ``target_accuracy``);
- with ``published``: ``<experiment>_vs_paper.{md,csv}``; on Chest-X-Ray-4 ``<experiment>_fig3_scatter.png``; with
  Single, pFedDB and a two-phase FedAvg variant ``<experiment>_fig5_two_phase.png``; when ``results/<experiment>/
  onboarding/`` exists, ``<experiment>_fig6_onboarding.png`` and ``<experiment>_onboarding.md`` (pFedDB Figs. 3-6).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from fedsilo.config import RESERVED_DOMAINS
from fedsilo.utils.io import atomic_dir, read_json

log = logging.getLogger(__name__)


class ReportError(RuntimeError):
    pass


def collect(results: Path, methods: list[str], seeds: list[int]) -> tuple[pd.DataFrame, dict]:
    """Every (method, seed) run's final metrics under ``results`` (an experiment's results folder): a row per
    domain (the mean over its clients), and the runs' histories."""
    clients, histories = collect_clients(results, methods, seeds)
    return by_domain(clients), histories


def collect_clients(results: Path, methods: list[str], seeds: list[int]) -> tuple[pd.DataFrame, dict]:
    """As :func:`collect`, a row per client (its domain in ``domain``)."""
    rows, histories = [], {}
    for m in methods:
        for s in seeds:
            d = results / m / f"seed{s}"
            if not (d / "metrics.json").exists():
                raise ReportError(f"{d / 'metrics.json'}: missing (train {m} seed {s} first: `dvc repro`)")
            met = read_json(d / "metrics.json")
            histories[(m, s)] = json.loads((d / "history.json").read_text())
            best = best_validation_round(histories[(m, s)])
            run_level = {  # the same for every domain of the run
                "bytes_per_round": float(np.mean(np.add(met["bytes_up_per_round"], met["bytes_down_per_round"]))),
                "up_per_client_round": upload_per_participant(histories[(m, s)]),
                "up_per_round": float(np.mean(met["bytes_up_per_round"])),  # every client of a round together
                "model_param_bytes": float(met.get("model_param_bytes", np.nan)),
                # the round whose FLOPs were counted ran under the counter's dispatch overhead: left out of the time
                # the median round: the first rounds' warm-up (allocations, kernel choice) does not weigh on it
                "train_s_per_round": float(np.median(_timed(histories[(m, s)]) or [np.nan])),
                "train_flops_per_round": float(met.get("train_flops_per_round", np.nan)),
                "best_val_round": float(best["round"]) if best else np.nan,
            }
            # a column per domain: where several clients share a domain (F²DC's protocol) they share its test set,
            # and the domain's accuracy is the mean over its clients (the same number when they share one model)
            domain_of = met.get("client_domains") or {}
            order = [c for c in met.get("clients", []) if c in met["per_client"]] or list(met["per_client"])  # the split's order
            for client in order:
                v = met["per_client"][client]
                rows.append({"method": m, "seed": s, "domain": domain_of.get(client, client), "client": client, "acc": v["acc"],
                             # NaN: a one-class test split (binary task); None: no AUC (more than two classes)
                             "auc": np.nan if v.get("auc") is None else v["auc"], "has_auc": "auc" in v,
                             "n_test": float((met.get("test_sizes") or {}).get(client, np.nan)),
                             "test_set": (met.get("test_set_of") or {}).get(client),
                             # the test accuracy at the run's round of best mean validation accuracy (NaN: no validation set)
                             "acc_best_val": best["eval"][client]["acc"] if best else np.nan,
                             # ... and at the client's own round of best validation accuracy (Single's scripts' rule)
                             "acc_best_own_val": own_best_validation_acc(histories[(m, s)], client) if best else np.nan,
                             **run_level})
    return pd.DataFrame(rows), histories


def by_domain(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`collect_clients`'s rows, a row per (method, seed, domain): clients of one domain (F²DC's protocol, a
    label-skew split's one dataset) become the mean over them, with the test images behind that mean."""
    if not df.empty and df.duplicated(["method", "seed", "domain"]).any():
        order = list(dict.fromkeys(df["domain"]))
        keys = ["method", "seed", "domain"]
        # the test images behind a domain's column, whose accuracy is the unweighted mean over its clients: one test
        # set shared by them (F²DC's clients of a domain) counts once; S distinct sets (label-skew clients of a
        # single-domain dataset) give the mean the variance of a proportion on S^2 / sum(1 / n_s) images (their
        # effective size: the total when the sets are equal); unknown (NaN) for runs that predate test_set_of
        def effective(g: pd.DataFrame) -> float:
            if not g["test_set"].notna().all():
                return np.nan
            sizes = g.drop_duplicates("test_set")["n_test"].to_numpy(dtype=float)
            return float(len(sizes) ** 2 / np.sum(1.0 / sizes))

        behind = {k: effective(g) for k, g in df.groupby(keys, sort=False)}
        # clients of one domain share its test set (F²DC's protocol): their NaN AUC stays NaN in the mean
        df = df.groupby(keys, sort=False, as_index=False).agg(
            {c: (lambda x: x.mean(skipna=False)) for c in df.columns if c not in ("method", "seed", "domain", "client", "test_set")})
        df["n_test"] = [behind[k] for k in zip(df["method"], df["seed"], df["domain"])]
        df["domain"] = pd.Categorical(df["domain"], categories=order)
        df = df.sort_values(["method", "seed", "domain"], kind="stable")
        df["domain"] = df["domain"].astype(str)
    return df


def per_client_accuracy(clients: pd.DataFrame) -> pd.DataFrame:
    """Every client's accuracy in every run, a row per method (columns: seed, client), from
    :func:`collect_clients`' rows: what tells two methods apart where a table's columns pool many clients (a
    label-skew experiment's one dataset column), for :func:`indistinct_rows`."""
    return clients.pivot_table(index="method", columns=["seed", "client"], values="acc", dropna=False, aggfunc="first")


def upload_per_participant(history: list[dict]) -> float:
    """Bytes uploaded per participating client per round, averaged over the rounds that upload: each round's total
    divided by the clients that took part in it (sampled), not by the whole federation, so that partial participation
    does not shrink the number. 0 for a method that never uploads."""
    per = [h["bytes_up_total"] / len(h["sampled"]) for h in history if h["bytes_up_total"] > 0]
    return float(np.mean(per)) if per else 0.0


def client_domains(results: Path, method: str, seed: int) -> dict[str, str]:
    """The split's client -> domain map, as a run's metrics.json records it (every run of an experiment shares it)."""
    return read_json(Path(results) / method / f"seed{seed}" / "metrics.json").get("client_domains") or {}


def one_class_clients(df: pd.DataFrame) -> list[tuple[str, int, str]]:
    """(method, seed, client) of a binary task whose client had no AUC (its test split holds one class)."""
    bad = df[df["has_auc"].astype(bool) & df["auc"].isna()]
    return [(r["method"], int(r["seed"]), r.get("client", r["domain"])) for _, r in bad.iterrows()]


def standard_errors(df: pd.DataFrame, acc: pd.DataFrame) -> pd.DataFrame | None:
    """Per method and domain, the binomial standard error (points) of the mean accuracy on that domain's test set,
    sqrt(p (1 - p) / n); Avg's combines the domains as independent, sqrt(sum SE^2) / D. Columns: (<domain>, se), and
    one row ``n`` holding each domain's test-set size. None when the runs predate ``test_sizes`` in metrics.json."""
    if "n_test" not in df or df["n_test"].isna().all():
        return None
    domains = [c for c in acc["mean"].columns if c not in ("Avg", "STD")]
    n = df.groupby("domain")["n_test"].first().reindex(domains)
    p = acc["mean"][domains] / 100
    se = np.sqrt(p * (1 - p) / n) * 100
    se["Avg"] = np.sqrt((se[domains] ** 2).sum(axis=1, min_count=len(domains))) / len(domains)
    sizes = pd.DataFrame([list(n) + [float(n.sum())]], index=["n"], columns=domains + ["Avg"])
    return pd.concat([sizes, se])


def standard_errors_markdown(tab: pd.DataFrame, title: str) -> str:
    cols = list(tab.columns)
    lines = [f"### {title}", "",
             "Binomial standard error of the accuracy (points), sqrt(p (1 - p) / n) at the mean accuracy p over seeds, "
             "for a test set of n images (first row; a domain whose clients each have their own test set: the effective "
             "size S^2 / sum(1 / n_s) of their mean, the total when the sets are equal; Avg: the domains' total, its SE "
             "combining the domains as independent). Two numbers on one test set closer than about two of these are "
             "not told apart by it.", "",
             "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines.append("| test images n | " + " | ".join("n/a" if pd.isna(v) else f"{round(v)}" for v in tab.loc["n"]) + " |")
    for m, r in tab.drop(index="n").iterrows():
        lines.append(f"| {m} | " + " | ".join("n/a" if pd.isna(v) else f"± {v:.1f}" for v in r) + " |")
    return "\n".join(lines) + "\n"


def _timed(history: list[dict]) -> list[float]:
    """Training seconds of the rounds that ran without the FLOP counter (all of them if every round was counted)."""
    plain = [h["train_seconds"] for h in history if "train_seconds" in h and "train_flops" not in h]
    return plain or [h["train_seconds"] for h in history if "train_seconds" in h]


def collect_spectra(results: Path, methods: list[str], seeds: list[int]) -> dict[tuple[str, int], dict[str, list[float]]] | None:
    """Every run's ``spectrum.json`` (client -> singular values), or None when a run has none (an older run)."""
    out = {}
    for m in methods:
        for s in seeds:
            f = results / m / f"seed{s}" / "spectrum.json"
            if not f.exists():
                return None
            out[(m, s)] = read_json(f)["clients"]
    return out


def collapse_table(spectra: dict[tuple[str, int], dict[str, list[float]]], methods: list[str], seeds: list[int]) -> pd.DataFrame:
    """Per method: the representation's dimension d and its effective rank (mean over clients, then mean and std
    over seeds); a collapsed representation has an effective rank far below d (F²DC Fig. 1 in one number)."""
    import torch

    from fedsilo.client.features import effective_rank

    rows = []
    for m in methods:
        # clients with fewer than two test images have no spectrum (an empty list) and are left out
        per_seed = [np.mean([effective_rank(torch.tensor(v)) for v in spectra[(m, s)].values() if v] or [np.nan]) for s in seeds]
        d = max((len(v) for v in spectra[(m, seeds[0])].values()), default=0)
        std = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else np.nan  # one seed has no spread
        rows.append({"method": m, "dim": d, "effective_rank": float(np.mean(per_seed)), "effective_rank_std": std})
    return pd.DataFrame(rows).set_index("method")


def collapse_markdown(tab: pd.DataFrame, title: str) -> str:
    lines = [f"### {title}", "", "| method | dimension d | effective rank (mean over clients) |", "|---|---|---|"]
    lines += [f"| {m} | {int(r['dim'])} | {mean_pm(r['effective_rank'], r['effective_rank_std'], '.1f')} |" for m, r in tab.iterrows()]
    return "\n".join(lines) + "\n"


FIG1_METHODS = ("fedavg", "f2dc")  # F²DC Fig. 1: vanilla FL against F²DC


def _fig1(path: Path, spectra: dict[tuple[str, int], dict[str, list[float]]], methods: list[str], seeds: list[int], client: str, title: str) -> str:
    """log10 of the singular values of one client's representation covariance, largest first, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(methods), 1, figsize=(6, 2.2 * len(methods)), sharex=True, sharey=True, squeeze=False)
    for ax, m in zip(axes[:, 0], methods):
        logs = np.mean([np.log10(np.maximum(np.asarray(spectra[(m, s)][client]), 1e-12)) for s in seeds], axis=0)
        ax.bar(np.arange(len(logs)), logs - logs.min(), bottom=logs.min(), width=1.0)
        ax.set_ylabel("log10 singular value")
        ax.set_title(f"{m}: client {client}", fontsize=9)
    axes[-1, 0].set_xlabel("singular value index (largest first)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def time_to_accuracy(histories: dict, methods: list[str], seeds: list[int], target: float) -> pd.DataFrame:
    """FedeCouple Table VII from our own histories: per method, the first evaluated round whose mean client accuracy
    reaches ``target`` (%), the training seconds of the rounds up to it (local training, transfers, aggregation; not
    evaluation) and the MiB each client sent and received until then (measured payloads, up + down, divided by the
    number of clients); mean over the seeds that reach it, and how many did."""
    rows = []
    for m in methods:
        hits = []
        for s in seeds:
            h = histories[(m, s)]
            first = next((e for e in h if "eval" in e and e["mean_acc"] * 100 >= target), None)
            if first is None:
                continue
            upto = [e for e in h if e["round"] <= first["round"]]
            n_clients = len(first["eval"])
            hits.append({
                "round": first["round"],
                "train_s": sum(e.get("train_seconds", np.nan) for e in upto),
                "MiB_per_client": sum(e["bytes_up_total"] + e["bytes_down_total"] for e in upto) / n_clients / 2**20,
            })
        row = {"method": m, "reached": f"{len(hits)}/{len(seeds)}"}
        for k in ("round", "train_s", "MiB_per_client"):
            row[k] = float(np.mean([x[k] for x in hits])) if hits else np.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def time_to_accuracy_markdown(tab: pd.DataFrame, title: str) -> str:
    lines = [f"### {title}", "", "| method | seeds that reach it | rounds | training s | MiB per client (up + down) |", "|---|---|---|---|---|"]
    for m, r in tab.iterrows():
        cells = ["—" if pd.isna(r[k]) else f"{r[k]:{f}}" for k, f in (("round", ".1f"), ("train_s", ".1f"), ("MiB_per_client", ".2f"))]
        lines.append(f"| {m} | {r['reached']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


LOCAL_NEW_EXTERNAL = {"mean_acc": "local test", "ensemble_acc": "new test", "external_ensemble_acc": "external test"}
# a published table's column names for the same metrics (pipelines/cd2pfed/published.yaml)
METRIC_COLUMNS = {"local": "local test", "new": "new test", "external": "external test"}
METRIC_COLUMNS_INV = {v: k for k, v in METRIC_COLUMNS.items()}


def local_new_external(results: Path, methods: list[str], seeds: list[int]) -> pd.DataFrame | None:
    """CD2-pFed's (and LG-FedAvg's) columns, mean and std over seeds in %: *local test* (each client's own model on
    its own test set, averaged over clients), *new test* (the ensemble of every client's model on the union of the
    test sets) and *external test* (the same ensemble on a site that never trained). None when no run recorded an
    ensemble (``train.ensemble_test`` off and no external site)."""
    rows, sizes = [], {}
    for m in methods:
        for s in seeds:
            met = read_json(results / m / f"seed{s}" / "metrics.json")
            rows.append({"method": m, **{col: met.get(key, np.nan) * 100 for key, col in LOCAL_NEW_EXTERNAL.items()}})
            if not sizes and met.get("test_sizes"):  # the images each column scores (the split's: every run's the same)
                owners = met.get("test_set_of") or {}
                sizes = {"new test": sum(n for c, n in met["test_sizes"].items() if owners.get(c, c) == c)}
                if "external_test_size" in met:
                    sizes["external test"] = int(met["external_test_size"])
    df = pd.DataFrame(rows)
    if df[["new test", "external test"]].isna().all().all():
        return None
    df = df.dropna(axis=1, how="all")
    g = df.groupby("method", sort=False)
    cols = [c for c in LOCAL_NEW_EXTERNAL.values() if c in df.columns]
    std = g[cols].std(ddof=1).where(g.size() > 1)  # one seed has no spread: NaN, shown as n = 1
    out = pd.concat({"mean": g[cols].mean(), "std": std}, axis=1).reindex(methods)
    out.attrs["images"] = {c: n for c, n in sizes.items() if c in cols}
    return out


def local_new_external_markdown(tab: pd.DataFrame, title: str, per_client: pd.DataFrame | None = None) -> str:
    """The table, with the images the new and external tests score and the binomial standard error of an accuracy
    near 50 % on them (a difference inside about two of it is noise), and a note where methods tie."""
    cols = list(tab["mean"].columns)
    images = tab.attrs.get("images") or {}
    said = "; ".join(f"{c}: {n} images (standard error near 50 %: ±{50 / np.sqrt(n):.1f} points)" for c, n in images.items() if n)
    lines = [f"### {title}", ""] + ([f"{said}.", ""] if said else []) + [
        "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in tab.index:
        lines.append(f"| {m} | " + " | ".join(mean_pm(tab["mean"].loc[m, c], tab["std"].loc[m, c], ".2f") for c in cols) + " |")
    same = indistinct_rows(tab, per_client)
    return "\n".join(lines) + "\n" + (f"\n> **Note:** {same}\n" if same else "")


def mean_pm(mean: float, std: float, fmt: str) -> str:
    """``mean ± std``, the mean alone where the std is undefined (a single seed), "n/a" where there is no mean."""
    if pd.isna(mean):
        return "n/a"
    return f"{mean:{fmt}}" if pd.isna(std) else f"{mean:{fmt}} ± {std:{fmt}}"


def over_seeds(seeds: list[int], latex: bool = False) -> str:
    """What a table's cells are: "mean ± std (ddof = 1) over 3 seeds [0, 1, 2]", or for one seed "seed 0 (n = 1, no
    spread)"."""
    if len(seeds) == 1:
        return f"seed {seeds[0]} (n = 1, no spread)"
    pm = "$\\pm$" if latex else "±"
    return f"mean {pm} sample std (ddof = 1) over {len(seeds)} seeds {list(seeds)}"


def summary_table(df: pd.DataFrame, metric: str, methods: list[str], domain_std: bool = False) -> pd.DataFrame:
    """Per method, each domain's column and Avg (the mean over domains), as mean and std over seeds. ``domain_std``
    adds STD after Avg: each run's sample std (ddof = 1) over its domain columns, then its mean and std over seeds
    (the STD column of F²DC's and FedHEAL's tables: how evenly a method serves the domains, lower is better)."""
    domains = list(dict.fromkeys(df["domain"]))
    # NaN stays NaN (dropna=False, skipna=False): a client with no AUC makes its cell and its Avg "n/a", never a
    # mean over the domains or seeds that happen to have one
    piv = df.pivot_table(index=["method", "seed"], columns="domain", values=metric, dropna=False,
                         aggfunc=lambda x: x.mean(skipna=False))[domains] * 100
    piv["Avg"] = piv[domains].mean(axis=1, skipna=False)
    if domain_std:
        piv["STD"] = piv[domains].std(axis=1, ddof=1, skipna=False)
    g = piv.groupby(level="method")
    missing = piv.isna().groupby(level="method").any().reindex(methods)
    mean = g.mean().reindex(methods).mask(missing)
    std = g.std(ddof=1).reindex(methods).mask(missing)
    runs = g.size().reindex(methods)
    std = std.where(runs > 1, axis=0)  # one seed has no spread: NaN (an empty CSV cell, no "± 0.0" in the tables)
    out = pd.concat({"mean": mean, "std": std}, axis=1)
    return out


def indistinct_rows(tab: pd.DataFrame, per_client: pd.DataFrame | None = None) -> str | None:
    """A note when methods of a table scored exactly the same in every column: runs too short or too small to tell
    them apart (a quickstart's few steps, each model predicting one class), whose bold "best" cells and differences
    from a paper mean nothing. Names the groups that tie when only some do; None when no two rows do.
    ``per_client``: each method's accuracy on every client of every run (:func:`per_client_accuracy`); where given, rows tie
    only when those are the same too (two label-skew runs whose means over 20 clients meet are not one model)."""
    mean = tab["mean"]
    if len(mean.index) < 2 or mean.isna().all().all():
        return None

    def row(m: str) -> np.ndarray:
        own = mean.loc[m].to_numpy(float)
        if per_client is None or m not in per_client.index:
            return own
        return np.concatenate([own, per_client.loc[m].to_numpy(float)])

    groups: list[list[str]] = []
    for m in mean.index:
        home = next((g for g in groups if np.allclose(row(g[0]), row(m), equal_nan=True)), None)
        if home is None:
            groups.append([m])
        else:
            home.append(m)
    # two causes, which the numbers alone do not tell apart: models that predict one class (a quickstart's few
    # steps), or settings that change nothing on these data (pFedDIL's lambda 0 and 0.2 where no task's intensity falls
    # below either: both keep one model, one run)
    why = ("models that each predict one class (runs too short or too small to tell the methods apart), or settings "
           "that change nothing on these data (compare their runs' metrics.json)")
    if len(groups) == 1:
        if np.allclose(mean.drop(columns=[c for c in mean.columns if c == "STD"]).to_numpy(float), 100.0, equal_nan=True):
            why = "every test image right in every run: test sets too easy or too small to tell the methods apart"
        return (f"all {len(mean.index)} methods scored the same in every column: {why}; their ranking and their "
                "differences from the paper mean nothing")
    ties = [g for g in groups if len(g) > 1]
    if not ties:
        return None
    return ("scored exactly the same in every column: " + "; ".join(", ".join(str(m) for m in g) for g in ties)
            + f". The same predictions: {why}; their differences mean nothing here")


def _cells(tab: pd.DataFrame, bold: str) -> pd.DataFrame:
    mean, std = tab["mean"], tab["std"]
    best = mean.max(axis=0)
    if "STD" in mean.columns:  # the spread over domains: the lowest is the best
        best["STD"] = mean["STD"].min()
    cells = mean.copy().astype(object)
    for col in mean.columns:
        for m in mean.index:
            txt = mean_pm(mean.loc[m, col], std.loc[m, col], ".1f")
            if not pd.isna(mean.loc[m, col]) and np.isclose(mean.loc[m, col], best[col]):
                txt = bold.format(txt)
            cells.loc[m, col] = txt
    return cells


def to_markdown(tab: pd.DataFrame, title: str) -> str:
    cells = _cells(tab, "**{}**")
    cols = list(cells.columns)
    lines = [f"### {title}", "", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, row in cells.iterrows():
        lines.append(f"| {m} | " + " | ".join(str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def latex_text(text: str) -> str:
    """A name (a method key, a domain, an experiment) as LaTeX text: its special characters escaped."""
    special = {"\\": "\\textbackslash{}", "&": "\\&", "%": "\\%", "$": "\\$", "#": "\\#", "_": "\\_", "{": "\\{",
               "}": "\\}", "~": "\\textasciitilde{}", "^": "\\textasciicircum{}"}
    return "".join(special.get(ch, ch) for ch in str(text))


def to_latex(tab: pd.DataFrame, caption: str) -> str:
    """``caption`` is LaTeX already (its names escaped by the caller, :func:`latex_text`); method and column names
    are escaped here."""
    cells = _cells(tab, "\\textbf{{{}}}").map(lambda s: s.replace("±", "$\\pm$"))
    cols = [latex_text(c) for c in cells.columns]
    lines = [
        "\\begin{table}[t]", "\\centering", f"\\caption{{{caption}}}", "\\begin{tabular}{l" + "c" * len(cols) + "}",
        "\\toprule", "Method & " + " & ".join(cols) + " \\\\", "\\midrule",
    ]
    for m, row in cells.iterrows():
        lines.append(f"{latex_text(m)} & " + " & ".join(row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    return "\n".join(lines) + "\n"


def communication_table(df: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """MiB uploaded per client per federated round, its ratio to the backbone, and the saving against FedAvg."""
    cols = ["up_per_client_round", "model_param_bytes"] + [c for c in ("up_per_round", "train_s_per_round", "train_flops_per_round") if c in df]
    g = df.groupby("method")[cols].mean().reindex(methods)
    out = pd.DataFrame(index=g.index)
    out["upload_MiB"] = g["up_per_client_round"] / 2**20
    if "up_per_round" in g:
        out["upload_round_bytes"] = g["up_per_round"]
    out["backbone_MiB"] = g["model_param_bytes"] / 2**20
    out["ratio"] = g["up_per_client_round"] / g["model_param_bytes"]
    if "train_s_per_round" in g and g["train_s_per_round"].notna().any():
        out["train_s_per_round"] = g["train_s_per_round"]
    if "train_flops_per_round" in g and g["train_flops_per_round"].notna().any():
        out["train_GFLOPs_per_round"] = g["train_flops_per_round"] / 1e9
    if "fedavg" in out.index and out.loc["fedavg", "upload_MiB"] > 0:
        out["saving_vs_fedavg"] = 1.0 - out["upload_MiB"] / out.loc["fedavg", "upload_MiB"]
    return out


def communication_markdown(tab: pd.DataFrame, title: str) -> str:
    has_saving = "saving_vs_fedavg" in tab.columns
    has_time = "train_s_per_round" in tab.columns
    has_flops = "train_GFLOPs_per_round" in tab.columns
    head = "| method | uploaded MiB per client per federated round (mean over rounds that upload) | backbone MiB | ratio |"
    head += " saving vs FedAvg |" if has_saving else ""
    head += " training s per round (all clients, this machine) |" if has_time else ""
    head += " training GFLOPs per round (all clients) |" if has_flops else ""
    caption = (
        "Uploads only, per participating client: the bytes all clients uploaded in a round divided by the clients "
        "that took part in that round (the sampled ones), averaged over the rounds that upload (rounds that send "
        "nothing, such as a two-phase method's local phase or Single's, are left out) and over seeds; ratio = that "
        "upload / the backbone's parameter bytes."
        + (" Training seconds: mean over the rounds timed without the FLOP counter." if has_time else "")
    )
    lines = [f"### {title}", "", caption, "", head, "|---|---|---|---|" + "---|" * (has_saving + has_time + has_flops)]
    for m, r in tab.iterrows():
        cells = [f"{r['upload_MiB']:.3f}", f"{r['backbone_MiB']:.3f}", f"{r['ratio']:.2f}"]
        if has_saving:
            cells.append(f"{r['saving_vs_fedavg'] * 100:.1f} %")
        if has_time:
            cells.append(f"{r['train_s_per_round']:.2f}")
        if has_flops:
            cells.append("" if pd.isna(r["train_GFLOPs_per_round"]) else f"{r['train_GFLOPs_per_round']:.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bar_figure(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(labels) > 5  # method names side by side overlap: wider, and slanted
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 4))
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    if many:
        ax.tick_params(axis="x", labelrotation=40)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def line_figure(path: Path, series: list[tuple[str, list[float], list[float]]], ylabel: str, title: str,
                 marks: tuple[float, ...] = (), xlabel: str = "round", xticks: list[str] | None = None,
                 connect: bool = True) -> str:
    """One PNG with a line per (label, x, y) and a dotted vertical line at each of ``marks`` (a stream's task
    boundaries). Rounds are whole numbers on the axis; ``xticks`` names the positions 0, 1, ... instead (a group's
    experiments; ``connect`` False: points only, for positions that are no scale). Past ten lines the colours come from a 20-colour map (the default repeats after ten); past three the
    legend stands beside the axes, not over the lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    many = len(series) > 10
    beside = len(series) > 3
    fig, ax = plt.subplots(figsize=(8.5 if beside else 6, 4))
    colours = plt.get_cmap("tab20").colors if many else [None] * len(series)
    for (label, x, y), colour in zip(series, colours):
        ax.plot(x, y, label=label, color=colour, marker="o" if xticks else None, linestyle="-" if connect else "none")
    for x in marks:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    if xticks:
        slant = sum(map(len, xticks)) > 60  # long names side by side overlap
        ax.set_xticks(range(len(xticks)), xticks, rotation=30 if slant else 0, ha="right" if slant else "center")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if beside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path.name


def domain_avg(entry: dict, domain_of: dict[str, str]) -> float:
    """A round's Avg as the accuracy tables form it: the mean over domains of the mean over each domain's clients
    (the mean over clients where every client is its own domain or all share one)."""
    by: dict[str, list[float]] = {}
    for client, v in entry["eval"].items():
        by.setdefault(domain_of.get(client, client), []).append(v["acc"])
    return float(np.mean([np.mean(v) for v in by.values()]))


def seed_curve(histories: dict, method: str, seeds: list[int], value: Callable[[dict], float]) -> tuple[list[int], list[float]]:
    """A method's curve over its seeds: per round that every seed evaluated (``eval``), the mean of ``value`` over the
    seeds' entries of that round. Rounds are matched by number: a deployed run whose evaluation went on without a
    site (``eval_partial``) has no such entry, and its round is left out of the curve, not paired with another."""
    by_seed = [{e["round"]: e for e in histories[(method, s)] if "eval" in e} for s in seeds]
    rounds = sorted(set.intersection(*(set(b) for b in by_seed)))
    return rounds, [float(np.mean([value(b[r]) for b in by_seed])) for r in rounds]


def _plots(out: Path, experiment: str, methods: list[str], seeds: list[int], histories: dict,
           domain_of: dict[str, str] | None = None) -> list[str]:
    def evals(m: str, s: int) -> list[dict]:
        return [e for e in histories[(m, s)] if "eval" in e]

    made = []
    series = []
    for m in methods:
        series.append((m, *seed_curve(histories, m, seeds, lambda e: domain_avg(e, domain_of or {}) * 100)))
    clients = list(evals(methods[0], seeds[0])[0]["eval"])
    domains = {(domain_of or {}).get(c, c) for c in clients}
    # F²DC's Fig. 5 (convergence of the average accuracy): its last point is the accuracy table's Avg; on one
    # dataset split among clients (label skew) that is the mean over the clients
    what = "Avg test accuracy over domains (%)" if len(domains) > 1 else "mean test accuracy over clients (%)"
    made.append(line_figure(out / f"{experiment}_curves.png", series, what, experiment))

    for m in methods if len(domains) > 1 else []:  # one domain: its line would be the curve above
        h0 = evals(m, seeds[0])
        groups: dict[str, list[str]] = {}  # a line per domain: the mean over its clients, as the tables form it
        for client in h0[0]["eval"]:
            groups.setdefault((domain_of or {}).get(client, client), []).append(client)
        series = [(dom, *seed_curve(histories, m, seeds, lambda e, cs=cs: float(np.mean([e["eval"][c]["acc"] for c in cs])) * 100))
                  for dom, cs in groups.items()]
        made.append(line_figure(out / f"{experiment}_{m}_domains.png", series, "test accuracy per domain (%)", f"{experiment}: {m}"))

    series = []
    for m in methods:
        h = histories[(m, seeds[0])]
        series.append((m, [e["round"] for e in h], [(e["bytes_up_total"] + e["bytes_down_total"]) / 2**20 for e in h]))
    made.append(line_figure(out / f"{experiment}_bytes.png", series, "MiB sent per round (up + down)", f"{experiment}: bytes per round, every client"))
    return made


CXR4_PAIRS = (("CheXpert", "RSNA"), ("OpenI", "VinBigData"))


def published_entry(root: Path, ref: str) -> tuple[dict[str, Any], str, str]:
    """``<file>#<table>`` -> (the published-numbers YAML, its path, the table key)."""
    import yaml

    path, _, key = ref.partition("#")
    f = Path(root) / path
    if not f.exists():
        raise ReportError(f"published: {f} not found")
    return yaml.safe_load(f.read_text()), path, key


def load_published_entries(root: Path, ref: str) -> dict[str, dict[str, Any] | None]:
    """``<file>#<table>``, the file read once -> its entries under that key: ``accuracy`` (domains, methods: {name:
    {mean, std}}), ``efficiency`` (per method, the paper's per-round costs) and ``time_to_accuracy`` (FedeCouple
    Table VII: the target and, per method, minutes, rounds and MB to reach it); None where the file has none. A key
    with neither an accuracy table nor a time_to_accuracy entry (a setting the paper times but prints no accuracy
    table for) is an error."""
    doc, path, key = published_entry(root, ref)
    out = {section: (doc.get(section) or {}).get(key) for section in ("accuracy", "efficiency", "time_to_accuracy")}
    if out["accuracy"] is None and out["time_to_accuracy"] is None:
        raise ReportError(f"published: {path} has no accuracy table {key!r} (has: {', '.join(doc.get('accuracy', {}))})")
    return out


def load_published(root: Path, ref: str) -> dict[str, Any] | None:
    """``<file>#<table>`` -> its accuracy table (see :func:`load_published_entries`)."""
    return load_published_entries(root, ref)["accuracy"]


# The paper's MB in FedeCouple's Table VII: 1,000 KB of 1,024 bytes (its 415.6 KB extractor is 106,400 float32
# parameters = 425,600 bytes; pipelines/fedecouple/published.yaml)
PAPER_MB_BYTES = 1000 * 1024


def time_to_accuracy_versus(ours: pd.DataFrame, paper: dict[str, Any]) -> pd.DataFrame:
    """Ours (:func:`time_to_accuracy`) beside the paper's Table VII, for the methods the paper lists: rounds, MB per
    client up + down (in the paper's MB) and training minutes. Minutes compare hardware as much as methods (the paper
    used one 2080 Ti): read them as ratios between methods."""
    rows = []
    for m, p in paper["methods"].items():
        r = ours.loc[m] if m in ours.index else None
        rows.append({
            "method": m,
            "reached": r["reached"] if r is not None else "not run",
            "rounds_ours": r["round"] if r is not None else np.nan,
            "rounds_paper": float(p["rounds"]),
            "MB_ours": r["MiB_per_client"] * 2**20 / PAPER_MB_BYTES if r is not None else np.nan,
            "MB_paper": float(p["comm_MB"]),
            "minutes_ours": r["train_s"] / 60 if r is not None else np.nan,
            "minutes_paper": float(p["minutes"]),
        })
    return pd.DataFrame(rows).set_index("method")


def time_to_accuracy_versus_markdown(tab: pd.DataFrame, title: str) -> str:
    lines = [f"### {title}", "",
             "Each cell: ours / paper. MB per client, up + down, in the paper's unit (1 MB = 1,000 KB of 1,024 bytes); "
             "minutes of training (ours on this run's device, the paper's on one RTX 2080 Ti: compare ratios between "
             "methods). — : the target was not reached (or the method was not run).", "",
             "| method | seeds that reach it | rounds | MB per client | training minutes |", "|---|---|---|---|---|"]

    def cell(a: float, b: float, f: str) -> str:
        return f"{'—' if pd.isna(a) else format(a, f)} / {format(b, f)}"

    for m, r in tab.iterrows():
        lines.append(f"| {m} | {r['reached']} | {cell(r['rounds_ours'], r['rounds_paper'], '.1f')} | "
                     f"{cell(r['MB_ours'], r['MB_paper'], '.1f')} | {cell(r['minutes_ours'], r['minutes_paper'], '.1f')} |")
    return "\n".join(lines) + "\n"


def efficiency_markdown(comm: pd.DataFrame, paper: dict[str, Any], title: str) -> str:
    """Ours (measured here) beside the paper's per-round costs, for the methods the paper lists. The paper's comm.
    reads as the upload of all of a round's clients together (F²DC's Table 4: ResNet-10 from 10 PACS clients), so
    ours is given that way too, beside the upload per client; the paper does not define its FLOPs or time (per client
    or per round of all clients, which input size), so the columns are shown side by side, not subtracted: compare
    ratios between methods, not absolute values."""
    lines = [f"### {title}", "",
             "Ours: measured in these runs (upload: tensor bytes, per client and for all of a round's clients together, "
             "in MiB and MB of 10^6 bytes; training seconds: the median round, this machine). The paper's columns as "
             "printed (its Table 4): its comm. matches the upload of all of a round's clients; it does not define its "
             "FLOPs or time, so nothing is subtracted: compare ratios between methods. A method of the paper's table "
             "that this report does not hold: \"not in this report\".", "",
             "| method | ours: upload per client (MiB) | ours: upload per round, all clients | ours: GFLOPs per round "
             "| ours: training s per round | paper: upload (params) | paper: comm. | paper: FLOPs | paper: training time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, p in paper.items():
        r = comm.loc[m] if m in comm.index else None

        def ours(col: str, fmt: str, r: Any = r) -> str:
            if r is None:
                return "not in this report"
            return fmt.format(r[col]) if col in r and not pd.isna(r[col]) else "–"

        total = "not in this report" if r is None else (
            f"{r['upload_round_bytes'] / 2**20:.1f} MiB ({r['upload_round_bytes'] / 1e6:.1f} MB)"
            if "upload_round_bytes" in r and not pd.isna(r["upload_round_bytes"]) else "–")
        lines.append(f"| {m} | {ours('upload_MiB', '{:.3f}')} | {total} | {ours('train_GFLOPs_per_round', '{:.2f}')} | "
                     f"{ours('train_s_per_round', '{:.2f}')} | {p.get('upload_params', '')} | {p.get('comm_MB', '')} MB | "
                     f"{p.get('flops', '')} | {p.get('train_s', '')} s |")
    return "\n".join(lines) + "\n"


NOT_DOMAINS = RESERVED_DOMAINS  # the accuracy tables' other columns (config refuses them as domain names)


def versus_paper(acc: pd.DataFrame, published: dict[str, Any], avg: bool = True) -> pd.DataFrame:
    """Ours beside the paper's, per method and domain (+ Avg, + STD where ours has it and the paper gives
    ``std_over_domains``): columns (<domain>, ours|paper|diff). ``avg=False`` for a table whose columns are metrics,
    not domains (CD2-pFed's local / new / external test)."""
    ours = acc["mean"]
    domains = list(published["domains"]) + (["Avg"] if avg else [])
    missing = [d for d in published["domains"] if d not in ours.columns]
    if missing:
        raise ReportError(f"published table domains {missing} are not domains of this experiment ({list(ours.columns)})")
    extra = [c for c in ours.columns if c not in published["domains"] and c not in NOT_DOMAINS]
    if avg and extra:  # our Avg is over every domain of ours, the paper's over its own
        log.warning("the paper's table has no column for %s: its Avg and ours average different domains", ", ".join(map(str, extra)))
    cols = {}
    rows = list(ours.index)  # every method of ours: one the paper has no row for (an ablation whose row did not
    # survive its text) prints "ours / –"

    def paper_value(m: str, i: int) -> float:
        if not (published["methods"].get(m) or {}).get("mean"):
            return float("nan")
        vals = published["methods"][m]["mean"]
        if len(vals) == 1:  # an Avg-only row (a sensitivity table that prints the mean over domains alone)
            return float(vals[0]) if i == len(domains) - 1 else float("nan")
        if len(vals) != len(domains):
            raise ReportError(f"published: methods.{m}.mean has {len(vals)} values for {len(domains)} columns ({domains})")
        return float(vals[i])

    for i, d in enumerate(domains):
        paper = pd.Series({m: paper_value(m, i) for m in rows}, dtype=float)
        cols[(d, "ours")] = ours.loc[rows, d]
        cols[(d, "paper")] = paper
        cols[(d, "diff")] = ours.loc[rows, d] - paper
    if avg and "STD" in ours.columns and has_domain_std(published):
        paper = pd.Series({m: float((published["methods"].get(m) or {}).get("std_over_domains", np.nan)) for m in rows}, dtype=float)
        cols[("STD", "ours")], cols[("STD", "paper")] = ours.loc[rows, "STD"], paper
        cols[("STD", "diff")] = ours.loc[rows, "STD"] - paper
    return pd.DataFrame(cols)


def has_domain_std(published: dict[str, Any] | None) -> bool:
    """Whether a published accuracy table prints a STD over domains (``std_over_domains`` on a row)."""
    return any("std_over_domains" in (row or {}) for row in ((published or {}).get("methods") or {}).values())


def versus_markdown(tab: pd.DataFrame, title: str) -> str:
    domains = list(dict.fromkeys(c[0] for c in tab.columns))
    lines = [f"### {title}", "", "Each cell: ours / paper (ours - paper), accuracy %.", "",
             "| method | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    for m, r in tab.iterrows():
        lines.append(f"| {m} | " + " | ".join(
            f"{r[(d, 'ours')]:.1f} / {r[(d, 'paper')]:.1f} ({r[(d, 'diff')]:+.1f})" if not pd.isna(r[(d, "paper")]) else f"{r[(d, 'ours')]:.1f} / –"
            for d in domains) + " |")
    return "\n".join(lines) + "\n"


SELECTION = {
    "final": "the final round's test accuracy",
    "best_validation": "the test accuracy at the round of best mean validation accuracy",
    "best_validation_per_client": "each client's test accuracy at the round of its own best validation accuracy",
    "task_end": "under each task, the mean accuracy over the tasks seen so far at that task's end (Avg: their mean)",
}


def paper_selection(paper: dict[str, Any] | None, method: str | None = None) -> str | None:
    """The published rule (``final`` / ``best_validation``) of a table's row: the method's own ``selection`` where
    the file records one (a paper whose rows come from different scripts), else the table's, else None."""
    row = (((paper or {}).get("methods") or {}).get(method) or {}) if method else {}
    return row.get("selection") or (paper or {}).get("selection")


def selection_note(paper: dict[str, Any] | None, ours: str | dict[str, str] = "final", rows: list[str] | None = None) -> str:
    """Which round each side's number comes from: ours (``final``, or ``best_validation`` when the runs scored a
    validation set and the paper's row was selected that way; a dict gives it per method); the paper's is the
    published ``selection`` (``final`` or ``best_validation``) of the row or its table, where the file records it.
    When the rules differ between rows, the note says them per method (``rows``: the methods compared; default the
    published table's)."""
    def theirs(m: str | None = None) -> str:
        return SELECTION.get(paper_selection(paper, m) or "", "not recorded in the published file")

    if isinstance(ours, dict) and len(set(ours.values())) <= 1:  # one rule for every row: one sentence
        ours = next(iter(ours.values()), "final")
    published_rows = (paper or {}).get("methods") or {}
    rows = list(published_rows) if rows is None else rows
    if isinstance(ours, str) and not any("selection" in (published_rows.get(m) or {}) for m in rows):
        return f"Ours: {SELECTION[ours]}. Paper: {theirs()}."
    ours_of = ours if isinstance(ours, dict) else dict.fromkeys(rows, ours)
    groups: dict[tuple[str, str], list[str]] = {}
    for m in rows:
        groups.setdefault((SELECTION[ours_of.get(m, "final")], theirs(m)), []).append(m)
    return "Which round each number comes from: " + "; ".join(
        f"{', '.join(ms)}: ours {o}, paper {p}" for (o, p), ms in groups.items()) + "."


def own_best_validation_acc(history: list[dict], client: str) -> float:
    """The client's test accuracy at the evaluated round where ITS validation accuracy was highest (the first such
    round on ties): each site's own model selection, as the authors' single-site scripts (``single_office.py``,
    ``single_domainnet.py``) choose the best epoch per site; NaN when the client scored no validation set. A
    deployment's evaluation that went on without other sites (``eval_partial``: min-eval-sites) counts for the sites
    that scored it."""
    ev = [v for e in history if "val_acc" in (v := (e.get("eval") or e.get("eval_partial") or {}).get(client, {}))]
    return float(max(ev, key=lambda v: v["val_acc"])["acc"]) if ev else float("nan")


def best_validation_round(history: list[dict]) -> dict | None:
    """Model selection by validation (FedBN's protocol): the evaluated round with the highest mean validation
    accuracy over clients (the first such round on ties), or None when the run scored no validation set (its split
    has no ``n_val``). :func:`collect` keeps every client's test accuracy at that round (``acc_best_val``)."""
    ev = [e for e in history if "eval" in e]
    if not ev or any("mean_val_acc" not in e for e in ev):
        return None
    return max(ev, key=lambda e: e["mean_val_acc"])  # max keeps the first of equal values


def _write_flat_csv(tab: pd.DataFrame, path: Path, seeds: pd.Series) -> None:
    """A (mean | std, column) table as a CSV with one ``<column>_<mean|std>`` column each, a row per method, and
    ``seeds``, the runs each row's mean and std are over (a CSV has no caption to say it)."""
    flat = tab.copy()
    flat.columns = [f"{col}_{stat}" for stat, col in flat.columns]
    flat.insert(0, "seeds", seeds.reindex(flat.index).fillna(0).astype(int))
    flat.index.name = "method"
    flat.to_csv(path, float_format="%.4f")


def _resolved_entry(method_entries: dict[str, Any], m: str) -> Any:
    """``methods.<m>`` as its method's typed params take it (the keys it does not set at their defaults)."""
    from fedsilo.methods.registry import entry_values, method_base, method_class

    return method_class(method_base(m, method_entries[m])).params_cls.model_validate(entry_values(method_entries[m]))


def settings_differ(paper: dict[str, Any] | None, method_entries: dict[str, Any] | None, methods: list[str]) -> list[str]:
    """Where a paper's row states the setting it was run with (``params`` in ``published.yaml``: F²DC's σ, τ, ... ),
    the methods of ours whose entry (``methods.<key>``, its unset values at their defaults) differs from it, one line
    each: a difference on such a row is not the paper's comparison."""
    if not paper or not method_entries:
        return []
    from fedsilo.tracking import flatten

    lines = []
    for m in methods:
        want = ((paper.get("methods") or {}).get(m) or {}).get("params")
        if not want or m not in method_entries:
            continue
        ours = flatten(_resolved_entry(method_entries, m).model_dump(mode="json"))
        diff = [f"{k} {ours.get(k, 'unset')} (the paper's row: {v})" for k, v in flatten(want).items() if ours.get(k) != v]
        if diff:
            lines.append(f"{m} ran with " + ", ".join(diff))
    return lines


def variant_drift(method_entries: dict[str, Any] | None, methods: list[str]) -> list[str]:
    """Where a table holds a method's entry (``cd2pfed``) and named variants of it (``cd2pfed_li: {method: cd2pfed,
    ...}``), the keys on which a variant differs from that entry without setting them itself: it takes the registered
    defaults where the entry was tuned (``p: 0.25`` on ``cd2pfed`` leaves its ablations at 0.5), so the rows differ in
    more than the variant's own switches. One line per variant, empty when they differ only there."""
    if not method_entries:
        return []
    from fedsilo.methods.registry import entry_values
    from fedsilo.tracking import flatten

    def resolved(m: str) -> tuple[dict[str, Any], set[str]]:
        typed = _resolved_entry(method_entries, m)
        return flatten(typed.model_dump(mode="json")), typed.unused_keys()

    lines = []
    for v in methods:
        entry = method_entries.get(v) or {}
        base = entry.get("method")
        if not base or base == v or base not in methods or base not in method_entries:
            continue
        # the keys the variant sets (a mapping it sets, such as decouple, whole) and those idle on either side
        (ref, idle_ref), (mine, idle_mine) = resolved(base), resolved(v)
        own = set(entry_values(entry)) | idle_ref | idle_mine
        drift = [f"{k} {mine.get(k)!r} ({base}: {ref.get(k)!r})" for k in sorted(set(ref) | set(mine))
                 if k.split(".")[0] not in own and mine.get(k) != ref.get(k)]
        if drift:
            lines.append(f"{v} takes {', '.join(drift)}")
    return lines


def runs_backbones(results: Path, methods: list[str], seeds: list[int]) -> set[str]:
    """The backbones the runs trained (``model`` and, where not 1, ``x<model_width>``), from what each run's
    metrics.json records of its params (``run``; runs before 2026-12-06 have none and are not counted)."""
    out = set()
    for m in methods:
        for s in seeds:
            train = (read_json(Path(results) / m / f"seed{s}" / "metrics.json").get("run") or {}).get("train") or {}
            if train.get("model"):
                width = train.get("model_width", 1.0)
                out.add(train["model"] + (f" x{width:g}" if width != 1.0 else ""))
    return out


def backbone_note(paper: dict[str, Any] | None, ours: set[str]) -> str:
    """A line for the vs-paper table when our runs trained another backbone than the published table's
    (``backbone``): a quickstart's small model beside the paper's ResNet; empty when they match or either is unknown."""
    theirs = (paper or {}).get("backbone")
    if not theirs or not ours or ours == {theirs}:
        return ""
    return (f"**Not the paper's backbone**: ours {', '.join(sorted(ours))}, the paper's {theirs}: these rows show the "
            "pipeline at work on this scale's data, not whether the paper's numbers reproduce (its paper-scale params "
            "train the paper's backbone).")


def paper_scale_note(params: Any, experiment: str, repo: Path) -> str:
    """A line for the vs-paper table of a paper's smaller scale (its quickstart): where ``experiment``'s settings here
    differ from the same experiment's in the paper-scale params (``pipelines/<paper>/paper/params.yaml``: the paper's
    stated settings, and FedBN's or the authors' code's where it is silent): image size, rounds, local epochs, batch,
    seeds, and whether the images come from offline mirrors (said at the paper's scale too, the root's default
    sources being mirrors). Empty outside a paper's pipeline, and where nothing differs."""
    import yaml

    from fedsilo.config import TrainParams

    meta = params.paper
    if meta is None:
        return ""
    ours_exp = params.experiments[experiment]
    data = params.datasets.get(ours_exp.dataset)
    mirrors = [s for s in getattr(data, "source_list", ()) if s in params.sources and params.sources[s].mode == "mirror"]
    mirror_part = f"our images from offline mirrors ({', '.join(mirrors)}), generated, not the real data" if mirrors else ""
    preset = Path(repo) / "pipelines" / meta.name / "paper" / "params.yaml"
    raw = (yaml.safe_load(preset.read_text()) or {}) if meta.scale != "paper" and preset.is_file() else {}
    theirs_exp = (raw.get("experiments") or {}).get(experiment)
    if not theirs_exp:  # the paper scale itself (its settings are the paper's), or no such experiment there
        return f"**Not the paper's data** ({meta.scale}): {mirror_part}." if mirror_part else ""
    theirs_train = TrainParams.model_validate(theirs_exp.get("train") or {})

    def px(dataset: str) -> Any:
        d = params.datasets.get(dataset)
        return getattr(d, "image_size", None)

    ours = {"image size": px(ours_exp.dataset), "rounds": ours_exp.train.rounds, "local epochs": ours_exp.train.local_epochs,
            "batch size": ours_exp.train.batch_size, "seeds": len(params.pipeline.seeds)}
    theirs = {"image size": px(theirs_exp.get("dataset", "")), "rounds": theirs_train.rounds,
              "local epochs": theirs_train.local_epochs, "batch size": theirs_train.batch_size,
              "seeds": len(raw.get("seeds") or (raw.get("pipeline") or {}).get("seeds") or ())}
    differ = [k for k in ours if theirs[k] is not None and ours[k] is not None and theirs[k] and ours[k] != theirs[k]]
    if not differ and not mirrors:
        return ""

    def show(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {d[k]}{' px' if k == 'image size' else ''}" for k in differ)

    parts = [f"ours {show(ours)}" if differ else "", f"the paper scale's ({preset.relative_to(Path(repo)).as_posix()}) {show(theirs)}" if differ else "",
             mirror_part]
    return (f"**Not the paper's scale** ({meta.scale}): " + "; ".join(x for x in parts if x)
            + ". These rows show the pipeline at work, not whether the paper's numbers reproduce.")


def write_versus(out: Path, exp: str, vs: pd.DataFrame, published: str, paper: dict[str, Any] | None = None,
                 ours: str = "final", settings: list[str] | None = None, backbones: set[str] | None = None,
                 scale: str = "") -> str:
    """``<exp>_vs_paper.md`` and ``.csv`` from a :func:`versus_paper` table (its columns flattened to
    ``<column>_<ours|paper|diff>`` in place, for the CSV); returns the markdown. ``paper``: the published table, whose
    ``selection`` says which round its numbers come from; ``ours``: which round ours come from (both stated under
    the title); ``settings``: our rows whose setting differs from the paper's row (:func:`settings_differ`), said
    under the title; ``backbones``: what our runs trained (:func:`runs_backbones`), said when not the paper's;
    ``scale``: :func:`paper_scale_note`'s line, said first."""
    md = versus_markdown(vs, f"{exp}: ours vs {published}")
    source = f"The paper's numbers: {paper['source']}. " if (paper or {}).get("source") else ""  # its data, clients, model
    md = md.replace("\n\nEach cell:", f"\n\n{source}{selection_note(paper, ours, list(vs.index))} Each cell:", 1)
    note = " ".join(x for x in (scale, backbone_note(paper, backbones or set())) if x)
    if note:
        md = md.replace("\n\n|", f"\n\n{note}\n\n|", 1)
    if settings:
        for line in settings:
            log.warning("%s: %s: not the paper's setting for that row", exp, line)
        md = md.replace("\n\n|", "\n\n**Not the paper's setting**: " + "; ".join(settings) + " (the difference on those rows "
                        "is not the paper's comparison).\n\n|", 1)
    (out / f"{exp}_vs_paper.md").write_text(md)
    vs.columns = [f"{d}_{k}" for d, k in vs.columns]
    vs.index.name = "method"
    vs.to_csv(out / f"{exp}_vs_paper.csv", float_format="%.4f")
    return md


def _fig3(path: Path, acc: pd.DataFrame, published: dict[str, Any] | None, title: str) -> str:
    """pFedDB Fig. 3: mean accuracy on CheXpert+RSNA (x) against OpenI+VinBigData (y), a point per method, dashed
    lines at Single's values; the paper's points hollow when its table is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (a1, a2), (b1, b2) = CXR4_PAIRS
    mean = acc["mean"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for i, m in enumerate(mean.index):
        x, y = (mean.loc[m, a1] + mean.loc[m, a2]) / 2, (mean.loc[m, b1] + mean.loc[m, b2]) / 2
        ax.scatter([x], [y], color=f"C{i % 10}", label=m)
        ax.annotate(m, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if published and m in published["methods"]:
            p = dict(zip(published["domains"], published["methods"][m]["mean"]))
            ax.scatter([(p[a1] + p[a2]) / 2], [(p[b1] + p[b2]) / 2], facecolors="none", edgecolors=f"C{i % 10}")
    if "single" in mean.index:
        ax.axvline((mean.loc["single", a1] + mean.loc["single", a2]) / 2, ls="--", color="grey", lw=1)
        ax.axhline((mean.loc["single", b1] + mean.loc["single", b2]) / 2, ls="--", color="grey", lw=1)
    ax.set_xlabel(f"mean accuracy on {a1} + {a2} (%)")
    ax.set_ylabel(f"mean accuracy on {b1} + {b2} (%)")
    ax.set_title(title + ("  (hollow: paper)" if published else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def experiment_groups(runs: dict[str, Any], experiment: str, every: Sequence[str]) -> dict[str, Any]:
    """The run groups of a paper (``runs``) whose table of ``experiment`` is not its whole report (``every``: the
    experiment's methods): the groups that train some of its methods, when they and the methods they set beside are
    fewer than all of them. A report stage writes each one's table in ``groups/<g>/``."""
    return {g: grp for g, grp in runs.items()
            if experiment in grp.experiments and grp.methods and set((*grp.methods, *grp.beside)) != set(every)}


def groups_index(groups: dict[str, Any]) -> str:
    """The section of an experiment's report README that lists its run groups' tables (:func:`experiment_groups`)."""
    return ("## Run groups\n\nEach group's own table of this experiment (`runs.<group>` of the params file: its methods "
            "and the ones it sets beside them):\n\n"
            + "".join(f"- [{g}](groups/{g}/README.md): {', '.join((*grp.methods, *grp.beside))}\n" for g, grp in groups.items()))


@contextlib.contextmanager
def written(out_dir: Path, in_place: bool = False) -> Iterator[Path]:
    """The folder a report writes into: ``out_dir`` itself when ``in_place`` (created; the caller's own atomic folder),
    else a temporary one that replaces it whole on success (:func:`atomic_dir`)."""
    if in_place:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        yield Path(out_dir)
        return
    with atomic_dir(out_dir) as tmp:
        yield tmp


def build_report(
    results: Path,
    experiment: str,
    methods: list[str],
    seeds: list[int],
    out_dir: Path,
    published: str | None = None,
    method_entries: dict[str, Any] | None = None,
    repo: Path = Path("."),
    target_accuracy: float | None = None,
    in_place: bool = False,
    scale: str = "",
) -> dict[str, Any]:
    """Tables and figures for one experiment from its results folder (``results/<experiment>`` or a paper's
    ``results/<paper>/<scale>/<experiment>``). ``published``: '<file>#<table>' of a paper's numbers (a path from the
    repository root ``repo``); ``method_entries``: the params' ``methods`` (to find the two-phase FedAvg of Fig. 5).
    ``in_place``: write into ``out_dir`` as it is (a folder the caller itself writes atomically), not through a
    temporary folder of its own."""
    results = Path(results)
    index = [f"# fedsilo report: {experiment}", ""]
    made: dict[str, Any] = {}
    with written(out_dir, in_place) as tmp:
        for exp in [experiment]:
            per_row, histories = collect_clients(results, methods, seeds)
            df = by_domain(per_row)
            entries = load_published_entries(repo, published) if published else {}
            # the paper's tables print a STD over domains: ours gets the column too
            domain_std = has_domain_std(entries.get("accuracy"))
            acc = summary_table(df, "acc", methods, domain_std)
            seeds_per_method = df.groupby("method")["seed"].nunique()  # the runs behind each row (the CSVs' seeds column)
            md = to_markdown(acc, f"{exp}: test accuracy (%), {over_seeds(seeds)}")
            per_client = per_client_accuracy(per_row)
            if not per_row.empty and per_row["client"].nunique() > per_row["domain"].nunique() > 1:
                md += ("\nAvg: the mean over the domain columns, each the mean over its clients; the training's "
                       "progress line and MLflow's `mean_acc` are the mean over clients, which weighs a domain by its "
                       "number of clients.\n")
            same = indistinct_rows(acc, per_client)
            if same:
                log.warning("%s: %s", exp, same)
                md += f"\n> **Note:** {same}\n"
            drift = variant_drift(method_entries, methods)
            if drift:
                for line in drift:
                    log.warning("%s: %s: a variant set apart from its method by more than its own keys", exp, line)
                md += ("\n> **Variants differ beyond their own keys** (a key the variant does not set takes the method's "
                       "default, not the entry's): " + "; ".join(drift) + ". Set the key in the variant too, or inherit "
                       "the entry with a YAML anchor (README, \"A paper's params file\").\n")
            if df["has_auc"].astype(bool).any():
                md += "\n" + to_markdown(summary_table(df, "auc", methods), f"{exp}: test AUC (%), {over_seeds(seeds)}")
                no_auc = one_class_clients(df)
                for m, s, c in no_auc:
                    log.warning("report %s: %s seed %d: client %s's test split holds one class; its AUC is n/a", exp, m, s, c)
                if no_auc:
                    md += ("\nAUC n/a: a test split with one class has no ROC AUC, and the Avg it would enter is n/a too: "
                           + "; ".join(f"{m} seed {s} client {c}" for m, s, c in no_auc) + ".\n")
            best_acc = None
            if df["best_val_round"].notna().all():  # every run scored a validation set
                best_acc = summary_table(df, "acc_best_val", methods, domain_std)
                picked = df.groupby(["method", "seed"], sort=False)["best_val_round"].first()
                bv_md = to_markdown(best_acc, f"{exp}: test accuracy (%) at the round of best mean validation accuracy, {over_seeds(seeds)}")
                bv_md += "\nRound picked per run: " + "; ".join(f"{m} seed {s}: {int(r)}" for (m, s), r in picked.items()) + ".\n"
                (tmp / f"{exp}_accuracy_best_val.md").write_text(bv_md)
                _write_flat_csv(best_acc, tmp / f"{exp}_accuracy_best_val.csv", seeds_per_method)
                md += "\n" + bv_md
            se = standard_errors(df, acc)
            if se is not None:
                se_md = standard_errors_markdown(se, f"{exp}: test-set sizes and binomial standard errors")
                (tmp / f"{exp}_standard_errors.md").write_text(se_md)
                se.index.name = "method"
                se.to_csv(tmp / f"{exp}_standard_errors.csv", float_format="%.4f")
                md += "\n" + se_md
            bytes_tab = df.groupby("method")["bytes_per_round"].mean().reindex(methods) / 2**20
            md += ("\n### Communication: what all clients send per round\n\nMiB sent per round by all clients together (up + "
                   "down), averaged over every round of the run (rounds that send nothing included) and over seeds. The "
                   "table after it counts uploads only, per client, over the rounds that upload.\n\n"
                   "| method | MiB per round, all clients, up + down (mean over all rounds) |\n|---|---|\n") + "".join(
                f"| {m} | {v:.2f} |\n" for m, v in bytes_tab.items()
            )
            comm = communication_table(df, methods)
            comm_md = communication_markdown(comm, f"{exp}: upload per client per federated round (measured payloads)")
            md += "\n" + comm_md
            (tmp / f"{exp}_communication.md").write_text(comm_md)
            comm.to_csv(tmp / f"{exp}_communication.csv", float_format="%.10g")
            (tmp / f"{exp}_accuracy.md").write_text(md)
            _write_flat_csv(acc, tmp / f"{exp}_accuracy.csv", seeds_per_method)
            (tmp / f"{exp}_accuracy.tex").write_text(to_latex(acc, f"{latex_text(exp)}: test accuracy (\\%), {over_seeds(seeds, latex=True)}"))
            figs = _plots(tmp, exp, methods, seeds, histories, client_domains(results, methods[0], seeds[0]))
            lne = local_new_external(results, methods, seeds)
            if lne is not None:
                lne_md = local_new_external_markdown(lne, f"{exp}: local, new and external test accuracy (%), {over_seeds(seeds)}",
                                                     per_client)
                (tmp / f"{exp}_local_new_external.md").write_text(lne_md)
                flat_lne = lne.copy()
                flat_lne.columns = [f"{col}_{stat}".replace(" ", "_") for stat, col in flat_lne.columns]
                flat_lne.index.name = "method"
                flat_lne.to_csv(tmp / f"{exp}_local_new_external.csv", float_format="%.4f")
                md += "\n" + lne_md
            paper_tta = entries.get("time_to_accuracy")
            if paper_tta is not None and paper_tta["target"] != target_accuracy:
                raise ReportError(f"experiments.{exp}.target_accuracy: {target_accuracy} but {published}'s time_to_accuracy "
                                  f"target is {paper_tta['target']}: set it to {paper_tta['target']} to set ours beside it")
            if target_accuracy is not None:
                tta = time_to_accuracy(histories, methods, seeds, target_accuracy)
                tta_md = time_to_accuracy_markdown(tta, f"{exp}: cost to reach {target_accuracy:g} % mean accuracy")
                (tmp / f"{exp}_time_to_accuracy.md").write_text(tta_md)
                tta.to_csv(tmp / f"{exp}_time_to_accuracy.csv", float_format="%.6g")
                md += "\n" + tta_md
                if paper_tta is not None:
                    tvs = time_to_accuracy_versus(tta, paper_tta)
                    tvs_md = time_to_accuracy_versus_markdown(tvs, f"{exp}: cost to reach {target_accuracy:g} %, ours vs {published}")
                    (tmp / f"{exp}_time_to_accuracy_vs_paper.md").write_text(tvs_md)
                    tvs.to_csv(tmp / f"{exp}_time_to_accuracy_vs_paper.csv", float_format="%.6g")
                    md += "\n" + tvs_md
            spectra = collect_spectra(results, methods, seeds)
            if spectra is None:
                md += "\n(No representation spectra: these runs predate `spectrum.json`; retrain them for the collapse table.)\n"
            else:
                collapse = collapse_table(spectra, methods, seeds)
                collapse_md = collapse_markdown(collapse, f"{exp}: dimensional collapse of the final representations (test images)")
                (tmp / f"{exp}_collapse.md").write_text(collapse_md)
                collapse.to_csv(tmp / f"{exp}_collapse.csv", float_format="%.6g")
                md += "\n" + collapse_md
                if all(m in methods for m in FIG1_METHODS):
                    first = next(iter(spectra[(FIG1_METHODS[0], seeds[0])]))
                    figs.append(_fig1(tmp / f"{exp}_fig1_spectrum.png", spectra, list(FIG1_METHODS), seeds, first,
                                      f"{exp}: singular values of the representation covariance"))
            figs.append(_bar_figure(tmp / f"{exp}_communication.png", methods, comm["upload_MiB"].fillna(0).tolist(),
                                    "MiB uploaded per client per federated round", f"{exp}: upload per client"))
            paper = entries.get("accuracy")
            if paper is not None:
                if set(paper["domains"]) <= set(METRIC_COLUMNS):  # the paper's columns are local / new / external test
                    if lne is None:
                        raise ReportError(f"published: {published} gives {paper['domains']} test accuracy; the runs scored no "
                                          f"ensemble (set experiments.{exp}.train.ensemble_test: true)")
                    vs = versus_paper(pd.concat({"mean": lne["mean"].rename(columns=METRIC_COLUMNS_INV)}, axis=1), paper, avg=False)
                    ours = "final"
                else:  # like for like: a row the paper selected by validation is set beside ours selected so
                    rules = {m: paper_selection(paper, m) for m in methods} if best_acc is not None else {}
                    ours_tab = acc.copy()
                    ours = dict.fromkeys(methods, "final")
                    for rule, metric in (("best_validation", "acc_best_val"), ("best_validation_per_client", "acc_best_own_val")):
                        picked = [m for m in methods if rules.get(m) == rule]
                        if picked:
                            ours_tab.loc[picked] = summary_table(df, metric, methods, domain_std).loc[picked]
                            ours.update(dict.fromkeys(picked, rule))
                    vs = versus_paper(ours_tab, paper)
                    ours = {m: ours[m] for m in vs.index}
                md += "\n" + write_versus(tmp, exp, vs, published, paper, ours,
                                           settings_differ(paper, method_entries, list(vs.index)),
                                           runs_backbones(results, methods, seeds), scale)
                made[exp + ":vs_paper"] = vs.to_dict(orient="index")
                paper_eff = entries.get("efficiency")
                if paper_eff and set(paper_eff) & set(comm.index):  # a table of "not run" rows says nothing
                    eff_md = efficiency_markdown(comm, paper_eff, f"{exp}: cost per round, ours beside the paper's")
                    (tmp / f"{exp}_efficiency_vs_paper.md").write_text(eff_md)
                    md += "\n" + eff_md
            if all(d in acc["mean"].columns for pair in CXR4_PAIRS for d in pair):
                figs.append(_fig3(tmp / f"{exp}_fig3_scatter.png", acc, paper, exp))
            onboard = sorted((results / "onboarding").glob("seed*/onboarding.json"))
            if onboard:
                runs = [read_json(f) for f in onboard]
                order = ("freeze_global", "finetune_all", "from_scratch")
                strategies = sorted(runs[0]["accuracy_per_round"], key=lambda k: order.index(k) if k in order else len(order))
                series = [
                    (s, list(range(1, runs[0]["rounds"] + 1)), list(np.mean([[a * 100 for a in r["accuracy_per_round"][s]] for r in runs], axis=0)))
                    for s in strategies
                ]
                figs.append(line_figure(tmp / f"{exp}_fig6_onboarding.png", series, f"{runs[0]['newcomer']} test accuracy (%)",
                                         f"{exp}: newcomer {runs[0]['newcomer']} joins"))
                lines = [f"### {exp}: onboarding of {runs[0]['newcomer']} (final accuracy %, mean over {len(runs)} seed(s))", "",
                         "| strategy | accuracy |", "|---|---|"]
                lines += [f"| {s} | {np.mean([r['final'][s] for r in runs]) * 100:.1f} |" for s in strategies]
                (tmp / f"{exp}_onboarding.md").write_text("\n".join(lines) + "\n")
                md += "\n" + "\n".join(lines) + "\n"
            two_phase = [m for m in methods if (method_entries or {}).get(m) and (method_entries[m] or {}).get("method", m) == "fedavg"
                         and (method_entries[m] or {}).get("local_rounds", 0) > 0]
            if two_phase and "single" in methods and "pfeddb" in methods:
                series = [(m, *seed_curve(histories, m, seeds, lambda e: e["mean_acc"] * 100)) for m in ("single", two_phase[0], "pfeddb")]
                figs.append(line_figure(tmp / f"{exp}_fig5_two_phase.png", series, "average test accuracy (%)",
                                         f"{exp}: Single, FedAvg (two-phase), pFedDB"))
            index += [md, ""] + [f"![{f}]({f})" for f in figs] + [""]
            made[exp] = {"table": acc["mean"]["Avg"].to_dict(), "figures": figs, "communication": comm.to_dict(orient="index")}
        (tmp / "README.md").write_text("\n".join(index) + "\n")
    return made
