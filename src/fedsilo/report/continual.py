"""The report of a task stream (a ``domain_incremental`` experiment; pFedDIL's tables), under
``results/.../report/<experiment>/``:

- ``<experiment>_stream.{md,csv}``: a row per method; a column per task in stream order holding the accuracy after
  learning that task (the mean over every task seen so far: the numbers pFedDIL's Tables 1-3 print under each domain),
  then Avg (their mean), Delta (the reference row's Avg minus this row's, as the paper's last column: the pFedDIL
  row the CLI picks, the registered method with every module on), forgetting, and
  the final accuracy; mean +- std over seeds (n = 1: the value alone);
- ``<experiment>_matrix.md``: each method's accuracy matrix, after task t (rows) on task j (columns), mean over seeds;
- ``<experiment>_cost.{md,csv}``: training seconds per round (pFedDIL Table 4, measured here), rounds to the best
  accuracy summed over the tasks (Table 5), and for methods that keep several models the models and MiB a client
  keeps at the end (Table 6); the bytes each client sends per round;
- with ``published``: ``<experiment>_vs_paper.{md,csv}``, ours beside the paper's per task and Avg with the
  difference;
- ``<experiment>_stream_curves.png``: the accuracy over the tasks seen so far at every evaluated round, a line per
  method, task boundaries marked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.report import ReportError, _line_figure, _pm, load_published, over_seeds, versus_paper, write_versus
from fedsilo.utils.io import atomic_dir, read_json


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
    g = df.groupby("method", sort=False)[cols]
    std = g.std(ddof=1) if len(seeds) > 1 else g.mean() * np.nan
    return pd.concat({"mean": g.mean().reindex(methods), "std": std.reindex(methods)}, axis=1)


def stream_markdown(tab: pd.DataFrame, title: str, reference: str | None = None) -> str:
    cols = list(tab["mean"].columns)
    tasks = cols[: cols.index("Avg")]
    head = " → ".join(tasks)
    delta = f"Delta = {reference}'s Avg minus the row's; " if reference else ""
    intro = (f"Accuracy (%) after learning each task, over every task seen so far ({head}); Avg = their mean; {delta}forgetting = "
             "best accuracy of a task at the end of a task minus its final accuracy, mean over all tasks but the last.")
    lines = [f"### {title}", "", intro, "", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in tab.index:
        cells = []
        for c in cols:
            mean, std = tab.loc[m, ("mean", c)], tab.loc[m, ("std", c)]
            cells.append("" if pd.isna(mean) else _pm(mean, std, ".2f"))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
    rows = []
    for m in methods:
        for s in seeds:
            met, h = metrics[(m, s)], histories[(m, s)]
            rows.append({
                "method": m,
                "train_s_per_round": float(np.mean([e["train_seconds"] for e in h])),
                "rounds_to_best_total": met["rounds_to_best_total"],
                "models_per_client": met.get("models_per_client", np.nan),
                "MiB_kept_per_client": met.get("bytes_kept_per_client", np.nan) / 2**20,
                "MiB_up_per_client_round": float(np.mean([e["bytes_up_total"] / max(len(e["sampled"]), 1) for e in h])) / 2**20,
            })
    return pd.DataFrame(rows).groupby("method", sort=False).mean().reindex(methods)


def cost_markdown(tab: pd.DataFrame, title: str, rounds_per_task: int) -> str:
    lines = [f"### {title}", "", "Training seconds per round (local training, transfers, aggregation; this machine), rounds to the best "
             f"accuracy summed over the tasks ({rounds_per_task} rounds per task), models and MiB a client keeps at the end (methods that "
             "keep several), MiB uploaded per taking-part client per round; mean over seeds.", "",
             "| method | train s / round | rounds to best (sum) | models kept | MiB kept | MiB up / client / round |", "|---|---|---|---|---|---|"]
    for m, r in tab.iterrows():
        kept = "" if pd.isna(r["models_per_client"]) else f"{r['models_per_client']:.2f}"
        mib = "" if pd.isna(r["MiB_kept_per_client"]) else f"{r['MiB_kept_per_client']:.3f}"
        lines.append(f"| {m} | {r['train_s_per_round']:.3f} | {r['rounds_to_best_total']:.1f} | {kept} | {mib} | {r['MiB_up_per_client_round']:.4f} |")
    return "\n".join(lines) + "\n"


def build_stream_report(results: Path, experiment: str, methods: list[str], seeds: list[int], out_dir: Path,
                        published: str | None = None, repo: Path = Path("."), reference: str | None = None) -> dict[str, Any]:
    """``reference``: the method Delta is measured against (the pFedDIL row; none: Delta left empty)."""
    metrics, histories = collect_stream(results, methods, seeds)
    tab = stream_table(metrics, methods, seeds, reference)
    per_task = metrics[(methods[0], seeds[0])]["rounds_per_task"]
    figs: list[str] = []
    with atomic_dir(out_dir) as tmp:
        md = stream_markdown(tab, f"{experiment}: accuracy along the stream, {over_seeds(seeds)}", reference)
        (tmp / f"{experiment}_stream.md").write_text(md)
        flat = tab.copy()
        flat.columns = [f"{c}_{stat}" for stat, c in flat.columns]
        flat.index.name = "method"
        flat.to_csv(tmp / f"{experiment}_stream.csv", float_format="%.4f")
        mat = matrix_markdown(metrics, methods, seeds, f"{experiment}: accuracy matrices")
        (tmp / f"{experiment}_matrix.md").write_text(mat)
        cost = cost_table(metrics, histories, methods, seeds)
        cost_md = cost_markdown(cost, f"{experiment}: cost (pFedDIL Tables 4-6)", per_task)
        (tmp / f"{experiment}_cost.md").write_text(cost_md)
        cost.to_csv(tmp / f"{experiment}_cost.csv", float_format="%.6g")
        full = md + "\n" + cost_md + "\n" + mat
        if published:  # the stream's tasks are the published table's domains, its Avg the tables' Avg
            full += "\n" + write_versus(tmp, experiment, versus_paper(tab, load_published(repo, published)), published)
        series = []
        for m in methods:
            ev = [[e for e in histories[(m, s)] if "seen_acc" in e] for s in seeds]
            series.append((m, [e["round"] for e in ev[0]], list(np.mean([[e["seen_acc"] * 100 for e in h] for h in ev], axis=0))))
        figs.append(_line_figure(tmp / f"{experiment}_stream_curves.png", series,
                                 f"accuracy over the tasks seen so far (%), {per_task} rounds per task", f"{experiment}: the stream"))
        (tmp / "README.md").write_text(f"# fedsilo report: {experiment}\n\n{full}\n" + "".join(f"![{f}]({f})\n" for f in figs))
    return {experiment: {"table": tab["mean"]["Avg"].to_dict(), "figures": figs}}
