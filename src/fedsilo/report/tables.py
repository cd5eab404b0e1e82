"""What the runs measured, as tables: results folders -> per-client and per-domain frames, the accuracy / AUC
summary (mean +- std over seeds), standard errors, communication, representation collapse, time to a target accuracy,
local / new / external test, and their markdown, CSV and LaTeX forms. No figure and no published number here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from fedsilo.utils.io import read_json

log = logging.getLogger("fedsilo.report")


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


def data_origin_note(results: Path, methods: list[str], seeds: list[int]) -> str:
    """A line for the top of a report whose runs trained on offline mirrors (their metrics.json's ``data_sources``,
    the data card's record of each source's fetch): generated images, so the numbers show the pipeline at work, not
    how the methods compare. Empty where every source is a real copy, or the runs predate the record."""
    mirrors: dict[str, str] = {}
    for m in methods:
        for s in seeds:
            path = Path(results) / m / f"seed{s}" / "metrics.json"
            if path.is_file():
                for src, how in (read_json(path).get("data_sources") or {}).items():
                    if how.get("mode") == "mirror":
                        mirrors[src] = str(how.get("origin", "offline mirror"))
    if not mirrors:
        return ""
    return ("> **Data: offline mirrors** (" + ", ".join(f"{s}: {o}" for s, o in sorted(mirrors.items())) + "): images "
            "generated here, not the real data. These numbers show the pipeline at work; they say nothing of how the "
            "methods compare on the real images (`mode: download` or `local` in `sources`: README, \"Data\").\n\n")


def write_runs_behind(results: Path, methods: list[str], seeds: list[int], out: Path, experiment: str) -> str:
    """The runs a report's tables were made from, each with what ties it to MLflow and to its inputs (its
    metrics.json's ``mlflow_run_id``, ``params_hash``, ``config_hash`` and the code's ``source_sha256``): written as
    ``<experiment>_runs.csv`` (full hashes) and ``<experiment>_runs.md`` (short ones), the markdown returned. A (method, seed) trained twice, or
    restored by ``dvc repro`` from its cache, leaves MLflow runs of the same name; this names the one behind the
    numbers."""
    rows = []
    for m in methods:
        for s in seeds:
            met = read_json(Path(results) / m / f"seed{s}" / "metrics.json")
            rows.append({"method": m, "seed": s, "mlflow_experiment": met.get("mlflow_experiment"),
                         "mlflow_run_id": met.get("mlflow_run_id"),
                         "params_hash": met.get("params_hash"), "config_hash": met.get("config_hash"),
                         "code_sha256": (met.get("code") or {}).get("source_sha256")})
    df = pd.DataFrame(rows)
    df.to_csv(out / f"{experiment}_runs.csv", index=False)
    exps = sorted({e for e in df["mlflow_experiment"] if isinstance(e, str) and e})
    short = lambda v, n=12: f"`{v[:n]}`" if isinstance(v, str) and v else None  # noqa: E731 - pandas reads None as NaN
    lines = [f"### {experiment}: the runs behind these tables", "",
             "MLflow names each run `<method>-seed<k>`; a run trained again (another setting, another code) keeps the "
             "name, so the run id names the one these numbers come from (MLflow UI: in its experiment, search "
             "`attributes.run_id = '<id>'`). " + (f"MLflow experiment: `{', '.join(exps)}`. " if exps else "")
             + f"Full hashes: `{experiment}_runs.csv`.", "",
             "| method | seed | MLflow run | params hash | code hash |", "|---|---|---|---|---|"]
    lines += [f"| {r.method} | {r.seed} | {short(r.mlflow_run_id, 32) or '- (not tracked)'} | {short(r.params_hash) or '-'} | "
              f"{short(r.code_sha256) or '-'} |" for r in df.itertuples()]
    md = "\n".join(lines) + "\n"
    (out / f"{experiment}_runs.md").write_text(md)
    return md


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
    # Avg's size, like its SE, only where every domain's is known (a partial sum would read as the whole test set)
    sizes = pd.DataFrame([list(n) + [float(n.sum(min_count=len(domains)))]], index=["n"], columns=domains + ["Avg"])
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
    if len(ties) == 1:
        named = ", ".join(str(m) for m in ties[0])
    else:  # each group numbered: a group's methods tie with each other, not with the next group's
        named = f"{len(ties)} groups, each tied within itself: " + "; ".join(
            f"({k}) " + ", ".join(str(m) for m in g) for k, g in enumerate(ties, 1))
    return f"scored exactly the same in every column: {named}. The same predictions: {why}; their differences mean nothing here"


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
    if "STD" in cols:  # the papers' column, unnamed in their captions: what it is, and what its lowest can hide
        lines += ["", "STD: the sample std (ddof = 1) of a row's accuracies over its domain columns, how evenly the method "
                  "serves the domains; lower is better, the lowest in bold (a model that predicts one class everywhere "
                  "can score it: read it beside Avg)."]
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
    has_paper = "paper_param_MB" in tab.columns or "paper_ratio" in tab.columns
    head = "| method | uploaded MiB per client per federated round (mean over rounds that upload) | backbone MiB | ratio |"
    head += " saving vs FedAvg |" if has_saving else ""
    head += " training s per round (all clients, this machine) |" if has_time else ""
    head += " training GFLOPs per round (all clients) |" if has_flops else ""
    head += " paper: Param (MB, as printed) | paper: ratio |" if has_paper else ""
    caption = (
        "Uploads only, per participating client: the bytes all clients uploaded in a round divided by the clients "
        "that took part in that round (the sampled ones), averaged over the rounds that upload (rounds that send "
        "nothing, such as a two-phase method's local phase or Single's, are left out) and over seeds; ratio = that "
        "upload / the backbone's parameter bytes."
        + (" Training seconds: mean over the rounds timed without the FLOP counter." if has_time else "")
        + (" The paper's Param and Ratio (pFedDB's Table 3) as printed: its MB reads as our MiB (AlexNet-BN's 71 % "
           "share is 153.5 of them)." if has_paper else "")
    )
    lines = [f"### {title}", "", caption, "", head, "|---|---|---|---|" + "---|" * (has_saving + has_time + has_flops + 2 * has_paper)]
    for m, r in tab.iterrows():
        cells = [f"{r['upload_MiB']:.3f}", f"{r['backbone_MiB']:.3f}", f"{r['ratio']:.2f}"]
        if has_saving:
            cells.append(f"{r['saving_vs_fedavg'] * 100:.1f} %")
        if has_time:
            cells.append(f"{r['train_s_per_round']:.2f}")
        if has_flops:
            cells.append("" if pd.isna(r["train_GFLOPs_per_round"]) else f"{r['train_GFLOPs_per_round']:.2f}")
        if has_paper:
            cells += ["–" if pd.isna(r.get(c, np.nan)) else f"{r[c]:{fmt}}" for c, fmt in (("paper_param_MB", ".1f"), ("paper_ratio", ".2f"))]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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


def write_flat_csv(tab: pd.DataFrame, path: Path, seeds: pd.Series) -> None:
    """A (mean | std, column) table as a CSV with one ``<column>_<mean|std>`` column each, a row per method, and
    ``seeds``, the runs each row's mean and std are over (a CSV has no caption to say it)."""
    flat = tab.copy()
    flat.columns = [f"{col}_{stat}" for stat, col in flat.columns]
    flat.insert(0, "seeds", seeds.reindex(flat.index).fillna(0).astype(int))
    flat.index.name = "method"
    flat.to_csv(path, float_format="%.4f")
