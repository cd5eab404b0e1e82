"""``fedsilo bench-grid``: a pipeline's grid against a sequential ``dvc repro``, measured in one run on one machine.

The arms start from the same state in copies of the workspace under ``work``: a base copy builds the data and splits
once (its own DVC cache), then each arm gets a full copy of it whose DVC run-cache is emptied, so no arm can restore a
run another arm trained. The arms run one after the other on the same machine:

- ``sequential``: ``dvc repro <pipeline>``;
- ``queue``: :func:`fedsilo.grid.run_grid` with ``jobs`` DVC queue workers (``per_experiment`` stages a queued
  experiment, default :func:`fedsilo.grid.batches`' choice);
- ``ray`` (with ``ray_address``): :func:`fedsilo.grid_ray.run_grid_ray` on that cluster, through a DVC remote in
  ``work``.

Every arm runs each stage with the same number of threads (``OMP_NUM_THREADS``: ``cpus_per_run``, by default the
machine's cores / ``jobs``, :func:`fedsilo.grid.threads_per_run`): the CPU kernels' sums depend on it, and equal
metrics are part of the result. With ``all_cores_sequential`` a fourth arm runs ``dvc repro`` with every core to
each run (the fastest sequential run, its metrics not comparable bit for bit).

For each arm: its wall seconds (from the start of the pipeline's reproduction to ``dvc status`` clean), the speed-up
``sequential / arm``, whether ``dvc status`` is clean, and whether every run's metrics equal the sequential arm's (every
``metrics.json`` under ``results/`` but its MLflow run id, every ``history.json`` but its seconds per round, every
``spectrum.json`` and ``onboarding.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from fedsilo.grid import TRAIN_STAGES, GridError, prepare_grid, run_dvc, run_grid, threads_per_run, tracking_env
from fedsilo.grid_ray import run_grid_ray, snapshot_commands, workspace_files

# every JSON a run writes, and what in it differs between equal runs (its MLflow run, the wall-clock seconds)
VOLATILE = {"metrics.json": ("mlflow_run_id",), "history.json": ("seconds", "train_seconds"), "spectrum.json": (),
            "onboarding.json": ()}


def _strip(obj: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_strip(v, keys) for v in obj]
    return obj


def run_numbers(root: Path) -> dict[str, Any]:
    """Every run's metrics and history under ``root/results``, without what differs between equal runs."""
    found = {}
    for name, keys in VOLATILE.items():
        for f in sorted((root / "results").rglob(name)):
            found[f.relative_to(root).as_posix()] = _strip(json.loads(f.read_text()), keys)
    return found


def _copy_workspace(repo: Path, dest: Path) -> None:
    for f in workspace_files(repo):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, dest / f)
    for _, cmd in snapshot_commands("bench", "bench-grid base"):
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True)


def bench_grid(pipeline: str, repo: Path, work: Path, jobs: int = 2, pattern: str = TRAIN_STAGES,
               tracking_uri: Optional[str] = None, ray_address: Optional[str] = None, cpus_per_run: Optional[float] = None,
               per_experiment: Optional[int] = None, all_cores_sequential: bool = False,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    repo, work = Path(repo).resolve(), Path(work).resolve()
    if work.exists() and any(work.iterdir()):
        raise GridError(f"bench-grid: {work} is not empty (the arms' copies go there)")
    base = work / "base"
    base.mkdir(parents=True)
    _copy_workspace(repo, base)
    log(f"bench-grid: building the data and splits once in {base}")
    t0 = time.monotonic()
    stages = prepare_grid(pipeline, base, pattern, tracking_env(tracking_uri, base), quiet=True)  # its line above says it
    prep_s = time.monotonic() - t0
    if not stages:
        raise GridError(f"bench-grid: no stage of {pipeline} matching {pattern} is out of date in the copy")
    threads = threads_per_run(jobs, cpus_per_run)
    arms = ["sequential", "queue"] + (["ray"] if ray_address else []) + (["sequential_all_cores"] if all_cores_sequential else [])
    result: dict[str, Any] = {"pipeline": pipeline, "stages": len(stages), "jobs": jobs, "cpu_count": os.cpu_count(),
                              "threads_per_run": threads, "data_and_splits_s": prep_s, "arms": {}}
    numbers: dict[str, dict[str, Any]] = {}
    for arm in arms:
        d = work / arm
        shutil.copytree(base, d, symlinks=True)
        shutil.rmtree(d / ".dvc" / "cache" / "runs", ignore_errors=True)  # no arm restores another arm's runs
        env = tracking_env(tracking_uri, d)
        env["OMP_NUM_THREADS"] = str(threads_per_run(1) if arm == "sequential_all_cores" else threads)
        log(f"bench-grid: {arm} arm in {d} ({len(stages)} stages, OMP_NUM_THREADS={env['OMP_NUM_THREADS']})")
        t = time.monotonic()
        if arm.startswith("sequential"):
            run_dvc(["repro", pipeline], d, env)
        elif arm == "queue":
            q = run_grid(pipeline, d, jobs, pattern=pattern, tracking_uri=tracking_uri, quiet=True, per_experiment=per_experiment,
                         threads=threads)
            result["queued_experiments"] = q["experiments"]
        else:
            run_dvc(["remote", "add", "-d", "benchstore", str(work / "remote")], d)
            run_grid_ray(pipeline, d, ray_address, pattern=pattern, tracking_uri=tracking_uri, cpus_per_run=threads,
                         worker_cache=str(work / "ray-node-cache"), quiet=True, log=log)
        secs = time.monotonic() - t
        status = run_dvc(["status", pipeline], d).stdout
        numbers[arm] = run_numbers(d)
        result["arms"][arm] = {"seconds": secs, "dvc_status_clean": "up to date" in status, "files_compared": len(numbers[arm])}
        log(f"bench-grid: {arm}: {secs:.0f} s, dvc status {'clean' if 'up to date' in status else 'NOT clean'}")
    seq = numbers["sequential"]
    for arm in arms:
        a = result["arms"][arm]
        a["speedup_vs_sequential"] = result["arms"]["sequential"]["seconds"] / a["seconds"]
        a["differing_files"] = sorted(k for k in set(seq) | set(numbers[arm]) if seq.get(k) != numbers[arm].get(k))
        a["identical_metrics"] = not a["differing_files"]
    result["python"] = sys.version.split()[0]
    return result


def format_bench(r: dict[str, Any]) -> str:
    lines = [f"{r['pipeline']}: {r['stages']} stages, {r['cpu_count']} CPUs, OMP_NUM_THREADS={r['threads_per_run']} a run "
             f"(data and splits built once: {r['data_and_splits_s']:.0f} s)",
             f"{'arm':<22}{'seconds':>9}{'speed-up':>10}  dvc status  metrics = sequential"]
    for arm, a in r["arms"].items():
        lines.append(f"{arm:<22}{a['seconds']:>9.0f}{a['speedup_vs_sequential']:>9.2f}x  "
                     f"{'clean' if a['dvc_status_clean'] else 'NOT clean':<11} "
                     f"{'yes' if a['identical_metrics'] else 'NO: ' + ', '.join(a['differing_files'][:5])}")
    return "\n".join(lines)
