"""The report stage: results -> tables (markdown, CSV, LaTeX) and figures (PNG) under
``results/report/<experiment>/``:
- ``<experiment>_accuracy.{md,csv,tex}``: a row per method, a column per domain plus Avg; each cell is the mean
  +- std over seeds of the final per-client test accuracy (%); Avg is each seed's mean over domains, then mean +- std
  over seeds; the best mean of each column is bold. Binary tasks get the same table for AUC.
- ``<experiment>_curves.png``: mean accuracy per round, one line per method (mean over seeds);
- ``<experiment>_<method>_domains.png``: per-domain accuracy per round for each method;
- ``<experiment>_bytes.png``: bytes sent per round (up + down) per method;
- ``<experiment>_communication.{md,csv}`` and ``<experiment>_communication.png`` (pFedDB Fig. 4, Table 3's Param and
  Ratio): per method the MiB uploaded per client per federated round, measured from the engine's payloads (rounds
  with no upload, such as pFedDB's Phase 1 or Single, are not averaged in), the ratio to the backbone's parameter
  bytes, and the saving against FedAvg's upload.
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
            up = [b for b in met["bytes_up_per_round"] if b > 0]
            for dom, v in met["per_client"].items():
                rows.append({"method": m, "seed": s, "domain": dom, "acc": v["acc"], "auc": v.get("auc", np.nan),
                             "bytes_per_round": float(np.mean(np.add(met["bytes_up_per_round"], met["bytes_down_per_round"]))),
                             "up_per_client_round": float(np.mean(up)) / len(met["per_client"]) if up else 0.0,
                             "model_param_bytes": float(met.get("model_param_bytes", np.nan))})
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


def communication_table(df: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """MiB uploaded per client per federated round, its ratio to the backbone, and the saving against FedAvg."""
    g = df.groupby("method")[["up_per_client_round", "model_param_bytes"]].mean().reindex(methods)
    out = pd.DataFrame(index=g.index)
    out["upload_MiB"] = g["up_per_client_round"] / 2**20
    out["backbone_MiB"] = g["model_param_bytes"] / 2**20
    out["ratio"] = g["up_per_client_round"] / g["model_param_bytes"]
    if "fedavg" in out.index and out.loc["fedavg", "upload_MiB"] > 0:
        out["saving_vs_fedavg"] = 1.0 - out["upload_MiB"] / out.loc["fedavg", "upload_MiB"]
    return out


def communication_markdown(tab: pd.DataFrame, title: str) -> str:
    has_saving = "saving_vs_fedavg" in tab.columns
    head = "| method | uploaded MiB per client per federated round | backbone MiB | ratio |" + (" saving vs FedAvg |" if has_saving else "")
    lines = [f"### {title}", "", head, "|---|---|---|---|" + ("---|" if has_saving else "")]
    for m, r in tab.iterrows():
        cells = [f"{r['upload_MiB']:.3f}", f"{r['backbone_MiB']:.3f}", f"{r['ratio']:.2f}"]
        if has_saving:
            cells.append(f"{r['saving_vs_fedavg'] * 100:.1f} %")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bar_figure(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _line_figure(path: Path, series: list[tuple[str, list[float], list[float]]], ylabel: str, title: str) -> str:
    """One PNG with a line per (label, x, y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, x, y in series:
        ax.plot(x, y, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _plots(out: Path, experiment: str, methods: list[str], seeds: list[int], histories: dict) -> list[str]:
    def evals(m: str, s: int) -> list[dict]:
        return [e for e in histories[(m, s)] if "eval" in e]

    made = []
    series = []
    for m in methods:
        rounds = [e["round"] for e in evals(m, seeds[0])]
        series.append((m, rounds, list(np.mean([[e["mean_acc"] * 100 for e in evals(m, s)] for s in seeds], axis=0))))
    made.append(_line_figure(out / f"{experiment}_curves.png", series, "mean client test accuracy (%)", experiment))

    for m in methods:
        h0 = evals(m, seeds[0])
        rounds = [e["round"] for e in h0]
        series = [
            (dom, rounds, list(np.mean([[e["eval"][dom]["acc"] * 100 for e in evals(m, s)] for s in seeds], axis=0)))
            for dom in h0[0]["eval"]
        ]
        made.append(_line_figure(out / f"{experiment}_{m}_domains.png", series, "test accuracy (%)", f"{experiment}: {m}"))

    series = []
    for m in methods:
        h = histories[(m, seeds[0])]
        series.append((m, [e["round"] for e in h], [(e["bytes_up_total"] + e["bytes_down_total"]) / 2**20 for e in h]))
    made.append(_line_figure(out / f"{experiment}_bytes.png", series, "MiB sent per round (up + down)", f"{experiment}: communication"))
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
            comm = communication_table(df, methods)
            comm_md = communication_markdown(comm, f"{exp}: upload per federated round (measured payloads)")
            md += "\n" + comm_md
            (tmp / f"{exp}_communication.md").write_text(comm_md)
            comm.to_csv(tmp / f"{exp}_communication.csv", float_format="%.10g")
            (tmp / f"{exp}_accuracy.md").write_text(md)
            flat = acc.copy()
            flat.columns = [f"{col}_{stat}" for stat, col in flat.columns]
            flat.index.name = "method"
            flat.to_csv(tmp / f"{exp}_accuracy.csv", float_format="%.4f")
            (tmp / f"{exp}_accuracy.tex").write_text(to_latex(acc, f"{exp}: test accuracy (\\%), mean $\\pm$ std over seeds"))
            figs = _plots(tmp, exp, methods, seeds, histories)
            figs.append(_bar_figure(tmp / f"{exp}_communication.png", methods, comm["upload_MiB"].fillna(0).tolist(),
                                    "MiB uploaded per client per federated round", f"{exp}: communication"))
            index += [md, ""] + [f"![{f}]({f})" for f in figs] + [""]
            made[exp] = {"table": acc["mean"]["Avg"].to_dict(), "figures": figs, "communication": comm.to_dict(orient="index")}
        (tmp / "README.md").write_text("\n".join(index) + "\n")
    return made
