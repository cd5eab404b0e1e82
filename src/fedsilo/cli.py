"""``fedsilo``: one command per pipeline stage; dvc.yaml calls only this CLI.

    fedsilo fetch --source chexpert
    fedsilo harmonize --dataset chest_xray4
    fedsilo split --experiment cxr4_quickstart
    fedsilo train --experiment cxr4_quickstart --method fedbn --seed 0
    fedsilo report --experiment cxr4_quickstart
    fedsilo check-params            # validate params.yaml and exit

Every command reads ``params.yaml`` (``--params`` to point elsewhere) and fails with a one-line message naming the
key, file, row or column at fault.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fedsilo.config import ConfigError, load_params


def _fetch(args: argparse.Namespace) -> None:
    from fedsilo.data.fetch import fetch

    p = load_params(args.params)
    if args.source not in p.sources:
        raise ConfigError(f"sources.{args.source}: not defined in {args.params}")
    m = fetch(args.source, p.sources[args.source], Path(args.root) / "data" / "raw" / args.source)
    print(f"fetch {args.source}: {len(m['files'])} files from {m['origin']}")


def _harmonize(args: argparse.Namespace) -> None:
    from fedsilo.data.harmonize import harmonize_cxr

    p = load_params(args.params)
    if args.dataset not in p.datasets:
        raise ConfigError(f"datasets.{args.dataset}: not defined in {args.params}")
    card = harmonize_cxr(p.datasets[args.dataset], Path(args.root) / "data" / "raw", Path(args.root) / "data" / "harmonized" / args.dataset)
    for dom, d in card["domains"].items():
        print(f"{args.dataset} {dom}: {d['images']} images ({d['by_class']}), {d['excluded']} excluded, {d['quarantined']} quarantined")


def _split(args: argparse.Namespace) -> None:
    import pandas as pd

    from fedsilo.data.splits import check_patient_disjoint, make_split
    from fedsilo.utils.io import write_json

    p = load_params(args.params)
    if args.experiment not in p.experiments:
        raise ConfigError(f"experiments.{args.experiment}: not defined in {args.params}")
    exp = p.experiments[args.experiment]
    rec_path = Path(args.root) / "data" / "harmonized" / exp.dataset / "records.parquet"
    if not rec_path.exists():
        raise FileNotFoundError(f"{rec_path}: missing; run `dvc repro harmonize@{exp.dataset}` first")
    records = pd.read_parquet(rec_path)
    split = make_split(records, exp.split, exp.split.seed)
    check_patient_disjoint(records, split)
    split["experiment"] = args.experiment
    split["dataset"] = exp.dataset
    write_json(Path(args.root) / "data" / "splits" / f"{args.experiment}.json", split)
    for c in split["clients"]:
        print(f"{args.experiment} client {c['name']}: {len(c['train'])} train / {len(c['test'])} test")


def _train(args: argparse.Namespace) -> None:
    from fedsilo.fl.run import run_training

    p = load_params(args.params)
    m = run_training(p, args.experiment, args.method, args.seed, Path(args.root))
    per = ", ".join(f"{k} {v['acc']:.3f}" for k, v in m["per_client"].items())
    print(f"{args.experiment} {args.method} seed {args.seed}: mean acc {m['mean_acc']:.3f} ± {m['std_acc']:.3f} ({per})")


def _report(args: argparse.Namespace) -> None:
    from fedsilo.report import build_report

    p = load_params(args.params)
    exps = [args.experiment] if args.experiment else list(p.pipeline.experiments)
    made = {}
    for exp in exps:
        if exp not in p.experiments:
            raise ConfigError(f"experiments.{exp}: not defined in {args.params}")
        made.update(build_report(Path(args.root), exp, list(p.pipeline.methods), list(p.pipeline.seeds), Path(args.root) / "results" / "report" / exp))
    for exp, info in made.items():
        print(f"report {exp}: Avg accuracy " + ", ".join(f"{m} {v:.1f}" for m, v in info["table"].items()))


def _check(args: argparse.Namespace) -> None:
    load_params(args.params)
    print(f"{args.params}: ok")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedsilo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="parameters file (default: params.yaml)")
    ap.add_argument("--root", default=".", help="repository root holding data/ and results/ (default: .)")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("fetch", help="bring one raw source into data/raw/<source>/")
    s.add_argument("--source", required=True)
    s.set_defaults(fn=_fetch)
    s = sub.add_parser("harmonize", help="raw sources -> data/harmonized/<dataset>/")
    s.add_argument("--dataset", required=True)
    s.set_defaults(fn=_harmonize)
    s = sub.add_parser("split", help="harmonized dataset -> data/splits/<experiment>.json")
    s.add_argument("--experiment", required=True)
    s.set_defaults(fn=_split)
    s = sub.add_parser("train", help="train one (experiment, method, seed); resumes from its last round")
    s.add_argument("--experiment", required=True)
    s.add_argument("--method", required=True)
    s.add_argument("--seed", type=int, required=True)
    s.set_defaults(fn=_train)
    s = sub.add_parser("report", help="tables and figures -> results/report/<experiment>/")
    s.add_argument("--experiment", help="one experiment (default: every one in pipeline.experiments)")
    s.set_defaults(fn=_report)
    s = sub.add_parser("check-params", help="validate params.yaml")
    s.set_defaults(fn=_check)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from fedsilo.data.fetch import FetchError
    from fedsilo.data.harmonize import HarmonizeError
    from fedsilo.data.sources.base import LabelFileError
    from fedsilo.data.splits import SplitError
    from fedsilo.report import ReportError

    try:
        args.fn(args)
    except (ConfigError, FetchError, HarmonizeError, LabelFileError, SplitError, ReportError, FileNotFoundError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"fedsilo {args.cmd}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
