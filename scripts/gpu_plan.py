"""Run a plan of paper-protocol runs on real Office-Caltech-10 images within a time budget, several at once on one
machine, and pack what came out into one tarball: the acceptance runs of the paper issues on a lent GPU machine.

    python scripts/gpu_plan.py PLAN.yaml OUT        (from the repository root; writes OUT.tgz)

PLAN.yaml:

    office_dir: .gpu/office_caltech_10   # the real images (four domain folders), carried to the machine
    jobs: 10                             # runs at once
    budget_s: 480                        # wall-clock budget of the training in this call (the device tool allows 600 s a
                                         # call); what is still running then is stopped and resumes in the next call
    threads: 1                           # OMP / torch threads per run (runs packed on one GPU: 1)
    checks:                              # optional: commands run (from the repository root, src and the root on
      - python scripts/check_da_cuda.py  # PYTHONPATH; 120 s at most each) before the training; output in
                                         # logs/check-<k>.log, status in manifest.json (a failing check, or one that
                                         # cannot run, is reported, the plan goes on)
    entries:
      - params: pipelines/f2dc/paper/params.yaml
        experiment: f2dc_office
        methods: [fedavg, fedheal, f2dc]
        seeds: [0, 1, 2]
        train: {}                        # optional overrides of experiments.<e>.train (a reduced schedule)

What it does: a root params file with ``sources.office_caltech10`` in ``local`` mode at ``office_dir`` and MLflow off;
per experiment, a copy of its paper params holding that experiment only (``scale: gpu``, so results go to
``results/<paper>/gpu/<experiment>/`` and never mix with a paper-scale run), its train overrides applied; then
``fedsilo fetch``, ``harmonize``, ``split`` and one ``fedsilo train`` per (method, seed), ``jobs`` at a time, seed
by seed across the entries (every entry's first seed, in plan order, before any second seed: a call cut short still
gives every table one seed of each method). At the budget (or when the driver itself gets SIGTERM / SIGINT) the runs still training get SIGTERM (each ends
the round in flight, writes its checkpoint and ends KILLED; after 60 s a run that has not stopped is killed). Calling the same plan again (the
machine still warm) skips the runs it finished (``.gpu/plan_done.json``, keyed by the params copy's sha256) and
resumes the others from their checkpoints. Each experiment's report is built over the (method, seed) runs that finished, every
unfinished run's history is taken from its checkpoint, and OUT.tgz holds the reports, the finished runs' metrics and
histories (no model files), the partial histories, every run's log, the exact plan and the params copies, and
``manifest.json`` (date, git commit and state, device, the commands, each run's exit status and seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

WORK = Path(".gpu")
CHECK_TIMEOUT_S = 120  # a plan's check: seconds at most (the device call's 600 s hold the training too)
CLI = [sys.executable, "-m", "fedsilo.cli"]


def _sh(cmd: list[str], log: Path | None = None, env: dict[str, str] | None = None) -> int:
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        return subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        if log:
            out.close()


def _check(check: str, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """One of a plan's checks: its command (``python`` / ``python3``: this interpreter; ``src`` and the repository
    root on PYTHONPATH), at most CHECK_TIMEOUT_S seconds; its exit status, or why it could not run, never an exception
    that would end the plan before anything is packed."""
    t0 = time.time()
    path = os.pathsep.join(p for p in ("src", ".", env.get("PYTHONPATH", "")) if p)
    try:
        cmd = shlex.split(check)
        if not cmd:
            raise ValueError("an empty command")
        if cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        with open(log, "w") as out:
            rc: Any = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": path},
                                     timeout=CHECK_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        rc = f"stopped after {CHECK_TIMEOUT_S} s"
    except (OSError, ValueError) as err:
        rc = f"could not run: {err}"
        log.write_text(f"{rc}\n")
    return {"rc": rc, "seconds": round(time.time() - t0, 1)}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "no GPU"
    except (OSError, subprocess.TimeoutExpired):
        return "no GPU (nvidia-smi absent)"


def prepare(plan: dict[str, Any]) -> tuple[Path, dict[tuple[str, str], Path]]:
    """The root params copy and one params copy per (params, experiment)."""
    WORK.mkdir(exist_ok=True)
    root = yaml.safe_load(open("params.yaml"))
    root["sources"]["office_caltech10"] = {"mode": "local", "path": str(plan["office_dir"])}
    root.setdefault("tracking", {})["enabled"] = False
    for d in root["datasets"].values():
        if d.get("kind") == "office_caltech10":
            d["workers"] = 0  # every core
    root_file = WORK / "root.yaml"
    copies: dict[tuple[str, str], Path] = {}
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for e in plan["entries"]:
        key = (e["params"], e["experiment"])
        m = merged.setdefault(key, {"methods": [], "seeds": [], "train": {}})
        m["methods"] += [x for x in e["methods"] if x not in m["methods"]]
        m["seeds"] += [s for s in e["seeds"] if s not in m["seeds"]]
        m["train"].update(e.get("train") or {})
    for (params, exp), m in merged.items():
        p = yaml.safe_load(open(params))
        if exp not in p["experiments"]:
            raise SystemExit(f"{params}: no experiment {exp!r}")
        unknown = [x for x in m["methods"] if x not in p["methods"]]
        if unknown:
            raise SystemExit(f"{params}: methods {unknown} are not in its methods")
        x = p["experiments"][exp]
        x["train"] = {**x["train"], **m["train"]}
        out = WORK / f"{p['paper']}_{exp}.yaml"
        p.update(data=str(root_file), params_file=str(out), repo_root="..", scale="gpu", seeds=m["seeds"],
                 experiments={exp: x}, runs={"gpu": {"experiments": [exp], "methods": m["methods"]}})
        p.setdefault("tracking", {})["enabled"] = False
        p.pop("onboarding", None)  # pFedDB's Fig. 6 runs name other experiments
        yaml.safe_dump(p, open(out, "w"), sort_keys=False)
        copies[(params, exp)] = out
        built = root.setdefault("pipeline", {}).setdefault("datasets", [])
        if x["dataset"] not in built:  # the split stage reads only datasets the root pipeline builds
            built.append(x["dataset"])
    yaml.safe_dump(root, open(root_file, "w"), sort_keys=False)
    return root_file, copies


def _pack(out_dir: Path, manifest: dict[str, Any], files: list[Path]) -> None:
    """The plan, its params copies and manifest.json into ``out_dir``, then ``out_dir`` into ``<out_dir>.tgz``."""
    for f in files:
        shutil.copy2(f, out_dir / f.name)
    manifest["ended"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    with tarfile.open(f"{out_dir}.tgz", "w:gz") as tar:
        tar.add(out_dir, arcname=out_dir.name)
    shutil.rmtree(out_dir)


def main(plan_path: str, out: str) -> int:
    plan = yaml.safe_load(open(plan_path))
    out_dir = Path(out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    root_file, copies = prepare(plan)
    env = {**os.environ, "OMP_NUM_THREADS": str(plan.get("threads", 1)), "PYTHONUNBUFFERED": "1"}
    manifest: dict[str, Any] = {"started": started, "commit": _git("rev-parse", "HEAD"), "git_status": _git("status", "--short"),
                                "device": _device(), "plan": plan, "commands": [], "runs": {}}

    def step(cmd: list[str], log: Path) -> int:
        manifest["commands"].append(" ".join(cmd[2:]))
        return _sh(cmd, log, env)

    for k, check in enumerate(plan.get("checks") or []):  # seconds each: what a device should confirm before the runs
        manifest.setdefault("checks", []).append({"command": check, **_check(str(check), out_dir / "logs" / f"check-{k}.log", env),
                                                  "log": f"logs/check-{k}.log"})
    if step([*CLI, "--params", str(root_file), "fetch", "--source", "office_caltech10"], out_dir / "logs" / "fetch.log"):
        manifest["error"] = "fetch failed: see logs/fetch.log"  # the tarball still comes back with the logs and checks
        _pack(out_dir, manifest, [Path(plan_path), root_file, *copies.values()])
        raise SystemExit(f"fetch failed: see logs/fetch.log in {out_dir}.tgz")
    for dataset in sorted({yaml.safe_load(open(f))["experiments"][e]["dataset"] for (_, e), f in copies.items()}):
        t0 = time.time()
        rc = step([*CLI, "--params", str(root_file), "harmonize", "--dataset", dataset], out_dir / "logs" / f"harmonize-{dataset}.log")
        manifest.setdefault("harmonize", {})[dataset] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    unsplit = set()
    for (_, exp), f in copies.items():
        if step([*CLI, "--params", str(f), "split", "--experiment", exp], out_dir / "logs" / f"split-{exp}.log"):
            unsplit.add(exp)
    # seed-major across the entries: every entry's first seed before any entry's second, so a campaign cut short by
    # the device time still gives each table one seed of every method (device time is scarce: one call may be all)
    jobs = [(copies[(e["params"], e["experiment"])], e["experiment"], m, e["seeds"][k])
            for k in range(max(len(e["seeds"]) for e in plan["entries"])) for e in plan["entries"] if k < len(e["seeds"])
            for m in e["methods"]]
    for _, exp, m, s in jobs:
        if exp in unsplit:
            manifest["runs"][f"{exp}/{m}/seed{s}"] = {"rc": None, "seconds": 0, "note": f"not started: split failed (logs/split-{exp}.log)"}
    jobs = [j for j in jobs if j[1] not in unsplit]
    deadline = [time.time() + float(plan["budget_s"])]
    done_file = WORK / "plan_done.json"
    done_before = json.loads(done_file.read_text()) if done_file.exists() else {}
    sha = {f: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in copies.values()}

    def stop(signum, frame) -> None:  # the driver is being stopped: end the training now, then report and pack
        deadline[0] = 0.0

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def train(job: tuple[Path, str, str, int]) -> None:
        f, exp, m, s = job
        name = f"{exp}/{m}/seed{s}"
        key = f"{sha[f]}:{name}"
        if key in done_before:  # finished in an earlier call of this plan
            manifest["runs"][name] = {**done_before[key], "note": "finished in an earlier call"}
            return
        if time.time() >= deadline[0]:
            manifest["runs"][name] = {"rc": None, "seconds": 0, "note": "not started: budget spent"}
            return
        cmd = [*CLI, "--params", str(f), "train", "--experiment", exp, "--method", m, "--seed", str(s)]
        manifest["commands"].append(" ".join(cmd[2:]))
        t0 = time.time()
        with open(out_dir / "logs" / f"{exp}-{m}-seed{s}.log", "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            while p.poll() is None and time.time() < deadline[0]:
                time.sleep(0.5)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the run ends its round, writes its checkpoint and ends KILLED
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
            rc = p.wait()
        manifest["runs"][name] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        if rc == 0:
            done_before[key] = manifest["runs"][name]
            done_file.write_text(json.dumps(done_before, indent=1))

    with ThreadPoolExecutor(max_workers=int(plan["jobs"])) as pool:
        list(pool.map(train, jobs))

    # reports over the finished runs; the unfinished ones' histories from their checkpoints
    import torch

    for (_, exp), f in copies.items():
        p = yaml.safe_load(open(f))
        results = Path("results") / p["paper"] / "gpu" / exp
        done = {(m, s) for m in p["runs"]["gpu"]["methods"] for s in p["seeds"]
                if f"{sha[f]}:{exp}/{m}/seed{s}" in done_before}  # finished under this very params copy
        methods = [m for m in p["runs"]["gpu"]["methods"] if all((m, s) in done for s in p["seeds"])]
        if methods:
            p["runs"]["gpu"]["methods"] = methods
            rep = WORK / f"report_{f.name}"
            p["params_file"] = str(rep)
            yaml.safe_dump(p, open(rep, "w"), sort_keys=False)
            step([*CLI, "--params", str(rep), "report", "--experiment", exp], out_dir / "logs" / f"report-{exp}.log")
        if results.exists():
            for path in results.rglob("*"):
                if path.is_file() and path.suffix != ".pt":
                    dst = out_dir / "results" / path.relative_to("results")
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, dst)
        planned = {f"{exp}/{m}/seed{s}" for _, e, m, s in jobs if e == exp}
        for ck in (Path("state") / p["paper"] / "gpu" / exp).rglob("checkpoint.pt"):
            if "/".join(ck.parent.parts[-3:]) not in planned:  # a run of another plan
                continue
            d = torch.load(ck, weights_only=False, map_location="cpu")
            dst = out_dir / "partial" / ck.parent.relative_to("state")
            dst.mkdir(parents=True, exist_ok=True)
            (dst / "history.json").write_text(json.dumps(d.get("history"), default=str))
            manifest["runs"].setdefault("/".join(ck.parent.parts[-3:]), {})["partial_round"] = d.get("round")
        report = Path("results") / p["paper"] / "gpu" / "report" / exp
        if report.exists():
            shutil.copytree(report, out_dir / "report" / exp, dirs_exist_ok=True)
    _pack(out_dir, manifest, [Path(plan_path), root_file, *copies.values()])
    finished = sum(1 for r in manifest["runs"].values() if r.get("rc") == 0)
    print(f"{finished} of {len(manifest['runs'])} runs finished; {out_dir}.tgz")
    for name, r in manifest["runs"].items():
        if r.get("rc") != 0:
            print(f"  {name}: {r.get('note') or 'exit status ' + str(r.get('rc'))}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
