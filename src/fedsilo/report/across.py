"""One table and figure across a run group's experiments (``runs.<g>.across``): the final Avg accuracy of each method
on each experiment, the experiments labelled by the setting that tells them apart (CD2-pFed's Fig. 5: local test
against the classes per client s; FedeCouple's Fig. 12: the join ratio; its Table XII: the local epochs on three
datasets, a row per dataset). Written by dvc.yaml's ``across_<g>`` stage (``fedsilo report --across <g>``, from the
report stages' accuracy tables) to ``results/<paper>/<scale>/across/<g>/``, and by ``fedsilo report --group <g>``
(from the runs) to ``results/<paper>/<scale>/groups/<g>/across/``:

- ``<g>_across.{md,csv}``: a row per method (per method and dataset where the experiments span several), a column per
  value of the setting, each cell the mean ± std over seeds of the Avg of the experiment's accuracy table (its mean
  local test on a label-skew split); with ``runs.<g>.published``, the paper's row under each of ours that it prints;
- ``<g>_across.png``: a line per row over the setting's values, in their order where they are numbers (the paper's
  dashed, in the colour of ours).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from fedsilo.report.figures import line_figure
from fedsilo.report.tables import ReportError, mean_pm, over_seeds
from fedsilo.utils.io import atomic_dir

log = logging.getLogger("fedsilo.report")


def differing(settings: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The keys whose values differ among the experiments' settings, each with its name for a reader (without its
    ``split.`` / ``train.`` prefix where that leaves it unambiguous)."""
    keys = sorted({k for s in settings.values() for k in s})
    differ = [k for k in keys if len({repr(s.get(k)) for s in settings.values()}) > 1]
    short = {k: k.split(".", 1)[1] if "." in k else k for k in differ}
    return short if len(set(short.values())) == len(short) else {k: k for k in differ}


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


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
    if all(_number(s.get(k)) is not None for s in settings.values()):
        order = sorted(order, key=lambda e: settings[e][k])
    return {e: f"{name} {s.get(k)}" for e, s in settings.items()}, order, (name, {e: str(s.get(k)) for e, s in settings.items()})


def across_columns(group: str, blocks: dict[str, list[str]], settings: dict[str, dict[str, Any]]
                   ) -> tuple[dict[str, str], list[str], Optional[tuple[str, dict[str, str]]]]:
    """The table's columns: each experiment's column label, the columns in order, and the axis (the setting's name
    and each column's value of it; None where the columns are the experiments' names). ``blocks``: dataset -> its
    experiments (:func:`fedsilo.config.across_blocks`). Across several datasets each dataset's experiments must
    differ in one and the same setting, whose values are the columns (FedeCouple's Table XII: local epochs 1 ... 10
    on CIFAR-10, CINIC-10 and Fashion-MNIST)."""
    for d, exps in blocks.items():  # two experiments of a dataset in one column would overwrite each other
        seen: dict[str, str] = {}
        for e in exps:
            key = repr(sorted(settings[e].items()))
            if key in seen:
                raise ReportError(f"runs.{group}.across: '{seen[key]}' and '{e}' on {d} have the same settings (one "
                                  "column would hold both): keep one of them")
            seen[key] = e
    if len(blocks) == 1:
        (exps,) = blocks.values()
        labels, order, axis = experiment_labels({e: settings[e] for e in exps})
        return labels, [labels[e] for e in order], (axis[0], {labels[e]: v for e, v in axis[1].items()}) if axis else None
    col_of: dict[str, str] = {}
    values: dict[str, str] = {}
    names = set()
    for d, exps in blocks.items():
        short = differing({e: settings[e] for e in exps})
        if len(short) != 1:
            raise ReportError(f"runs.{group}.across: on {d} the experiments {', '.join(exps)} differ in "
                              f"{', '.join(short.values()) or 'nothing'}; across several datasets each dataset's "
                              "experiments differ in one and the same setting (its values are the columns)")
        (k, name), = short.items()
        names.add(name)
        for e in exps:
            col_of[e] = f"{name} {settings[e].get(k)}"
            values[col_of[e]] = str(settings[e].get(k))
    if len(names) > 1:
        raise ReportError(f"runs.{group}.across: the datasets' experiments differ in {', '.join(sorted(names))}; across "
                          "several datasets they differ in one and the same setting (its values are the columns)")
    cols = list(dict.fromkeys(col_of.values()))
    if all(_number(v) is not None for v in values.values()):
        cols.sort(key=lambda c: float(values[c]))
    return col_of, cols, (names.pop(), values)


def published_rows(group: str, entry: dict[str, Any], ref: str, axis: Optional[tuple[str, dict[str, str]]],
                   rows: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, float]]:
    """The paper's numbers (``published.yaml``'s ``across`` entry: ``setting`` and ``methods: {method: {dataset:
    {value: mean}}}``) as (method, dataset) -> column -> mean, checked against the table: the same setting, and
    every method and dataset one of its rows (a key that names none would vanish from the table unseen)."""
    if axis is None:
        raise ReportError(f"runs.{group}.published ({ref}): the group's experiments differ in several settings; the "
                          "paper's numbers need one setting whose values are the columns")
    name, values = axis
    if entry.get("setting") != name:
        raise ReportError(f"runs.{group}.published ({ref}): setting '{entry.get('setting')}' but the group's experiments "
                          f"differ in '{name}'")
    by_value = {}
    for col, v in values.items():
        by_value[_number(v) if _number(v) is not None else v] = col
    out: dict[tuple[str, str], dict[str, float]] = {}
    methods = entry.get("methods")
    if not isinstance(methods, dict) or not all(isinstance(per, dict) for per in methods.values()):
        raise ReportError(f"runs.{group}.published ({ref}): methods: a mapping method -> dataset -> {{value: mean}}")
    for m, per_dataset in methods.items():
        for d, cells in per_dataset.items():
            if (m, d) not in rows:
                ours = sorted({b for _, b in rows})
                why = (f"; the paper's numbers are of {d}, this group's experiments of {', '.join(ours)}: they cannot "
                       "stand beside each other (leave published out at this scale)") if d not in ours else ""
                raise ReportError(f"runs.{group}.published ({ref}): methods.{m}.{d}: no such row of the table (its "
                                  f"rows: {', '.join(f'{a} on {b}' for a, b in rows)}){why}")
            if not isinstance(cells, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in cells.values()):
                raise ReportError(f"runs.{group}.published ({ref}): methods.{m}.{d}: a mapping {name} value -> the paper's "
                                  f"mean (a number), not {cells!r}")
            row = {}
            for v, mean in cells.items():
                key = _number(v) if _number(v) is not None else str(v)
                if key not in by_value:
                    raise ReportError(f"runs.{group}.published ({ref}): methods.{m}.{d}: {name} {v} is none of the "
                                      f"group's experiments ({', '.join(values.values())})")
                row[by_value[key]] = float(mean)
            out[(m, d)] = row
    return out


def build_across_report(group: str, blocks: dict[str, list[str]], avg: dict[str, pd.DataFrame],
                        settings: dict[str, dict[str, Any]], methods: list[str], seeds: list[int], out_dir: Path,
                        published: Optional[tuple[dict[str, Any], str]] = None) -> dict[str, Any]:
    """The table and figure of ``methods`` across the experiments of ``blocks`` (dataset -> its experiments),
    labelled from ``settings`` (:func:`across_columns`). ``avg``: experiment -> a table indexed by method with the
    ``mean`` and ``std`` over seeds of its Avg. ``published``: the paper's ``across`` entry and its reference.
    Returns the table's means (by row label) and its columns."""
    col_of, cols, axis = across_columns(group, blocks, settings)
    several = len(blocks) > 1
    rows = [(m, d) for d in blocks for m in methods]
    label = {r: f"{r[0]} on {r[1]}" if several else r[0] for r in rows}
    mean = pd.DataFrame(np.nan, index=[label[r] for r in rows], columns=cols)
    std = mean.copy()
    for (m, d) in rows:
        for e in blocks[d]:
            if m not in avg[e].index:  # every run of the group is in its experiments' tables (the report stages need them)
                raise ReportError(f"runs.{group}: {m} is not in {e}'s accuracy table (its rows: {', '.join(map(str, avg[e].index))})")
            mean.loc[label[(m, d)], col_of[e]] = avg[e].loc[m, "mean"]
            std.loc[label[(m, d)], col_of[e]] = avg[e].loc[m, "std"]
    paper = published_rows(group, *published, axis, rows) if published else {}
    title = f"{group}: Avg test accuracy (%) across its experiments, {over_seeds(seeds)}"
    lines = [f"### {title}", ""]
    where = []  # what sets each column's experiment apart
    for d, exps in blocks.items():
        short = differing({e: settings[e] for e in exps})
        named = axis is None  # columns named by the experiments: each with its settings apart
        said = ("; " if named else ", ").join(
            f"{e}: " + ", ".join(f"{short[k]} {settings[e].get(k)}" for k in short) if named else f"{col_of[e]}: {e}"
            for e in sorted(exps, key=lambda e: cols.index(col_of[e])))
        where.append(f"{d}: {said}" if several else said)
    lines += ["Columns: " + "; ".join(where) + ".", ""]
    if axis is None:  # no one setting is the axis: say so where a reader meant a sweep
        apart = sorted({v for exps in blocks.values() for v in differing({e: settings[e] for e in exps}).values()})
        note = (f"**Several settings apart**: the experiments differ in {', '.join(apart)}, so the columns are named by "
                "experiment and are no one setting's values (a sweep of one setting keeps the others equal).")
        lines += [note, ""]
        log.warning("runs.%s.across: the experiments differ in %s; the columns are named by experiment", group, ", ".join(apart))
    lines += ([f"paper: {published[0].get('source', '')} ({published[1]}); each paper row stands under ours.", ""] if published
              else ["No published numbers beside these (`runs.<group>.published`; a quickstart's experiments are not the paper's).", ""])
    head = ["method", *(["dataset"] if several else []), *cols]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    csv_rows = []  # tidy: a row per method, dataset, source and column, the column's setting and value beside it

    def cells(m: str, d: str, source: str, mean_of: Any, std_of: Any) -> list[dict[str, Any]]:
        return [{"method": m, "dataset": d, "source": source, "column": c, "setting": axis[0] if axis else "experiment",
                 "value": axis[1][c] if axis else c, "mean": mean_of(c), "std": std_of(c)} for c in cols]

    for r in rows:
        m, d = r
        lead = [m, *([d] if several else [])]
        lines.append("| " + " | ".join([*lead, *(mean_pm(mean.loc[label[r], c], std.loc[label[r], c], ".1f") for c in cols)]) + " |")
        csv_rows += cells(m, d, "ours", lambda c, r=r: mean.loc[label[r], c], lambda c, r=r: std.loc[label[r], c])
        if r in paper:
            lines.append("| " + " | ".join(["paper", *([d] if several else []),
                                            *(f"{paper[r][c]:.2f}" if c in paper[r] else "–" for c in cols)]) + " |")
            csv_rows += cells(m, d, "paper", lambda c, r=r: paper[r].get(c, np.nan), lambda c: np.nan)
    md = "\n".join(lines) + "\n"
    with atomic_dir(out_dir) as tmp:
        (tmp / f"{group}_across.md").write_text(md)
        pd.DataFrame(csv_rows).to_csv(tmp / f"{group}_across.csv", index=False, float_format="%.4f")
        numeric = _numbers(axis)
        xs = [float(axis[1][c]) for c in cols] if numeric else list(range(len(cols)))
        series, styles = [], {}
        palette = [f"C{i}" for i in range(10)] if len(rows) <= 10 else [tuple(c) for c in _tab20()]
        for i, r in enumerate(rows):
            colour = palette[i % len(palette)]
            series.append((label[r], xs, [float(v) for v in mean.loc[label[r], cols]]))
            styles[label[r]] = {"color": colour}
            if r in paper:
                series.append((f"{label[r]} (paper)", xs, [paper[r].get(c, np.nan) for c in cols]))
                styles[f"{label[r]} (paper)"] = {"color": colour, "linestyle": "--", "marker": "x"}
        if not numeric:  # settings that are no scale: points only
            styles = {k: {**v, "linestyle": "none"} for k, v in styles.items()}
        line_figure(tmp / f"{group}_across.png", series, "Avg test accuracy (%)", title.split(",")[0],
                    xlabel=axis[0] if axis else "experiment", xticks=[axis[1][c] for c in cols] if axis else cols,
                    connect=numeric, styles=styles, xtick_positions=xs if numeric else None)
    return {"table": mean.to_dict(orient="index"), "columns": cols, "paper": {label[r]: v for r, v in paper.items()}}


def _tab20() -> list:
    import matplotlib

    return list(matplotlib.colormaps["tab20"].colors)


def _numbers(axis: Optional[tuple[str, dict[str, str]]]) -> bool:
    """Whether an axis's values are all numbers (a scale a line may join)."""
    return axis is not None and all(_number(v) is not None for v in axis[1].values())


def avg_from_csv(path: Path, experiment: str) -> pd.DataFrame:
    """An experiment's Avg (``mean``, ``std`` over seeds, by method) from the report stage's ``<e>_accuracy.csv``."""
    if not path.is_file():
        raise ReportError(f"{path}: not found; the across table reads the report stage's accuracy table of "
                          f"{experiment} (`dvc repro` its report@{experiment} first)")
    df = pd.read_csv(path, index_col="method")
    if "Avg_mean" not in df.columns:
        raise ReportError(f"{path}: no Avg_mean column (an accuracy table of the report stage has one)")
    return pd.DataFrame({"mean": df["Avg_mean"], "std": df.get("Avg_std", pd.Series(np.nan, index=df.index))})


__all__ = ["across_columns", "avg_from_csv", "build_across_report", "differing", "experiment_labels", "published_rows"]
