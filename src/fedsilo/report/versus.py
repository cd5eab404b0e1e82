"""A paper's published numbers beside ours: the published entries (``published.yaml#<table>``), the vs-paper tables
of accuracy, cost and time to a target, and the notes that say where our runs differ from the paper's (model
selection, settings, variants, backbone, scale)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsilo.config import RESERVED_DOMAINS
from fedsilo.report.tables import ReportError
from fedsilo.utils.io import read_json

log = logging.getLogger("fedsilo.report")


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


def load_published_across(root: Path, ref: str) -> dict[str, Any]:
    """``<file>#<key>`` -> the file's ``across`` entry of that key (the paper's numbers of a table across a run
    group's experiments: ``source``, ``setting`` and ``methods: {method: {dataset: {value: mean}}}``)."""
    doc, path, key = published_entry(root, ref)
    entry = (doc.get("across") or {}).get(key)
    if not isinstance(entry, dict):
        raise ReportError(f"published: {path} has no across table {key!r} (has: {', '.join(doc.get('across') or {}) or 'none'})")
    return entry


def load_published(root: Path, ref: str) -> dict[str, Any] | None:
    """``<file>#<table>`` -> its accuracy table (see :func:`load_published_entries`)."""
    return load_published_entries(root, ref)["accuracy"]


def row_widths(columns: list[Any], avg: bool) -> list[int]:
    """How many values a published row's ``mean`` may hold (the one rule for check-params and the report): one per
    column, then the Avg, or the Avg alone, where the columns are domains (``avg``); one per column where they are
    metrics (CD2-pFed's local / new / external test)."""
    return [len(columns) + 1, 1] if avg else [len(columns)]


def published_table_problems(table: dict[str, Any], domains: list[str] | None = None) -> list[str]:
    """What is wrong with a published accuracy table, found before any run trains (the report stage finds it only
    after all of them): ``domains`` a list, each one of the experiment's ``domains`` where params say them (None: its
    folders decide), or all of them the local / new / external test columns; each ``methods.<m>.mean`` one value
    per column, plus the Avg where the columns are domains, or the Avg alone; ``std`` as long as ``mean``."""
    from fedsilo.config import did_you_mean
    from fedsilo.report.tables import METRIC_COLUMNS

    cols = table.get("domains")
    if not isinstance(cols, list) or not cols:
        return ["domains: give the table's columns as a list (the domains, or local / new / external test)"]
    metrics = set(cols) <= set(METRIC_COLUMNS)
    out = [f"domains: '{d}' is not a domain of this experiment{did_you_mean(d, domains)} (its domains: {', '.join(domains)})"
           for d in cols if not metrics and domains is not None and d not in domains]
    want = row_widths(cols, avg=not metrics)
    methods = table.get("methods")
    if not isinstance(methods, dict):
        return out + ["methods: give the paper's rows as a mapping method -> {mean: [...], std: [...]}"]
    for m, row in methods.items():
        mean, std = (row or {}).get("mean"), (row or {}).get("std")
        if mean is None:
            continue  # a row of other numbers only (pFedDB's Table 3: parameters and ratio)
        if not isinstance(mean, list) or len(mean) not in want:
            n = len(mean) if isinstance(mean, list) else 1
            out.append(f"methods.{m}.mean: {n} value(s) for the columns {cols}; give "
                       + (f"{len(cols)}" if metrics else f"{len(cols) + 1} (each column, then the Avg) or 1 (the Avg alone)"))
        elif std is not None and (not isinstance(std, list) or len(std) != len(mean)):
            out.append(f"methods.{m}.std: {len(std) if isinstance(std, list) else 1} value(s) for {len(mean)} means")
    return out


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
        if len(vals) not in row_widths(published["domains"], avg):
            raise ReportError(f"published: methods.{m}.mean has {len(vals)} values for {len(domains)} columns ({domains})")
        if len(vals) == 1 and avg:  # an Avg-only row (a sensitivity table that prints the mean over domains alone)
            return float(vals[0]) if i == len(domains) - 1 else float("nan")
        return float(vals[i])

    def paper_std(m: str, i: int) -> float:
        row = published["methods"].get(m) or {}
        vals = row.get("std") or []
        return float(vals[i]) if len(vals) == len(domains) and len(row.get("mean") or []) == len(domains) else float("nan")

    printed_std = any(len((published["methods"].get(m) or {}).get("std") or []) == len(domains) for m in rows)
    for i, d in enumerate(domains):
        paper = pd.Series({m: paper_value(m, i) for m in rows}, dtype=float)
        cols[(d, "ours")] = ours.loc[rows, d]
        cols[(d, "paper")] = paper
        cols[(d, "diff")] = ours.loc[rows, d] - paper
        if printed_std:  # the paper's spread over its runs, where it prints one (pFedDB's appendix, FedeCouple, ...)
            cols[(d, "paper_std")] = pd.Series({m: paper_std(m, i) for m in rows}, dtype=float)
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
    spread = any(c[1] == "paper_std" for c in tab.columns)
    lines = [f"### {title}", "", "Each cell: ours / paper (ours - paper), accuracy %"
             + ("; the paper's ± is the spread over its runs where it prints one (ours: the accuracy tables)." if spread else "."), "",
             "| method | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]

    def theirs(r: pd.Series, d: str) -> str:
        sd = r.get((d, "paper_std"), np.nan)
        return f"{r[(d, 'paper')]:.1f}" + ("" if pd.isna(sd) else f" ± {sd:.1f}")

    for m, r in tab.iterrows():
        lines.append(f"| {m} | " + " | ".join(
            f"{r[(d, 'ours')]:.1f} / {theirs(r, d)} ({r[(d, 'diff')]:+.1f})" if not pd.isna(r[(d, "paper")]) else f"{r[(d, 'ours')]:.1f} / –"
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
            "pipeline at work on this scale's data, not whether the paper's numbers reproduce.")


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


# the settings warnings this process has printed, per experiment (a paper's report writes a table of an experiment per
# run group, each with the same rows; another experiment's same line is its own warning)
_SAID: set[tuple[str, str]] = set()


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
        for line in settings:  # once an experiment (its group tables each state it under their own title)
            if (exp, line) not in _SAID:
                _SAID.add((exp, line))
                log.warning("%s: %s: not the paper's setting for that row", exp, line)
        md = md.replace("\n\n|", "\n\n**Not the paper's setting**: " + "; ".join(settings) + " (the difference on those rows "
                        "is not the paper's comparison).\n\n|", 1)
    # a run the paper has no row of, set beside another method's (published.yaml's ``row_of``: F²DC's authors' code
    # settings beside the paper's F²DC row): said above the table, as a setting of ours that is not the paper's
    rows = (paper or {}).get("methods") or {}
    stand_ins = [f"{m} (the paper's {(rows.get(m) or {})['row_of']} row)" for m in vs.index if (rows.get(m) or {}).get("row_of")]
    if stand_ins:
        md = md.replace("\n\n|", "\n\n**Set beside another method's row**: " + "; ".join(stand_ins) + ": the paper has no row "
                        "of these runs, whose settings are not that row's; the difference is not the paper's comparison.\n\n|", 1)
    unmatched = [str(m) for m in (paper or {}).get("methods") or {} if m not in vs.index]
    if unmatched:  # a method not run here, or a key misspelt in the published file: said, not dropped without a word
        md = md.rstrip("\n") + ("\n\n**The paper's rows with no run here**: " + ", ".join(unmatched) + " (methods this "
                                 f"report does not hold, or keys of {published.partition('#')[0]} that name none of ours).\n")
    (out / f"{exp}_vs_paper.md").write_text(md)
    vs.columns = [f"{d}_{k}" for d, k in vs.columns]
    vs.index.name = "method"
    vs.to_csv(out / f"{exp}_vs_paper.csv", float_format="%.4f")
    return md
