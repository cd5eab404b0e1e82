"""The whole params file: the root's ``params.yaml`` (sources, datasets, experiments, methods, pipeline, tracking) or
a paper's ``pipelines/<paper>/params.yaml`` joined with the root's data sections; the checks across sections; the
loaders. Its validators check and never change a value: a run's numbers depend on ``train.py`` and ``base.py``, the
split's on ``split.py``, the data's on ``data.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Optional, get_args

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from fedsilo.config.base import ConfigError, Strict
from fedsilo.config.data import (
    OWN_READERS,
    RESERVED_DOMAINS,
    SOURCE_MODES,
    SOURCE_NAME,
    BenchmarkDatasetParams,
    CXRDatasetParams,
    DatasetParams,
    SourceParams,
)
from fedsilo.config.errors import METHOD_ENTRY_HINT, did_you_mean, format_validation_error
from fedsilo.config.train import ExperimentParams, TrainParams, min_image_size
from fedsilo.layout import Layout


# --------------------------------------------------------------------------- pipeline / report
def seeds_listed(v: Any) -> Any:
    """A bare number where a list of seeds belongs: refused with the list it likely means."""
    if isinstance(v, (int, str)) and not isinstance(v, bool):
        raise ValueError(f"{v!r}: seeds are a list, one run of each method per seed (e.g. seeds: [{v}])")
    return v


def distinct_seeds(v: tuple[int, ...]) -> tuple[int, ...]:
    """Seeds given each once (a seed is one run of each method: twice would be one run counted as two), none
    negative (the seeded streams of every round take non-negative keys only)."""
    negative = sorted({s for s in v if s < 0})
    if negative:
        raise ValueError(f"seed(s) {negative}: a seed is a non-negative integer (0, 1, 2, ...)")
    twice = sorted({s for s in v if v.count(s) > 1})
    if twice:
        raise ValueError(f"seed(s) {twice} listed twice: a seed is one run of each method (give each once)")
    return v


# a pipeline's or a paper's seeds: a list (a bare number refused), each given once, none negative
Seeds = Annotated[tuple[int, ...], BeforeValidator(seeds_listed), AfterValidator(distinct_seeds)]


class PipelineParams(Strict):
    sources: tuple[str, ...]
    datasets: tuple[str, ...]
    splits: dict[str, str] = Field(description="experiment -> its dataset: the split stages dvc.yaml expands")
    experiments: tuple[str, ...] = Field(description="experiments trained and reported (each must be in splits)")
    methods: tuple[str, ...]
    seeds: Seeds
    onboarding: tuple[str, ...] = Field((), description="holdout_domain experiments whose newcomer onboarding (pFedDB Fig. 6) dvc.yaml runs")


class TrackingParams(Strict):
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"


class RunGroup(Strict):
    """Runs a paper's table or figure needs: every listed experiment with every listed method, for each seed."""

    experiments: tuple[str, ...] = Field(min_length=1)
    methods: tuple[str, ...] = Field(
        description="empty: the group trains nothing (dvc.yaml keeps its train_<group> stage group, with no stage)"
    )
    beside: tuple[str, ...] = Field(
        (), description="methods another group trains on these experiments that the table sets beside this group's (an "
        "ablation's full method): `fedsilo report --group` reports them too"
    )
    beside_experiments: tuple[str, ...] = Field(
        (), description="experiments another group trains this group's methods on that its table across experiments "
        "sets beside its own (CD2-pFed's Fig. 5: s = 2 is Table 1's experiment): `fedsilo report --group` reads them too"
    )
    across: bool = Field(
        False, description="one table and figure across the group's experiments (beside_experiments with them), a "
        "column per value of the setting that tells them apart and a row per method (and dataset, where they span "
        "several; two or more experiments of each): dvc.yaml's across_<group> stage writes it (CD2-pFed's Fig. 5, "
        "FedeCouple's Fig. 12 and Table XII)"
    )
    published: Optional[str] = Field(
        None, description="with across: '<file>#<key>' of the paper's numbers for the table across experiments (the "
        "file's `across` section), set beside ours"
    )


class PaperMeta(Strict):
    name: str
    scale: str
    params_file: str
    runs: dict[str, RunGroup]


class Params(Strict):
    """The whole of params.yaml (or of a paper's params file joined with the root's data sections)."""

    sources: dict[str, SourceParams]
    datasets: dict[str, DatasetParams]
    experiments: dict[str, ExperimentParams]
    methods: dict[str, dict[str, Any]]
    pipeline: PipelineParams
    tracking: TrackingParams = TrackingParams()
    _paper: Optional[PaperMeta] = PrivateAttr(None)  # set when loaded from a paper's params file
    _source: str = PrivateAttr("params.yaml")  # the file it was loaded from, as given (errors name it)
    # methods.<key> -> its typed params, filled once by fedsilo.methods.check_methods (this module does not know the
    # method classes)
    _typed_methods: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def paper(self) -> Optional[PaperMeta]:
        return self._paper

    @property
    def source(self) -> str:
        """The params file this was loaded from (as given; ``params.yaml`` for params made in memory)."""
        return self._source

    def layout(self, root: str | Path = ".") -> Layout:
        return Layout(Path(root), f"{self._paper.name}/{self._paper.scale}" if self._paper else "")

    def train_stage(self, experiment: str, method: str, seed: int) -> str:
        """``dvc repro``'s target for the run (experiment, method, seed): the root's ``train@...``, a paper's
        ``train_<group>@...`` of the group that trains it."""
        item = f"{experiment}-{method}-{seed}"
        if self._paper is None:
            return f"train@{item}"
        group = next((g for g, grp in self._paper.runs.items() if experiment in grp.experiments and method in grp.methods), None)
        if group is None:
            raise ConfigError(f"{self._paper.params_file}: runs: no group trains '{method}' on '{experiment}'")
        return self.stage_target(f"train_{group}@{item}")

    def stage_target(self, stage: str) -> str:
        """``dvc repro``'s target for a stage of this params file's pipeline: the root's by name, a paper's through the
        dvc.yaml beside its params file (``pipelines/pfeddb/dvc.yaml:split@pfeddb_cxr4``)."""
        if self._paper is None:
            return stage
        return f"{Path(self._paper.params_file).parent.as_posix()}/dvc.yaml:{stage}"

    def experiment_methods(self, experiment: str) -> tuple[str, ...]:
        """The methods trained on ``experiment``: a paper's run groups that list it, else pipeline.methods."""
        if self._paper is None:
            return tuple(self.pipeline.methods)
        out: dict[str, None] = {}
        for g in self._paper.runs.values():
            if experiment in g.experiments:
                out.update(dict.fromkeys(g.methods))
        return tuple(out)

    @model_validator(mode="after")
    def _cross_refs(self) -> "Params":
        for s, sp in self.sources.items():
            if sp.reader is not None:
                if s in SOURCE_MODES:
                    raise ValueError(f"sources.{s}.reader: {s} is a public source with its own reader; give your own "
                                     f"source another name (e.g. {s}_site) or drop 'reader'")
                if not SOURCE_NAME.fullmatch(s):
                    raise ValueError(f"sources.{s}: a source of your own needs a name of lower-case letters, digits and _ "
                                     "(it names the folder data/raw/<name> and the DVC stage fetch@<name>)")
                modes = OWN_READERS[sp.reader]
                if sp.mode not in modes:
                    raise ValueError(f"sources.{s}.mode: {sp.mode!r} is not offered by reader {sp.reader} (its modes: {', '.join(modes)})")
                continue
            if s not in SOURCE_MODES:
                raise ValueError(f"sources.{s}: unknown source (known: {', '.join(SOURCE_MODES)}; a source of your own "
                                 "needs 'reader: cxr_table' (chest X-rays and a label table), 'reader: image_folder' (one "
                                 "folder per class) or 'reader: image_table' (images and a table of their classes))")
            if sp.mode not in SOURCE_MODES[s]:
                raise ValueError(f"sources.{s}.mode: {sp.mode!r} is not offered by {s} (its modes: {', '.join(SOURCE_MODES[s])})")
        for name, ds in self.datasets.items():
            for s in ds.source_list:
                if s not in self.sources:
                    raise ValueError(f"datasets.{name}.sources: '{s}' has no entry under 'sources'")
            if isinstance(ds, CXRDatasetParams):
                _check_cxr_sources(name, ds, self.sources)
            else:
                _check_folder_sources(name, ds, self.sources)
        for name, ex in self.experiments.items():
            if ex.dataset not in self.datasets:
                raise ValueError(f"experiments.{name}.dataset: '{ex.dataset}' is not under 'datasets'")
            _check_model_fits(name, ex, ex.dataset, self.datasets[ex.dataset].image_size)
        for e in self.pipeline.experiments:
            if e not in self.pipeline.splits:
                raise ValueError(f"pipeline.experiments: '{e}' is trained but its split is not built (add it to pipeline.splits)")
        for e in self.pipeline.onboarding:
            if e not in self.pipeline.experiments:
                raise ValueError(f"pipeline.onboarding: '{e}' must also be in pipeline.experiments (pFedDB is trained on it first)")
            if "pfeddb" not in self.pipeline.methods:
                raise ValueError("pipeline.onboarding: needs pfeddb in pipeline.methods")
            sp = self.experiments[e].split if e in self.experiments else None
            if sp is None or sp.protocol != "holdout_domain" or sp.role != "newcomer":
                raise ValueError(f"pipeline.onboarding: experiments.{e}.split must be holdout_domain with role newcomer")
        for e, d in self.pipeline.splits.items():
            if e in self.experiments and self.experiments[e].dataset != d:
                raise ValueError(f"pipeline.splits.{e}: '{d}' differs from experiments.{e}.dataset '{self.experiments[e].dataset}'")
        for key, known in (
            ("sources", self.sources),
            ("datasets", self.datasets),
            ("splits", self.experiments),
            ("experiments", self.experiments),
            ("methods", self.methods),
        ):
            for item in getattr(self.pipeline, key):
                if item not in known:
                    raise ValueError(f"pipeline.{key}: '{item}' is not defined under '{key}'{did_you_mean(item, known)}"
                                     + (METHOD_ENTRY_HINT.format(m=item) if key == "methods" else ""))
        for d in self.pipeline.datasets:  # harmonize@<d> reads data/raw/<s>, which only fetch@<s> writes
            missing = [s for s in self.datasets[d].source_list if s not in self.pipeline.sources]
            if missing:
                raise ValueError(f"pipeline.datasets: '{d}' is harmonized from {', '.join(missing)}, which "
                                 f"{'is' if len(missing) == 1 else 'are'} not in pipeline.sources (add "
                                 f"{'it' if len(missing) == 1 else 'them'} there: no stage would fetch "
                                 + ", ".join(f"data/raw/{s}" for s in missing) + ")")
        return self


def _check_cxr_sources(name: str, ds: CXRDatasetParams, sources: dict[str, SourceParams]) -> None:
    """A chest X-ray dataset's sources are the public ones or tables of the user's own, each a domain of its own."""
    for s in ds.own_sources():
        if sources[s].reader != "cxr_table":
            raise ValueError(f"datasets.{name}.sources: '{s}' is not a chest X-ray source (chexpert, openi, rsna, vinbigdata, "
                             f"chest_xray4_released) nor one with reader: cxr_table (sources.{s}.reader)")
    domains: dict[str, str] = {}
    for s in ds.sources:
        if ds.domain_of(s) in RESERVED_DOMAINS:  # a source named like a report column, with no domain of its own set
            raise ValueError(f"datasets.{name}.tables.{s}.domain: {ds.domain_of(s)!r} (the source's name) is a column of the "
                             f"report's tables ({', '.join(sorted(RESERVED_DOMAINS))}): set another 'domain'")
        for dom in ds.domains_of(s):
            key = dom.strip().casefold()
            if key in domains:
                mine = s if s in ds.own_sources() else domains[key]
                raise ValueError(f"datasets.{name}.tables.{mine}.domain: {dom!r} is also the domain of "
                                 f"{domains[key] if mine == s else s}; every source forms a domain of its own (set a distinct 'domain')")
            domains[key] = s


def _check_folder_sources(name: str, ds: BenchmarkDatasetParams, sources: dict[str, SourceParams]) -> None:
    """A benchmark dataset's sources of your own are image folders, and the domains they name are their own."""
    seen: dict[str, str] = {}
    for s in ds.own_sources():
        reader = sources[s].reader
        if reader not in ("image_folder", "image_table"):
            raise ValueError(f"datasets.{name}.sources: '{s}' is not a source of {ds.kind} nor one with reader: image_folder "
                             f"or image_table (sources.{s}.reader is {reader}" + ("; chest X-rays with a label table join a "
                             "kind: chest_xray4 dataset)" if reader == "cxr_table" else ")"))
        if reader == "image_table" and s not in ds.tables:
            raise ValueError(f"datasets.{name}.tables.{s}: missing; a source with reader: image_table needs its table's "
                             "rules (at least the label column: label, or label_columns)")
        if reader == "image_folder" and s in ds.tables:
            raise ValueError(f"datasets.{name}.tables.{s}: {s} has reader: image_folder (its rules go under folders.{s}); "
                             f"a table of its classes needs sources.{s}.reader: image_table")
        dom = ds.domain_of(s)
        if dom is None:
            continue
        key = ds.rules_key(s, name)
        if dom in RESERVED_DOMAINS:  # the source's name, no domain of its own set
            raise ValueError(f"{key}.domain: {dom!r} (the source's name) is a column of the report's "
                             f"tables ({', '.join(sorted(RESERVED_DOMAINS))}): set another 'domain'")
        folded = dom.strip().casefold()
        if folded in seen:
            raise ValueError(f"{key}.domain: {dom!r} is also the domain of {seen[folded]}; every source "
                             "forms a domain of its own (set a distinct 'domain')")
        seen[folded] = s


def _check_model_fits(experiment: str, ex: ExperimentParams, dataset: str, size: int) -> None:
    """A backbone too deep for the images fails here, naming both keys, not at the first batch inside PyTorch."""
    model, need = ex.train.model, min_image_size(ex.train.model)
    if size < need:
        fits = [m for m in get_args(TrainParams.model_fields["model"].annotation) if min_image_size(m) <= size]
        raise ValueError(
            f"experiments.{experiment}.train.model: {model} needs images of at least {need} px, but "
            f"datasets.{dataset}.image_size is {size}; raise datasets.{dataset}.image_size to {need} or more (harmonize "
            f"reruns), or set experiments.{experiment}.train.model to one that takes {size} px ({', '.join(fits)})"
        )


def parse_params(raw: dict[str, Any], source: str = "params.yaml") -> Params:
    """Validate every section but the values of ``methods.<key>`` entries, which belong to each method's own params
    class (:func:`fedsilo.methods.check_methods`; :func:`fedsilo.fl.params.load_params` runs both)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    if "paper" in raw:
        raise ConfigError(f"{source}: a paper's params file is read from its place in the repository (load_params)")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {format_validation_error(err, model=Params)}") from None


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last silently: `lam: 0.8, ...,
    lam: 0.5` would train 0.5 with no word). Merge keys (`<<: *anchor`) may still be overridden, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found (run from the repository root, or name the params file with --params: "
                          "a site's, or the coordinator's copy of the repository's)")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    params = load_paper_params(path, raw) if isinstance(raw, dict) and "paper" in raw else parse_params(raw, str(path))
    params._source = str(path)
    return params


# --------------------------------------------------------------------------- a paper's params file
SLUG = r"^[a-z0-9][a-z0-9_]*$"
SLUG_RE = re.compile(SLUG)


# a paper's outputs sit beside the root's: data/code/<paper>/ beside data/code/methods/, results/<paper>/ beside
# results/report/, the root's run groups' results/groups/ and results/across/, `report --methods`' results/selected/
# and a deployment's results/deploy/ and state/deploy/ (a root experiment's name is refused with the root file read)
RESERVED_PAPERS = frozenset({"methods", "report", "selected", "groups", "across", "deploy"})


class PaperParams(Strict):
    """``pipelines/<paper>/params.yaml`` (one file per scale): the paper's experiments and methods and exactly the
    runs its tables and figures need. Sources and datasets are the root's (``data``): a paper never copies data."""

    paper: str = Field(pattern=SLUG, description="results go under results/<paper>/<scale>/")

    scale: str = Field(pattern=SLUG, description="quickstart, paper, ...")
    params_file: str = Field(description="this file's path from the repository root (dvc.yaml's params dependency)")
    repo_root: str = Field(description="the repository root from this file's folder (dvc.yaml's wdir)")
    data: str = Field("params.yaml", description="the root params file whose sources and datasets the experiments use")
    seeds: Seeds = Field(min_length=1)
    runs: dict[str, RunGroup] = Field(description="group -> experiments x methods; dvc.yaml has a train_<group> stage per group")
    onboarding: tuple[str, ...] = Field((), description="holdout_domain experiments whose newcomer onboarding (pFedDB Fig. 6) runs")
    experiments: dict[str, ExperimentParams]
    methods: dict[str, dict[str, Any]]
    tracking: TrackingParams = TrackingParams()

    @model_validator(mode="before")
    @classmethod
    def _data_is_the_roots(cls, raw: Any) -> Any:
        """A root section written into a paper's file (a user pointing the paper at their own copy of a dataset) is
        told where it goes, not only that it is an unknown key."""
        if isinstance(raw, dict):
            for key in ("sources", "datasets", "pipeline"):
                if key in raw:
                    root = raw.get("data", "params.yaml")
                    where = ("there: a paper never copies data; a dataset of your own is added there and named by the "
                             "experiments' dataset here" if key != "pipeline" else "there for the root's stages; this "
                             "file's stages are its runs")
                    raise ValueError(f"{key}: a paper's params file has no {key} section: its sources and datasets are "
                                     f"those of the root params file its data: names ({root}); set {key} {where}")
        return raw

    @field_validator("paper")
    @classmethod
    def _not_the_roots(cls, v: str) -> str:
        if v in RESERVED_PAPERS:
            raise ValueError(f"'{v}' names a folder of the root pipeline's (data/code/methods, results/report, "
                             "results/selected, results/groups, results/across, results/deploy): give the paper another name")
        return v

    @model_validator(mode="after")
    def _runs(self) -> "PaperParams":
        seen: dict[tuple[str, str], str] = {}
        for g, grp in self.runs.items():
            if not SLUG_RE.match(g):
                raise ValueError(f"runs.{g}: a group name is lower-case letters, digits and _ (it names DVC stages)")
            for e in grp.experiments:
                if e not in self.experiments:
                    raise ValueError(f"runs.{g}.experiments: '{e}' is not defined under 'experiments'"
                                     f"{did_you_mean(e, self.experiments)}")
            for m in grp.methods:
                if m not in self.methods:
                    raise ValueError(f"runs.{g}.methods: '{m}' is not defined under 'methods'{did_you_mean(m, self.methods)}"
                                     + METHOD_ENTRY_HINT.format(m=m))
            for key, items in (("experiments", grp.experiments), ("methods", grp.methods), ("beside", grp.beside),
                               ("beside_experiments", grp.beside_experiments)):
                twice = sorted({x for x in items if items.count(x) > 1})
                if twice:
                    raise ValueError(f"runs.{g}.{key}: {', '.join(twice)} listed twice")
            for m in grp.beside:
                if m in grp.methods:
                    raise ValueError(f"runs.{g}.beside: '{m}' is one of the group's own methods")
            for e in grp.experiments:
                for m in grp.methods:
                    if (e, m) in seen:
                        raise ValueError(f"runs.{g}: {e} x {m} is already trained by runs.{seen[(e, m)]} (a run belongs to one group; "
                                         f"to set it in this group's table, list {m} under runs.{g}.beside, or {e} under "
                                         f"runs.{g}.beside_experiments)")
                    seen[(e, m)] = g
        for g, grp in self.runs.items():  # what a group sets beside its own is trained by another group
            for e in grp.experiments:
                for m in grp.beside:
                    if (e, m) not in seen:
                        raise ValueError(f"runs.{g}.beside: no group trains '{m}' on '{e}'")
            for e in grp.beside_experiments:
                if e not in self.experiments:
                    raise ValueError(f"runs.{g}.beside_experiments: '{e}' is not defined under 'experiments'"
                                     f"{did_you_mean(e, self.experiments)}")
                if e in grp.experiments:
                    raise ValueError(f"runs.{g}.beside_experiments: '{e}' is one of the group's own experiments")
                for m in (*grp.methods, *grp.beside):
                    if (e, m) not in seen:
                        raise ValueError(f"runs.{g}.beside_experiments: no group trains '{m}' on '{e}'")
        for g, grp in self.runs.items():
            if grp.published and not grp.across:
                raise ValueError(f"runs.{g}.published: the paper's numbers of a table across experiments; set runs.{g}.across: true")
            if grp.across:
                across_blocks(g, grp, self.experiments)
        trained = {e for e, _ in seen}
        for e in self.experiments:
            if e not in trained:
                raise ValueError(f"experiments.{e}: no runs group trains it")
            if e in ("report", "groups", "across"):  # results/<paper>/<scale>/{report,groups}/, groups/<g>/across/
                raise ValueError(f"experiments.{e}: the name is taken by the {e} folder")
        return self


def across_blocks(group: str, grp: RunGroup, experiments: dict[str, ExperimentParams]) -> dict[str, list[str]]:
    """A run group's experiments for its table across them (``runs.<group>.across``), ``beside_experiments`` first,
    by dataset: each dataset two or more experiments with static clients (a task stream's sweep is pFedDIL's
    ``report --sensitivity``). Which setting tells them apart is the report's to find (:mod:`fedsilo.report.across`)."""
    exps = list(dict.fromkeys([*grp.beside_experiments, *grp.experiments]))
    streams = [e for e in exps if experiments[e].split.protocol == "domain_incremental"]
    if streams:
        raise ValueError(f"runs.{group}.across: '{streams[0]}' is a task stream (its sweeps across streams are "
                         "`fedsilo report --sensitivity`)")
    blocks: dict[str, list[str]] = {}
    for e in exps:
        blocks.setdefault(experiments[e].dataset, []).append(e)
    for d, es in blocks.items():
        if len(es) < 2:
            raise ValueError(f"runs.{group}.across: '{es[0]}' is the group's only experiment on {d}; a table across "
                             "experiments sets two or more of each dataset side by side (add the others, or "
                             "beside_experiments for ones another group trains)")
    return blocks


def load_paper_params(path: Path, raw: dict[str, Any]) -> Params:
    """A paper's params file joined with the sources and datasets of the root params file it names."""
    try:
        pp = PaperParams.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, model=PaperParams)}") from None
    repo = (path.parent / pp.repo_root).resolve()
    if (repo / pp.params_file).resolve() != path.resolve():
        raise ConfigError(f"{path}: params_file: '{pp.params_file}' (from repo_root '{pp.repo_root}') is not this file")
    data_path = repo / pp.data
    root = load_params(data_path)
    if root.paper is not None:
        raise ConfigError(f"{path}: data: '{pp.data}' is a paper's params file, not the root's")
    if pp.paper in root.experiments:  # results/<paper>/ and state/<paper>/ would be the root experiment's folders
        raise ConfigError(f"{path}: paper: '{pp.paper}' is an experiment of {pp.data}: its results/{pp.paper}/ and "
                          f"state/{pp.paper}/ are that experiment's folders (its report would depend on the paper's runs); "
                          "give the paper another name")
    unbuilt: dict[str, str] = {}  # dataset -> the first experiment on it
    for e, ex in pp.experiments.items():
        if ex.dataset not in root.pipeline.datasets:
            unbuilt.setdefault(ex.dataset, e)
    if unbuilt:  # every one at once, with the sources their fetch stages need
        defined = [d for d in unbuilt if d in root.datasets]
        sources = sorted({s for d in defined for s in root.datasets[d].source_list} - set(root.pipeline.sources))
        e, d = next(iter(unbuilt.items()))[::-1]
        raise ConfigError(
            f"{path}: experiments.{e}.dataset: '{d}' is not built by {pp.data}"
            + ("" if d in root.datasets else did_you_mean(d, root.datasets))
            + (f"; nor {', '.join(repr(x) for x in list(unbuilt)[1:])}" if len(unbuilt) > 1 else "")
            + " (add each to pipeline.datasets there, defining under datasets any it lacks"
            + (f"; add their sources {', '.join(sources)} to pipeline.sources too, pointed at your copies" if sources else "") + ")"
        )
    for e, ex in pp.experiments.items():
        ds = root.datasets[ex.dataset]
        if ds.own_sources():
            kind = "chest_xray4" if isinstance(ds, CXRDatasetParams) else ds.kind
            raise ConfigError(
                f"{path}: experiments.{e}.dataset: '{ex.dataset}' holds sources of your own in {pp.data} "
                f"({', '.join(ds.own_sources())}); a paper's pipeline reproduces its published tables on the public domains: "
                f"give your sources a dataset of their own there (datasets.<name>: {{kind: {kind}, sources: [...]}}) "
                f"and keep datasets.{ex.dataset} to the public sources"
            )
    methods: dict[str, None] = {}
    for grp in pp.runs.values():
        methods.update(dict.fromkeys(grp.methods))
    pipeline = {
        "sources": root.pipeline.sources,
        "datasets": root.pipeline.datasets,
        "splits": {e: ex.dataset for e, ex in pp.experiments.items()},
        "experiments": tuple(pp.experiments),
        "methods": tuple(methods),
        "seeds": pp.seeds,
        "onboarding": pp.onboarding,
    }
    try:
        params = Params.model_validate({
            "sources": root.sources, "datasets": root.datasets, "experiments": pp.experiments,
            "methods": pp.methods, "pipeline": pipeline, "tracking": pp.tracking,
        })
    except ValidationError as err:
        raise ConfigError(f"{path}: {format_validation_error(err, model=Params)}") from None
    params._paper = PaperMeta(name=pp.paper, scale=pp.scale, params_file=pp.params_file, runs=pp.runs)
    return params
