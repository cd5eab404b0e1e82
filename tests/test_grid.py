"""`fedsilo grid`: a pipeline's train stages run on several DVC queue workers, then `dvc repro` restores them from the
run-cache (each trained exactly once), runs what depends on them, and leaves `dvc status` clean; a failing stage
stops the grid with its log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from fedsilo.grid import (
    TRAIN_STAGES,
    GridError,
    batches,
    run_grid,
    stop_workers,
    threads_per_run,
    tracking_env,
    upstream,
)

PIPE = """
stages:
  prep:
    cmd: python -c "open('prep.txt','w').write(open('dep.txt').read())"
    deps: [dep.txt]
    outs: [prep.txt]
  train_g:
    foreach: [a, b, c]
    do:
      cmd: python -c "import os, time; time.sleep(1); open(os.environ['GRID_LOG'], 'a').write('${item}:' + os.environ.get('OMP_NUM_THREADS', '-') + '\\n'); open(os.environ['GRID_LOG'] + '.gpu', 'a').write(os.environ.get('FEDSILO_GPU_SLOTS', '-') + '\\n'); os.makedirs('out', exist_ok=True); open('out/${item}.txt', 'w').write('${item}' + open('prep.txt').read()); {fail}"
      deps: [prep.txt]
      outs:
        - out/${item}.txt
  report:
    cmd: python -c "import glob; open('report.txt', 'w').write(''.join(sorted(open(f).read() for f in glob.glob('out/*.txt'))))"
    deps: [out]
    outs: [report.txt]
"""


def _dvc(*args: str, cwd: Path) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _repo(tmp: Path, fail: str = "None", sub: bool = False, pipe: str = PIPE, remote: Optional[Path] = None) -> Path:
    """A repository with the pipeline ``pipe`` (its ``{fail}`` replaced) at its root, or (``sub``) in
    pipelines/demo/dvc.yaml running at the root, as the paper pipelines do; ``remote``: its default DVC remote."""
    repo = tmp / "repo"
    repo.mkdir()
    git = ["git", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    for k, v in (("user.email", "grid@test"), ("user.name", "grid test")):
        subprocess.run(["git", "config", k, v], cwd=repo, check=True)
    _dvc("init", "-q", cwd=repo)
    if remote is not None:
        _dvc("remote", "add", "-d", "store", str(remote), cwd=repo)
    (repo / "dep.txt").write_text("1")
    text = pipe.replace("{fail}", fail)
    if sub:  # every stage runs at the repository root
        text = re.sub(r"^( +)cmd:", lambda m: f"{m.group(1)}wdir: ../..\n{m.group(1)}cmd:", text, flags=re.M)
        (repo / "pipelines" / "demo").mkdir(parents=True)
    (repo / ("pipelines/demo/dvc.yaml" if sub else "dvc.yaml")).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=repo, check=True)
    return repo


def test_grid_trains_each_stage_once_on_two_workers_and_leaves_the_pipeline_up_to_date(tmp_path, monkeypatch):
    log = tmp_path / "runs.log"
    monkeypatch.setenv("GRID_LOG", str(log))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    repo = _repo(tmp_path)
    assert upstream("dvc.yaml", repo, "train_*") == ["prep"]
    # a --stages subset: its runs are restored, the others stay untrained, and the report waits (the whole repro
    # would train them here, one after another, unasked)
    said: list = []
    r = run_grid("dvc.yaml", repo, jobs=2, pattern="train_g@a", quiet=True, poll_s=0.5, log=said.append)
    t = threads_per_run(2)
    assert r["queued"] == ["train_g@a"] and r["left_out"] == ["train_g@b", "train_g@c"] and "report" not in r["ran_after"]
    assert log.read_text().split() == [f"a:{t}"] and not (repo / "report.txt").exists()
    assert any("2 out-of-date train stage(s) outside --stages (train_g@b, train_g@c)" in m for m in said), said
    # the same subset again: nothing of it is out of date, and no `dvc repro` runs (without a target it runs them all)
    r = run_grid("dvc.yaml", repo, jobs=2, pattern="train_g@a", quiet=True, poll_s=0.5, log=said.append)
    assert r["queued"] == [] and r["ran_after"] == [] and log.read_text().split() == [f"a:{t}"]
    r = run_grid("dvc.yaml", repo, jobs=2, quiet=True, poll_s=0.5, per_experiment=1)  # an experiment a stage
    assert sorted(r["queued"]) == ["train_g@b", "train_g@c"] and r["experiments"] == 2 and r["left_out"] == []
    # each trained once, by a worker, with the machine's cores shared out as its threads; none again by repro
    assert t == max(1, (os.cpu_count() or 1) // 2) and r["threads_per_run"] == str(t)
    assert sorted(log.read_text().split()) == [f"a:{t}", f"b:{t}", f"c:{t}"]
    # where a run with train.device: auto claims its GPU on a machine with several (utils/slots.py): one folder of
    # this repository for every worker
    assert set(Path(str(log) + ".gpu").read_text().split()) == {str((repo / ".dvc" / "tmp" / "gpu-slots").resolve())}
    assert not any(s.startswith("train_g") for s in r["ran_after"]) and "report" in r["ran_after"]
    assert (repo / "report.txt").read_text() == "a1b1c1"
    assert "up to date" in _dvc("status", cwd=repo)
    assert "grid-" not in _dvc("exp", "list", "--all-commits", cwd=repo)  # the queued experiments are gone
    # nothing stale: a second grid queues nothing and trains nothing
    assert run_grid("dvc.yaml", repo, jobs=2, quiet=True)["queued"] == []
    assert len(log.read_text().split()) == 3


def test_runs_this_machines_run_cache_holds_are_restored_here_not_queued(tmp_path, monkeypatch):
    """A stopped grid's finished runs (here: runs of `dvc repro`) are in the run-cache: a second grid restores them in
    the workspace first, with real DVC, and queues nothing (each queued experiment set up a copy of the repository
    first: tens of seconds a run just to find it cached); the mix of cached and new stages: the fake-queue test below."""
    log = tmp_path / "runs.log"
    monkeypatch.setenv("GRID_LOG", str(log))
    repo = _repo(tmp_path)
    _dvc("repro", cwd=repo)  # dep 1: all three trained here
    (repo / "dep.txt").write_text("2")
    _dvc("repro", cwd=repo)  # dep 2: all three again
    (repo / "dep.txt").write_text("1")  # back: the three runs of dep 1 are in this machine's run-cache
    said: list[str] = []
    r = run_grid("dvc.yaml", repo, jobs=1, quiet=True, poll_s=0.5, log=said.append)
    assert sorted(r["restored_here"]) == ["train_g@a", "train_g@b", "train_g@c"] and r["queued"] == [] and r["experiments"] == 0
    assert "grid: 3 stage(s) restored from this machine's run-cache, not queued" in said
    assert len(log.read_text().split()) == 6  # nothing trained again
    assert (repo / "report.txt").read_text() == "a1b1c1" and "up to date" in _dvc("status", cwd=repo)


def test_the_data_phase_names_each_target_and_shows_dvcs_output_as_it_comes(tmp_path, capfd):
    """What the runs read is reproduced first, here: unless quiet, each target is named and DVC's output (the stages'
    own progress) reaches standard error as it comes, not captured; a failure then points at it."""
    from fedsilo.grid import prepare_grid, run_dvc

    repo = _repo(tmp_path)
    said: list = []
    capfd.readouterr()
    assert sorted(prepare_grid("dvc.yaml", repo, "train_*", {**os.environ}, quiet=False, log=said.append)) == [
        "train_g@a", "train_g@b", "train_g@c"]
    assert said == ["grid: what the runs read, here first (1/1): dvc repro prep"]
    assert "Running stage 'prep'" in capfd.readouterr().err
    with pytest.raises(GridError, match=r"`dvc repro no_such_stage` failed \(exit \d+\):\nits output is above"):
        run_dvc(["repro", "no_such_stage"], repo, shown=True)
    assert "no_such_stage" in capfd.readouterr().err


def test_a_failing_stage_stops_the_grid_naming_it(tmp_path, monkeypatch):
    log = tmp_path / "runs.log"
    monkeypatch.setenv("GRID_LOG", str(log))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a number of threads the user set wins over the shared-out default
    repo = _repo(tmp_path, fail="exit(3) if '${item}' == 'b' else None", sub=True)  # a paper pipeline's place
    with pytest.raises(GridError, match=r"1 of 3 queued stages failed: train_g@b"):
        run_grid("pipelines/demo/dvc.yaml", repo, jobs=2, quiet=True, poll_s=0.5)
    assert not (repo / "report.txt").exists()
    ran = log.read_text().split()  # b failed after its log line; the grid may stop before c
    assert "b:3" in ran and set(ran) <= {"a:3", "b:3", "c:3"}


def test_workers_log_to_this_workspaces_mlflow_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    env = tracking_env("sqlite:///mlflow.db", tmp_path)
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path.resolve().as_posix()}/mlflow.db"
    assert tracking_env("http://mlflow.example:5000", tmp_path)["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///elsewhere")
    assert tracking_env("sqlite:///mlflow.db", tmp_path)["MLFLOW_TRACKING_URI"] == "file:///elsewhere"


def test_matched_stages_that_depend_on_each_other_are_refused(tmp_path):
    # each run goes alone (--single-item, a Ray task): one reading another matched run's output would read a stale one
    repo = _repo(tmp_path)
    with pytest.raises(GridError, match=r"--stages '\*': report depends on another matched stage"):
        upstream("dvc.yaml", repo, "*")


def test_stages_are_batched_into_about_four_experiments_a_worker():
    stages = [f"s{i}" for i in range(55)]  # the pFedDB quickstart grid
    b = batches(stages, jobs=2)
    assert [len(x) for x in b] == [7] * 7 + [6] and sum(b, []) == stages
    assert batches(stages[:3], jobs=2) == [["s0"], ["s1"], ["s2"]]
    assert batches(stages[:3], jobs=2, per_experiment=2) == [["s0", "s1"], ["s2"]]
    with pytest.raises(GridError, match="--runs-per-experiment"):
        batches(stages, jobs=2, per_experiment=0)
    assert threads_per_run(2, 4.0) == 4 and threads_per_run(2, 0.5) == 1  # Ray's rule for a fraction of a CPU
    with pytest.raises(GridError, match="--cpus-per-run"):
        threads_per_run(2, 0)


def test_a_queue_worker_that_misses_the_stop_is_ended_and_others_are_left_alone(tmp_path):
    # DVC 3.67's worker started while `dvc queue stop` is broadcast idles forever; the grid must not leave it behind
    repo, other = tmp_path / "repo", tmp_path / "other"
    repo.mkdir()
    other.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", "exp", "queue-worker", "dvc-exp-x-1@localhost"]
    stuck = subprocess.Popen(sleeper, cwd=repo)
    elsewhere = subprocess.Popen(sleeper, cwd=other)
    try:
        said: list[str] = []
        # interrupted (experiments still running): the workers are asked to stop, never terminated
        assert stop_workers(repo, grace_s=1.0, terminate=False, log=said.append) == 0
        assert stuck.poll() is None and "interrupted" in said.pop()
        assert stop_workers(repo, grace_s=1.0, log=said.append) == 1
        assert stuck.wait(timeout=10) is not None
        assert elsewhere.poll() is None
        assert str(stuck.pid) in said[0]
    finally:
        for p in (stuck, elsewhere):
            p.kill()
            p.wait()


def test_after_its_runs_the_queue_grid_ends_the_mlflow_runs_whose_process_died(tmp_path, monkeypatch):
    """A run SIGKILLed in a queue worker's copy of the repository stays RUNNING (nothing resumes it): once the queue
    is done the grid marks KILLED the RUNNING runs of this host whose process is gone, says so, and leaves a live one.
    DVC is stood in for (the queue reports the experiment done at once): this checks the grid's own end."""
    from tests.conftest import killed_and_live_runs

    t, uri, killed, live = killed_and_live_runs(tmp_path, monkeypatch, "train_g@a")
    ran, _ = _fake_queue(monkeypatch, tmp_path, lambda name, call: "Success")
    said: list[str] = []
    r = run_grid("dvc.yaml", tmp_path, jobs=1, tracking_uri=uri, quiet=True, poll_s=0.0, log=said.append)
    assert r["queued"] == ["train_g@a"] and len([a for a in ran if a[:2] == ["exp", "run"]]) == 1
    assert t.client.get_run(killed).info.status == "KILLED" and t.client.get_run(live).info.status == "RUNNING"
    assert any("1 MLflow run(s) whose process died marked KILLED: train_g@a" in x for x in said), said


def _fake_queue(monkeypatch, tmp_path, statuses):
    """The grid with DVC stood in for: one stage queued, `dvc queue status` answering ``statuses(name, call)``, no
    worker process alive; returns the DVC commands run and the ``terminate`` each stop_workers call got."""
    import fedsilo.grid as grid

    ran: list[list[str]] = []
    stops: list[bool] = []
    calls = iter(range(10**6))

    def dvc(args, cwd, env=None, check=True, detached=False, shown=False):
        ran.append(list(args))
        return subprocess.CompletedProcess(args, 0, "", "")

    def status(repo):
        names = [a[a.index("--name") + 1] for a in ran if a[:2] == ["exp", "run"]]
        return {n: statuses(n, next(calls)) for n in names}

    monkeypatch.setattr(grid, "prepare_grid", lambda *a, **k: ["train_g@a"])
    monkeypatch.setattr(grid, "left_out", lambda *a: [])
    monkeypatch.setattr(grid, "restore_cached", lambda *a: [])
    monkeypatch.setattr(grid, "lock_files", lambda repo: [])
    monkeypatch.setattr(grid, "run_dvc", dvc)
    monkeypatch.setattr(grid, "queue_workers", lambda repo: [])
    monkeypatch.setattr(grid, "queue_status", status)
    monkeypatch.setattr(grid, "stop_workers", lambda *a, terminate=True, **k: stops.append(terminate) or 0)
    monkeypatch.setattr(grid, "restore_grid", lambda *a, **k: [])
    monkeypatch.setattr(grid, "STATUS_EVERY_S", 0.0)
    return ran, stops


def test_a_task_whose_queue_worker_died_is_ended_and_named_not_waited_for_forever(tmp_path, monkeypatch):
    """A worker SIGKILLed (or killed for memory) under its experiment leaves DVC listing the task Running with no
    worker alive, for ever: the grid waited on it without a word. After three looks it ends the task (`dvc queue
    kill`) and fails naming the stage and what a second grid does."""
    from fedsilo.grid import GridError

    exps = tmp_path / ".dvc" / "tmp" / "exps"

    def running(name, call):  # DVC's record of the run and the copy it runs in, as a queue worker leaves them
        if call == 0:
            _dvc_run_record(exps, "a1b2", name)
            _dvc_run_record(exps, "c3d4", "grid-other-000")  # another experiment's: left alone
        return "Running"

    ran, stops = _fake_queue(monkeypatch, tmp_path, running)
    said: list[str] = []
    with pytest.raises(GridError, match=r"1 of 1 queued experiments lost their DVC queue worker \(killed, out of memory\?\) "
                       r"while running: train_g@a; ended with `dvc queue kill`\. Run the grid again"):
        run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=said.append)
    kills = [a for a in ran if a[:2] == ["queue", "kill"]]
    assert len(kills) == 1 and kills[0][2].startswith("grid-") and stops == [True]
    # the lost experiment's copy of the repository (its checked-out data) and DVC's record of it are removed
    assert not (exps / "tmpa1b2").exists() and not (exps / "run" / "a1b2").exists()
    assert (exps / "tmpc3d4" / "data.bin").exists() and (exps / "run" / "c3d4" / "c3d4.run").exists()
    assert said == [f"grid: removed the copies of the repository the lost experiments ran in: {(exps / 'tmpa1b2').resolve()}"]


def _dvc_run_record(exps: Path, rev: str, name: str, root: Optional[Path] = None) -> Path:
    """DVC 3.67's record of a queued experiment's run (``.dvc/tmp/exps/run/<rev>/<rev>.run``) and its copy."""
    copy = root or exps / f"tmp{rev}"
    copy.mkdir(parents=True)
    (copy / "data.bin").write_bytes(b"\0" * 16)
    (exps / "run" / rev).mkdir(parents=True)
    (exps / "run" / rev / f"{rev}.run").write_text(json.dumps({"name": name, "root_dir": str(copy), "location": "dvc-task"}))
    return copy


def test_only_a_lost_experiments_copy_inside_dvcs_temporary_folder_is_removed(tmp_path):
    from fedsilo.grid import remove_lost_copies

    exps = tmp_path / ".dvc" / "tmp" / "exps"
    outside = _dvc_run_record(exps, "e5f6", "grid-x-000", root=tmp_path / "elsewhere")  # a record naming a folder outside
    (exps / "run" / "bad0").mkdir(parents=True)
    (exps / "run" / "bad0" / "bad0.run").write_text("{not json")  # a record being written
    assert remove_lost_copies(tmp_path, ["grid-x-000"]) == [] and (outside / "data.bin").exists()
    _dvc_run_record(exps, "a1b2", "grid-x-000")
    assert remove_lost_copies(tmp_path, ["grid-x-000"]) == [(exps / "tmpa1b2").resolve()]


def test_an_earlier_grids_experiments_still_queued_are_named_before_this_one_queues(tmp_path, monkeypatch):
    """After an interrupted grid, its queued (and running) experiments stay in DVC's queue and a new grid's workers
    run them first: the grid said nothing of them (minutes of silence). It names them and how to drop them."""
    import fedsilo.grid as grid

    _fake_queue(monkeypatch, tmp_path, lambda name, call: "Success")
    fake_status = grid.queue_status
    monkeypatch.setattr(grid, "queue_status", lambda repo: {"grid-0ld000-000": "Queued", "grid-0ld000-001": "Running",
                                                             "grid-0ld000-002": "Success", **fake_status(repo)})
    said: list[str] = []
    run_grid("dvc.yaml", tmp_path, jobs=1, quiet=False, poll_s=0.0, log=said.append)
    assert said[0] == ("grid: 2 experiment(s) of an earlier grid still in DVC's queue (grid-0ld000-000 queued, "
                       "grid-0ld000-001 running): this grid's workers run them first; `dvc queue kill <name>` / "
                       "`dvc queue remove --all` drop them")
    assert "grid: 1 stages queued in 1 experiments; 1 DVC queue workers started" in said


def test_a_running_task_whose_worker_is_alive_is_waited_for_not_ended_as_lost(tmp_path, monkeypatch):
    """A task DVC lists Running while a queue worker is alive is a run in progress, however many looks it takes to
    finish: it is neither ended (`dvc queue kill`) nor named lost."""
    from types import SimpleNamespace

    import fedsilo.grid as grid

    ran, stops = _fake_queue(monkeypatch, tmp_path, lambda name, call: "Running" if call < 5 else "Success")
    worker = SimpleNamespace(pid=os.getpid(), children=lambda recursive=True: [])
    monkeypatch.setattr(grid, "queue_workers", lambda repo: [worker])
    r = run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=lambda m: None)
    assert r["queued"] == ["train_g@a"] and stops == [True]
    assert not any(a[:2] == ["queue", "kill"] for a in ran)


def test_a_queued_task_left_with_no_worker_to_run_it_gets_the_workers_started_again(tmp_path, monkeypatch):
    """DVC's workers exit when they find the queue empty; one that exits while a task is being queued leaves it Queued
    with nobody to run it: after three looks with no worker alive the grid starts the workers again."""
    ran, _ = _fake_queue(monkeypatch, tmp_path, lambda name, call: "Queued" if call < 4 else "Success")
    run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=lambda m: None)
    assert [a for a in ran if a[:2] == ["queue", "start"]] == [["queue", "start", "--jobs", "1"]] * 2


def test_the_threads_a_run_is_given_win_over_omp_num_threads_and_the_default_shares_the_cores(tmp_path, monkeypatch):
    """``--cpus-per-run`` wins over an ``OMP_NUM_THREADS`` already set (which wins over the default only); a fraction
    gives its whole part (Ray's rule); the default shares this machine's cores out among the runs, at least one each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _fake_queue(monkeypatch, tmp_path, lambda name, call: "Success")
    assert run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, threads=2, log=lambda m: None)["threads_per_run"] == "2"
    assert run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=lambda m: None)["threads_per_run"] == "3"
    assert threads_per_run(2, 2.7) == 2 and threads_per_run(1, 1.5) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert [threads_per_run(j) for j in (1, 3, 8, 16)] == [8, 2, 1, 1]


def test_a_grid_run_that_the_closing_repro_trains_again_is_named_not_hidden(tmp_path, monkeypatch):
    """Where the closing `dvc repro` runs a stage a worker ran (the run-cache did not hold it), the grid fails naming
    it, a paper pipeline's stage too (DVC names it <file>:<stage>); the stages after the grid's are what it runs."""
    import fedsilo.grid as grid

    out = "Running stage 'pipelines/demo/dvc.yaml:train_g@a':\nRunning stage 'pipelines/demo/dvc.yaml:report':\n"
    monkeypatch.setattr(grid, "run_dvc", lambda args, cwd, env=None, **k: subprocess.CompletedProcess(args, 0, out, ""))
    with pytest.raises(GridError, match=r"dvc repro trained again what the workers ran \(not in the run-cache\?\): "
                       r"pipelines/demo/dvc\.yaml:train_g@a$"):
        grid.restore_grid("pipelines/demo/dvc.yaml", tmp_path, ["train_g@a"], {})
    assert grid.restore_grid("pipelines/demo/dvc.yaml", tmp_path, ["train_g@b"], {}) == [
        "pipelines/demo/dvc.yaml:train_g@a", "pipelines/demo/dvc.yaml:report"]


def test_sigterm_stops_the_grid_as_ctrl_c_does(tmp_path, monkeypatch):
    """`kill <grid>` (a cancelled job; a grid started in the background ignores Ctrl-C's SIGINT) died at once and
    left its workers taking the queued experiments: it now stops the queue, leaves the running experiment to finish
    (stop_workers without terminating) and exits 143; the previous SIGTERM handler is back afterwards."""
    import signal

    def statuses(name, call):
        if call == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # while the grid waits on a running experiment
        return "Running"

    before = signal.getsignal(signal.SIGTERM)
    ran, stops = _fake_queue(monkeypatch, tmp_path, statuses)
    with pytest.raises(SystemExit) as stopped:
        run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=lambda m: None)
    assert stopped.value.code == 128 + signal.SIGTERM and stops == [False]
    assert not any(a[:2] == ["queue", "kill"] for a in ran) and signal.getsignal(signal.SIGTERM) is before


BENCH_PIPE = PIPE.split("  train_g:")[0] + """  train_g:
    foreach: [a, b]
    do:
      cmd: python -c "import json, os, uuid; os.makedirs('results/${item}', exist_ok=True); json.dump(dict(acc='${item}' + open('prep.txt').read(), threads=os.environ.get('OMP_NUM_THREADS'), mlflow_run_id=uuid.uuid4().hex), open('results/${item}/metrics.json', 'w'))"
      deps: [prep.txt]
      outs:
        - results/${item}
  onboard:
    cmd: python -c "import json, os; os.makedirs('results/after', exist_ok=True); json.dump(dict(threads=os.environ.get('OMP_NUM_THREADS')), open('results/after/onboarding.json', 'w'))"
    deps: [results/a]
    outs:
      - results/after
"""


def test_bench_grid_times_each_arm_from_the_same_state_with_the_same_threads(tmp_path, monkeypatch):
    from fedsilo.grid_bench import bench_grid, format_bench

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    repo = _repo(tmp_path, pipe=BENCH_PIPE)
    r = bench_grid("dvc.yaml", repo, tmp_path / "work", jobs=2, all_cores_sequential=True, log=lambda m: None)
    t = threads_per_run(2)
    assert r["stages"] == 2 and r["threads_per_run"] == t and list(r["arms"]) == ["sequential", "queue", "sequential_all_cores"]
    seq, queue, full = (r["arms"][a] for a in ("sequential", "queue", "sequential_all_cores"))
    assert all(a["dvc_status_clean"] and a["files_compared"] == 3 for a in (seq, queue, full))
    # the run ids differ run to run and are left out; the threads are part of the metrics here, as the kernels' sums
    # are; the stage that trains after the grid (onboard, restored by `dvc repro`) runs with the grid's threads too
    assert queue["identical_metrics"] and queue["differing_files"] == []
    assert full["identical_metrics"] == (os.cpu_count() == t)
    assert "results/a/metrics.json" in full["differing_files"] or full["identical_metrics"]
    assert seq["speedup_vs_sequential"] == 1.0 and queue["speedup_vs_sequential"] > 0
    assert f"OMP_NUM_THREADS={t} a run" in format_bench(r)
    assert not (repo / "results").exists()  # the workspace itself is left alone
    with pytest.raises(GridError, match="not empty"):
        bench_grid("dvc.yaml", repo, tmp_path / "work", jobs=2)


def test_the_default_pattern_matches_only_train_stages_in_every_shipped_pipeline():
    """`--stages train*` (the default) matches only stages that train, in the root's and every paper's dvc.yaml: a
    stage that matched it beside them (the code_fingerprint stage every train stage depends on, were it named train_*)
    would make every grid refuse its own stages as chained."""
    import fnmatch

    import yaml

    repo = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files", "*dvc.yaml"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    matched = 0
    for f in files:
        for name, st in yaml.safe_load((repo / f).read_text())["stages"].items():
            if fnmatch.fnmatch(name, TRAIN_STAGES):
                matched += 1
                assert " train " in str(st.get("do", st)["cmd"]), f"{f}: stage {name} matches {TRAIN_STAGES!r} and does not train"
    assert matched >= 10


def test_the_default_pattern_takes_the_root_pipelines_train_stages_and_one_matching_nothing_is_refused(tmp_path):
    # the root dvc.yaml's train stages are `train@<experiment>-<method>-<seed>`, a paper's `train_<group>@...`
    repo = _repo(tmp_path, pipe=PIPE.replace("  train_g:", "  train:"))
    assert upstream("dvc.yaml", repo, TRAIN_STAGES) == ["prep"]
    with pytest.raises(GridError, match=r"--stages 'train_\*': no stage of dvc.yaml matches \(its stages: prep, report, train;"):
        upstream("dvc.yaml", repo, "train_*")


def test_a_command_that_leaves_a_process_running_returns_when_it_exits():
    """`dvc queue start` spawns queue workers that outlive it: run with pipes, the call waited for the last worker
    (the grid printed no progress and could not be interrupted until every run ended); run_detached returns when
    the command exits, its output read back."""
    import psutil

    from fedsilo.grid import run_detached

    code = ("import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print('started', p.pid, flush=True)")
    t0 = time.monotonic()
    r = run_detached([sys.executable, "-c", code], Path.cwd())
    took = time.monotonic() - t0
    child = int(r.stdout.split()[1])
    try:
        assert r.returncode == 0 and r.stdout.startswith("started") and took < 60  # not the child's 120 s
        assert psutil.pid_exists(child)  # still running: the call did not wait for it
    finally:
        psutil.Process(child).kill()


def test_stages_this_machines_run_cache_restores_are_not_queued_and_the_grid_says_so(tmp_path, monkeypatch):
    """A stopped grid's finished runs (this machine's run-cache holds them) are restored, not queued again: the grid
    queues the others only, says how many were restored, and returns them as restored_here."""
    import fedsilo.grid as grid

    ran, _ = _fake_queue(monkeypatch, tmp_path, lambda name, call: "Success")
    monkeypatch.setattr(grid, "prepare_grid", lambda *a, **k: ["train_g@a", "train_g@b"])
    monkeypatch.setattr(grid, "restore_cached", lambda pipeline, repo, stages, env: [s for s in stages if s == "train_g@a"])
    said: list[str] = []
    r = run_grid("dvc.yaml", tmp_path, jobs=1, quiet=True, poll_s=0.0, log=said.append)
    assert r["queued"] == ["train_g@b"] and r["restored_here"] == ["train_g@a"]
    queued = [a for a in ran if a[:2] == ["exp", "run"]]
    assert len(queued) == 1 and "train_g@a" not in " ".join(queued[0]), queued
    assert "grid: 1 stage(s) restored from this machine's run-cache, not queued" in said
