"""Shared fixtures: a small offline mirror of the four CXR sources, harmonized once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO.parent / "shared" / "samples"

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

if os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist: the cores shared among the workers, not each taking all
    _PER_WORKER = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    # and the processes a test starts (train stages, DVC, grids) inherit it: two workers' subprocesses with all cores'
    # threads each oversubscribe the machine (measured on 2 cores: the resume and run-integrity files 154 s -> 139 s)
    os.environ.setdefault("OMP_NUM_THREADS", str(_PER_WORKER))
    import torch

    torch.set_num_threads(_PER_WORKER)


def pytest_configure(config):
    """Once per run (the xdist controller, or a serial run): fedsilo's own modules byte-compiled, so that each process
    a test starts (DVC stages, CLI commands, ClientApps, Ray workers) loads them instead of compiling ~130 files again
    where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE=1, as this development machine sets:
    ~1 s of CPU less per train stage started). Nothing is written where bytecode already is up to date."""
    if not hasattr(config, "workerinput"):
        import compileall

        compileall.compile_dir(str(REPO / "src" / "fedsilo"), quiet=1)


def needs_samples(sub: str = "") -> pytest.MarkDecorator:
    path = SAMPLES / sub
    return pytest.mark.skipif(not path.exists(), reason=f"{path} absent (real samples live in ../shared/samples)")


def paper_params(paper: str, scale: str, check: bool = True):
    """``pipelines/<paper>/params.yaml`` (quickstart) or ``pipelines/<paper>/paper/params.yaml`` joined with the root
    params.yaml, every root dataset added to pipeline.datasets (as a paper-scale preset's header tells a user to; the
    root copy goes to .pytest_cache); its method entries checked against their params classes unless ``check`` is off."""
    import yaml

    from fedsilo.config import load_paper_params
    from fedsilo.methods.registry import check_methods

    root = yaml.safe_load((REPO / "params.yaml").read_text())
    root["pipeline"]["datasets"] = list(root["datasets"])
    root["pipeline"]["sources"] = list(root["sources"])  # and their sources, fetched
    tmp = REPO / ".pytest_cache" / f"root_params_{paper}_{scale}.yaml"
    tmp.parent.mkdir(exist_ok=True)
    part = tmp.with_name(f"{tmp.name}.{os.getpid()}")
    part.write_text(yaml.safe_dump(root))
    os.replace(part, tmp)  # whole: another worker may read it meanwhile
    path = REPO / "pipelines" / paper / ("paper" if scale == "paper" else "") / "params.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["data"] = str(tmp.relative_to(REPO))
    p = load_paper_params(path, raw)
    if check:
        check_methods(p, str(path))
    return p


BENCHMARK_SOURCES = ("mnist", "svhn", "usps", "synthdigits", "mnist_m", "office_caltech10", "pacs", "domainnet")


def add_benchmarks(p: dict) -> dict:
    """Add the eight benchmark mirrors (tiny), the four benchmark datasets and one split-only experiment per
    split protocol, as params.yaml does."""
    p["sources"].update({s: {"mode": "mirror", "mirror": {"per_class": 6, "seed": 0, "image_px": 32}} for s in BENCHMARK_SOURCES})
    p["datasets"].update({k: {"kind": k, "image_size": 16, "workers": 1} for k in ("digits5", "office_caltech10", "pacs", "domainnet10")})
    p["experiments"].update(
        {
            "digits_dc": {"dataset": "digits5", "split": {"protocol": "domain_clients", "n_train": 20, "n_test": 20}},
            "office_multi": {"dataset": "office_caltech10", "split": {"protocol": "domain_multi_clients", "clients_per_domain": {"caltech": 3, "amazon": 2, "webcam": 2, "dslr": 3}, "fraction": 0.2}},
            "pacs_skew": {"dataset": "pacs", "split": {"protocol": "label_skew", "clients": 5, "scheme": "dirichlet", "beta": 0.5, "min_per_client": 5}},
            "dn_incremental": {"dataset": "domainnet10", "split": {"protocol": "domain_incremental", "clients": 3, "alpha": 1.0}},
            "cxr_holdout": {"dataset": "chest_xray4", "split": {"protocol": "holdout_domain", "holdout": "OpenI", "n_train": 16, "n_test": 8}},
        }
    )
    p["pipeline"]["sources"] = list(p["pipeline"]["sources"]) + list(BENCHMARK_SOURCES)
    p["pipeline"]["datasets"] = ["chest_xray4", "digits5", "office_caltech10", "pacs", "domainnet10"]
    p["pipeline"]["splits"].update({"digits_dc": "digits5", "office_multi": "office_caltech10", "pacs_skew": "pacs", "dn_incremental": "domainnet10", "cxr_holdout": "chest_xray4"})
    return p


@pytest.fixture(autouse=True)
def _auto_checkpoints_every_round(monkeypatch):
    """``train.checkpoint_every: auto`` spaces its writes by what one takes; the in-process tests that stop a run after
    some rounds and resume it need a checkpoint after every round whatever this machine's speed, so in the tests auto
    writes after every round (its schedule is tested on a fake clock with the real ratio, test_engine.py). Runs in a
    subprocess that get interrupted set ``checkpoint_every: 1`` themselves."""
    from fedsilo.fl import engine

    monkeypatch.setattr(engine, "AUTO_CHECKPOINT_RATIO", 0)


def small_params(patients: int = 90, image_size: int = 32, **train) -> dict:
    """A params.yaml dict for tests: small mirror, tiny images, few rounds, tracking off."""
    # FLOPs are counted by the tests that check them (the counter's dispatch slows a CPU round several-fold)
    t = {"model": "simple_cnn", "rounds": 3, "local_epochs": 1, "batch_size": 16, "lr": 0.02, "eval_every": 1, "device": "cpu", "count_flops": False}
    t.update(train)
    if t["model"] == "simple_cnn":  # FedBN's model at a quarter width: the same layers, 16x fewer weights to train and write
        t.setdefault("model_width", 0.25)
    return {
        "sources": {s: {"mode": "mirror", "mirror": {"patients": patients, "seed": 0, "image_px": 96}} for s in ("chexpert", "openi", "rsna", "vinbigdata")},
        "datasets": {"chest_xray4": {"image_size": image_size, "workers": 1}},
        "experiments": {"quick": {"dataset": "chest_xray4", "split": {"protocol": "domain_clients", "n_train": 24, "n_test": 16}, "train": t}},
        "methods": {"single": {}, "fedavg": {}, "fedprox": {"mu": 0.01}, "fedbn": {}},
        "pipeline": {"sources": ["chexpert", "openi", "rsna", "vinbigdata"], "datasets": ["chest_xray4"], "splits": {"quick": "chest_xray4"}, "experiments": ["quick"], "methods": ["single", "fedavg", "fedprox", "fedbn"], "seeds": [0], "onboarding": []},
        "tracking": {"enabled": False},
    }


@pytest.fixture(scope="session")
def mirror_root(tmp_path_factory) -> Path:
    """A project root with data/raw (four mirrors) and data/harmonized/chest_xray4 at 32 px."""
    from fedsilo.config import parse_params
    from fedsilo.data.fetch import fetch
    from fedsilo.data.harmonize import harmonize_cxr

    root = tmp_path_factory.mktemp("project")
    p = parse_params(small_params())
    for s in p.pipeline.sources:
        fetch(s, p.sources[s], root / "data" / "raw" / s)
    harmonize_cxr(p.datasets["chest_xray4"], root / "data" / "raw", root / "data" / "harmonized" / "chest_xray4")
    return root


# the files that take longest on two cores, longest first (`pytest --durations`, 2026-11-28): DVC repros, a SuperLink
# with three SuperNodes, Ray (a simulation start is several times slower while the other worker keeps its core busy),
# grids of stages, whole train stages killed and resumed; the in-memory files follow
HEAVY_FIRST = ("test_dvc_pipeline.py", "test_deploy_processes.py", "test_flower.py", "test_grid.py", "test_resume_tracking.py",
               "test_grid_ray.py", "test_flower_streams.py", "test_presets.py", "test_run_integrity.py", "test_continual.py",
               "test_engine.py", "test_recent_methods.py", "test_f2dc.py", "test_code_reaches_results.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's file scheduling (``--dist loadfile``) hands out files with the most tests first, so a long file
    of one test (the SuperLink deployment) started last and the other worker idled minutes at the end. This one hands
    out :data:`HEAVY_FIRST` first, in its order, then the rest as xdist orders them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node):
            if not self.ordered:
                rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
                queue = sorted(self.workqueue.items(), key=lambda kv: rank.get(Path(kv[0]).name, len(rank)))
                self.workqueue.clear()
                self.workqueue.update(queue)
                self.ordered = True
            super()._assign_work_unit(node)

    return HeavyFilesFirst(config, log)


def killed_and_live_runs(tmp_path: Path, monkeypatch, killed_name: str):
    """An MLflow store (sqlite under ``tmp_path``) holding two RUNNING runs of experiment ``demo``: ``killed_name``,
    tagged with the pid of a process that has exited (SIGKILLed, a lost worker), and ``mine``, this live process's.
    Returns (tracker, uri, killed run id, live run id)."""
    import subprocess
    import sys

    from mlflow.entities import RunTag

    from fedsilo.tracking import Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(True, uri)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = t.start("demo", killed_name, {}, {})
    t.client.log_batch(killed, tags=[RunTag("fedsilo.pid", str(gone.pid))])
    return t, uri, killed, t.start("demo", "mine", {}, {})
