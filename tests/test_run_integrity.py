"""MLflow tells the truth about a run (issue 17.7): a killed run is not left RUNNING, two processes never train the
same run at once, and a fresh clone under `dvc repro` is not tagged dirty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from fedsilo.tracking import git_commit
from tests.test_resume_tracking import _project


def _train(root: Path, wait: bool = True):
    cmd = [sys.executable, "-m", "fedsilo.cli", "--root", str(root), "--params", str(root / "params.yaml"),
           "train", "--experiment", "quick", "--method", "fedavg", "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _wait_round(proc, ckpt: Path, rnd: int = 1, not_hash: str = "") -> str:
    """Wait until ``proc`` has checkpointed round ``rnd`` (a checkpoint with another hash than ``not_hash``)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists():
            try:
                ck = torch.load(ckpt, weights_only=False)
                if ck["round"] >= rnd and ck["config_hash"] != not_hash:
                    return ck["config_hash"]
            except Exception:  # noqa: BLE001 - read between write and rename
                pass
        time.sleep(0.05)
    raise AssertionError("the run ended before it could be interrupted")


def _runs(root: Path) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    return {r.info.run_id: r.info.status for r in c.search_runs([c.get_experiment_by_name("quick").experiment_id])}


def test_a_second_process_is_refused_sigkill_is_marked_killed_when_superseded_and_sigterm_ends_killed(mirror_root, tmp_path):
    root = _project(mirror_root, tmp_path / "p", tracking=True)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["experiments"]["quick"]["train"].update({"rounds": 30, "local_epochs": 1, "count_flops": False})
    raw["methods"]["fedavg"] = {}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    ckpt = root / "state" / "quick" / "fedavg" / "seed0" / "checkpoint.pt"

    first = _train(root, wait=False)
    old_hash = _wait_round(first, ckpt)
    second = _train(root)
    assert second.returncode == 2
    assert f"quick/fedavg/seed0 is already being trained by pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    first.send_signal(signal.SIGKILL)
    first.wait()
    (killed,) = _runs(root)
    assert _runs(root)[killed] == "RUNNING"  # nobody could say otherwise yet

    # the configuration changes, so the interrupted run will never be resumed: its MLflow run is ended KILLED. This
    # one writes no checkpoint of its own before its last round (checkpoint_every: 1000) but the one of round 0
    raw["experiments"]["quick"]["train"].update({"rounds": 200, "checkpoint_every": 1000})
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    third = _train(root, wait=False)
    _wait_round(third, ckpt, rnd=0, not_hash=old_hash)
    time.sleep(1.5)  # into its rounds
    third.send_signal(signal.SIGTERM)  # a cancelled job
    assert third.wait() == 128 + signal.SIGTERM
    err = third.stderr.read()
    assert "Traceback" not in err and "SIGTERM: ending after the round in flight" in err
    runs = _runs(root)
    assert runs[killed] == "KILLED" and len(runs) == 2
    assert [s for r, s in runs.items() if r != killed] == ["KILLED"]
    assert ckpt.exists(), "a SIGTERMed run keeps its checkpoint for a resume"
    ck = torch.load(ckpt, weights_only=False)
    # the round in flight ended and was written: a resume loses no finished round
    assert 1 <= ck["round"] < 200 and len(ck["history"]) == ck["round"]

    # a job's `| tee log` dies with it: the resumed run's stderr has no reader when the SIGTERM comes. Its progress
    # line then meets a broken pipe, which must not turn the stop into a failure. It writes every round's checkpoint
    # (not in the run's hash: it resumes the same run)
    raw["experiments"]["quick"]["train"]["checkpoint_every"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    fourth = _train(root, wait=False)
    _wait_round(fourth, ckpt, rnd=ck["round"] + 1)
    fourth.stderr.close()
    time.sleep(0.5)
    fourth.send_signal(signal.SIGTERM)
    assert fourth.wait() == 128 + signal.SIGTERM
    assert _runs(root) == runs, "the resumed MLflow run ends KILLED again (not FAILED), no new one"
    assert torch.load(ckpt, weights_only=False)["round"] > ck["round"]


def test_dvc_lock_files_rewritten_by_a_repro_do_not_make_the_checkout_dirty(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("a\n")
    (tmp_path / "pipelines" / "p").mkdir(parents=True)
    (tmp_path / "pipelines" / "p" / "dvc.lock").write_text("a\n")
    (tmp_path / "params.yaml").write_text("x: 1\n")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    (tmp_path / "dvc.lock").write_text("b\n")
    (tmp_path / "pipelines" / "p" / "dvc.lock").write_text("b\n")
    assert git_commit(tmp_path)[1] is False
    (tmp_path / "params.yaml").write_text("x: 2\n")
    assert git_commit(tmp_path)[1] is True


def test_a_stop_right_after_the_mlflow_run_starts_marks_it_killed(mirror_root, tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) landing just after the MLflow run started, before the first round (here: while the
    progress bar is made), ends that run KILLED, not RUNNING until some later run supersedes it."""
    import shutil

    import pytest

    from fedsilo.cli import main
    from fedsilo.config import parse_params
    from fedsilo.fl import run as run_module
    from tests.conftest import small_params

    root = tmp_path / "p"
    shutil.copytree(mirror_root / "data" / "harmonized", root / "data" / "harmonized")
    raw = small_params(rounds=2)
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{root / 'mlflow.db'}"}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--root", str(root), "--params", str(root / "params.yaml"), "split", "--experiment", "quick"]) == 0

    def sigterm(*a, **k):
        raise SystemExit(128 + signal.SIGTERM)

    monkeypatch.setattr(run_module, "Progress", sigterm)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit):
        run_module.run_training(parse_params(raw), "quick", "fedavg", 0, root, quiet=True)
    assert list(_runs(root).values()) == ["KILLED"]
