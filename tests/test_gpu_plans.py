"""The GPU acceptance plans (scripts/plans/*.yaml) build params a GPU session can run: device time is scarce, so a
wrong experiment, method key or train override fails here, not on the machine."""

from __future__ import annotations

import importlib.util
import os

import pytest
import yaml

from fedsilo.config import ConfigError
from fedsilo.fl.params import load_params
from fedsilo.methods.registry import resolve_method
from tests.conftest import REPO

PLANS = sorted(p.name for p in (REPO / "scripts" / "plans").glob("*.yaml"))


def _gpu_plan():
    spec = importlib.util.spec_from_file_location("gpu_plan", REPO / "scripts" / "gpu_plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("plan", PLANS)
def test_each_gpu_plan_prepares_params_that_validate_and_name_methods_that_resolve(plan, tmp_path, monkeypatch):
    for name in ("params.yaml", "pipelines"):  # prepare reads them from the working directory, as on the machine
        os.symlink(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((REPO / "scripts" / "plans" / plan).read_text())
    _, copies = _gpu_plan().prepare(raw)
    assert len(copies) == len({(e["params"], e["experiment"]) for e in raw["entries"]})
    for (_, experiment), path in copies.items():
        p = load_params(tmp_path / path)
        x = p.experiments[experiment]
        entries = [e for e in raw["entries"] if e["experiment"] == experiment]
        for k, v in {k: v for e in entries for k, v in (e.get("train") or {}).items()}.items():
            assert getattr(x.train, k) == v, (plan, experiment, k)  # the override reached the run's train block
        for method in p.experiment_methods(experiment):
            resolve_method(p, method, x.train)
        assert sorted(p.experiment_methods(experiment)) == sorted({m for e in entries for m in e["methods"]})


def test_a_plan_with_a_wrong_method_or_train_key_is_refused_before_the_machine(tmp_path, monkeypatch):
    for name in ("params.yaml", "pipelines"):
        os.symlink(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    entry = {"params": "pipelines/f2dc/paper/params.yaml", "experiment": "f2dc_office", "methods": ["f2dc"], "seeds": [0]}
    plan = {"office_dir": ".gpu/office_caltech_10", "entries": [entry]}
    with pytest.raises(SystemExit, match=r"methods \['f2dcc'\] are not in its methods"):
        _gpu_plan().prepare({**plan, "entries": [{**entry, "methods": ["f2dcc"]}]})
    _, copies = _gpu_plan().prepare({**plan, "entries": [{**entry, "train": {"rouds": 20}}]})
    with pytest.raises(ConfigError, match="rouds"):
        load_params(tmp_path / next(iter(copies.values())))
