"""The report of a task stream (a ``domain_incremental`` experiment; pFedDIL's tables), under
``results/.../report/<experiment>/``:

- ``<experiment>_stream.{md,csv}``: a row per method; a column per task in stream order holding the accuracy after
  learning that task (the mean over every task seen so far: the numbers pFedDIL's Tables 1-3 print under each domain),
  then Avg (their mean), Delta (the reference row's Avg minus this row's, as the paper's last column: the pFedDIL
  row the CLI picks, the registered method with every module on), forgetting, and
  the final accuracy; mean +- std over seeds (n = 1: the value alone);
- ``<experiment>_on_task.{md,csv}``: the other reading of the paper's columns: the accuracy on each task right after
  learning it (the matrix's diagonal) and its mean; beside it the Avg of the stream table with every client's test
  images pooled (correct over images, as FedCIL's code scores) where the runs recorded it;
- ``<experiment>_matrix.md``: each method's accuracy matrix, after task t (rows) on task j (columns), mean over seeds;
- ``<experiment>_cost.{md,csv}``: training seconds per round (pFedDIL Table 4, measured here), rounds to the best
  accuracy summed over the tasks (Table 5), the models and MiB a client keeps at the end to answer every task seen
  (Table 6, ``Method.storage``); the bytes each client sends per round;
- with ``published``: ``<experiment>_vs_paper.{md,csv}``, ours beside the paper's per task and Avg with the
  difference;
- ``<experiment>_stream_curves.png``: the accuracy over the tasks seen so far at every evaluated round, a line per
  method, task boundaries marked.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.report import written
from fedsilo.report.figures import line_figure
from fedsilo.report.tables import ReportError, data_origin_note, indistinct_rows, mean_pm, over_seeds, write_runs_behind
from fedsilo.report.versus import (
    load_published,
    published_entry,
    runs_backbones,
    settings_differ,
    versus_paper,
    write_versus,
)
from fedsilo.utils.io import atomic_dir, read_json

log = logging.getLogger(__name__)


def collect_stream(results: Path, methods: list[str], seeds: list[int]) -> tuple[dict[tuple[str, int], dict], dict[tuple[str, int], list]]:
    metrics, histories = {}, {}
    for m in methods:
        for s in seeds:
            d = Path(results) / m / f"seed{s}"
            if not (d / "metrics.json").exists():
                raise ReportError(f"{d / 'metrics.json'}: missing (train {m} seed {s} first: `dvc repro`)")
            met = read_json(d / "metrics.json")
            if "accuracy_matrix" not in met:
                raise ReportError(f"{d / 'metrics.json'}: not a task-stream run (no accuracy_matrix); is the experiment's split domain_incremental?")
            metrics[(m, s)] = met
            histories[(m, s)] = json.loads((d / "history.json").read_text())
    return metrics, histories


def stream_table(metrics: dict, methods: list[str], seeds: list[int], reference: str | None = None) -> pd.DataFrame:
    """Columns (stat, column): mean and std over seeds of the accuracy (%) after each task, Avg, Delta, forgetting, final."""
    tasks = metrics[(methods[0], seeds[0])]["tasks"]
    rows = []
    for m in methods:
        for s in seeds:
            met = metrics[(m, s)]
            row = {"method": m, "seed": s, **{t: 100 * met["acc_after_task"][t] for t in tasks}, "Avg": 100 * met["avg_acc"],
                   "forgetting": 100 * met["forgetting"] if met.get("forgetting") is not None else np.nan, "final": 100 * met["final_acc"]}
            rows.append(row)
    df = pd.DataFrame(rows)
    if reference in methods:
        ref = df[df["method"] == reference].set_index("seed")["Avg"]
        df["Delta"] = df.apply(lambda r: ref.get(r["seed"], np.nan) - r["Avg"], axis=1)
    else:
        df["Delta"] = np.nan
    cols = [*tasks, "Avg", "Delta", "forgetting", "final"]
    return _over_seeds(df, cols, methods, seeds)


def _over_seeds(df: pd.DataFrame, cols: list[str], methods: list[str], seeds: list[int]) -> pd.DataFrame:
    """Columns (stat, column): the mean and the std (ddof = 1; NaN for one seed) over a method's rows (its seeds)."""
    g = df.groupby("method", sort=False)[cols]
    std = g.std(ddof=1) if len(seeds) > 1 else g.mean() * np.nan
    return pd.concat({"mean": g.mean().reindex(methods), "std": std.reindex(methods)}, axis=1)


def _mean_std_table(tab: pd.DataFrame, title: str, intro: str) -> str:
    """A markdown table of a (stat, column) frame: a row per method, mean +- std per column (empty where NaN)."""
    cols = list(tab["mean"].columns)
    lines = [f"### {title}", "", intro, "", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in tab.index:
        cells = []
        for c in cols:
            mean, std = tab.loc[m, ("mean", c)], tab.loc[m, ("std", c)]
            cells.append("" if pd.isna(mean) else mean_pm(mean, std, ".2f"))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def on_task_table(metrics: dict, methods: list[str], seeds: list[int]) -> pd.DataFrame:
    """Columns (stat, column): mean and std over seeds of the accuracy (%) on each task right after learning it, their
    mean (Avg on task), and the stream table's Avg with the test images pooled (NaN for runs that did not record it)."""
    tasks = metrics[(methods[0], seeds[0])]["tasks"]
    rows = []
    for m in methods:
        for s in seeds:
            met = metrics[(m, s)]
            on = met.get("acc_on_task") or {t: row[-1] for t, row in zip(tasks, met["accuracy_matrix"])}
            rows.append({"method": m, **{t: 100 * on[t] for t in tasks if t in on},
                         "Avg on task": 100 * float(np.nanmean(list(on.values()))),
                         "Avg pooled": 100 * met["avg_acc_pooled"] if met.get("avg_acc_pooled") is not None else np.nan})
    df = pd.DataFrame(rows)
    cols = [c for c in df.columns if c != "method"]
    return _over_seeds(df, cols, methods, seeds)


def on_task_markdown(tab: pd.DataFrame, title: str) -> str:
    intro = ("Accuracy (%) on each task right after learning it (the accuracy matrix's diagonal) and its mean; Avg pooled = "
             "the stream table's Avg with every client's test images of a task pooled (correct over images) instead of a "
             "mean over clients. pFedDIL's tables do not say which of these their columns are: the stream table reads "
             "them as the mean over the tasks seen so far, which its Office-31 Source-only row (46.53, then 20.61 with "
             "the model frozen) rules out; this diagonal reading allows it, but makes other rows implausible.")
    return _mean_std_table(tab, title, intro)


def stream_markdown(tab: pd.DataFrame, title: str, reference: str | None = None) -> str:
    cols = list(tab["mean"].columns)
    tasks = cols[: cols.index("Avg")]
    head = " → ".join(tasks)
    delta = f"Delta = {reference}'s Avg minus the row's; " if reference else ""
    intro = (f"Accuracy (%) after learning each task, over every task seen so far ({head}); Avg = their mean; {delta}forgetting = "
             "best accuracy of a task at the end of a task minus its final accuracy, mean over all tasks but the last "
             "(the best over the ends of the tasks from its own to the last but one: negative where the last task left a "
             "task better known than any end before).")
    return _mean_std_table(tab, title, intro)


def matrix_markdown(metrics: dict, methods: list[str], seeds: list[int], title: str) -> str:
    tasks = metrics[(methods[0], seeds[0])]["tasks"]
    out = [f"### {title}", "", "Row: after learning that task; column: accuracy (%) on that task's test set; mean over seeds.", ""]
    for m in methods:
        mats = [metrics[(m, s)]["accuracy_matrix"] for s in seeds]
        out += [f"**{m}**", "", "| after \\ on | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for t, name in enumerate(tasks[: len(mats[0])]):
            vals = [np.mean([mat[t][j] for mat in mats]) * 100 for j in range(t + 1)]
            out.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" + " |" * (len(tasks) - t - 1))
        out.append("")
    return "\n".join(out) + "\n"


def cost_table(metrics: dict, histories: dict, methods: list[str], seeds: list[int]) -> pd.DataFrame:
    """Per method, the mean over seeds of: the median round's training seconds and the MiB a taking-part client
    uploads per round, both over the rounds in which something was uploaded (Source-only's rounds after its first task
    train and send nothing: counted, they would read as a cheaper method), the rounds to the best accuracy summed over
    the tasks, and the models and MiB a client keeps at the end."""
    rows = []
    for m in methods:
        for s in seeds:
            met, every = metrics[(m, s)], histories[(m, s)]
            h = [e for e in every if e["bytes_up_total"] > 0] or every
            rows.append({
                "method": m,
                # the median round: a round's seconds on a busy machine swing by an order of magnitude
                "train_s_per_round": float(np.median([e["train_seconds"] for e in h])),
                "rounds_to_best_total": met["rounds_to_best_total"],
                "models_per_client": met.get("models_per_client", np.nan),
                "MiB_kept_per_client": met.get("bytes_kept_per_client", np.nan) / 2**20,
                "MiB_up_per_client_round": float(np.mean([e["bytes_up_total"] / max(len(e["sampled"]), 1) for e in h])) / 2**20,
            })
    return pd.DataFrame(rows).groupby("method", sort=False).mean().reindex(methods)


def cost_markdown(tab: pd.DataFrame, title: str, rounds_per_task: int, paper_seconds: dict[str, float] | None = None,
                  paper_rounds: dict[str, float] | None = None) -> str:
    """``paper_seconds`` / ``paper_rounds``: the paper's Table 4 (seconds per round) and Table 5 (rounds to the best
    accuracy) for this stream, set beside ours where given."""
    paper = paper_seconds is not None or paper_rounds is not None
    head = "| method | train s / round | rounds to best (sum) | models kept | MiB kept | MiB up / client / round |"
    if paper:
        head += " paper s / round (Table 4) | paper rounds to best (Table 5) |"
    lines = [f"### {title}", "", "Training seconds per round (the median round: local training, transfers, aggregation; this machine), "
             f"rounds to the best accuracy summed over the tasks ({rounds_per_task} rounds per task), models and MiB a client keeps "
             "at the end to answer every task seen, MiB uploaded per taking-part client per round; the seconds and MiB over "
             "the rounds that upload (a method that stops training after a task is not cheaper for its idle rounds); "
             "mean over seeds."
             + (" The paper's seconds are its own machine's (compare them as ratios between methods) and its rounds count "
                "its own schedule's rounds per task." if paper else ""), "",
             head, "|---" * (head.count("|") - 1) + "|"]
    for m, r in tab.iterrows():
        kept = "" if pd.isna(r["models_per_client"]) else f"{r['models_per_client']:.2f}"
        mib = "" if pd.isna(r["MiB_kept_per_client"]) else f"{r['MiB_kept_per_client']:.3f}"
        row = f"| {m} | {r['train_s_per_round']:.3f} | {r['rounds_to_best_total']:.1f} | {kept} | {mib} | {r['MiB_up_per_client_round']:.4f} |"
        if paper:
            ps, pr = (paper_seconds or {}).get(m), (paper_rounds or {}).get(m)
            row += f" {'–' if ps is None else f'{ps:g}'} | {'–' if pr is None else f'{pr:g}'} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def test_sizes_note(met: dict[str, Any]) -> str:
    """The test images behind each task's column (every client's together) and the binomial standard error at 50 %
    accuracy of that many images: a task whose clients hold few test images gives a column of few images. Empty for
    runs that predate ``test_sizes_by_task``."""
    sizes = met.get("test_sizes_by_task")
    if not sizes:
        return ""
    counts = {t: sum(by_client.values()) for t, by_client in sizes.items()}
    return ("\nTest images per task, every client's together (a column is the mean over clients of each one's accuracy "
            "on its own test images; the binomial standard error at 50 % of that many images in brackets): "
            + ", ".join(f"{t} {n} (±{100 * math.sqrt(0.25 / n):.1f})" if n else f"{t} 0" for t, n in counts.items())
            + ". Fewest per client: " + ", ".join(f"{t} {min(by_client.values())}" for t, by_client in sizes.items()) + ".\n")


def order_note(tasks: list[str], domains: list[str]) -> str | None:
    """Why a stream's columns cannot be set beside a published table's, or None: an accuracy after a task is over the
    tasks seen so far, so two streams are comparable column by column only in the same task order."""
    if list(tasks) == list(domains):
        return None
    ours, theirs = " → ".join(map(str, tasks)), " → ".join(map(str, domains))
    if list(domains[: len(tasks)]) == list(tasks) or list(tasks[: len(domains)]) == list(domains):
        return (f"**Not the paper's stream**: ours {ours}, the paper's {theirs}: the columns the two share are the same "
                "quantity but each Avg averages other tasks, so no table is set beside the paper's (train the paper's "
                "tasks, `split.domain_order`, to compare).")
    return (f"**Not the paper's task order**: ours {ours}, the paper's {theirs}. A column is the accuracy over the tasks "
            "seen after that task, so the two streams' columns (and Avg) are not the same quantity: no table is set "
            "beside the paper's (restore `split.domain_order` to compare).")


def build_stream_report(results: Path, experiment: str, methods: list[str], seeds: list[int], out_dir: Path,
                        published: str | None = None, repo: Path = Path("."), reference: str | None = None,
                        in_place: bool = False, method_entries: dict[str, Any] | None = None, scale: str = "") -> dict[str, Any]:
    """``reference``: the method Delta is measured against (the pFedDIL row; none: Delta left empty);
    ``method_entries``: the params' ``methods``, to name a row run with another setting than the paper's row."""
    metrics, histories = collect_stream(results, methods, seeds)
    tab = stream_table(metrics, methods, seeds, reference)
    per_task = metrics[(methods[0], seeds[0])]["rounds_per_task"]
    figs: list[str] = []
    with written(out_dir, in_place) as tmp:  # in_place: the caller's own atomic folder (build_report's)
        md = stream_markdown(tab, f"{experiment}: accuracy along the stream, {over_seeds(seeds)}", reference)
        same = indistinct_rows(tab)
        if same:
            log.warning("%s: %s", experiment, same)
            md += f"\n> **Note:** {same}\n"
        md += test_sizes_note(metrics[(methods[0], seeds[0])])
        (tmp / f"{experiment}_stream.md").write_text(md)
        flat = tab.copy()
        flat.columns = [f"{c}_{stat}" for stat, c in flat.columns]
        flat.index.name = "method"
        flat.insert(0, "seeds", len(seeds))  # the runs behind each row (every seed: a missing one stops the report)
        flat.to_csv(tmp / f"{experiment}_stream.csv", float_format="%.4f")
        on = on_task_table(metrics, methods, seeds)
        on_md = on_task_markdown(on, f"{experiment}: accuracy on the task just learned, {over_seeds(seeds)}")
        (tmp / f"{experiment}_on_task.md").write_text(on_md)
        flat_on = on.copy()
        flat_on.columns = [f"{c}_{stat}" for stat, c in flat_on.columns]
        flat_on.index.name = "method"
        flat_on.to_csv(tmp / f"{experiment}_on_task.csv", float_format="%.4f")
        mat = matrix_markdown(metrics, methods, seeds, f"{experiment}: accuracy matrices")
        (tmp / f"{experiment}_matrix.md").write_text(mat)
        cost = cost_table(metrics, histories, methods, seeds)
        doc, _, key = published_entry(repo, published) if published else ({}, "", "")
        cost_md = cost_markdown(cost, f"{experiment}: cost (pFedDIL Tables 4-6)", per_task,
                                (doc.get("seconds_per_round") or {}).get(key), (doc.get("rounds_to_best") or {}).get(key))
        (tmp / f"{experiment}_cost.md").write_text(cost_md)
        cost.to_csv(tmp / f"{experiment}_cost.csv", float_format="%.6g")
        full = data_origin_note(results, methods, seeds) + md + "\n" + on_md + "\n" + cost_md + "\n" + mat
        if published:  # the stream's tasks are the published table's domains, its Avg the tables' Avg
            paper = load_published(repo, published)
            order = order_note(metrics[(methods[0], seeds[0])]["tasks"], paper["domains"])
            if order:
                log.warning("%s: %s", experiment, order.replace("**", ""))
                vs_md = f"### {experiment}: ours vs {published}\n\n{order}\n"
                (tmp / f"{experiment}_vs_paper.md").write_text(vs_md)
                full += "\n" + vs_md
            else:
                full += "\n" + write_versus(tmp, experiment, versus_paper(tab, paper), published, paper, ours="task_end",
                                             settings=settings_differ(paper, method_entries, methods),
                                             backbones=runs_backbones(results, methods, seeds), scale=scale)
        series = []
        for m in methods:
            ev = [[e for e in histories[(m, s)] if "seen_acc" in e] for s in seeds]
            series.append((m, [e["round"] for e in ev[0]], list(np.mean([[e["seen_acc"] * 100 for e in h] for h in ev], axis=0))))
        n_tasks = len(metrics[(methods[0], seeds[0])]["tasks"])
        figs.append(line_figure(tmp / f"{experiment}_stream_curves.png", series,
                                 f"accuracy over the tasks seen so far (%), {per_task} rounds per task", f"{experiment}: the stream",
                                 marks=tuple(per_task * t + 0.5 for t in range(1, n_tasks))))
        full += "\n" + write_runs_behind(results, methods, seeds, tmp, experiment)
        (tmp / "README.md").write_text(f"# fedsilo report: {experiment}\n\n{full}\n" + "".join(f"![{f}]({f})\n" for f in figs))
    return {experiment: {"table": tab["mean"]["Avg"].to_dict(), "figures": figs}}


# ----------------------------------------------------------------------------------- across streams: Fig. 2, Table 6
def _xy_figure(path: Path, panels: list[tuple[str, list[tuple[str, list[float], list[float]]]]], xlabel: str, ylabel: str,
               logx: bool = False) -> str:
    """One PNG, a panel per (title, series), a line with markers per (label, x, y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for label, x, y in series:
            ax.plot(x, y, marker="o", label=label)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _avg(results: Path, method: str, seeds: list[int]) -> list[dict[str, Any]]:
    metrics, _ = collect_stream(results, [method], seeds)
    return [metrics[(method, s)] for s in seeds]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else float("nan"))


def lambda_table(runs: dict[str, dict[float, tuple[Path, str]]], seeds: list[int], paper: dict[str, Any] | None) -> pd.DataFrame:
    """``runs``: stream -> lambda -> (results folder, method key). A row per (stream, lambda): Avg (%), models and MiB a
    client keeps (mean and std over seeds, std with ddof = 1), and the paper's Table 6 beside where it has the stream."""
    rows = []
    for stream, by_lam in runs.items():
        pub = (paper or {}).get(stream) or {}
        values = list((paper or {}).get("values", []))
        for lam in sorted(by_lam):
            results, method = by_lam[lam]
            mets = _avg(results, method, seeds)
            avg, avg_sd = _mean_std([100 * m["avg_acc"] for m in mets])
            kept, kept_sd = _mean_std([m.get("models_per_client", np.nan) for m in mets])
            mib, _ = _mean_std([m.get("bytes_kept_per_client", np.nan) / 2**20 for m in mets])
            i = next((k for k, v in enumerate(values) if abs(v - lam) < 1e-9), None)
            rows.append({"stream": stream, "lambda": lam, "method": method, "Avg": avg, "Avg_std": avg_sd,
                         "models_kept": kept, "models_kept_std": kept_sd, "MiB_kept": mib,
                         "paper_Avg": pub["avg_acc"][i] if i is not None and "avg_acc" in pub else np.nan,
                         "paper_model_MB": pub["model_size_mb"][i] if i is not None and "model_size_mb" in pub else np.nan})
    return pd.DataFrame(rows)


def alpha_table(families: dict[str, dict[float, Path]], methods: dict[str, list[str]], seeds: list[int]) -> pd.DataFrame:
    """``families``: stream -> alpha -> results folder; ``methods``: stream -> the method keys run at every alpha. A row
    per (stream, method, alpha): Avg (%) mean and std over seeds (ddof = 1)."""
    rows = []
    for stream, by_alpha in families.items():
        for m in methods[stream]:
            for a in sorted(by_alpha):
                avg, sd = _mean_std([100 * x["avg_acc"] for x in _avg(by_alpha[a], m, seeds)])
                rows.append({"stream": stream, "method": m, "alpha": a, "Avg": avg, "Avg_std": sd})
    return pd.DataFrame(rows)


def build_sensitivity_report(lam_runs: dict[str, dict[float, tuple[Path, str]]], families: dict[str, dict[float, Path]],
                             family_methods: dict[str, list[str]], seeds: list[int], out_dir: Path,
                             paper_lambda: dict[str, Any] | None = None) -> dict[str, Any]:
    """pFedDIL's sensitivity results across streams, under ``out_dir`` (``results/.../report/sensitivity/``):
    ``lambda.{md,csv}`` + ``lambda.png`` (Table 6: Avg and the models a client keeps against lambda, the paper's
    numbers beside) and ``alpha.{md,csv}`` + ``alpha.png`` (Fig. 2: Avg against the Dirichlet alpha of the label skew
    inside every domain, a line per method, a panel per stream)."""
    if not lam_runs and not families:
        raise ReportError("sensitivity: no lambda sweep and no alpha family among the experiments")
    figs: list[str] = []
    parts: list[str] = []
    with atomic_dir(out_dir) as tmp:
        if lam_runs:
            lt = lambda_table(lam_runs, seeds, paper_lambda)
            lt.to_csv(tmp / "lambda.csv", index=False, float_format="%.4f")
            lines = ["### Table 6: lambda against accuracy and storage", "",
                     f"Avg (%) along the stream and the models a client keeps at the end, {over_seeds(seeds)}; the paper's "
                     "Avg and model size (MB as printed) beside where it reports the stream.", "",
                     "| stream | lambda | run | Avg | models kept | MiB kept | paper Avg | paper MB |", "|---|---|---|---|---|---|---|---|"]
            for _, r in lt.iterrows():
                pa = "" if pd.isna(r["paper_Avg"]) else f"{r['paper_Avg']:.2f}"
                pm = "" if pd.isna(r["paper_model_MB"]) else f"{r['paper_model_MB']:.0f}"
                lines.append(f"| {r['stream']} | {r['lambda']:g} | {r['method']} | {mean_pm(r['Avg'], r['Avg_std'], '.2f')} | "
                             f"{mean_pm(r['models_kept'], r['models_kept_std'], '.2f')} | {r['MiB_kept']:.3f} | {pa} | {pm} |")
            md = "\n".join(lines) + "\n"
            (tmp / "lambda.md").write_text(md)
            parts.append(md)
            panels = [(s, [("Avg (%)", list(g["lambda"]), list(g["Avg"]))]
                       + ([("paper", list(g["lambda"]), list(g["paper_Avg"]))] if g["paper_Avg"].notna().any() else []))
                      for s, g in lt.groupby("stream", sort=False)]
            figs.append(_xy_figure(tmp / "lambda.png", panels, "lambda", "Avg accuracy (%)"))
        if families:
            at = alpha_table(families, family_methods, seeds)
            at.to_csv(tmp / "alpha.csv", index=False, float_format="%.4f")
            lines = ["### Fig. 2: data heterogeneity", "",
                     f"Avg (%) along the stream against the Dirichlet alpha inside every domain, {over_seeds(seeds)}.", ""]
            for s, g in at.groupby("stream", sort=False):
                alphas = sorted(g["alpha"].unique())
                lines += [f"**{s}**", "", "| method | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |", "|---" * (len(alphas) + 1) + "|"]
                for m, gm in g.groupby("method", sort=False):
                    cells = {r["alpha"]: mean_pm(r["Avg"], r["Avg_std"], ".2f") for _, r in gm.iterrows()}
                    lines.append(f"| {m} | " + " | ".join(cells.get(a, "") for a in alphas) + " |")
                lines.append("")
            md = "\n".join(lines) + "\n"
            (tmp / "alpha.md").write_text(md)
            parts.append(md)
            panels = [(s, [(m, list(gm["alpha"]), list(gm["Avg"])) for m, gm in g.groupby("method", sort=False)])
                      for s, g in at.groupby("stream", sort=False)]
            figs.append(_xy_figure(tmp / "alpha.png", panels, "Dirichlet alpha (log scale)", "Avg accuracy (%)", logx=True))
        (tmp / "README.md").write_text("# fedsilo report: pFedDIL sensitivity\n\n" + "\n".join(parts) + "\n"
                                       + "".join(f"![{f}]({f})\n" for f in figs))
    return {"sensitivity": {"figures": figs}}


def sensitivity_inputs(p: Any, layout: Any, repo: Path = Path(".")) -> dict[str, Any]:
    """From a pipeline's params: the lambda sweeps (per stream experiment, the pFedDIL entries with every module on, by
    their lambda; a stream with at least two) and the alpha families (stream experiments on the same dataset, domain
    order and clients that differ in the split's alpha; the methods run at every alpha), named by the published table
    of the family (e.g. ``digit10``) or the experiment; the paper's Table 6 from the published file's ``lambda``."""
    import yaml

    from fedsilo.methods.registry import method_base, method_params

    streams = [e for e in p.pipeline.experiments if p.experiments[e].split.protocol == "domain_incremental"]

    def name(e: str) -> str:
        ref = p.experiments[e].published
        return ref.partition("#")[2] if ref else e

    lam_runs: dict[str, dict[float, tuple[Path, str]]] = {}
    paper_lambda = None
    for e in streams:
        by_lam: dict[float, tuple[Path, str]] = {}
        for m in p.experiment_methods(e):
            if method_base(m, p.methods[m]) != "pfeddil":
                continue
            mp = method_params(p, m)
            if mp.migration and mp.share_extractor and mp.correlation:
                by_lam.setdefault(float(mp.lam), (layout.results(e), m))
        if len(by_lam) > 1:
            lam_runs[name(e)] = by_lam
            ref = p.experiments[e].published
            if ref and paper_lambda is None:
                f = Path(repo) / ref.partition("#")[0]
                paper_lambda = (yaml.safe_load(f.read_text()) or {}).get("lambda") if f.exists() else None
    groups: dict[tuple, list[str]] = {}
    for e in streams:
        s = p.experiments[e].split
        groups.setdefault((p.experiments[e].dataset, tuple(s.domain_order or ()), s.clients), []).append(e)
    families: dict[str, dict[float, Path]] = {}
    family_methods: dict[str, list[str]] = {}
    for members in groups.values():
        alphas = {float(p.experiments[e].split.alpha): e for e in reversed(members)}  # the first member wins a tie
        if len(alphas) < 2:
            continue
        named = next((e for e in members if p.experiments[e].published), members[0])
        common = [m for m in p.experiment_methods(named) if all(m in p.experiment_methods(e) for e in alphas.values())]
        if common:
            families[name(named)] = {a: layout.results(e) for a, e in alphas.items()}
            family_methods[name(named)] = common
    return {"lam_runs": lam_runs, "families": families, "family_methods": family_methods, "paper_lambda": paper_lambda}
