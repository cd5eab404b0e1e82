"""The report stage: results -> tables (markdown, CSV, LaTeX) and figures (PNG) under
``results/report/<experiment>/``:
- ``<experiment>_accuracy.{md,csv,tex}``: a row per method, a column per domain plus Avg; each cell is the mean
  +- std over seeds of the final per-client test accuracy (%); Avg is each seed's mean over domains, then mean +- std
  over seeds; the best mean of each column is bold. Binary tasks get the same table for AUC.
- ``<experiment>_curves.png``: mean accuracy per round, one line per method (mean over seeds);
- ``<experiment>_<method>_domains.png``: per-domain accuracy per round for each method;
- ``<experiment>_bytes.png``: bytes sent per round (up + down) per method.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.utils.io import atomic_dir, read_json


class ReportError(RuntimeError):
    pass


def collect(root: Path, experiment: str, methods: list[str], seeds: list[int]) -> tuple[pd.DataFrame, dict]:
    rows, histories = [], {}
    for m in methods:
        for s in seeds:
            d = root / "results" / experiment / m / f"seed{s}"
            if not (d / "metrics.json").exists():
                raise ReportError(f"{d / 'metrics.json'}: missing (run `dvc repro train@{experiment}-{m}-{s}`)")
            met = read_json(d / "metrics.json")
            histories[(m, s)] = json.loads((d / "history.json").read_text())
            for dom, v in met["per_client"].items():
                rows.append({"method": m, "seed": s, "domain": dom, "acc": v["acc"], "auc": v.get("auc", np.nan),
                             "bytes_per_round": float(np.mean(np.add(met["bytes_up_per_round"], met["bytes_down_per_round"])))})
    return pd.DataFrame(rows), histories


def summary_table(df: pd.DataFrame, metric: str, methods: list[str]) -> pd.DataFrame:
    domains = list(dict.fromkeys(df["domain"]))
    piv = df.pivot_table(index=["method", "seed"], columns="domain", values=metric)[domains] * 100
    piv["Avg"] = piv[domains].mean(axis=1)
    mean = piv.groupby(level="method").mean().reindex(methods)
    std = piv.groupby(level="method").std(ddof=0).reindex(methods).fillna(0.0)
    out = pd.concat({"mean": mean, "std": std}, axis=1)
    return out


def _cells(tab: pd.DataFrame, bold: str) -> pd.DataFrame:
    mean, std = tab["mean"], tab["std"]
    best = mean.max(axis=0)
    cells = mean.copy().astype(object)
    for col in mean.columns:
        for m in mean.index:
            txt = f"{mean.loc[m, col]:.1f} ± {std.loc[m, col]:.1f}"
            if np.isclose(mean.loc[m, col], best[col]):
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


def to_latex(tab: pd.DataFrame, caption: str) -> str:
    cells = _cells(tab, "\\textbf{{{}}}").map(lambda s: s.replace("±", "$\\pm$"))
    cols = list(cells.columns)
    lines = [
        "\\begin{table}[t]", "\\centering", f"\\caption{{{caption}}}", "\\begin{tabular}{l" + "c" * len(cols) + "}",
        "\\toprule", "Method & " + " & ".join(cols) + " \\\\", "\\midrule",
    ]
    for m, row in cells.iterrows():
        lines.append(f"{m} & " + " & ".join(row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    return "\n".join(lines) + "\n"


def _plots(out: Path, experiment: str, methods: list[str], seeds: list[int], histories: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        curves = []
        for s in seeds:
            h = [e for e in histories[(m, s)] if "eval" in e]
            curves.append([e["mean_acc"] * 100 for e in h])
        rounds = [e["round"] for e in histories[(m, seeds[0])] if "eval" in e]
        ax.plot(rounds, np.mean(curves, axis=0), label=m)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title(experiment)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{experiment}_curves.png", dpi=120)
    plt.close(fig)
    made.append(f"{experiment}_curves.png")

    for m in methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        h0 = [e for e in histories[(m, seeds[0])] if "eval" in e]
        rounds = [e["round"] for e in h0]
        for dom in h0[0]["eval"]:
            vals = np.mean([[e["eval"][dom]["acc"] * 100 for e in histories[(m, s)] if "eval" in e] for s in seeds], axis=0)
            ax.plot(rounds, vals, label=dom)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{experiment}: {m}")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{experiment}_{m}_domains.png", dpi=120)
        plt.close(fig)
        made.append(f"{experiment}_{m}_domains.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        h = histories[(m, seeds[0])]
        ax.plot([e["round"] for e in h], [(e["bytes_up_total"] + e["bytes_down_total"]) / 2**20 for e in h], label=m)
    ax.set_xlabel("round")
    ax.set_ylabel("MiB sent per round (up + down)")
    ax.set_title(f"{experiment}: communication")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{experiment}_bytes.png", dpi=120)
    plt.close(fig)
    made.append(f"{experiment}_bytes.png")
    return made


def build_report(root: Path, experiment: str, methods: list[str], seeds: list[int], out_dir: Path) -> dict[str, Any]:
    root = Path(root)
    index = [f"# fedsilo report: {experiment}", ""]
    made: dict[str, Any] = {}
    with atomic_dir(out_dir) as tmp:
        for exp in [experiment]:
            df, histories = collect(root, exp, methods, seeds)
            acc = summary_table(df, "acc", methods)
            md = to_markdown(acc, f"{exp}: test accuracy (%), mean ± std over seeds {list(seeds)}")
            if df["auc"].notna().any():
                md += "\n" + to_markdown(summary_table(df, "auc", methods), f"{exp}: test AUC (%), mean ± std over seeds")
            bytes_tab = df.groupby("method")["bytes_per_round"].mean().reindex(methods) / 2**20
            md += "\n### Communication\n\n| method | MiB per round (up + down) |\n|---|---|\n" + "".join(
                f"| {m} | {v:.2f} |\n" for m, v in bytes_tab.items()
            )
            (tmp / f"{exp}_accuracy.md").write_text(md)
            flat = acc.copy()
            flat.columns = [f"{col}_{stat}" for stat, col in flat.columns]
            flat.index.name = "method"
            flat.to_csv(tmp / f"{exp}_accuracy.csv", float_format="%.4f")
            (tmp / f"{exp}_accuracy.tex").write_text(to_latex(acc, f"{exp}: test accuracy (\\%), mean $\\pm$ std over seeds"))
            figs = _plots(tmp, exp, methods, seeds, histories)
            index += [md, ""] + [f"![{f}]({f})" for f in figs] + [""]
            made[exp] = {"table": acc["mean"]["Avg"].to_dict(), "figures": figs}
        (tmp / "README.md").write_text("\n".join(index) + "\n")
    return made
