"""One table and figure across a run group's experiments (``fedsilo report --group <g>`` when the group spans
several): the final Avg accuracy of each method on each experiment, the experiments labelled by the setting that
tells them apart (CD2-pFed's Fig. 5: local test against the classes per client s; FedeCouple's Fig. 12: the join
ratio). Written to ``results/<paper>/<scale>/groups/<g>/across/``:

- ``<g>_across.{md,csv}``: a row per method, a column per experiment, each cell the mean ± std over seeds of the Avg
  of the experiment's accuracy table (its mean local test on a label-skew split);
- ``<g>_across.png``: a line per method over the experiments, in the order of the setting's values where they are
  numbers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from fedsilo.report.figures import line_figure
from fedsilo.report.tables import collect, mean_pm, over_seeds, summary_table
from fedsilo.utils.io import atomic_dir

log = logging.getLogger("fedsilo.report")


def differing(settings: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The keys whose values differ among the experiments' settings, each with its name for a reader (without its
    ``split.`` / ``train.`` prefix where that leaves it unambiguous)."""
    keys = sorted({k for s in settings.values() for k in s})
    differ = [k for k in keys if len({repr(s.get(k)) for s in settings.values()}) > 1]
    short = {k: k.split(".", 1)[1] if "." in k else k for k in differ}
    return short if len(set(short.values())) == len(short) else {k: k for k in differ}


def experiment_labels(settings: dict[str, dict[str, Any]]) -> tuple[dict[str, str], list[str], Optional[tuple[str, dict[str, str]]]]:
    """Each experiment's label from its settings (its split and train, flattened) where one key tells them apart,
    ``key value`` (:func:`differing`'s name for the key), with that key and each experiment's value of it (the
    figure's axis), the experiments in the order of the value where it is a number (else as given); where none or
    several do, their names and no axis."""
    short = differing(settings)
    if len(short) != 1:  # several settings apart (FedeCouple's join ratio: a fraction and a range): the names say it
        return {e: e for e in settings}, list(settings), None
    (k, name), = short.items()
    order = list(settings)
    if all(isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool) for s in settings.values()):
        order = sorted(order, key=lambda e: settings[e][k])
    return {e: f"{name} {s.get(k)}" for e, s in settings.items()}, order, (name, {e: str(s.get(k)) for e, s in settings.items()})


def build_across_report(group: str, results: dict[str, Path], settings: dict[str, dict[str, Any]], methods: list[str],
                        seeds: list[int], out_dir: Path) -> dict[str, Any]:
    """The table and figure of ``methods`` across the experiments of ``results`` (experiment -> its results
    folder), labelled from ``settings`` (:func:`experiment_labels`). Returns the table's means."""
    labels, order, axis = experiment_labels(settings)
    mean, std = pd.DataFrame(index=methods, dtype=float), pd.DataFrame(index=methods, dtype=float)
    for e in order:
        df, _ = collect(results[e], methods, seeds)
        tab = summary_table(df, "acc", methods)
        mean[labels[e]] = tab[("mean", "Avg")]
        std[labels[e]] = tab[("std", "Avg")]
    cols = [labels[e] for e in order]
    title = f"{group}: Avg test accuracy (%) across its experiments, {over_seeds(seeds)}"
    lines = [f"### {title}", ""]
    short = differing(settings)
    if short:  # what sets each column's experiment apart
        lines += ["Columns: " + "; ".join(f"{labels[e]}: {e}" if labels[e] != e else
                                          f"{e}: " + ", ".join(f"{short[k]} {settings[e].get(k)}" for k in short)
                                          for e in order) + ".", ""]
    lines += ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(mean_pm(mean.loc[m, c], std.loc[m, c], ".1f") for c in cols) + " |" for m in methods]
    md = "\n".join(lines) + "\n"
    with atomic_dir(out_dir) as tmp:
        (tmp / f"{group}_across.md").write_text(md)
        flat = pd.concat({"mean": mean, "std": std}, axis=1)
        flat.columns = [f"{col}_{stat}" for stat, col in flat.columns]
        flat.index.name = "method"
        flat.to_csv(tmp / f"{group}_across.csv", float_format="%.4f")
        xs = list(range(len(order)))
        series = [(m, xs, [float(mean.loc[m, c]) if not pd.isna(mean.loc[m, c]) else np.nan for c in cols]) for m in methods]
        # one setting apart: it names the axis, its values the ticks
        line_figure(tmp / f"{group}_across.png", series, "Avg test accuracy (%)", title.split(",")[0],
                     xlabel=axis[0] if axis else "experiment", xticks=[axis[1][e] for e in order] if axis else cols,
                     connect=_numbers(axis))  # settings that are no scale: points only
    return {"table": mean.to_dict(orient="index"), "columns": cols}


def _numbers(axis: Optional[tuple[str, dict[str, str]]]) -> bool:
    """Whether an axis's values are all numbers (a scale a line may join)."""
    if axis is None:
        return False
    try:
        [float(v) for v in axis[1].values()]
    except ValueError:
        return False
    return True


__all__ = ["build_across_report", "differing", "experiment_labels"]
