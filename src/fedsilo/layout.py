"""Where a stage reads and writes, for the root pipeline and for a paper's pipeline.

The root pipeline (``dvc.yaml``, ``params.yaml``) writes ``data/splits/<experiment>.json``, ``results/<experiment>/``,
``results/report/<experiment>/`` and ``state/<experiment>/``. A paper's pipeline (``pipelines/<paper>/``) reads the
same ``data/raw`` and ``data/harmonized`` (the root builds them) and writes under its namespace ``<paper>/<scale>``:
``data/splits/<paper>/<scale>/``, ``results/<paper>/<scale>/`` (its runs and ``report/``), ``state/<paper>/<scale>/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path
    namespace: str = ""  # "" for the root pipeline, "<paper>/<scale>" for a paper's

    def _ns(self, base: Path) -> Path:
        return base / self.namespace if self.namespace else base

    def harmonized(self, dataset: str) -> Path:
        return self.root / "data" / "harmonized" / dataset

    def sources_fingerprint(self, dataset: str) -> Path:
        """What ``harmonize@<dataset>`` depends on in place of all of ``data/raw``: its own sources' content."""
        return self.root / "data" / "fingerprints" / f"{dataset}.json"

    def train_code(self) -> Path:
        """All of the training code's hash (the root's ``code_fingerprint``; a train or onboard stage depends on its
        method's file in :meth:`method_code_dir` instead)."""
        return self.root / "data" / "code" / "train.json"

    def method_code_dir(self) -> Path:
        """``code_fingerprint``'s files, one per ``methods`` key of the params file (the hash of the code its runs
        depend on, :func:`fedsilo.codehash.method_code_files`): ``data/code/methods/`` for the root's pipeline,
        ``data/code/<paper>/<scale>/`` for a paper's."""
        return self.root / "data" / "code" / (self.namespace or "methods")

    def params_checked(self) -> Path:
        """``check_params``'s output, which the stages that params edit reruns depend on (``fedsilo check-params
        --stamp``): a params file that fails its checks stops ``dvc repro`` before DVC removes any of their outputs."""
        return self._ns(self.root / "data" / "checked") / "params.json"

    def split(self, experiment: str) -> Path:
        return self._ns(self.root / "data" / "splits") / f"{experiment}.json"

    def results(self, experiment: str) -> Path:
        return self._ns(self.root / "results") / experiment

    def run(self, experiment: str, method: str, seed: int) -> Path:
        return self.results(experiment) / method / f"seed{seed}"

    def checkpoint(self, experiment: str, method: str, seed: int) -> Path:
        return self._ns(self.root / "state") / experiment / method / f"seed{seed}" / "checkpoint.pt"

    def onboarding(self, experiment: str, seed: int) -> Path:
        return self.results(experiment) / "onboarding" / f"seed{seed}"

    def report(self, experiment: str) -> Path:
        return self._ns(self.root / "results") / "report" / experiment

    def group_report(self, group: str, experiment: str) -> Path:
        """``fedsilo report --group``: one run group's table of an experiment, beside (not inside) the report stages'
        outputs, so that DVC's ``report@<experiment>`` stays as its last run left it."""
        return self._ns(self.root / "results") / "groups" / group / experiment

    def across(self, group: str) -> Path:
        """dvc.yaml's ``across_<group>`` stage: a run group's table and figure across its experiments (beside, not
        inside, the report stages' outputs, which it reads)."""
        return self._ns(self.root / "results") / "across" / group

    def selected_report(self, experiment: str) -> Path:
        """``fedsilo report --methods``: the methods a user chose of an experiment, beside the report stages' outputs
        (each call replaces the last)."""
        return self._ns(self.root / "results") / "selected" / experiment

    def tracking_experiment(self, experiment: str) -> str:
        """The MLflow experiment of a pipeline experiment: the paper's runs are kept apart from the root's."""
        return f"{self.namespace}/{experiment}" if self.namespace else experiment
