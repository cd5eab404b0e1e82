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
  several domains), and ``<experiment>_<method>_domains_val.png`` the same on the validation sets where every client
  scored one (pFedDB's appendix Fig. 2);
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
  Single, pFedDB and a two-phase FedAvg variant ``<experiment>_fig5_two_phase.png`` (the average validation accuracy
  per round, as the paper's Fig. 5, where the split scored a validation set; else test); when ``results/<experiment>/
  onboarding/`` exists, ``<experiment>_fig6_onboarding.png`` and ``<experiment>_onboarding.md`` (pFedDB Figs. 3-6).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd

from fedsilo.report import figures
from fedsilo.report.figures import CXR4_PAIRS, FIG1_METHODS
from fedsilo.report.tables import (
    METRIC_COLUMNS,
    METRIC_COLUMNS_INV,
    ReportError,
    by_domain,
    client_domains,
    collapse_markdown,
    collapse_table,
    collect_clients,
    collect_spectra,
    communication_markdown,
    communication_table,
    data_origin_note,
    indistinct_rows,
    latex_text,
    local_new_external,
    local_new_external_markdown,
    one_class_clients,
    over_seeds,
    per_client_accuracy,
    seed_curve,
    standard_errors,
    standard_errors_markdown,
    summary_table,
    time_to_accuracy,
    time_to_accuracy_markdown,
    to_latex,
    to_markdown,
    write_flat_csv,
    write_runs_behind,
)
from fedsilo.report.versus import (
    efficiency_markdown,
    has_domain_std,
    load_published_entries,
    paper_selection,
    runs_backbones,
    settings_differ,
    time_to_accuracy_versus,
    time_to_accuracy_versus_markdown,
    variant_drift,
    versus_paper,
    write_versus,
)
from fedsilo.utils.io import atomic_dir, read_json

log = logging.getLogger("fedsilo.report")


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
            md = data_origin_note(results, methods, seeds) + to_markdown(acc, f"{exp}: test accuracy (%), {over_seeds(seeds)}")
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
                write_flat_csv(best_acc, tmp / f"{exp}_accuracy_best_val.csv", seeds_per_method)
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
            for col, key in (("paper_param_MB", "param_MB"), ("paper_ratio", "ratio")):  # pFedDB Table 3's Param and Ratio
                printed = {m: float(row[key]) for m, row in ((entries.get("accuracy") or {}).get("methods") or {}).items()
                           if key in (row or {}) and m in comm.index}
                if printed:
                    comm[col] = pd.Series(printed, dtype=float).reindex(comm.index)
            comm_md = communication_markdown(comm, f"{exp}: upload per client per federated round (measured payloads)")
            md += "\n" + comm_md
            (tmp / f"{exp}_communication.md").write_text(comm_md)
            comm.to_csv(tmp / f"{exp}_communication.csv", float_format="%.10g")
            (tmp / f"{exp}_accuracy.md").write_text(md)
            write_flat_csv(acc, tmp / f"{exp}_accuracy.csv", seeds_per_method)
            (tmp / f"{exp}_accuracy.tex").write_text(to_latex(acc, f"{latex_text(exp)}: test accuracy (\\%), {over_seeds(seeds, latex=True)}"))
            figs = figures.round_figures(tmp, exp, methods, seeds, histories, client_domains(results, methods[0], seeds[0]))
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
                    figs.append(figures.fig1_spectrum(tmp / f"{exp}_fig1_spectrum.png", spectra, list(FIG1_METHODS), seeds, first,
                                      f"{exp}: singular values of the representation covariance"))
            figs.append(figures.bar_figure(tmp / f"{exp}_communication.png", methods, comm["upload_MiB"].fillna(0).tolist(),
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
                figs.append(figures.fig3_scatter(tmp / f"{exp}_fig3_scatter.png", acc, paper, exp))
            onboard = sorted((results / "onboarding").glob("seed*/onboarding.json"))
            if onboard:
                runs = [read_json(f) for f in onboard]
                order = ("freeze_global", "finetune_all", "from_scratch")
                strategies = sorted(runs[0]["accuracy_per_round"], key=lambda k: order.index(k) if k in order else len(order))
                series = [
                    (s, list(range(1, runs[0]["rounds"] + 1)), list(np.mean([[a * 100 for a in r["accuracy_per_round"][s]] for r in runs], axis=0)))
                    for s in strategies
                ]
                figs.append(figures.line_figure(tmp / f"{exp}_fig6_onboarding.png", series, f"{runs[0]['newcomer']} test accuracy (%)",
                                         f"{exp}: newcomer {runs[0]['newcomer']} joins"))
                lines = [f"### {exp}: onboarding of {runs[0]['newcomer']} (final accuracy %, mean over {len(runs)} seed(s))", "",
                         "| strategy | accuracy |", "|---|---|"]
                lines += [f"| {s} | {np.mean([r['final'][s] for r in runs]) * 100:.1f} |" for s in strategies]
                (tmp / f"{exp}_onboarding.md").write_text("\n".join(lines) + "\n")
                md += "\n" + "\n".join(lines) + "\n"
            two_phase = [m for m in methods if (method_entries or {}).get(m) and (method_entries[m] or {}).get("method", m) == "fedavg"
                         and (method_entries[m] or {}).get("local_rounds", 0) > 0]
            if two_phase and "single" in methods and "pfeddb" in methods:
                three = ("single", two_phase[0], "pfeddb")
                # the paper's Fig. 5 plots the average validation accuracy: ours too where the split scored one
                val = all("mean_val_acc" in e for m in three for k in seeds for e in histories[(m, k)] if "eval" in e)
                key, what = ("mean_val_acc", "validation") if val else ("mean_acc", "test")
                series = [(m, *seed_curve(histories, m, seeds, lambda e, key=key: e[key] * 100)) for m in three]
                figs.append(figures.line_figure(tmp / f"{exp}_fig5_two_phase.png", series, f"average {what} accuracy (%)",
                                         f"{exp}: Single, FedAvg (two-phase), pFedDB"))
            md += "\n" + write_runs_behind(results, methods, seeds, tmp, exp)
            index += [md, ""] + [f"![{f}]({f})" for f in figs] + [""]
            made[exp] = {"table": acc["mean"]["Avg"].to_dict(), "figures": figs, "communication": comm.to_dict(orient="index")}
        (tmp / "README.md").write_text("\n".join(index) + "\n")
    return made
