"""``fedsilo``: one command per pipeline stage; dvc.yaml calls only this CLI.

    fedsilo fetch --source chexpert
    fedsilo fingerprint --dataset chest_xray4   # what harmonize@<dataset> depends on: its sources' content only
    fedsilo harmonize --dataset chest_xray4
    fedsilo split --experiment cxr4_quickstart
    fedsilo train --experiment cxr4_quickstart --method fedbn --seed 0
    fedsilo report --experiment cxr4_quickstart
    fedsilo check-params            # validate params.yaml and exit

Every command reads ``params.yaml`` (``--params`` to point elsewhere) and fails with a one-line message naming the
key, file, row or column at fault. The data commands (fetch, harmonize, split) validate every section but the method
entries, so they start without importing PyTorch (a second instead of four per stage); train, onboard, report and
check-params validate the method entries too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from fedsilo import config
from fedsilo.config import ConfigError, Params
from fedsilo.layout import Layout


def load_params(path: str | Path) -> config.Params:
    """Every section, the method entries by their own classes (imports the methods, hence PyTorch)."""
    from fedsilo.fl.params import load_params as load_with_methods

    return load_with_methods(path)


def _defined(params_file: Any, section: str, name: str, known: Any) -> None:
    """``name`` is defined under ``section`` of the params file, else a ConfigError naming the file, the dotted key
    and a near miss."""
    if name not in known:
        from fedsilo.config.errors import REGISTER_HINT
        from fedsilo.methods import REGISTRY

        hint = config.METHOD_ENTRY_HINT.format(m=name) if section == "methods" and name in REGISTRY else config.did_you_mean(name, known)
        if not hint and section in ("experiments", "datasets"):  # a paper's, named without its params file
            hint = config.errors.defined_elsewhere(params_file, section, name)
        if section == "methods" and name not in REGISTRY and not hint:  # perhaps a method of one's own not registered
            hint = REGISTER_HINT
        raise ConfigError(f"{params_file}: {section}.{name}: not defined{hint}")


def _fetch(args: argparse.Namespace) -> None:
    from fedsilo.data.fetch import fetch

    p = config.load_params(args.params)  # no method entries: no PyTorch import
    _defined(args.params, "sources", args.source, p.sources)
    # the reader's rules where a chest X-ray dataset takes the source (a local folder is read before it is copied)
    rules = next((d.rules(args.source) for d in p.datasets.values()
                  if isinstance(d, config.CXRDatasetParams) and args.source in d.sources), None)
    m = fetch(args.source, p.sources[args.source], Path(args.root) / "data" / "raw" / args.source, Path(args.root),
              quiet=args.quiet, rules=rules)
    print(f"fetch {args.source}: {len(m['files'])} files from {m['origin']}")


def _fingerprint(args: argparse.Namespace) -> None:
    from fedsilo.data.fetch import sources_fingerprint
    from fedsilo.utils.io import write_json

    p = config.load_params(args.params)  # no method entries: no PyTorch import
    _defined(args.params, "datasets", args.dataset, p.datasets)
    fp = sources_fingerprint(args.dataset, p.datasets[args.dataset].source_list, Path(args.root) / "data" / "raw")
    write_json(p.layout(args.root).sources_fingerprint(args.dataset), fp)
    for s, v in fp["sources"].items():
        print(f"fingerprint {args.dataset} {s}: {v['files']} files, {v['bytes']} bytes, sha256 {v['sha256'][:12]}")


def _code_fingerprint(args: argparse.Namespace) -> None:
    import os

    from fedsilo.codehash import (
        PACKAGE,
        TRAIN_CODE,
        code_sha256,
        method_code_files,
        train_code_files,
        train_code_sha256,
    )
    from fedsilo.methods.registry import method_base, method_class
    from fedsilo.utils.io import atomic_dir, write_json

    # the checkout's code, which DVC watches (the stage's deps), whichever fedsilo this interpreter imports
    pkg = Path(args.root).resolve() / "src" / "fedsilo"
    if not pkg.is_dir():
        raise ConfigError(f"{pkg}: no such folder: code-fingerprint hashes the training code of the checkout at --root "
                          "(the code_fingerprint stage of its dvc.yaml)")
    if pkg != PACKAGE and train_code_sha256(PACKAGE) != train_code_sha256(pkg):
        # the train stages would run the other copy's code while dvc.lock ties their results to this one's
        why = (f"fedsilo runs from {PACKAGE}, whose training code is not this checkout's {pkg}: its train stages would run "
               "that code, not the one hashed here; install this checkout (`pip install -e .` in it) or put its src/ first "
               f"(PYTHONPATH={pkg.parent})")
        if os.environ.get("DVC_STAGE"):  # under dvc repro: its dvc.lock would record the wrong code for every result
            raise ConfigError(why)
        print(f"fedsilo code-fingerprint: warning: {why}", file=sys.stderr)  # by hand: metrics.json names the code that ran
    p = load_params(args.params)
    layout = p.layout(args.root)
    if p.paper is None:  # the root's: the hash of all of the training code too (what a deployment's checkpoint holds)
        sha, files = train_code_sha256(pkg), train_code_files(pkg)
        write_json(layout.train_code(), {"parts": [f"src/fedsilo/{p}" for p in TRAIN_CODE], "files": len(files), "sha256": sha})
        print(f"code-fingerprint: {len(files)} source files of {', '.join(TRAIN_CODE)}, sha256 {sha[:12]}")
    # one file per method key: the code its runs depend on (a method added or edited reruns its own runs only)
    with atomic_dir(layout.method_code_dir()) as tmp:
        for key, entry in p.methods.items():
            base = method_base(key, entry)
            module = method_class(base).__module__
            files = method_code_files(module, pkg)
            write_json(tmp / f"{key}.json", {"method": key, "base": base, "module": module,
                                             "files": [f.relative_to(pkg).as_posix() for f in files],
                                             "sha256": code_sha256(files, pkg)})
    print(f"code-fingerprint: {len(p.methods)} methods' code -> {layout.method_code_dir()}")


def _harmonize(args: argparse.Namespace) -> None:
    from fedsilo.data.harmonize import HarmonizeError, harmonize_dataset, preview_dataset

    p = config.load_params(args.params)  # no method entries: no PyTorch import
    _defined(args.params, "datasets", args.dataset, p.datasets)
    if args.dry_run:
        pv = preview_dataset(p.datasets[args.dataset], Path(args.root) / "data" / "raw", args.dataset, quiet=args.quiet)
        for dom, d in pv["domains"].items():
            classes = ", ".join(f"{c} {n}" for c, n in d["by_class"].items())
            reasons = "; ".join(f"{r} {n}" for r, n in d["excluded_by_reason"].items()) or "none"
            missing = f"; {d['missing_files']} kept rows name no file (e.g. {', '.join(d['missing_examples'])})" if d["missing_files"] else ""
            print(f"{args.dataset} {dom}: {d['rows']} rows, {d['kept']} kept ({classes}), {d['excluded']} excluded ({reasons}){missing}")
        for w in pv["warnings"]:
            print(f"warning: datasets.{args.dataset}: {w}", file=sys.stderr)
        print(f"dry run: no image decoded, nothing written (`fedsilo harmonize --dataset {args.dataset}` decodes and writes; "
              "an undecodable file is quarantined then)")
        if pv["would_fail"]:
            raise HarmonizeError("harmonize would fail: " + "; ".join(pv["would_fail"]))
        return
    card = harmonize_dataset(p.datasets[args.dataset], Path(args.root) / "data" / "raw", Path(args.root) / "data" / "harmonized" / args.dataset, quiet=args.quiet)
    for dom, d in card["domains"].items():
        print(f"{args.dataset} {dom}: {d['images']} images ({d['by_class']}), {d['excluded']} excluded, {d['quarantined']} quarantined")
    for w in card.get("warnings", []):
        print(f"warning: datasets.{args.dataset}: {w}", file=sys.stderr)


def _split(args: argparse.Namespace) -> None:
    import numpy as np
    import pandas as pd

    from fedsilo.data.splits import SplitError, check_patient_disjoint, iter_sides, make_split
    from fedsilo.utils.io import read_json, write_json

    p = config.load_params(args.params)  # no method entries: no PyTorch import
    _defined(args.params, "experiments", args.experiment, p.experiments)
    exp = p.experiments[args.experiment]
    layout = p.layout(args.root)
    rec_path = layout.harmonized(exp.dataset) / "records.parquet"
    if not rec_path.exists():
        raise FileNotFoundError(f"{rec_path}: missing; run `dvc repro harmonize@{exp.dataset}` first")
    records = pd.read_parquet(rec_path)
    card = read_json(rec_path.parent / "card.json")
    try:
        split = make_split(records, exp.split, exp.split.seed)
    except SplitError as err:  # the params file and the whole dotted key, as every other params error names them
        msg = str(err)
        key = f"experiments.{args.experiment}." if msg.startswith("split") else f"experiments.{args.experiment}.split: "
        raise SplitError(f"{args.params}: {key}{msg}") from None
    split["data_sha256"] = card["sha256"]  # ties the split to the exact arrays it indexes
    # the model's outputs: the dataset's class list, even where its last classes have no image in these records (a
    # class list given in params, a domain filter)
    split["num_classes"] = max(split["num_classes"], len(card.get("classes") or ()))
    check_patient_disjoint(records, split)
    split["experiment"] = args.experiment
    split["dataset"] = exp.dataset
    write_json(layout.split(args.experiment), split)
    val = {c["name"]: len(c.get("val") or ()) for c in split["clients"]}  # FedBN's validation sets, where drawn
    labels = records["label"].to_numpy()
    few = split["num_classes"] <= 4  # a binary task's class counts on each side (the draws keep no class balance)

    def counts(rows: list[int]) -> str:
        if not few:
            return ""
        by = np.bincount(labels[rows], minlength=split["num_classes"]) if len(rows) else np.zeros(split["num_classes"], int)
        return " (" + " / ".join(f"{c}: {int(n)}" for c, n in enumerate(by)) + ")"

    for name, train, test in iter_sides(split):
        print(f"{args.experiment} {name}: {len(train)} train{counts(train)}" + (f" / {val[name]} val" if val.get(name) else "")
              + f" / {len(test)} test{counts(test)}")


def _train(args: argparse.Namespace) -> None:
    from fedsilo.fl.run import run_training

    p = load_params(args.params)
    m = run_training(p, args.experiment, args.method, args.seed, Path(args.root), quiet=args.quiet)
    per = ", ".join(f"{k} {v['acc']:.3f}" for k, v in m["per_client"].items())
    if "accuracy_matrix" in m:  # a stream: the paper's Avg (after each task, averaged), then the last evaluation's
        forgetting = "n/a" if m.get("forgetting") is None else f"{m['forgetting']:.3f}"
        print(f"{args.experiment} {args.method} seed {args.seed}: Avg {m['avg_acc']:.3f} (accuracy after each task, averaged), "
              f"forgetting {forgetting}; after the last task {m['final_acc']:.3f} over the tasks, per client ({per})")
        return
    print(f"{args.experiment} {args.method} seed {args.seed}: mean acc {m['mean_acc']:.3f} over the clients (std "
          f"{m['std_acc']:.3f} between them; the report's ± is over seeds) ({per})")


def _onboard(args: argparse.Namespace) -> None:
    from fedsilo.fl.onboard import run_onboarding

    p = load_params(args.params)
    _defined(args.params, "experiments", args.experiment, p.experiments)
    out = run_onboarding(p, args.experiment, args.seed, Path(args.root))
    print(f"{args.experiment} onboarding of {out['newcomer']} (seed {args.seed}): " + ", ".join(f"{s} {a:.3f}" for s, a in out["final"].items()))


def _refuse_missing_runs(p: Params, layout: Layout, source: str, what: str, runs: list[tuple[str, str]]) -> None:
    """Every (experiment, method) run of ``runs`` trained for every seed, with the params ``p`` sets for it now, or
    a ConfigError naming those that are not trained, or were trained with other params (a run left from before an
    edit: a table would give its numbers under the row of the edited method), and the one ``dvc repro`` command that
    trains them (this params file's stages)."""
    from fedsilo.fl.run import trained_otherwise

    every = [(e, m, k) for e, m in dict.fromkeys(runs) for k in p.pipeline.seeds]
    missing = [r for r in every if not (layout.run(*r) / "metrics.json").exists()]

    def listed(rs: list[tuple[str, str, int]]) -> str:
        return ", ".join(f"{e}/{m}/seed{k}" for e, m, k in rs[:6]) + (", ..." if len(rs) > 6 else "")

    params = f"--params {shlex.quote(str(source))} " if str(source) != "params.yaml" else ""  # for the commands named

    def train(rs: list[tuple[str, str, int]]) -> str:
        # the pipeline's own runs: its train stages; a method no stage trains on that experiment (report --methods), or
        # an experiment the pipeline does not train at all, by hand
        staged = [r for r in rs if r[0] in p.pipeline.experiments and r[1] in p.experiment_methods(r[0])]
        by_hand = [r for r in rs if r not in staged]
        cmds = ["dvc repro " + " ".join(shlex.quote(p.train_stage(*r)) for r in staged)] if staged else []
        cmds += [f"fedsilo {params}train --experiment {e} --method {m} --seed {k}" for e, m, k in by_hand]
        if len(staged) > 1:  # one after another; the grid trains the pipeline's out-of-date runs (these among them) at once
            cmds[0] += f" (or several at once: fedsilo {params}grid --jobs 2, every out-of-date run of the pipeline)"
        return "; ".join(cmds)

    if missing:
        done = {(e, m) for e, m, _ in every} - {(e, m) for e, m, _ in missing}
        exps = sorted({e for e, _ in done})
        trained = ("" if what != "report" or len(exps) != 1 else
                   f" (or report the methods trained for every seed: fedsilo {params}report --experiment {exps[0]} --methods "
                   + ",".join(m for e, m in dict.fromkeys((e, m) for e, m, _ in every) if (e, m) in done) + ")")
        raise ConfigError(f"{source}: {what}: {len(missing)} run(s) not trained yet ({listed(missing)}); train them: {train(missing)}{trained}")
    stale = trained_otherwise(p, layout, every)
    if stale:
        said = "; ".join(f"{e}/{m}/seed{k}: {', '.join(d[:4])}{', ...' if len(d) > 4 else ''}" for (e, m, k), d in list(stale.items())[:4])
        raise ConfigError(f"{source}: {what}: {len(stale)} run(s) trained with other params than the file sets now ({said}"
                          f"{'; ...' if len(stale) > 4 else ''}); retrain them: {train(list(stale))}")


def _report(args: argparse.Namespace) -> None:
    p = load_params(args.params)
    layout = p.layout(args.root)
    if args.sensitivity and args.group:
        raise ConfigError("--sensitivity and --group: one or the other (the sensitivity figures span every stream experiment)")
    if args.across:
        if args.group or args.sensitivity or args.experiment or args.methods is not None:
            raise ConfigError("--across: alone (one run group's table across its experiments)")
        _report_across(args, p)
        return
    if args.sensitivity:  # across streams: pFedDIL's Table 6 (lambda) and Fig. 2 (alpha)
        from fedsilo.report.continual import build_sensitivity_report, sensitivity_inputs

        inputs = sensitivity_inputs(p, layout, Path(args.root))
        runs = [(path.name, m) for by_lam in inputs["lam_runs"].values() for path, m in by_lam.values()]
        runs += [(path.name, m) for fam, by_alpha in inputs["families"].items() for path in by_alpha.values()
                 for m in inputs["family_methods"][fam]]
        _refuse_missing_runs(p, layout, args.params, "--sensitivity", runs)
        made = build_sensitivity_report(**inputs, seeds=list(p.pipeline.seeds), out_dir=layout.report("sensitivity"))
        print(f"report sensitivity: {', '.join(made['sensitivity']['figures'])} in {layout.report('sensitivity')}")
        return
    exps = [args.experiment] if args.experiment else list(p.pipeline.experiments)
    across: list[str] = []  # a group's experiments, for its table across them
    methods_of, out_of = p.experiment_methods, layout.report
    if args.methods is not None:  # a chosen set of one experiment, written apart from the report stages' outputs
        if not args.experiment or args.group:
            raise ConfigError("--methods: with --experiment and without --group (one experiment's chosen methods)")
        _defined(args.params, "experiments", args.experiment, p.experiments)
        if not args.methods:
            raise ConfigError("--methods: name at least one method")
        for m in args.methods:
            _defined(args.params, "methods", m, p.methods)
        chosen = list(dict.fromkeys(args.methods))
        methods_of, out_of = (lambda e: chosen), layout.selected_report
        _refuse_missing_runs(p, layout, args.params, "--methods", [(args.experiment, m) for m in chosen])
    elif args.group:  # one table of a paper: the group's runs only, written apart from the report stages' outputs
        if p.paper is None:
            raise ConfigError(f"--group: {args.params} is not a paper's params file (a paper's runs.<group> names one table's runs)")
        if args.group not in p.paper.runs:
            raise ConfigError(f"{args.params}: runs.{args.group}: no such run group (groups: {', '.join(p.paper.runs)})")
        grp = p.paper.runs[args.group]
        if args.experiment and args.experiment not in grp.experiments:
            raise ConfigError(f"{args.params}: runs.{args.group}.experiments: '{args.experiment}' is not one of them "
                              f"({', '.join(grp.experiments)})")
        exps = [args.experiment] if args.experiment else list(grp.experiments)
        methods_of, out_of = (lambda e: (*grp.methods, *grp.beside)), (lambda e: layout.group_report(args.group, e))
        across = [] if args.experiment or not grp.across else list(dict.fromkeys([*grp.beside_experiments, *grp.experiments]))
        _refuse_missing_runs(p, layout, args.params, f"runs.{args.group}",
                             [(e, m) for e in dict.fromkeys([*exps, *across]) for m in methods_of(e)])
    else:
        _refuse_missing_runs(p, layout, args.params, "report", [(e, m) for e in exps if e in p.experiments for m in methods_of(e)])
    from fedsilo.report import experiment_groups, groups_index
    from fedsilo.utils.io import atomic_dir

    made = {}
    grouped = args.group is None and args.methods is None and p.paper is not None
    beside = tuple(p.paper.runs[args.group].beside) if args.group else ()
    for exp in exps:
        _defined(args.params, "experiments", exp, p.experiments)
        with _naming_published(args.params, exp, p.experiments[exp].published):
            if not grouped:
                _report_one(args, p, exp, methods_of(exp), out_of(exp), made, beside)
                continue
            # a paper's report stage: the experiment's table, and each run group's own table of it under groups/<g>/,
            # so that `dvc repro` rebuilds a group's table whenever one of its runs is retrained
            with atomic_dir(out_of(exp)) as tmp:  # the whole folder or nothing: its reports write into it as it is
                _report_one(args, p, exp, methods_of(exp), tmp, made, beside, in_place=True)
                groups = experiment_groups(p.paper.runs, exp, p.experiment_methods(exp))
                for g, grp in groups.items():
                    _report_one(args, p, exp, (*grp.methods, *grp.beside), tmp / "groups" / g, {}, tuple(grp.beside), in_place=True)
                if groups:
                    with open(tmp / "README.md", "a") as f:
                        f.write(groups_index(groups))
    for exp, info in made.items():
        if "table" not in info:
            continue
        print(f"report {exp}: Avg accuracy " + ", ".join(f"{m} {v:.1f}" for m, v in info["table"].items())
              + (f" ({out_of(exp)})" if args.group or args.methods is not None else ""))
    if across:  # the group's table and figure across its experiments, from its runs
        from fedsilo.report.across import build_across_report
        from fedsilo.report.tables import collect, summary_table

        a = across_inputs(p, args.group, Path(args.root), str(args.params))
        seeds = list(p.pipeline.seeds)
        avg = {e: summary_table(collect(layout.results(e), a["methods"], seeds)[0], "acc", a["methods"]).xs("Avg", axis=1, level=1)
               for e in across}
        out = layout.group_report(args.group, "across")
        got = build_across_report(args.group, a["blocks"], avg, a["settings"], a["methods"], seeds, out, a["published"])
        print(f"report {args.group} across {', '.join(got['columns'])}: {out}")


def _report_across(args: argparse.Namespace, p: Params) -> None:
    """dvc.yaml's ``across_<group>`` stage: a run group's table and figure across its experiments, from the report
    stages' accuracy tables of them (what the stage depends on), into ``results/<paper>/<scale>/across/<group>/``."""
    from fedsilo.report.across import avg_from_csv, build_across_report

    if p.paper is None or args.across not in p.paper.runs:
        raise ConfigError(f"--across: {args.params} has no run group '{args.across}'"
                          + (f" (groups: {', '.join(p.paper.runs)})" if p.paper else " (it is not a paper's params file)"))
    if not p.paper.runs[args.across].across:
        raise ConfigError(f"{args.params}: runs.{args.across}.across is not set (a table across experiments is a group's "
                          "choice: `across: true`)")
    layout = p.layout(args.root)
    a = across_inputs(p, args.across, Path(args.root), str(args.params))
    avg = {e: avg_from_csv(layout.report(e) / f"{e}_accuracy.csv", e) for es in a["blocks"].values() for e in es}
    out = layout.across(args.across)
    got = build_across_report(args.across, a["blocks"], avg, a["settings"], a["methods"], list(p.pipeline.seeds), out, a["published"])
    print(f"report {args.across} across {', '.join(got['columns'])}: {out}")


@contextlib.contextmanager
def _naming_published(params: Any, exp: str, ref: Optional[str]) -> Iterator[None]:
    """A report error from the paper's published table (its domains, its rows) names the key and file that point
    to it."""
    from fedsilo.report import ReportError

    try:
        yield
    except ReportError as err:
        if ref and str(err).startswith("published"):
            raise ConfigError(f"{params}: experiments.{exp}.published ({ref}): {str(err).removeprefix('published: ')}") from None
        raise


def across_inputs(p: Params, group: str, root: Path, where: str) -> dict[str, Any]:
    """What a run group's table across experiments (``runs.<group>.across``) is built from, checked: its
    experiments by dataset, their settings, the methods, and the paper's numbers where ``runs.<group>.published``
    names them (every row and value of them one of the table's). ``where``: the params file, for the errors."""
    from fedsilo.config import across_blocks
    from fedsilo.report import ReportError
    from fedsilo.report.across import across_columns, published_rows
    from fedsilo.report.versus import load_published_across
    from fedsilo.tracking import flatten

    grp = p.paper.runs[group]
    blocks = across_blocks(group, grp, p.experiments)
    exps = [e for es in blocks.values() for e in es]
    settings = {e: flatten({"split": p.experiments[e].split.model_dump(mode="json"),
                            "train": p.experiments[e].train.model_dump(mode="json")}) for e in exps}
    methods = list(dict.fromkeys([*grp.methods, *grp.beside]))
    published = None
    try:
        _, _, axis = across_columns(group, blocks, settings)
        if grp.published:
            published = (load_published_across(root, grp.published), grp.published)
            published_rows(group, *published, axis, [(m, d) for d in blocks for m in methods])
    except (ReportError, OSError, ValueError) as err:
        said = str(err).removeprefix("published: ")
        raise ConfigError(f"{where}: {said if said.startswith('runs.') else f'runs.{group}.published: {said}'}") from None
    return {"blocks": blocks, "settings": settings, "methods": methods, "published": published}


def _report_one(args: argparse.Namespace, p: Params, exp: str, methods: Sequence[str], out: Path, made: dict,
                beside: Sequence[str] = (), in_place: bool = False) -> None:
    """The report of one experiment's ``methods`` into ``out`` and ``made``: a task stream's (pFedDIL's tables) or a
    static one's. ``beside``: the methods a run group sets beside its own rows; ``in_place``: ``out`` is a folder the
    caller writes atomically."""
    from fedsilo.report import build_report
    from fedsilo.report.continual import build_stream_report
    from fedsilo.report.versus import paper_scale_note

    layout = p.layout(args.root)
    scale = paper_scale_note(p, exp, Path(args.root)) if p.experiments[exp].published else ""
    if p.experiments[exp].split.protocol == "domain_incremental":
        ms = list(methods)
        # Delta's reference: the pFedDIL entry with every module on (not an ablation); in a group's table the one the
        # group sets beside its own rows (Table 6's lambda sweep is compared with the paper's pFedDIL, not its first lambda)
        full = [m for m in sorted(ms, key=lambda m: m not in beside) if (p.methods[m] or {}).get("method", m) == "pfeddil"
                and all((p.methods[m] or {}).get(k, True) for k in ("migration", "share_extractor", "correlation"))]
        made.update(build_stream_report(layout.results(exp), exp, ms, list(p.pipeline.seeds), out,
                                        published=p.experiments[exp].published, repo=Path(args.root),
                                        reference=full[0] if full else None, in_place=in_place, method_entries=p.methods,
                                        scale=scale))
        return
    made.update(build_report(layout.results(exp), exp, list(methods), list(p.pipeline.seeds),
                             out, published=p.experiments[exp].published, method_entries=p.methods,
                             repo=Path(args.root), target_accuracy=p.experiments[exp].target_accuracy, in_place=in_place,
                             scale=scale))


def _host_policy_arg(text: str | None) -> tuple[dict, ...]:
    """``--host-augment``: a YAML / JSON list of albumentations transforms, or a file holding one."""
    if not text:
        return ()
    import yaml

    path = Path(text)
    spec = yaml.safe_load(path.read_text() if path.is_file() else text)
    if not isinstance(spec, list) or not all(isinstance(t, dict) and "name" in t for t in spec):
        raise ConfigError("--host-augment: give a list of transforms, e.g. '[{name: CLAHE, p: 1.0}, {name: Affine, rotate: [-15, 15]}]'")
    return tuple(spec)


def _bench(args: argparse.Namespace) -> None:
    from fedsilo.bench import format_result, run_bench
    from fedsilo.utils.io import write_json

    r = run_bench(
        model=args.model, image_size=args.image_size, channels=args.channels, num_classes=args.classes,
        clients=args.clients, samples=args.samples, test_samples=args.test_samples, batch_size=args.batch_size,
        local_epochs=args.local_epochs, rounds=args.rounds, warmup=args.warmup,
        methods=tuple(m for m in args.methods.split(",") if m), device=args.device, amp=args.amp,
        channels_last=args.channels_last, compile=args.compile, checkpoint=not args.no_checkpoint,
        memory_clients=args.memory_clients, memory_rounds=args.memory_rounds, memory_samples=args.memory_samples,
        memory_fraction=args.memory_fraction, harmonize_images=args.harmonize_images, harmonize_px=args.harmonize_px,
        host_augment=_host_policy_arg(args.host_augment),
        parallel_clients=tuple(int(k) for k in args.parallel_clients.split(",") if k) if args.parallel_clients else (),
    )
    print(format_result(r))
    if args.json:
        write_json(args.json, r)


def _grid_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The dvc.yaml beside --params, and the tracking URI its runs log to (None when tracking is off)."""
    p = config.load_params(args.params)  # no method import
    return (Path(args.params).parent / "dvc.yaml").as_posix(), (p.tracking.uri if p.tracking.enabled else None)


def _grid(args: argparse.Namespace) -> None:
    pipeline, uri = _grid_target(args)
    if args.ray:
        from fedsilo.grid_ray import run_grid_ray

        r = run_grid_ray(pipeline, Path(args.root), args.ray, pattern=args.stages, tracking_uri=uri, cpus_per_run=1.0 if args.cpus_per_run is None else args.cpus_per_run,
                         gpus_per_run=args.gpus_per_run, worker_cache=args.worker_cache or None, quiet=args.quiet)
        hosts = sorted({x["host"] for x in r["runs"]})
        where = f"on Ray ({len(hosts)} host{'s' if len(hosts) != 1 else ''}: {', '.join(hosts)}; remote {r['remote']})" if hosts else "on Ray"
    else:
        from fedsilo.grid import run_grid

        r = run_grid(pipeline, Path(args.root), args.jobs, pattern=args.stages, tracking_uri=uri, keep=args.keep, quiet=args.quiet,
                     per_experiment=args.runs_per_experiment, threads=args.cpus_per_run)
        where = f"on {args.jobs} workers x {r['threads_per_run']} threads ({r['experiments']} queued experiments)"
    cached = f", {len(r['restored_here'])} restored from this machine's run-cache" if r["restored_here"] else ""
    print(f"grid {pipeline}: {len(r['queued'])} stages {where} in {r['grid_s']:.0f} s{cached} "
          f"(data and splits {r['prepare_s']:.0f} s, restore and reports {r['restore_and_report_s']:.0f} s)")


def _bench_grid(args: argparse.Namespace) -> None:
    from fedsilo.grid_bench import bench_grid, format_bench
    from fedsilo.utils.io import write_json

    pipeline, uri = _grid_target(args)
    r = bench_grid(pipeline, Path(args.root), Path(args.work), jobs=args.jobs, pattern=args.stages,
                   tracking_uri=uri, ray_address=args.ray, cpus_per_run=args.cpus_per_run,
                   per_experiment=args.runs_per_experiment, all_cores_sequential=args.all_cores_sequential, log=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr)))
    print(format_bench(r))
    if args.json:
        write_json(args.json, r)


def _check(args: argparse.Namespace) -> None:
    from fedsilo.data.splits import check_split_domains
    from fedsilo.methods.registry import check_pipeline_fits

    p = load_params(args.params)
    check_pipeline_fits(p, str(args.params))
    check_split_domains(p, str(args.params))
    for name in p.pipeline.sources:  # what `dvc repro` fetches: a folder of your own missing here is said now
        src = p.sources[name]
        if src.mode == "local":
            where = Path(str(src.path)).expanduser()
            where = where if where.is_absolute() else Path(args.root) / where
            if not where.exists():
                logging.getLogger("fedsilo").warning(
                    "sources.%s.path: %s does not exist on this machine: `dvc repro` will stop at fetch@%s here (a "
                    "params file written for another machine is fine)", name, where, name)
    _check_published(p, str(args.params), Path(args.root))
    from fedsilo.scaffold import check_paper_stages

    check_paper_stages(p, str(args.params), Path(args.root))
    if args.stamp:  # the same bytes whenever the file holds: the stages depending on it rerun for their own params only
        from fedsilo.utils.io import write_json

        write_json(p.layout(args.root).params_checked(), {"params": str(args.params), "checked": True})
    if args.method:
        from fedsilo.methods.registry import describe_method

        for key in args.method:
            print(describe_method(p, key, str(args.params)))
        return
    print(f"{args.params}: ok")


def _new_paper(args: argparse.Namespace) -> None:
    from fedsilo.scaffold import describe, new_paper

    root = Path(args.root)
    folder = new_paper(config.load_params(args.params), root, args.name, args.experiment,
                       [m.strip() for m in args.methods.split(",") if m.strip()], args.title)
    print(describe(folder, root))


def _stale_runs(args: argparse.Namespace) -> None:
    import os
    import socket
    from datetime import datetime

    from mlflow.tracking import MlflowClient

    from fedsilo.tracking import mark_killed, process_of, stale_runs

    p = config.load_params(args.params)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or p.tracking.uri
    if not os.environ.get("MLFLOW_TRACKING_URI") and not p.tracking.enabled:
        raise ConfigError(f"{args.params}: tracking.enabled is false: no MLflow store to look in (set MLFLOW_TRACKING_URI to name one)")
    client = MlflowClient(tracking_uri=uri)
    gone, unknown = stale_runs(client)
    names = {i: client.get_experiment(i).name for i in {r.info.experiment_id for r in gone}}
    host = socket.gethostname()
    print(f"stale-runs {uri}: {len(gone)} RUNNING run(s) whose process on {host} is gone"
          + (", marked KILLED" if args.end and gone else ""))
    for run in gone:
        t = run.data.tags
        started = datetime.fromtimestamp(run.info.start_time / 1000).isoformat(timespec="seconds")
        print(f"  {names.get(run.info.experiment_id, run.info.experiment_id)}  {run.info.run_name}  {run.info.run_id}  "
              f"(pid {t['fedsilo.pid']}, started {started})")
    if args.end:
        mark_killed(client, gone)
    if unknown:
        untagged = [r for r in unknown if process_of(r.data.tags) is None]
        hosts = sorted({r.data.tags.get("fedsilo.host", "?") for r in unknown if r not in untagged} - {host})
        here = [r for r in unknown if r not in untagged and r.data.tags.get("fedsilo.host") == host]
        why = [f"started on {', '.join(hosts)} (run this there)" if hosts else "",
               f"{len(here)} started on {host} in another container or before a reboot" if here else "",
               f"{len(untagged)} without their process's tags (started by an older fedsilo)" if untagged else ""]
        print(f"  {len(unknown)} other RUNNING run(s) not judged here: " + "; ".join(x for x in why if x))
    if gone and not args.end:
        print("  fedsilo stale-runs --end marks them KILLED (a run's checkpoint in state/ still resumes it)")


def _methods(args: argparse.Namespace) -> None:
    from fedsilo.methods.registry import list_methods

    print(list_methods())


def _check_published(p: Params, where: str, root: Path) -> None:
    """Every ``experiments.<e>.published`` names a file and a table of it that exist, whose columns and rows fit
    (:func:`~fedsilo.report.versus.published_table_problems`): the report stage would find a typo only after every
    run trained, and DVC removes the old report before running it."""
    from fedsilo.data.splits import dataset_domains
    from fedsilo.report import ReportError
    from fedsilo.report.versus import load_published_entries, published_table_problems

    for e, exp in p.experiments.items():
        if exp.published:
            try:
                table = load_published_entries(root, exp.published)["accuracy"]
            except (ReportError, OSError, ValueError) as err:
                raise ConfigError(f"{where}: experiments.{e}.published: {str(err).removeprefix('published: ')}") from None
            problems = published_table_problems(table, dataset_domains(p, exp.dataset)) if table is not None else []
            if problems:
                raise ConfigError(f"{where}: experiments.{e}.published ({exp.published}): " + "; ".join(problems))
    for g, grp in (p.paper.runs.items() if p.paper else ()):
        if grp.across:  # its columns (one setting apart) and the paper's numbers, before any run trains
            across_inputs(p, g, root, where)


def _site(args: argparse.Namespace) -> None:
    import json

    from fedsilo.fl.site import site_card
    from fedsilo.utils.io import write_json

    if args.action in ("audit", "evaluate"):  # no --experiment: the site's wire logs, or a dataset of its own
        {"audit": _site_audit, "evaluate": _site_evaluate}[args.action](args)
        return
    if args.action == "predict":
        _site_predict(args)
        return
    if args.action == "onboard":
        _site_onboard(args)
        return
    p = load_params(args.params)
    card = site_card(p, args.experiment, Path(args.root))
    if args.action == "card":
        out = Path(args.root) / "data" / "site" / f"{args.experiment}.json"
        write_json(out, card)
        print(json.dumps(card, indent=1))
        stream = f" in {len(card['tasks'])} tasks ({' -> '.join(t['domain'] for t in card['tasks'])})" if "tasks" in card else ""
        print(f"site {card['site']}: {card['n_train']} train / {card['n_val']} val / {card['n_test']} test images{stream}; "
              f"fingerprint {card['fingerprint']} (send {out} to the coordinator)", file=sys.stderr)
        return
    from fedsilo.fl.credentials import check_site_credentials
    from fedsilo.fl.services import fedsilo_command, restart_after_s, supernode_command

    for flag, f in (("--root-certificates", args.root_certificates), ("--auth-key", args.auth_key)):
        if not Path(f).is_file():
            raise ConfigError(f"{flag}: {f}: no such file")
    for warning in check_site_credentials(Path(args.root_certificates), Path(args.auth_key)):
        print(warning, file=sys.stderr)
    _check_supernode_addresses(args.superlink, args.port, bind=not (args.dry_run or args.systemd_unit))
    cmd = supernode_command(Path(args.params), args.experiment, Path(args.root), args.superlink, Path(args.root_certificates),
                            Path(args.auth_key), port=args.port)
    print(f"site {card['site']} (fingerprint {card['fingerprint'][:16]}): {shlex.join(cmd)}", file=sys.stderr)  # as a shell takes it
    root = Path(args.root).resolve()
    service = fedsilo_command("--params", str(Path(args.params).resolve()), "--root", str(root), "site", "supernode", "--experiment",
                              args.experiment, "--superlink", args.superlink, "--root-certificates", str(Path(args.root_certificates).resolve()),
                              "--auth-key", str(Path(args.auth_key).resolve()), "--port", str(args.port))
    _run_or_install(args, cmd, service, root, f"fedsilo site {card['site']}: Flower SuperNode of the federation at {args.superlink}",
                    f"site {card['site']}, data fingerprint {card['fingerprint']}; fedsilo checks the data against it at every start",
                    restart_after_s())


def _check_supernode_addresses(superlink: str, port: int, bind: bool) -> None:
    """What Flower's SuperNode would only fail on after its start (exit status 1, which a service manager retries):
    ``--superlink`` not ``host:port`` (Flower: "cannot be parsed"); ``--port`` out of range, or (``bind``: the
    SuperNode starts now) one a process on this machine already listens on (a second SuperNode of the site)."""
    import ipaddress
    import socket

    host, _, link_port = superlink.strip().rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host

    def an_address(h: str) -> bool:
        try:
            ipaddress.ip_address(h.split("%")[0])  # an IPv6 address may carry its zone (fe80::1%eth0)
            return True
        except ValueError:
            return False

    good_host = bool(bare) and not any(c.isspace() for c in bare) and (":" not in bare and bare == host or an_address(bare))
    if not good_host or not link_port.isdigit() or not 0 < int(link_port) < 65536:
        raise ConfigError(f"--superlink: {superlink!r} is not host:port (the SuperLink's Fleet API, e.g. "
                          "coordinator.example.org:9093, the address and port `deploy superlink --listen` opens)")
    if not 0 < port < 65536:
        raise ConfigError(f"--port: {port} is not a port number (1-65535)")
    if bind:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by a SuperNode that ended is free
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ConfigError(f"--port: 127.0.0.1:{port} is taken: a process on this machine listens on it (another "
                                  "SuperNode of this site, or of another; `ss -ltnp` names it); stop it, or give this "
                                  "SuperNode another --port") from None


def _run_or_install(args: argparse.Namespace, cmd: list[str], service: list[str], workdir: Path, description: str, note: str,
                    restart_s: int) -> None:
    """``--systemd-unit FILE``: write a service that runs ``service`` (the fedsilo command that checks, then runs
    ``cmd``); ``--dry-run``: stop here; else become ``cmd`` (a service manager stops it with SIGTERM)."""
    import os
    import shutil

    from fedsilo.fl.services import systemd_unit, write_unit

    if args.systemd_unit:
        env = {"FLWR_HOME": str(workdir / ".flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
        out = write_unit(Path(args.systemd_unit), systemd_unit(description, service, workdir, restart_s, env, note=note))
        print(f"{out}: a systemd service ({description}) run as {workdir.owner()} in {workdir}; install: sudo cp {out} "
              f"/etc/systemd/system/ && sudo systemctl daemon-reload && sudo systemctl enable --now {out.name}")
        return
    if args.dry_run:
        return
    exe = shutil.which(cmd[0])
    if exe is None:
        raise ConfigError(f"{cmd[0]}: not installed; in fedsilo's checkout: pip install -e '.[flower]' -c constraints.txt")
    os.execv(exe, cmd)


def _deploy(args: argparse.Namespace) -> None:
    from fedsilo.fl import credentials, deploy, services

    if args.action == "superlink":
        host, _, port = args.listen.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [::]:9093: Flower adds the brackets of an IPv6 address itself
        if not host or not port.isdigit():
            raise ConfigError(f"--listen: {args.listen!r}; give host:port (0.0.0.0:9093 listens on every address)")
        database = None if args.database == ":memory:" else Path(args.database)
        cmd = services.superlink_command(Path(args.certs), database, host, int(port))
        for warning in credentials.check_superlink_certificates(Path(args.certs))["warnings"]:
            print(warning, file=sys.stderr)
        print(f"superlink: {shlex.join(cmd)}", file=sys.stderr)
        certs, state = Path(args.certs).resolve(), str(database.resolve()) if database is not None else ":memory:"
        service = services.fedsilo_command("deploy", "superlink", "--certs", str(certs), "--database", state, "--listen", args.listen)
        _run_or_install(args, cmd, service, Path.cwd(), f"fedsilo federation SuperLink on {args.listen}",
                        f"certificates in {certs}; state in {state}", 5)
        return
    if args.action == "status":
        _deploy_status(args)
        return
    if args.action == "certs" and args.renew:
        r = credentials.renew_server_certificate(Path(args.out), tuple(args.host) if args.host else None, days=args.days)
        before = f" (the old one, valid until {r['previous_until']:%Y-%m-%d}, is {r['server.pem']}.old)" if r["previous_until"] else ""
        print(f"deploy certs --renew: {r['server.pem']} for {', '.join(r['hosts'])}, valid until {r['valid_until']:%Y-%m-%d}{before}; "
              f"restart the SuperLink to serve it (the sites keep their ca.crt)")
    elif args.action == "certs":
        made = credentials.make_certificates(Path(args.out), tuple(args.host or ("127.0.0.1", "localhost")), days=args.days, ca_days=args.ca_days)
        print(f"deploy certs: {', '.join(str(v) for v in made.values())} (the sites and the coordinator's CLI trust ca.crt)")
    elif args.action == "key":
        made = credentials.make_node_key(Path(args.out), args.name)
        print(f"deploy key: {made[args.name]} stays at the site; {made[args.name + '.pub']} goes to the coordinator (flwr supernode register)")
    else:
        fed = deploy.load_federation(args.federation)
        dep = deploy.write_app(fed, load_params(args.params), Path(args.out), federation_file=args.federation, results=args.results,
                               state=args.state)
        key, base = dep["method"]["key"], dep["method"]["base"]
        print(f"deploy app: {args.out} ({key}{f' = {base}' if base != key else ''}, {len(dep['sites'])} sites, "
              f"{dep['train']['rounds']} rounds, params from {args.params}); run it with: flwr run {args.out} <connection> --stream")


def _site_model(args: argparse.Namespace) -> Path:
    """--model, or the only model.pt the site keeps under --root."""
    model = Path(args.model) if args.model else None
    if model is None:
        root = Path(args.root)  # a deployment's kept model, or one `fedsilo site onboard` adapted
        kept = sorted([*root.glob("state/deploy/*/*/*/model.pt"), *root.glob("onboarding/*/*/*/model.pt")])
        if len(kept) != 1:
            raise ConfigError(f"--model required: this site keeps {len(kept)} models ({', '.join(map(str, kept)) or 'none'}; "
                              "`fedsilo site audit` lists a deployment's, onboarding/ holds the ones `fedsilo site onboard` adapted)")
        model = kept[0]
    elif not model.is_file():
        raise ConfigError(f"--model: {model}: no such file")
    return model


def _site_evaluate(args: argparse.Namespace) -> None:
    import json

    from fedsilo.client.data import pick_device
    from fedsilo.fl.evaluate import evaluate_site_model, evaluation_markdown
    from fedsilo.utils.io import atomic_file

    model = _site_model(args)
    out = Path(args.out) if args.out else Path(args.root) / "evaluation" / args.dataset
    if out.exists() and not out.is_dir():  # before the scoring, not after it
        raise ConfigError(f"--out: {out} is a file; evaluate writes a folder (evaluation.md, evaluation.json, "
                          "predictions.csv): name a folder")
    device = str(pick_device(args.device, "--device"))
    summary, rows = evaluate_site_model(load_params(args.params), args.dataset, model, Path(args.root), args.bootstrap,
                                        args.seed, device=device, quiet=args.quiet)
    md = evaluation_markdown(summary)
    out.mkdir(parents=True, exist_ok=True)
    for name, write in (("evaluation.json", lambda f: f.write_text(json.dumps(summary, indent=1))),
                        ("evaluation.md", lambda f: f.write_text(md)),
                        ("predictions.csv", lambda f: rows.to_csv(f, index=False))):
        with atomic_file(out / name) as tmp:  # each file whole; nothing else in the folder is touched
            write(tmp)
    print(md, end="")
    if summary.get("trained_on"):
        print(f"site evaluate: warning: datasets.{args.dataset} is the data {summary['trained_on']} trained on (its split's "
              "fingerprint is the model's): the scores are not an external validation", file=sys.stderr)
    print(f"site evaluate: {summary['all']['images']} images of {args.dataset} scored by {model}; {out}/evaluation.md, "
          "evaluation.json, predictions.csv", file=sys.stderr)


def _site_onboard(args: argparse.Namespace) -> None:
    from fedsilo.fl.onboard import onboard_site

    summary, out = onboard_site(load_params(args.params), args.experiment, Path(args.root), Path(args.model),
                                args.strategy or None, Path(args.out) if args.out else None, quiet=args.quiet)
    pre = summary["pretrained_local_acc"]
    print(f"site onboard: {summary['site']} adapted the federation's model of {summary['method']} ({summary['federation']}, "
          f"{summary['bytes_down']} bytes downloaded): " + ", ".join(f"{s} {a:.3f}" for s, a in summary["final"].items())
          + (f" (its own local model {pre:.3f})" if pre is not None else "")
          + f"; kept {summary['kept']}: {out}/model.pt (`fedsilo site predict --model` takes it), {out}/onboarding.json"
          + (f"; it replaced the model onboarding kept there before ({summary['replaced']['kept']}; --out elsewhere keeps both)"
             if "replaced" in summary else ""), file=sys.stderr)


def _check_out_file(out: Path) -> None:
    """``--out`` of a command that writes one file: refused before the work when it names a folder or a folder that
    does not exist (the work would be lost at the end)."""
    if out.is_dir() or str(out).endswith(("/", "\\")):
        raise ConfigError(f"--out: {out} is a folder; predict writes one CSV file: name it (e.g. {out / 'predictions.csv'})")
    if not out.parent.is_dir():
        raise ConfigError(f"--out: {out.parent} does not exist; make it first, or name a file in an existing folder")


def _site_predict(args: argparse.Namespace) -> None:
    import pandas as pd

    from fedsilo.client.data import pick_device
    from fedsilo.fl.predict import image_files, predict_images
    from fedsilo.utils.io import atomic_file

    model = _site_model(args)
    if args.out:
        _check_out_file(Path(args.out))
    device = str(pick_device(args.device, "--device"))
    files, left = image_files(args.images)
    if left:
        names = ", ".join(f"{f.name} ({why})" for f, why in left[:3]) + (", ..." if len(left) > 3 else "")
        print(f"site predict: {len(left)} file(s) under the folders named are not images, left out: {names}", file=sys.stderr)
    rows = predict_images(load_params(args.params), args.experiment, model, files, device=device, quiet=args.quiet, root=Path(args.root),
                          warn=lambda m: print(f"site predict: warning: {m}", file=sys.stderr))
    bad = int((rows["error"] != "").sum())
    if args.out:
        with atomic_file(Path(args.out)) as tmp:
            rows.to_csv(tmp, index=False)
    else:
        rows.to_csv(sys.stdout, index=False)
    slide_rows = rows["patches"].notna() if "patches" in rows.columns else pd.Series(False, index=rows.index)
    patch_rows = (rows["slide"] != "") if "slide" in rows.columns else pd.Series(False, index=rows.index)
    pictures = ~slide_rows & ~patch_rows & (rows["error"] == "")
    counts = rows.loc[pictures | slide_rows, "predicted"].value_counts().to_dict()
    slides = f" and {int(slide_rows.sum())} slides ({int((patch_rows & (rows['error'] == '')).sum())} patches)" if slide_rows.any() else ""
    predicted = ", ".join(f"{c} {n}" for c, n in counts.items()) or "none"
    print(f"site predict: {int(pictures.sum())} images{slides} scored by {model} (predicted: {predicted}), {bad} "
          f"{'row' if bad == 1 else 'rows'} not scored" + (" (its error column says why)" if bad == 1 else " (their error column says why)" if bad else "")
          + (f"; {args.out}" if args.out else ""), file=sys.stderr)


def _site_audit(args: argparse.Namespace) -> None:
    import json

    from fedsilo.fl.deploy import site_audit

    audits = site_audit(Path(args.root))
    if args.json:
        print(json.dumps(audits, indent=1))
        return

    def mb(n: int) -> str:
        return f"{n / 1e6:.3f} MB"

    for a in audits:
        runs = ", ".join(f"{r} (rounds {x[0]}-{x[-1]})" if x else f"{r} (no round)" for r, x in a["runs"].items())
        print(f"federation {a['federation']} (deployment {a['deployment']}): Flower runs {runs}; "
              f"received {mb(a['received_tensor_bytes'])} of tensors, sent {mb(a['sent_tensor_bytes'])}")
        for kind, v in sorted(a["sent"].items()):
            tensors = "; ".join(f"{rec}: {len(names)} tensors ({', '.join(list(names)[:4])}{', ...' if len(names) > 4 else ''})"
                                for rec, names in v["arrays"].items()) or "no tensor"
            keys = ", ".join(v["metrics"] + v["config"])
            print(f"  sent {kind} x{v['messages']}: {tensors}, {mb(v['tensor_bytes'])}" + (f"; keys {keys}" if keys else "")
                  + (f"; {v['errors']} errors" if v["errors"] else ""))
        for site, k in a["kept"].items():
            print(f"  kept here for {site}: rounds {k['rounds']}, {k['tensors']} tensors, {mb(k['tensor_bytes'])} ({k['folder']})")
            if k["model"]:
                print(f"  its model, as evaluated in round {k['model']['round']}: {k['model']['path']}")
        if a["unreadable_lines"]:
            print(f"  {len(a['unreadable_lines'])} lines cannot be read (lines {a['unreadable_lines'][:5]}): cut short by a stop?")
        for e in a["errors"][-3:]:
            print(f"  error in round {e['round']} ({e['message']}, Flower run {e['flower_run']}): {e['error'][:300]}")
        print(f"  wire log: {a['wire_log']} (a reply counts as sent when the ClientApp handed it to this site's SuperNode; "
              "one the SuperLink refused, its run stopped or ended, is not in the coordinator's wire.jsonl)")


SUPERLINK_DOWN = ("start the SuperLink again: `fedsilo deploy superlink` with the same --database; the SuperNodes "
                  "reconnect, and a `flwr run` of the App resumes after the checkpoint's round")


def _deploy_status(args: argparse.Namespace) -> None:
    import json
    import shutil

    from fedsilo.fl.deploy import deployment_status

    flwr = shutil.which("flwr")
    if flwr is None:
        raise ConfigError("flwr: not installed; in fedsilo's checkout: pip install -e '.[flower]' -c constraints.txt")
    conn = [args.connection] if args.connection else []
    # the SuperLink's answer, or why there is none: what the disk holds is told either way
    listed, unreached = _flwr_json(flwr, ["supernode", "list", *conn], "flwr supernode list")

    def flower_run(run_id: int) -> tuple[str | None, str | None]:
        runs, why = _flwr_json(flwr, ["ls", *conn, "--run-id", str(run_id)], "flwr ls")
        status = str(runs["runs"][0]["status"]) if runs is not None and runs.get("runs") else None
        return status, why or (None if status else f"flwr ls: run {run_id} is not listed")

    st = deployment_status(Path(args.app), None if listed is None else listed["nodes"], Path(args.superlink_dir),
                           flower_run=None if unreached else flower_run)
    st["certificates"] = _certificates_status(Path(args.certs))
    if unreached:
        st["superlink_error"] = unreached
    if args.json:
        print(json.dumps(st, indent=1))
        if unreached:
            raise ConfigError(f"{unreached}: the sites' states are unknown ({SUPERLINK_DOWN})")
        return
    print(f"federation {st['federation']}: {st['method']}, seed {st['seed']}, {st['rounds']} rounds" + (" per task" if st["stream"] else ""))
    width = max(len(x["site"]) for x in st["sites"])
    for x in st["sites"]:
        since = f" since {x['since']}" if x["since"] else ""
        joined = " (joined the run in progress)" if x.get("joined") else ""
        print(f"  {x['site']:<{width}}  node {x['node_id'] if x['node_id'] is not None else '-':<20}  {x['status']}{since}{joined}")
    for x in st["unlisted_nodes"]:
        print(f"  {'(no site)':<{width}}  node {x['node_id']:<20}  {x['status']}: registered, not in this federation")
    ck = st["checkpoint"]
    print("checkpoint: " + ("none (not started, or finished)" if ck is None else
                            f"{ck['path']} written by another deployment or fedsilo (a run starts afresh)" if ck.get("other") else
                            f"round {ck['round']} ({ck['path']}): `flwr run` of this App resumes after it"))
    last = st["last_message"]
    said = (f"; its last message {last['seconds_ago'] // 60} min {last['seconds_ago'] % 60} s ago: round {last['round']} "
            f"{last['message']} {'to' if last['to'] == 'site' else 'from'} {last['site'] or 'a node'}" if last else "")
    print("run: " + (f"in progress ({st['running']}){said}" if st["running"] else f"none in progress on this machine{said}"))
    fr = st.get("flower_run")
    if fr and fr["serverapp_died"]:
        conn = args.connection or "<connection>"
        print(f"  but Flower lists its run {fr['run_id']} as running: its ServerApp died (killed, out of memory) if it ran "
              f"on this machine; `flwr stop {fr['run_id']} {conn}`, then `flwr run <app> {conn} --stream` resumes after the "
              "checkpoint's round")
    elif fr and fr["error"]:
        print(f"  (its Flower run {fr['run_id']}: {fr['error']})")
    print(f"results: {st['results'] or 'not written yet'}")
    c = st["certificates"]
    if c is not None:
        print(f"certificates ({c['folder']}): " + (c["problem"] if "problem" in c else
                                                  f"SuperLink's until {c['server.pem'][:10]}, CA until {c['ca.crt'][:10]}"))
        for w in c.get("warnings", []):
            print(f"  {w}")
    if unreached:  # after what the disk says: the checkpoint, the run lock, the results
        raise ConfigError(f"{unreached}: the sites' states above are unknown ({SUPERLINK_DOWN})")


def _flwr_json(flwr: str, command: list[str], what: str) -> tuple[dict | None, str | None]:
    """``flwr <command> --format json``: (its answer, None), or (None, why not: flwr's own message, its exit code
    where it said nothing, or no answer in 120 s), ``what`` naming the command."""
    import json
    import subprocess

    try:
        r = subprocess.run([flwr, *command, "--format", "json"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, f"{what}: no answer from the SuperLink in 120 s (is it running, and is the connection's address right?)"
    try:
        answer = json.loads(r.stdout)
    except json.JSONDecodeError:
        answer = None
    if r.returncode == 0 and isinstance(answer, dict) and answer.get("success"):
        return answer, None
    said = (answer.get("error-message") if isinstance(answer, dict) else None) or r.stderr or r.stdout or ""
    return None, f"{what}: {said.strip()[-500:] or f'exit {r.returncode}, no output'}"


def _certificates_status(certs: Path) -> dict | None:
    """The coordinator's certificates as `deploy superlink` checks them (None where --certs holds none)."""
    from fedsilo.fl.credentials import check_superlink_certificates

    if not (certs / "server.pem").is_file():
        return None
    try:
        return {"folder": str(certs), **check_superlink_certificates(certs)}
    except ConfigError as e:
        return {"folder": str(certs), "problem": str(e)}


def _known(argv: list[str]) -> dict[str, list[str]]:
    """What the params file named in ``argv`` (default params.yaml) defines, for the commands' --help: a plain YAML
    read, no validation (help must work on a file that does not validate yet)."""
    import yaml

    path = "params.yaml"
    for i, a in enumerate(argv):
        if a == "--params" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--params="):
            path = a.split("=", 1)[1]
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {"file": [path]}
    seeds = (raw.get("pipeline") or {}).get("seeds", raw.get("seeds"))  # a paper's params file lists them at its top
    return {"file": [path], **{k: sorted(raw.get(k) or {}) for k in ("sources", "datasets", "experiments", "methods")},
            "seeds": [str(x) for x in seeds or []], "groups": list(raw.get("runs") or {})}  # a paper's run groups


def _seed(text: str) -> int:
    """A run's seed on the command line: a non-negative integer (every round's seeded streams take such keys)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: a seed is a non-negative integer (0, 1, 2, ...)")
    return value


def _listing(known: dict[str, list[str]], *keys: str) -> str:
    if len(known) == 1:
        return f"({known['file'][0]} not readable here: run in the repository root or pass --params)"
    lines = [f"defined in {known['file'][0]}:"]
    for k in keys:
        lines.append(f"  {k}: {', '.join(known.get(k) or []) or '(none)'}")
    return "\n".join(lines)


VERSIONED = ("torch", "torchvision", "dvc", "mlflow", "flwr", "ray", "pydicom", "albumentations", "numpy", "pandas")


def version_text() -> str:
    """What a bug report or a results folder needs to name the code: fedsilo's version, the checkout's git commit
    (with ``+ uncommitted edits`` where ``src/fedsilo`` differs from it), the hash of all of the training code,
    Python's and the main libraries' versions (read from the installed packages' metadata: nothing is imported)."""
    import importlib.metadata as md
    import platform
    import subprocess

    from fedsilo.codehash import PACKAGE, train_code_sha256

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    from fedsilo.tracking import git_commit

    try:  # the package's own files tracked by a checkout (not site-packages inside some other repository)
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"], cwd=PACKAGE, capture_output=True).returncode == 0
    except OSError:  # no git on this machine
        tracked = False
    sha, dirty = git_commit(PACKAGE) if tracked else ("unknown", False)  # its edits: those under src/fedsilo
    commit = f"git {sha[:12]}{' + uncommitted edits' if dirty else ''}" if sha != "unknown" else "not a git checkout"
    libs = ", ".join(f"{d} {version(d)}" for d in VERSIONED)
    return (f"fedsilo {version('fedsilo')} ({PACKAGE}; {commit})\n"
            f"training code sha256 {train_code_sha256()} (all of it, as data/code/train.json holds it; a run's "
            "metrics.json code.source_sha256 hashes its method's share)\n"
            f"Python {platform.python_version()} on {platform.system()} {platform.machine()}; {libs}")


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kw.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *a: Any) -> None:
        print(version_text())
        parser.exit()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    # the params file is read for the commands' --help listings only, not on every start-up
    known = _known(argv) if not argv or "-h" in argv or "--help" in argv else {"file": ["params.yaml"]}
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="fedsilo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="parameters file (default: params.yaml)")
    ap.add_argument("--root", default=".", help="repository root holding data/ and results/ (default: .)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log what each stage decides (resumes, removals)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars or lines (rounds, images)")
    ap.add_argument("--version", action=_Version, help="fedsilo's version, git commit, training-code hash and the "
                    "main libraries' versions (for a bug report), then exit")
    # --params, --root and -q are accepted after the command too (`fedsilo train --params ... --experiment ...`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", default=argparse.SUPPRESS, help="parameters file (default: params.yaml)")
    common.add_argument("--root", default=argparse.SUPPRESS, help="repository root (default: .)")
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars or lines")
    # what `grid` and `bench-grid` both take: the queue's workers and batches, the stages, the Ray cluster and a run's CPUs
    grid_opts = argparse.ArgumentParser(add_help=False)
    grid_opts.add_argument("--jobs", type=int, default=2, help="DVC queue workers (runs at once; not with grid --ray)")
    grid_opts.add_argument("--stages", default="train*", help="the grid's stages, a shell pattern of stage names (default "
                           "train*: the root's train@... and a paper's train_<group>@...)")
    grid_opts.add_argument("--runs-per-experiment", type=int, default=None, help="stages a queued experiment runs (default: "
                           "about four experiments a worker; DVC's set-up of an experiment costs seconds of CPU)")
    grid_opts.add_argument("--ray", metavar="ADDRESS", help="the Ray cluster at ADDRESS (auto, host:6379, ray://host:10001): "
                           "grid runs the stages there instead of DVC's queue, results through the default DVC remote; "
                           "bench-grid times that as a third arm")
    grid_opts.add_argument("--cpus-per-run", type=float, default=None, help="CPU threads a run uses (OMP_NUM_THREADS; a "
                           "sequential run with as many threads gives equal metrics): on the queue default the cores / "
                           "--jobs; with --ray the CPUs a run reserves, default 1")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="command")
    s = sub.add_parser("fetch", parents=[common], help="bring one raw source into data/raw/<source>/", formatter_class=fmt, epilog=_listing(known, "sources"))
    s.add_argument("--source", required=True)
    s.set_defaults(fn=_fetch)
    s = sub.add_parser("fingerprint", parents=[common], help="hash one dataset's fetched sources -> data/fingerprints/<dataset>.json", formatter_class=fmt, epilog=_listing(known, "datasets"))
    s.add_argument("--dataset", required=True)
    s.set_defaults(fn=_fingerprint)
    s = sub.add_parser("code-fingerprint", parents=[common], help="hash the training code: per methods key, the code its "
                       "runs depend on -> data/code/methods/<key>.json (a paper's: data/code/<paper>/<scale>/<key>.json), "
                       "which its train stages depend on; the root's all of it (src/fedsilo: client, fl, methods, models, "
                       "utils, config/base.py and config/train.py) -> data/code/train.json, which the onboard stages depend on", formatter_class=fmt)
    s.set_defaults(fn=_code_fingerprint)
    s = sub.add_parser("harmonize", parents=[common], help="raw sources -> data/harmonized/<dataset>/", formatter_class=fmt, epilog=_listing(known, "datasets"))
    s.add_argument("--dataset", required=True)
    s.add_argument("--dry-run", action="store_true", help="read the label files only: print what would be kept, excluded (by "
                   "reason) and found missing per domain, in seconds; decode nothing, write nothing (for trying label rules). "
                   "Slides (datasets.<d>.folders.<s>.slides) are planned: each one's thumbnail is read to find its "
                   "tissue, a second or two per slide")
    s.set_defaults(fn=_harmonize)
    s = sub.add_parser("split", parents=[common], help="harmonized dataset -> data/splits/<experiment>.json", formatter_class=fmt, epilog=_listing(known, "experiments"))
    s.add_argument("--experiment", required=True)
    s.set_defaults(fn=_split)
    s = sub.add_parser("train", parents=[common], help="train one (experiment, method, seed); resumes from its last round", formatter_class=fmt,
                       epilog=_listing(known, "experiments", "methods", "seeds") + "\nEach method's parameters and defaults: fedsilo check-params --method KEY; README, \"Federated learning\".")
    s.add_argument("--experiment", required=True, help="an experiment of the params file (listed below)")
    s.add_argument("--method", required=True, help="a method of the params file (listed below)")
    s.add_argument("--seed", type=_seed, required=True, help="the run's seed (pipeline.seeds lists the pipeline's)")
    s.set_defaults(fn=_train)
    s = sub.add_parser("onboard", parents=[common], help="pFedDB Fig. 6: the held-out newcomer adapts with three strategies", formatter_class=fmt, epilog=_listing(known, "experiments"))
    s.add_argument("--experiment", required=True)
    s.add_argument("--seed", type=_seed, required=True)
    s.set_defaults(fn=_onboard)
    s = sub.add_parser("report", parents=[common], help="tables and figures -> results/report/<experiment>/ (a paper's: "
                       "results/<paper>/<scale>/report/<experiment>/)", formatter_class=fmt,
                       epilog=_listing(known, "experiments", *(["groups"] if known.get("groups") else [])))
    s.add_argument("--experiment", help="one experiment (default: every one the pipeline reports: the root's "
                   "pipeline.experiments, a paper's the experiments of its runs groups)")
    s.add_argument("--group", help="a paper's run group (runs.<group>, one table): the tables of its runs and of the "
                   "methods it sets beside (runs.<group>.beside) -> results/<paper>/<scale>/groups/<group>/<experiment>/; "
                   "runs not trained yet are named, with the dvc repro targets that train them")
    s.add_argument("--across", metavar="GROUP", help="a paper's run group with runs.<group>.across (dvc.yaml's "
                   "across_<group> stage): its table and figure across its experiments, from the report stages' accuracy "
                   "tables -> results/<paper>/<scale>/across/<group>/")
    s.add_argument("--sensitivity", action="store_true", help="across task streams: accuracy and storage against "
                   "pFedDIL's lambda (Table 6) and against the split's alpha (Fig. 2) -> results/.../report/sensitivity/")
    s.add_argument("--methods", type=lambda t: [m.strip() for m in t.split(",") if m.strip()], metavar="M1,M2,...",
                   help="with --experiment: only these methods (any defined under methods, trained by the pipeline or by "
                   "`fedsilo train`), in this order -> results/[<paper>/<scale>/]selected/<experiment>/ (each call replaces "
                   "the last; the report stages' outputs are left alone)")
    s.set_defaults(fn=_report)
    s = sub.add_parser(
        "grid", parents=[common, grid_opts], formatter_class=fmt,
        help="a pipeline's out-of-date train stages on several DVC queue workers or a Ray cluster, then dvc repro (nothing trains twice)",
        description="Runs the dvc.yaml beside --params: its data and splits here, then every out-of-date stage matching "
        "--stages as a queued DVC experiment on --jobs workers (dvc exp run --queue, dvc queue start), then dvc repro, "
        "which restores those stages from DVC's run-cache and runs the reports. dvc status is clean afterwards. With --ray "
        "the stages run as Ray tasks on that cluster instead, their data and results through the default DVC remote.")
    s.add_argument("--keep", action="store_true", help="keep the queued experiments (dvc exp show) after restoring them")
    s.add_argument("--gpus-per-run", type=float, default=0.0, help="with --ray: GPUs a run reserves (0.5: two runs share one)")
    s.add_argument("--worker-cache", default="~/.cache/fedsilo/grid-dvc", help="with --ray: each node's DVC cache, shared by "
                   "its runs ('' for one per run)")
    s.set_defaults(fn=_grid)
    s = sub.add_parser(
        "bench-grid", parents=[common, grid_opts], formatter_class=fmt,
        help="time a pipeline's grid (DVC queue, optionally Ray) against a sequential dvc repro, in copies of the workspace",
        description="Copies the workspace to --work, builds the data and splits once there, then runs the dvc.yaml beside "
        "--params three ways from that same state, one after the other: sequential dvc repro, fedsilo grid --jobs N, and "
        "with --ray fedsilo grid --ray, every run with the same threads (--cpus-per-run). Prints each arm's seconds, its "
        "speed-up over sequential, whether dvc status is clean, and whether every run's metrics equal the sequential "
        "ones. Not a test: it reports numbers.")
    s.add_argument("--work", required=True, help="an empty folder for the copies (several times the workspace's data)")
    s.add_argument("--all-cores-sequential", action="store_true", help="a fourth arm: sequential dvc repro with every "
                   "core to each run (the fastest sequential run; its metrics differ in the last bits)")
    s.add_argument("--json", help="also write the result as JSON here")
    s.set_defaults(fn=_bench_grid)
    s = sub.add_parser(
        "bench", parents=[common],
        help="engine throughput against the single-model loop, memory over rounds, harmonize throughput",
        description="Measures, in one process: (a) a plain single-model training loop over the same samples, batches "
        "and evaluation (the limit), (b) FedAvg rounds through the engine, (c) the other --methods; prints samples/s, "
        "the ratios b/a and c/a, peak device and host memory; then host/device memory over many rounds of many "
        "Simple-CNN clients, and DICOM harmonize throughput on all cores. Not a test: it reports numbers.",
    )
    s.add_argument("--model", default="simple_cnn", help="backbone (simple_cnn, alexnet_bn, densenet121, resnet10, resnet10_cifar, resnet18, vit_tiny)")
    s.add_argument("--image-size", type=int, default=28, help="image edge in pixels (default 28, Digits-Five)")
    s.add_argument("--channels", type=int, default=3, help="input channels (default 3)")
    s.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    s.add_argument("--clients", type=int, default=5, help="clients (default 5)")
    s.add_argument("--samples", type=int, default=743, help="training samples per client (default 743, FedBN's Digits-Five)")
    s.add_argument("--test-samples", type=int, default=256, help="test samples per client evaluated every round (default 256)")
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--local-epochs", type=int, default=1)
    s.add_argument("--rounds", type=int, default=2, help="measured rounds (median is reported; default 2)")
    s.add_argument("--warmup", type=int, default=1, help="rounds run before measuring")
    s.add_argument("--methods", default="fedavg,pfeddb", help="comma-separated registered methods to time, or 'all' (default fedavg,pfeddb; pfeddb is timed in its federated phase)")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    s.add_argument("--amp", default="auto", choices=["auto", "off", "bf16"], help="bf16 autocast (auto = on CUDA)")
    s.add_argument("--channels-last", default="auto", choices=["auto", "on", "off"])
    s.add_argument("--compile", action="store_true", help="torch.compile the model")
    s.add_argument("--no-checkpoint", action="store_true", help="leave the per-round checkpoint out of the engine timing")
    s.add_argument("--memory-clients", type=int, default=100, help="clients in the memory-flatness run (0 skips it)")
    s.add_argument("--memory-rounds", type=int, default=50)
    s.add_argument("--memory-samples", type=int, default=16)
    s.add_argument("--memory-fraction", type=float, default=None, help="clients sampled per round (default 1.0 on GPU, 0.1 on CPU)")
    s.add_argument("--harmonize-images", type=int, default=32, help="mirror DICOMs decoded for harmonize throughput (0 skips it)")
    s.add_argument("--harmonize-px", type=int, default=1024, help="edge of those DICOMs")
    s.add_argument("--host-augment", default=None, help="an albumentations policy (train.augment.host: a YAML list, or a file "
                   "with one) to time FedAvg with and without: the cost per round of host augmentation")
    s.add_argument("--parallel-clients", default=None, metavar="K[,K...]",
                   help="also time FedAvg with train.parallel_clients: K (clients trained at once, each on its own copy of "
                   "the model) against one at a time, and check its final model is the same")
    s.add_argument("--json", help="also write the full result as JSON here")
    s.set_defaults(fn=_bench)
    _add_site(sub, common, fmt)
    _add_deploy(sub, common, fmt)
    s = sub.add_parser("check-params", parents=[common], help="validate params.yaml; --method KEY: that method's parameters",
                       formatter_class=fmt, epilog=_listing(known, "methods"))
    s.add_argument("--method", action="append", metavar="KEY", help="print methods.KEY's parameters as a run takes them: "
                   "value, set or default, meaning (repeatable)")
    s.add_argument("--stamp", action="store_true", help="when the params hold, write data/checked/[<paper>/<scale>/]params.json "
                   "(the check_params stage: the split, train, onboard and report stages depend on it, so a params file "
                   "that fails stops dvc repro before DVC removes their outputs)")
    s.set_defaults(fn=_check)
    s = sub.add_parser("new-paper", parents=[common], help="a paper's pipeline of your own: pipelines/NAME/ with params.yaml "
                       "(an experiment of the root params, the methods, one run group), dvc.yaml and published.yaml",
                       formatter_class=fmt, epilog=_listing(known, "experiments", "methods") + "\nREADME, \"A paper of your own\".")
    s.add_argument("name", help="the paper's name: lower-case letters, digits and _ (pipelines/NAME, results/NAME/)")
    s.add_argument("--experiment", required=True, help="an experiment of the root params file whose dataset, split and "
                   "training the paper's experiment starts from (its dataset must be in pipeline.datasets)")
    s.add_argument("--methods", required=True, help="comma-separated methods (fedsilo methods lists them), e.g. fedavg,fedprox,ditto")
    s.add_argument("--title", default="", help="the paper, in words, for the files' headers")
    s.set_defaults(fn=_new_paper)
    s = sub.add_parser("stale-runs", parents=[common], help="the MLflow runs left RUNNING whose process on this host is "
                       "gone (SIGKILLed, a lost queue worker); --end marks them KILLED", formatter_class=fmt)
    s.add_argument("--end", action="store_true", help="mark them KILLED (a checkpoint of one still resumes it)")
    s.set_defaults(fn=_stale_runs)
    s = sub.add_parser("methods", help="list every registered method: the data it learns, whether a site may join a run "
                       "in progress, its one-line summary")
    s.set_defaults(fn=_methods)
    return ap


def _nonempty(value: str) -> str:
    """An option's value that names something (a folder, a site, an experiment): an empty one is refused by argparse
    (``--out ""`` wrote the CA into the current folder)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("empty; give a value")
    return value


def _actions(parser: argparse.ArgumentParser, common: argparse.ArgumentParser, fmt: type, fn: Callable[[argparse.Namespace], None],
             actions: dict[str, tuple[str, str]]) -> dict[str, argparse.ArgumentParser]:
    """One sub-command per action of ``site`` / ``deploy`` (``fedsilo site evaluate --help`` lists evaluate's options
    only, and argparse names a missing required one): ``actions`` maps each to (its line in the command's listing,
    the longer description of its own --help)."""
    acts = parser.add_subparsers(dest="action", required=True, metavar="action")
    made = {}
    for name, (line, description) in actions.items():
        made[name] = acts.add_parser(name, parents=[common], formatter_class=fmt, help=line, description=description)
        made[name].set_defaults(fn=fn)
    return made


def _add_site(sub: argparse._SubParsersAction, common: argparse.ArgumentParser, fmt: type) -> None:
    s = sub.add_parser(
        "site", parents=[common], formatter_class=fmt,
        help="a hospital's side of a deployment: its data card and fingerprint, its Flower SuperNode, its kept model",
        description="Run at a site, with the site's own params file (its source, harmonize options and a one-client "
        "split of its own data, made by `fedsilo fetch / harmonize / split` there). `fedsilo site ACTION --help` "
        "lists an action's options.")
    a = _actions(s, common, fmt, _site, {
        "card": ("print the site's card and write it to data/site/<experiment>.json",
                 "Print the site's card (counts, contract, data fingerprint: hashes only) and write it to "
                 "data/site/<experiment>.json: what the site sends the coordinator."),
        "supernode": ("check the card, then run the site's Flower SuperNode against the coordinator's SuperLink",
                      "Check the card, then run flower-supernode against the coordinator's SuperLink with TLS and the "
                      "site's authentication key (--dry-run prints the command; --systemd-unit FILE writes a service that "
                      "runs this command, restarted after a failure once the SuperLink lets the node in again)."),
        "audit": ("what crossed this site's link, from its own wire logs",
                  "What crossed this site's link, from its own wire logs under --root: per deployment, the bytes it "
                  "received and sent, and per message type what it sent (tensor names, dtypes, shapes, bytes; metric and "
                  "config keys; errors; never values), the stores and the model it keeps (--json: the received side too)."),
        "predict": ("score image files with the model the site kept",
                    "Score image files with the model the site kept from a deployment (or adapted with `site onboard`), "
                    "each harmonized as the site's training images were (--experiment's dataset): path, predicted class, "
                    "class probabilities, error."),
        "evaluate": ("external validation of the kept model on a labelled dataset the site harmonized",
                     "External validation: the kept model on every image of a labelled --dataset the site harmonized "
                     "(per domain and overall: accuracy, AUC, sensitivity, specificity with patient-level bootstrap "
                     "intervals, PPV, NPV, confusion; one row per image) -> evaluation.md/.json and predictions.csv in "
                     "--out (default evaluation/<dataset>; a later evaluation replaces these three files)."),
        "onboard": ("a hospital outside a deployed run adapts the federation's model on its own data",
                    "A hospital that was not part of a deployed run adapts the federation's model (--model: the "
                    "coordinator's final_model.pt) on its own data: pFedDB's phi as its Fig. 6 (its own local model first, "
                    "experiments.<e>.onboarding.pretrain_rounds), a plain backbone's shared layers (FedBN, FedRep, ...), "
                    "or the method's own client round against the finished federation (as_member: Ditto, FedPAC, F2DC, "
                    "...), or a global model (FedAvg, FedProx, ...: finetune_all); onboarding.rounds rounds of each "
                    "--strategy, scored on its test split; keeps the first strategy's model as model.pt (predict and "
                    "evaluate take it) with onboarding.json in --out (default onboarding/<federation>/<method>/seed<k>); "
                    "nothing is sent."),
    })
    for name in ("card", "supernode", "predict", "onboard"):
        a[name].add_argument("--experiment", required=True, type=_nonempty, help="the site's one-client experiment (experiments.<name>)")
    for name in ("predict", "evaluate"):
        a[name].add_argument("--model", help="the model.pt the site kept (default: the only one under --root: a "
                             "deployment's, or one `site onboard` adapted)")
        a[name].add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, auto; default cpu)")
    a["supernode"].add_argument("--superlink", required=True, type=_nonempty, help="the SuperLink's address, host:port")
    a["supernode"].add_argument("--root-certificates", required=True, type=_nonempty, help="the federation's CA certificate (ca.crt from the coordinator)")
    a["supernode"].add_argument("--auth-key", required=True, type=_nonempty, help="the site's private authentication key (fedsilo deploy key)")
    a["supernode"].add_argument("--port", type=int, default=9094, help="this SuperNode's Runtime API port on 127.0.0.1 (default 9094)")
    _service_options(a["supernode"], "flower-supernode")
    a["audit"].add_argument("--json", action="store_true", help="print JSON (with the received side)")
    a["predict"].add_argument("--images", nargs="+", required=True, metavar="FILE_OR_FOLDER",
                              help="image files (DICOM, PNG, JPEG) or folders of them")
    a["predict"].add_argument("--out", help="the CSV to write (default: standard output)")
    a["evaluate"].add_argument("--dataset", required=True, type=_nonempty, help="the labelled dataset (datasets.<name>, harmonized here) to score")
    a["evaluate"].add_argument("--bootstrap", type=int, default=1000, help="patient-level bootstrap samples for the 95 %% "
                               "intervals (default 1000)")
    a["evaluate"].add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    a["evaluate"].add_argument("--out", help="the folder to write (default evaluation/<dataset>)")
    a["onboard"].add_argument("--model", required=True, type=_nonempty, help="the deployment's final_model.pt (from the coordinator)")
    a["onboard"].add_argument("--strategy", nargs="+", choices=["freeze_global", "finetune_all", "from_scratch", "as_member"],
                              help="the strategies to run, the first one's model kept (default: the method's own way: "
                              "freeze_global for pFedDB, FedBN, FedRep, FedPer, LG-FedAvg: the federation's tensors frozen, "
                              "what a site keeps trained; as_member for a method whose sites are evaluated with a model of "
                              "their own (Ditto, FedPAC, F2DC, ...): its own client round against the finished federation; "
                              "finetune_all for a global model: every tensor trained from the federation's). from_scratch: a "
                              "fresh backbone on this site's data alone (a baseline). pFedDB refuses as_member")
    a["onboard"].add_argument("--out", help="the folder to write (default onboarding/<federation>/<method>/seed<k>)")


def _service_options(parser: argparse.ArgumentParser, program: str) -> None:
    """--dry-run / --systemd-unit of an action that becomes a long-running Flower process (`_run_or_install`)."""
    parser.add_argument("--dry-run", action="store_true", help=f"print the {program} command, do not run it")
    parser.add_argument("--systemd-unit", metavar="FILE", help="write a systemd service running this command here, do not run it")


def _add_deploy(sub: argparse._SubParsersAction, common: argparse.ArgumentParser, fmt: type) -> None:
    s = sub.add_parser(
        "deploy", parents=[common], formatter_class=fmt,
        help="the coordinator's side of a deployment: TLS certificates, site keys, the Flower App of a federation",
        description="The coordinator's side of a deployment across sites. `fedsilo deploy ACTION --help` lists an "
        "action's options.")
    a = _actions(s, common, fmt, _deploy, {
        "certs": ("a CA and the SuperLink's TLS certificate (--renew: a new SuperLink certificate)",
                  "A federation CA and the SuperLink's TLS certificate for --host names (default 127.0.0.1, localhost) in "
                  "--out; with --renew, a new SuperLink certificate signed by the CA in --out."),
        "key": ("a SuperNode authentication key pair for one site",
                "A SuperNode authentication key pair named --name in --out: the private key goes to the site, the .pub "
                "to the coordinator (flwr supernode register)."),
        "app": ("the Flower App of a federation: flwr run it",
                "The Flower App of --federation federation.yaml in --out, method params from --params: flwr run it."),
        "superlink": ("run flower-superlink with TLS, SuperNode authentication and its state on disk",
                      "Run flower-superlink with TLS from --certs, SuperNode authentication and its state in --database "
                      "(--dry-run prints the command; --systemd-unit FILE writes a service that runs it)."),
        "status": ("where the deployment of an App stands",
                   "Where the deployment of --app stands: each site's node online or offline (the SuperLink's, through "
                   "flwr supernode list), the ServerApp's checkpoint round, whether the results are written, when the "
                   "certificates in --certs expire."),
    })
    a["certs"].add_argument("--out", required=True, type=_nonempty, help="the folder to write (ca.crt, ca.key, server.pem, server.key)")
    a["certs"].add_argument("--host", action="append", help="an address or DNS name of the SuperLink (repeat)")
    a["certs"].add_argument("--days", type=int, default=365, help="validity of the SuperLink's certificate in days (default 365)")
    a["certs"].add_argument("--ca-days", type=int, default=3650, help="validity of the federation CA, the ca.crt every site "
                            "trusts, in days (default 3650)")
    a["certs"].add_argument("--renew", action="store_true", help="a new SuperLink certificate in --out, signed by the CA "
                            "there (names from the old one unless --host); the sites keep their ca.crt")
    a["key"].add_argument("--out", required=True, type=_nonempty, help="the folder to write the key pair in")
    a["key"].add_argument("--name", required=True, type=_nonempty, help="the site's name")
    a["app"].add_argument("--out", required=True, type=_nonempty, help="the App folder to write")
    a["app"].add_argument("--federation", required=True, type=_nonempty, help="the federation file")
    a["app"].add_argument("--results", help="where the ServerApp writes its results (default "
                          "results/deploy/<federation>/<method>/seed<k> under the SuperLink's folder)")
    a["app"].add_argument("--state", help="where the ServerApp keeps its checkpoint, from which a run started again resumes "
                          "(default state/deploy/<federation>/<method>/seed<k> under the SuperLink's folder)")
    for name in ("superlink", "status"):
        a[name].add_argument("--certs", default="certs", help="the folder `deploy certs` wrote (default certs)")
    a["superlink"].add_argument("--database", default="superlink.db", help="the SuperLink's state file, registrations and "
                                "runs kept across restarts (default superlink.db; ':memory:' keeps none)")
    a["superlink"].add_argument("--listen", default="0.0.0.0:9093", help="host:port of its Fleet and Control APIs (default 0.0.0.0:9093)")
    _service_options(a["superlink"], "flower-superlink")
    a["status"].add_argument("--app", required=True, type=_nonempty, help="the App folder `deploy app` wrote")
    a["status"].add_argument("--connection", help="the flwr CLI's SuperLink connection (default: its default one)")
    a["status"].add_argument("--superlink-dir", default=".", help="the SuperLink's working folder, where a relative "
                             "state-dir or results-dir is (default .)")
    a["status"].add_argument("--json", action="store_true", help="print JSON")


def _root_and_params(args: argparse.Namespace) -> list[str]:
    """A warning where ``--params`` names a file in a folder that holds ``data/`` while ``--root`` (the folder of
    data/ and results/) has none: a site's `fedsilo --params hospital/params.yaml harmonize` read and wrote under
    the current folder, and its "raw source folder missing (run fedsilo fetch)" led to a second copy there."""
    params_dir, root = Path(args.params).parent, Path(args.root)
    try:
        if params_dir.resolve() == root.resolve() or not (params_dir / "data").is_dir() or (root / "data").exists():
            return []
    except OSError:
        return []
    return [f"fedsilo {args.cmd}: warning: --params {args.params} is in {params_dir}, which holds data/, but --root is "
            f"{args.root}, which does not: data/ and results/ are read and written under --root (add --root {params_dir})"]


def main(argv: list[str] | None = None) -> int:
    """The ``fedsilo`` command; its output piped into a reader that stops early (``fedsilo --version | head -1``,
    ``fedsilo site predict ... | head``) ends it quietly with the status of a process SIGPIPE ended (141)."""
    import os

    try:
        try:
            return _main(argv)
        finally:  # here (--version's exit too), not at the interpreter's exit, where a closed pipe is a stderr message
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():  # another pipe (a worker's, a subprocess's): an error of its own, not a reader gone
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe
        return 128 + 13


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), no poll on this system
        return False


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    if not argv:  # bare `fedsilo`: what it can do, not an argparse complaint
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from fedsilo.data.download import DownloadError, cache_dir
    from fedsilo.data.fetch import FetchError
    from fedsilo.data.harmonize import HarmonizeError
    from fedsilo.data.sources.base import LabelFileError
    from fedsilo.data.splits import SplitError
    from fedsilo.grid import GridError
    from fedsilo.report import ReportError
    from fedsilo.utils.io import disk_full, no_space_message

    for line in _root_and_params(args):
        print(line, file=sys.stderr)
    try:
        args.fn(args)
    except Exception as err:  # noqa: BLE001 - re-raised unless it is one of ours or a full disk
        full = disk_full(err)  # whatever wrote (numpy, pandas, torch.save, a plain write): where, and what to do
        if full is not None:
            root = Path(args.root)
            elsewhere = [
                (cache_dir(root), "set FEDSILO_DOWNLOAD_CACHE to a folder on a larger disk"),
                (root, "point --root elsewhere (a copy of the repository on a larger disk)"),
            ]
            msg = no_space_message(full, root, elsewhere)
        elif isinstance(err, (ConfigError, FetchError, DownloadError, HarmonizeError, LabelFileError, SplitError, ReportError, GridError, FileNotFoundError)):
            msg = err
            other = Path(args.root) / "params.yaml"
            if str(err).startswith(f"{args.params}: not found") and args.params == "params.yaml" and other.is_file():
                msg = (f"{err}; --root {args.root} holds one: add --params {other} (--root names the folder of data/ "
                       "and results/, --params the file read; neither implies the other)")
        elif type(err).__name__ == "PrivacyViolation":  # fl.engine's (not imported here: no torch for the data commands)
            msg = (f"{err}: the method's code is at fault, not the input (its local_update returned a tensor its "
                   "private_keys declares private; README, \"Adding a method\"; -v shows where)")
        else:
            raise
        if args.verbose:  # where it was raised: a missing file the code did not expect, named in one line otherwise
            traceback.print_exception(err, file=sys.stderr)
        print(f"fedsilo {args.cmd}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the stage's own cleanup has run (temporaries removed, MLflow run KILLED)
        print(f"fedsilo {args.cmd}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
