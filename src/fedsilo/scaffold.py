"""``fedsilo new-paper``: a paper's pipeline folder of one's own, ready to run: ``pipelines/<name>/params.yaml`` (one
experiment taken from the root params file, the methods chosen, one run group ``table1``), ``dvc.yaml`` (the stages
every paper's pipeline has, with ``train_table1``) and ``published.yaml`` (empty, its format in comments). The
stages are the shipped papers' (tests/test_scaffold.py holds them equal), so the new pipeline builds, tracks and
reports as theirs do; a run group added later needs its ``train_<group>`` stage, a copy of ``train_table1``:
:func:`check_paper_stages` (``fedsilo check-params``) holds any paper's run groups and its dvc.yaml in agreement."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Sequence

import yaml

from fedsilo.config import SLUG_RE, ConfigError, Params, did_you_mean

GROUP = "table1"

# the stages of every paper's dvc.yaml (pipelines/*/dvc.yaml) with one train group; ${...} are the params file's
DVC_YAML = """\
# {title}: the runs its tables need, at the scale of the params.yaml beside this file (written by
# `fedsilo new-paper {name}`; README, "A paper of your own").
#   dvc repro pipelines/{name}/dvc.yaml
# Sources and harmonized datasets are the root pipeline's (dvc.yaml / params.yaml at the repository root): this file
# builds its own splits and runs from them and never copies data. Every stage runs at the repository root.
vars:
  - params.yaml

stages:
  # A params file that fails its checks stops `dvc repro` here, before DVC removes the outputs of any stage it would
  # rerun (the root dvc.yaml says more); its output's bytes are the same whenever the files hold.
  check_params:
    wdir: ${{repo_root}}
    cmd: fedsilo --params ${{params_file}} check-params --stamp
    deps:
      - ${{params_file}}
      - ${{data}}                        # the root params file whose sources and datasets it uses
    outs:
      - data/checked/${{paper}}/${{scale}}/params.json:
          persist: true                # kept while the stage runs: a failed check leaves the stages after it as they were

  # The code each method's runs depend on, one file per methods key of this params file: adding or editing a method
  # reruns its own runs only.
  code_fingerprint:
    wdir: ${{repo_root}}
    cmd: fedsilo --params ${{params_file}} code-fingerprint
    deps:
      - data/checked/${{paper}}/${{scale}}/params.json   # it reads the params file: check_params first
      - src/fedsilo/client
      - src/fedsilo/fl
      - src/fedsilo/methods
      - src/fedsilo/models
      - src/fedsilo/utils
      - src/fedsilo/config/base.py
      - src/fedsilo/config/train.py
      - src/fedsilo/codehash.py
    params:
      - ${{params_file}}:
          - methods
    outs:
      - data/code/${{paper}}/${{scale}}

  split:
    foreach: ${{experiments}}
    do:
      wdir: ${{repo_root}}
      cmd: fedsilo --params ${{params_file}} split --experiment ${{key}}
      deps:
        - data/checked/${{paper}}/${{scale}}/params.json
        - data/harmonized/${{item.dataset}}
        - src/fedsilo/data/splits.py
        - src/fedsilo/config/base.py
        - src/fedsilo/config/split.py
      params:
        - ${{params_file}}:
            - experiments.${{key}}.dataset
            - experiments.${{key}}.split
      outs:
        - data/splits/${{paper}}/${{scale}}/${{key}}.json

  # One train stage group per runs group of params.yaml (a run belongs to exactly one group). Another group: a copy
  # of this stage named train_<group>, its matrix reading runs.<group>.experiments and runs.<group>.methods, its
  # deps, params and outs the anchors below (*train_deps, *train_params, *train_outs).
  train_{group}:
    matrix:
      experiment: ${{runs.{group}.experiments}}
      method: ${{runs.{group}.methods}}
      seed: ${{seeds}}
    wdir: ${{repo_root}}
    cmd: fedsilo --params ${{params_file}} train --experiment ${{item.experiment}} --method ${{item.method}} --seed ${{item.seed}}
    deps: &train_deps
      - data/checked/${{paper}}/${{scale}}/params.json
      - data/splits/${{paper}}/${{scale}}/${{item.experiment}}.json
      - data/code/${{paper}}/${{scale}}/${{item.method}}.json   # the code this method's runs depend on (code_fingerprint)
    params: &train_params
      - ${{params_file}}:
          - experiments.${{item.experiment}}.train
          - methods.${{item.method}}
    outs: &train_outs
      - results/${{paper}}/${{scale}}/${{item.experiment}}/${{item.method}}/seed${{item.seed}}

  report:
    foreach: ${{experiments}}
    do:
      wdir: ${{repo_root}}
      cmd: fedsilo --params ${{params_file}} report --experiment ${{key}}
      deps:
        - data/checked/${{paper}}/${{scale}}/params.json
        - results/${{paper}}/${{scale}}/${{key}}
        - src/fedsilo/report
        - pipelines/${{paper}}/published.yaml
      params:
        - ${{params_file}}:
            - experiments.${{key}}
            - methods
            - runs
            - seeds
      outs:
        - results/${{paper}}/${{scale}}/report/${{key}}
"""

PUBLISHED_YAML = """\
# {title}: the paper's published numbers, set beside ours in each experiment's report once
# experiments.<e>.published names a table here ('pipelines/{name}/published.yaml#<table>'); checked by
# `fedsilo check-params` before anything trains. An accuracy table (top-1 %, as the paper prints it):
#
# accuracy:
#   <table>:
#     source: Table 1 of the paper (its data, clients and model, in words)
#     backbone: simple_cnn             # the paper's model; the report says where ours differs
#     domains: [MNIST, SVHN, USPS]     # its columns: the experiment's domains, or [local, new] / [local, new, external]
#     methods:                         # a row per method key of params.yaml's methods (a row with no run is listed)
#       fedavg: {{mean: [90.1, 70.2, 88.3, 82.9], std: [0.5, 1.1, 0.7, 0.4]}}   # each domain, then the Avg
#       fedprox: {{mean: [83.0]}}                                               # the Avg alone
#       ditto: {{mean: [...], std_over_domains: 8.1, selection: best_validation}}  # optional keys
#
# `selection: best_validation` says the paper's row is its best mean validation round (the report sets ours so);
# `row_of: fedavg` sets a run the paper has no row of beside another method's row (the report says so);
# pipelines/*/published.yaml of the shipped papers hold more (efficiency, time_to_accuracy, across).
accuracy: {{}}
"""


def new_paper(params: Params, root: Path, name: str, experiment: str, methods: Sequence[str], title: str = "") -> Path:
    """``pipelines/<name>/`` under ``root`` (see the module), from the root params ``params``: ``experiment`` one of
    its experiments (its dataset must be one the root pipeline builds), ``methods`` registered methods (the root's
    entry of each where it has one, else the method's defaults). Written whole or not at all."""
    from fedsilo.methods.registry import REGISTRY
    from fedsilo.utils.io import atomic_dir

    if params.paper is not None:
        raise ConfigError(f"{params.source}: a paper's params file; new-paper takes the root's (--params params.yaml)")
    if not SLUG_RE.match(name):
        near = re.sub(r"[^a-z0-9_]", "_", name.lower())
        hint = f" (did you mean '{near}'?)" if SLUG_RE.match(near) else ""
        raise ConfigError(f"'{name}' is no paper name{hint}: lower-case letters, digits and _, starting with a letter "
                          "or digit (it names the folder pipelines/<name> and results/<name>/)")
    if name in params.experiments:
        raise ConfigError(f"'{name}' is an experiment of {params.source}: the paper's results/{name}/ and state/{name}/ "
                          "would be that experiment's folders (its report would depend on the paper's runs); give the "
                          "paper another name")
    if not title.isprintable():  # a line break of any kind (YAML reads U+2028 and U+0085 as ones too), a control character
        raise ConfigError("--title: one line of printable text (it heads the comment of each file written; a line break "
                          "would end the comment and break the YAML of every pipeline DVC reads)")
    folder = root / "pipelines" / name
    if folder.exists():
        raise ConfigError(f"{folder} exists; choose another name, or edit its files")
    if experiment not in params.experiments:
        raise ConfigError(f"--experiment: '{experiment}' is not under experiments in {params.source}"
                          f"{did_you_mean(experiment, params.experiments)} (its experiments: {', '.join(params.experiments)})")
    dataset = params.experiments[experiment].dataset
    if dataset not in params.pipeline.datasets:
        raise ConfigError(f"--experiment {experiment}: its dataset '{dataset}' is not in pipeline.datasets of "
                          f"{params.source}; add it there (a paper's pipeline uses the data the root builds)")
    if not methods:
        raise ConfigError("--methods: name one method or more (fedsilo methods lists them)")
    unknown = [m for m in methods if m not in REGISTRY and (params.methods.get(m) or {}).get("method") not in REGISTRY]
    if unknown:
        raise ConfigError(f"--methods: '{unknown[0]}' is no registered method{did_you_mean(unknown[0], REGISTRY)} "
                          "(fedsilo methods lists them)")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods: {', '.join(methods)} names a method twice")
    source = Path(params.source).resolve()
    if not source.is_relative_to(root.resolve()):
        raise ConfigError(f"{params.source} is not inside --root {root}: a paper's params name the root's by its "
                          "place in the repository")
    data = source.relative_to(root.resolve()).as_posix()
    raw = yaml.safe_load(source.read_text())
    exp = copy.deepcopy(raw["experiments"][experiment])
    exp.pop("published", None)  # the root's published table is not this paper's
    key = f"{name}_{experiment}" if not experiment.startswith(f"{name}_") else experiment
    title = title or name
    doc = {
        "paper": name,
        "scale": "quickstart",
        "params_file": f"pipelines/{name}/params.yaml",
        "repo_root": "../..",
        "data": data,
        "seeds": list(params.pipeline.seeds),
        "experiments": {key: exp},
        "methods": {m: copy.deepcopy((raw.get("methods") or {}).get(m) or {}) for m in methods},
        "runs": {GROUP: {"experiments": [key], "methods": list(methods)}},
        "tracking": copy.deepcopy(raw.get("tracking") or {}),  # the root's store (an MLflow server, tracking off)
    }
    if not doc["tracking"]:
        del doc["tracking"]
    _check_before_writing(doc, folder / "params.yaml", root)
    header = (f"# {title}: a paper's pipeline (written by `fedsilo new-paper {name}`; README, \"A paper of your own\"). Its\n"
              f"# experiment is the root's {experiment} at the root's settings; change them here. A run group added under runs\n"
              f"# needs its train_<group> stage in dvc.yaml (a copy of train_{GROUP}); `fedsilo check-params --params\n"
              f"# pipelines/{name}/params.yaml` names one missing.\n")
    with atomic_dir(folder) as tmp:
        (tmp / "params.yaml").write_text(header + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
        (tmp / "dvc.yaml").write_text(DVC_YAML.format(title=title, name=name, group=GROUP))
        (tmp / "published.yaml").write_text(PUBLISHED_YAML.format(title=title, name=name))
    return folder


def _check_before_writing(doc: dict, path: Path, root: Path) -> None:
    """The params file about to be written, checked as `fedsilo check-params` will check it (a dataset of one's own
    sources, a stream method on static clients, ...), so that nothing is written that the pipeline would refuse."""
    from fedsilo.config import load_paper_params
    from fedsilo.methods.registry import check_methods, check_pipeline_fits

    where = path.relative_to(root).as_posix()
    try:
        params = load_paper_params(path, copy.deepcopy(doc))
        check_methods(params, where)
        check_pipeline_fits(params, where)
    except ConfigError as err:
        raise ConfigError(f"nothing written, the pipeline would refuse it: {err}") from None


def check_paper_stages(p: Params, where: str, root: Path) -> None:
    """A paper's run groups and the dvc.yaml beside its params file agree: each group that trains has its
    ``train_<group>`` stage reading that group's experiments and methods, each ``across: true`` group its
    ``across_<group>`` stage, and no such stage names a group params lacks. (DVC's templating cannot loop over the
    groups, so dvc.yaml lists them; a group added to params only would train nothing and its report stage, whose
    old output DVC removes first, would then stop for the runs missing.) A params file with no dvc.yaml beside it
    runs by hand (``fedsilo train``): nothing to agree with."""
    if p.paper is None:
        return
    dvc_file = Path(p.paper.params_file).parent / "dvc.yaml"
    if not (root / dvc_file).is_file():
        return
    stages = (yaml.safe_load((root / dvc_file).read_text()) or {}).get("stages") or {}
    copy = "a copy of another train_<group> stage whose matrix reads runs.<group>.experiments and runs.<group>.methods"
    for g, grp in p.paper.runs.items():
        stage = stages.get(f"train_{g}")
        if stage is None:
            if grp.methods:
                raise ConfigError(f"{where}: runs.{g}: {dvc_file} has no train_{g} stage, so its runs would never train; "
                                  f"add one ({copy})")
            continue
        matrix = stage.get("matrix") or {}
        for key, field in (("experiment", "experiments"), ("method", "methods")):
            if matrix.get(key) != f"${{runs.{g}.{field}}}":
                raise ConfigError(f"{where}: runs.{g}: {dvc_file}: stage train_{g}'s matrix.{key} is {matrix.get(key)!r}, "
                                  f"not '${{runs.{g}.{field}}}': it would train another group's runs under this one's name")
        if grp.across and f"across_{g}" not in stages:
            raise ConfigError(f"{where}: runs.{g}.across: {dvc_file} has no across_{g} stage, so its table across "
                              "experiments would never be written; add one (a copy of another across_<group> stage)")
    for name in stages:
        for prefix in ("train_", "across_"):
            g = name[len(prefix):] if name.startswith(prefix) else None
            if g is not None and (g not in p.paper.runs or (prefix == "across_" and not p.paper.runs[g].across)):
                raise ConfigError(f"{where}: {dvc_file}: stage {name}: " + (
                    f"no run group '{g}' under runs{did_you_mean(g, p.paper.runs)}" if g not in p.paper.runs
                    else f"runs.{g} has no across: true (the stage's report --across would refuse it)"))


def describe(folder: Path, root: Path) -> str:
    """What ``fedsilo new-paper`` wrote and what to run next."""
    rel = folder.relative_to(root).as_posix()
    return (f"new-paper: wrote {rel}/params.yaml, dvc.yaml, published.yaml\n"
            f"  fedsilo --params {rel}/params.yaml check-params     # every key checked, in a second\n"
            f"  dvc repro {rel}/dvc.yaml                           # splits, runs and the report\n"
            f"  results/{folder.name}/quickstart/report/<experiment>/   # tables and figures")

