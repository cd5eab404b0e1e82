"""The report's figures (PNG, matplotlib's Agg backend): curves per round, per-domain curves, bytes and upload bars,
F²DC's Fig. 1 spectrum and pFedDB's Fig. 3 scatter."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.report.tables import domain_avg, seed_curve

log = logging.getLogger("fedsilo.report")


FIG1_METHODS = ("fedavg", "f2dc")  # F²DC Fig. 1: vanilla FL against F²DC


def fig1_spectrum(path: Path, spectra: dict[tuple[str, int], dict[str, list[float]]], methods: list[str], seeds: list[int], client: str, title: str) -> str:
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


def bar_figure(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
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
                 connect: bool = True, styles: dict[str, dict[str, Any]] | None = None,
                 xtick_positions: list[float] | None = None) -> str:
    """One PNG with a line per (label, x, y) and a dotted vertical line at each of ``marks`` (a stream's task
    boundaries). Rounds are whole numbers on the axis; ``xticks`` names the positions 0, 1, ... instead (a group's
    experiments; ``connect`` False: points only, for positions that are no scale). Past ten lines the colours come from a 20-colour map (the default repeats after ten); past three the
    legend stands beside the axes, not over the lines. ``styles``: a label's own matplotlib line settings (a paper's
    numbers dashed in the colour of ours); ``xtick_positions``: where ``xticks`` stand, for x values that are a
    setting's numbers (local epochs 1, 5, 10 spaced as numbers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    many = len(series) > 10
    beside = len(series) > 3
    fig, ax = plt.subplots(figsize=(8.5 if beside else 6, 4))
    colours = plt.get_cmap("tab20").colors if many else [None] * len(series)
    for (label, x, y), colour in zip(series, colours):
        style = {"color": colour, "marker": "o" if xticks else None, "linestyle": "-" if connect else "none",
                 **(styles or {}).get(label, {})}
        ax.plot(x, y, label=label, **style)
    for x in marks:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    if xticks:
        slant = sum(map(len, xticks)) > 60  # long names side by side overlap
        ax.set_xticks(xtick_positions if xtick_positions is not None else range(len(xticks)), xticks,
                      rotation=30 if slant else 0, ha="right" if slant else "center")
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


def round_figures(out: Path, experiment: str, methods: list[str], seeds: list[int], histories: dict,
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
        # where every client scored a validation set each evaluated round: the same per domain on it (pFedDB's
        # appendix Fig. 2 plots the per-domain validation accuracy)
        if all("val_acc" in v for k in seeds for e in evals(m, k) for v in e["eval"].values()):
            series = [(dom, *seed_curve(histories, m, seeds, lambda e, cs=cs: float(np.mean([e["eval"][c]["val_acc"] for c in cs])) * 100))
                      for dom, cs in groups.items()]
            made.append(line_figure(out / f"{experiment}_{m}_domains_val.png", series, "validation accuracy per domain (%)",
                                    f"{experiment}: {m}"))

    series = []
    for m in methods:
        h = histories[(m, seeds[0])]
        series.append((m, [e["round"] for e in h], [(e["bytes_up_total"] + e["bytes_down_total"]) / 2**20 for e in h]))
    made.append(line_figure(out / f"{experiment}_bytes.png", series, "MiB sent per round (up + down)", f"{experiment}: bytes per round, every client"))
    return made


CXR4_PAIRS = (("CheXpert", "RSNA"), ("OpenI", "VinBigData"))


def fig3_scatter(path: Path, acc: pd.DataFrame, published: dict[str, Any] | None, title: str) -> str:
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
