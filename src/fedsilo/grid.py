"""A paper pipeline's runs on several workers at once, through DVC's experiment queue (``fedsilo grid``).

``dvc repro`` runs one stage at a time. The train stages of a paper pipeline (method x seed x experiment) are
independent of each other, so ``fedsilo grid`` hands them to DVC's own scheduler instead of a home-made one:

1. ``dvc repro`` of everything the train stages need (data, splits), in this workspace, once;
2. every train stage that is out of date becomes a queued DVC experiment (``dvc exp run --queue <stage>``), run by
   ``--jobs`` queue workers (``dvc queue start --jobs N``), each in its own temporary copy of the repository that shares
   this repository's DVC cache; every finished stage lands in the cache and in DVC's run-cache;
3. ``dvc repro`` of the whole pipeline here: each train stage is found in the run-cache ("Stage ... is cached -
   skipping run, checking out outputs"), so nothing trains twice, ``dvc.lock`` records every run, and the reports run.

``dvc status`` is clean afterwards, exactly as after a sequential ``dvc repro``, and the metrics are the same (every
run is seeded). The workers log to this workspace's MLflow store: a relative ``sqlite:///`` tracking URI of the
pipeline's params is made absolute and handed to them as ``MLFLOW_TRACKING_URI``, since each worker runs in a
temporary folder. The queued experiments are removed once their results are restored (``--keep`` keeps them for
``dvc exp show``). A failed stage stops the grid with its log (``dvc queue logs``) and leaves the workspace as it was.

Workers on one machine share its CPU cores and GPUs. With one GPU, ``--jobs`` runs of a small model share it; with
several, each run whose ``train.device`` is ``auto`` claims one (``FEDSILO_GPU_SLOTS``, :mod:`fedsilo.utils.slots`:
the GPUs' first places, then their second, ...), so ``--jobs 4`` on four GPUs trains one run on each.
``CUDA_VISIBLE_DEVICES`` set for ``fedsilo grid`` reaches every worker (the GPUs it lists are the ones shared out).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

from fedsilo.tracking import end_stale_runs, init_store
from fedsilo.utils.progress import Progress
from fedsilo.utils.signals import exit_on_signal, on_sigterm
from fedsilo.utils.slots import GPU_SLOTS_ENV

# the train stages of every pipeline: the root's `train@<experiment>-<method>-<seed>` and a paper's
# `train_<group>@<experiment>-<method>-<seed>` (the default of `fedsilo grid --stages`)
TRAIN_STAGES = "train*"


class GridError(RuntimeError):
    pass


def run_detached(cmd: list[str], cwd: Path, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``cmd`` until it exits, its output (stdout and stderr together) read from a temporary file, not a pipe: a
    process it leaves running (a DVC queue worker `dvc queue start` spawns) inherits the file, so the call returns when
    ``cmd`` does, where a pipe would keep it waiting until the last such process exits."""
    import tempfile

    with tempfile.TemporaryFile() as out:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.seek(0)
        text = out.read().decode(errors="replace")
    return subprocess.CompletedProcess(r.args, r.returncode, text, "")


def run_dvc(args: list[str], cwd: Path, env: Optional[dict[str, str]] = None, check: bool = True,
         detached: bool = False, shown: bool = False) -> subprocess.CompletedProcess:
    """``dvc <args>``; ``detached``: a command that starts processes outliving it (``queue start``), run with
    :func:`run_detached`; ``shown``: its output (the stages' own progress: downloads, images harmonized) goes to
    this process's standard error as it comes, not captured."""
    cmd = [sys.executable, "-m", "dvc", *args]
    if detached:
        r = run_detached(cmd, cwd, env)
    elif shown:
        sys.stderr.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=2, stderr=2, text=True)
    else:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        said = (r.stderr or r.stdout or "").strip()[-3000:] or "its output is above"
        raise GridError(f"`dvc {' '.join(args)}` failed (exit {r.returncode}):\n{said}")
    return r


def git_files(repo: Path, *args: str) -> list[str]:
    """``git ls-files -z <args>`` in ``repo``: the paths it lists."""
    r = subprocess.run(["git", "ls-files", "-z", *args], cwd=repo, capture_output=True, text=True)
    if r.returncode != 0:
        raise GridError(f"grid: `git ls-files {' '.join(args)}` failed in {repo}: {r.stderr.strip()}")
    return [f for f in r.stdout.split("\0") if f]


def lock_files(repo: Path) -> list[str]:
    """Every ``dvc.lock`` of the workspace, tracked, untracked or ignored (this repository commits
    none: each workspace's own), not DVC's own temporary copies under ``.dvc/``: what says which data and splits the stages read."""
    found = git_files(repo, "--cached", "--others", "--", "dvc.lock", "**/dvc.lock")
    return sorted({f for f in found if not f.startswith(".dvc/") and (Path(repo) / f).is_file()})


def stale_stages(pipeline: str, repo: Path, pattern: str) -> list[str]:
    """The stages of ``pipeline`` matching ``pattern`` (shell-style, on the stage name without its file) that
    ``dvc status`` reports out of date, in dvc.yaml order."""
    # a dvc.yaml below the root lists its stages as "<file>:<name>", the root's as "<name>"
    names = [n.rpartition(":")[2] for n in run_dvc(["stage", "list", "--name-only", pipeline], repo).stdout.split()]
    status = json.loads(run_dvc(["status", "--json", pipeline], repo).stdout or "{}")
    stale = {k.rpartition(":")[2] for k in status}
    return [n for n in names if fnmatch.fnmatch(n, pattern) and n in stale]


def dag(pipeline: str, repo: Path) -> tuple[set[str], dict[str, set[str]]]:
    """``dvc dag --dot``'s stages and, for each, the stages it depends on."""
    dot = run_dvc(["dag", "--dot", pipeline], repo).stdout
    edges = re.findall(r'"([^"]+)"\s*->\s*"([^"]+)"', dot)
    nodes = set(re.findall(r'^"([^"]+)";', dot, flags=re.M)) | {n for e in edges for n in e}
    parents: dict[str, set[str]] = {}
    for a, b in edges:
        parents.setdefault(b, set()).add(a)
    return nodes, parents


def ancestors(parents: dict[str, set[str]], stages: set[str]) -> set[str]:
    """Every stage ``stages`` depend on, directly or not, that is not one of them (``parents`` as :func:`dag` gives)."""
    need: set[str] = set()
    todo = [p for n in stages for p in parents.get(n, ())]
    while todo:
        n = todo.pop()
        if n in need or n in stages:
            continue
        need.add(n)
        todo.extend(parents.get(n, ()))
    return need


def upstream(pipeline: str, repo: Path, pattern: str) -> list[str]:
    """The stages the matching stages depend on, directly or not (never a matching stage, never one downstream of
    one), from ``dvc dag --dot``: the targets to reproduce before the grid, each ``dvc repro``-able."""
    nodes, parents = dag(pipeline, repo)
    matched = {n for n in nodes if fnmatch.fnmatch(n.rpartition(":")[2], pattern)}
    if not matched:  # never an empty grid that `dvc repro` afterwards quietly trains one run at a time
        names = sorted({n.rpartition(":")[2].partition("@")[0] for n in nodes})
        raise GridError(f"--stages {pattern!r}: no stage of {pipeline} matches (its stages: {', '.join(names)}; "
                        f"a pattern matches a stage's name, e.g. train@<experiment>-<method>-<seed>)")
    # each run goes alone (--single-item, a Ray task): one that reads another run's output would read a stale one
    chained = sorted(n for n in matched if ancestors(parents, {n}) & matched)
    if chained:
        raise GridError(f"--stages {pattern!r}: {chained[0]} depends on another matched stage; the grid runs each "
                        "alone, so match only stages independent of each other (the default, train*)")
    need = ancestors(parents, matched)
    # only the stages nothing else in `need` depends on: reproducing them brings their own upstream
    leaves = {n for n in need if not any(n in parents.get(m, ()) for m in need)}
    return sorted(leaves)


def queue_status(repo: Path) -> dict[str, str]:
    """Experiment name -> status (Queued, Running, Success, Failed, ...) from ``dvc queue status`` (its "Worker
    status" line is not read: it said 0 active, 0 idle while two workers ran experiments; :func:`queue_workers`)."""
    out = run_dvc(["queue", "status"], repo).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and re.fullmatch(r"[0-9a-f]{7,}", parts[0]):
            found[parts[1]] = parts[-1]
    return found


STATUS_EVERY_S = 30.0  # run_grid asks `dvc queue status` at least this often, and whenever the workers' processes change


def queue_activity(workers: list) -> frozenset[int]:
    """The process ids of queue ``workers`` (:func:`queue_workers`) and of everything they run (a stage's command):
    it changes when a run ends or a worker comes or goes, a cheap look where `dvc queue status` costs a DVC process."""
    import psutil

    pids = set()
    for w in workers:
        pids.add(w.pid)
        try:
            pids.update(c.pid for c in w.children(recursive=True))
        except psutil.Error:  # gone meanwhile
            continue
    return frozenset(pids)


def queue_workers(repo: Path) -> list:
    """This repository's DVC queue worker processes (``dvc exp queue-worker`` run in ``repo``), alive."""
    import psutil

    root = str(Path(repo).resolve())
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = p.info["cmdline"] or []
            if "queue-worker" in cmd and "exp" in cmd and p.info["cwd"] == root and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:  # gone between the listing and the look
            continue
    return found


def remove_lost_copies(repo: Path, names: Sequence[str]) -> list[Path]:
    """The temporary copies of the repository the experiments ``names`` ran in, removed (with DVC's record of each
    run): a worker killed under its experiment leaves both in ``.dvc/tmp/exps/`` for ever (neither `dvc queue kill`,
    `dvc queue remove` nor `dvc exp clean` removes them), and a copy holds the checked-out data the runs read. DVC's
    record of a run is ``.dvc/tmp/exps/run/<rev>/<rev>.run``, a JSON naming the experiment (``name``) and its copy
    (``root_dir``); only a copy inside ``.dvc/tmp/exps/`` is removed. Returns the copies removed."""
    exps = (repo / ".dvc" / "tmp" / "exps").resolve()
    removed: list[Path] = []
    for info in sorted(exps.glob("run/*/*.run")):
        try:
            rec = json.loads(info.read_text())
        except (OSError, ValueError):
            continue  # another run's record being written: not one of ours
        if not isinstance(rec, dict) or rec.get("name") not in names or not rec.get("root_dir"):
            continue
        copy = Path(str(rec["root_dir"])).resolve()
        if copy.parent != exps or not copy.is_dir():
            continue
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(info.parent, ignore_errors=True)
        removed.append(copy)
    return removed


def stop_workers(repo: Path, env: Optional[dict[str, str]] = None, grace_s: float = 30.0, terminate: bool = True,
                 log: Callable[[str], None] = print) -> int:
    """``dvc queue stop``, then (``terminate``: every queued experiment has finished, so no worker is busy) end this
    repository's DVC queue workers that outlive it by ``grace_s`` seconds: a worker started while the stop was
    broadcast misses it and idles forever (seen with DVC 3.67's filesystem broker), holding the repository's queue.
    Returns how many had to be terminated."""
    import psutil

    run_dvc(["queue", "stop"], repo, env, check=False)
    if not terminate:  # interrupted: the running experiments finish, then their workers stop
        log("grid: interrupted; the running experiments finish first (`dvc queue kill <name>` stops them now)")
        return 0
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # gone (and reaped) between the two calls
            return False

    deadline = time.monotonic() + grace_s
    left = queue_workers(repo)
    while left and time.monotonic() < deadline:
        time.sleep(1.0)
        left = [p for p in left if alive(p)]
    for p in left:
        log(f"grid: DVC queue worker {p.pid} ({' '.join(p.info['cmdline'][-2:])}) did not stop; terminating it")
        try:
            p.terminate()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
    return len(left)


def tracking_env(uri: Optional[str], repo: Path) -> dict[str, str]:
    """The environment for the workers: a relative sqlite tracking URI made absolute against ``repo``."""
    env = dict(os.environ)
    # DVC starts its queue workers as `dvc` from PATH: this interpreter's (the venv's) first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if uri and "MLFLOW_TRACKING_URI" not in env:
        m = re.fullmatch(r"sqlite:///(.+)", uri)
        if m and not os.path.isabs(m.group(1)):
            uri = f"sqlite:///{(Path(repo).resolve() / m.group(1)).as_posix()}"
        env["MLFLOW_TRACKING_URI"] = uri
    return env


def prepare_grid(pipeline: str, repo: Path, pattern: str, env: dict[str, str], *, quiet: bool,
                 log: Callable[[str], None] = print) -> list[str]:
    """The out-of-date stages matching ``pattern``, after reproducing here, once, what they need (data, splits);
    unless ``quiet``, each target is named and DVC's output (the stages' progress: downloads, harmonized images)
    shown as it comes: on real images this phase can take hours."""
    if not (repo / pipeline).exists():
        raise GridError(f"{pipeline}: no such dvc.yaml under {repo}")
    targets = upstream(pipeline, repo, pattern)
    for i, target in enumerate(targets, 1):  # data and splits first, here, once: the workers find them
        if not quiet:                         # cached (queue) or pulled (Ray)
            log(f"grid: what the runs read, here first ({i}/{len(targets)}): dvc repro {target}")
            sys.stdout.flush()  # the line before DVC's output on fd 2, where both go to one file
        run_dvc(["repro", target], repo, env, shown=not quiet)
    init_store(env.get("MLFLOW_TRACKING_URI"))  # the runs start together: the store's tables exist before they log
    # only now: a changed input upstream (a source, a split's params) makes its train stages stale once it is rebuilt
    return stale_stages(pipeline, repo, pattern)


def restore_cached(pipeline: str, repo: Path, stages: list[str], env: dict[str, str]) -> list[str]:
    """The out-of-date ``stages`` this machine's DVC run-cache holds (a run finished here whose params were since
    changed and changed back; a stopped grid's finished runs), restored here, in seconds: a queued experiment would
    first set up its copy of the repository (tens of seconds each), and a Ray node sees its own worker cache's
    run-cache only and would train them again. One ``dvc repro --keep-going`` whose shell is ``false`` (DVC runs a stage's command as ``$SHELL -c <cmd>``;
    not on Windows, where it ignores ``SHELL``): a stage the run-cache holds is checked out without its command, any
    other stage's command fails at once, running nothing; DVC removed those stages' previous outputs first, so they
    are checked out again from ``dvc.lock`` (the workspace as it was). Returns the stages restored."""
    false = shutil.which("false")
    if not stages or false is None or os.name == "nt":
        return []
    runs = Path(run_dvc(["cache", "dir"], repo, env).stdout.strip()) / "runs"
    if not runs.is_dir() or not any(runs.iterdir()):  # nothing was ever run here: nothing to restore
        return []
    run_dvc(["repro", "--single-item", "--keep-going", *(f"{pipeline}:{s}" for s in stages)], repo, {**env, "SHELL": false},
            check=False)  # the stages the run-cache does not hold fail, by design: the cluster trains them
    still = set(stale_stages(pipeline, repo, "*"))
    left = [s for s in stages if s in still]
    if left:  # their previous results back in the workspace, as before the pass (the cluster's replace them)
        run_dvc(["checkout", *(f"{pipeline}:{s}" for s in left)], repo, env, check=False)
    return [s for s in stages if s not in still]


def left_out(pipeline: str, repo: Path, pattern: str, stages: list[str]) -> list[str]:
    """The out-of-date train stages a ``--stages`` pattern leaves out of the grid (none for the default pattern): a
    closing ``dvc repro`` of the whole pipeline would train them here, one after another."""
    if pattern == TRAIN_STAGES:
        return []
    return [s for s in stale_stages(pipeline, repo, TRAIN_STAGES) if s not in stages]


def restore_grid(pipeline: str, repo: Path, stages: list[str], env: dict[str, str], pull: bool = False,
                 others: Sequence[str] = (), log: Callable[[str], None] = print) -> list[str]:
    """``dvc repro`` of the whole pipeline here: the grid's stages come from the run-cache (with ``pull``: the remote's,
    fetched first), never trained again; the stages after them (onboarding, reports) run. Where train stages the
    grid left out are out of date (``others``: a ``--stages`` subset), only the grid's stages are restored: the whole
    repro would train those here, one after another, unasked. Returns the stages run."""
    if pull:
        run_dvc(["fetch", "--run-cache"], repo, env)
    if others:
        r = run_dvc(["repro", *(["--pull"] if pull else []), "--single-item", *(f"{pipeline}:{s}" for s in stages)], repo, env) \
            if stages else None  # no target: `dvc repro --single-item` alone would run every stage of the root pipeline
        log(f"grid: {len(others)} out-of-date train stage(s) outside --stages ({', '.join(others[:3])}"
            + (", ..." if len(others) > 3 else "") + "), so only the grid's runs were restored and the stages after them "
            "(reports, onboarding) were not run: `fedsilo grid` without --stages (or `dvc repro`) trains the rest")
    else:
        r = run_dvc(["repro", *(["--pull"] if pull else []), pipeline], repo, env)
    ran = re.findall(r"Running stage '([^']+)'", r.stdout) if r is not None else []
    rerun = [s for s in ran if s.rpartition(":")[2] in stages]
    if rerun:  # the run-cache should have held them: say so rather than hide a second training
        raise GridError(f"dvc repro trained again what the workers ran (not in the run-cache?): {', '.join(rerun)}")
    return ran


def batches(stages: list[str], jobs: int, per_experiment: Optional[int] = None) -> list[list[str]]:
    """The stages in queued experiments of ``per_experiment`` stages each (default: about four experiments a worker,
    so that DVC's cost of setting up an experiment is paid a few times per worker, not once per run, while the
    workers still share the work evenly), in order."""
    if per_experiment is None:
        per_experiment = max(1, -(-len(stages) // (4 * jobs)))
    if per_experiment < 1:
        raise GridError("--runs-per-experiment: at least 1")
    return [stages[i:i + per_experiment] for i in range(0, len(stages), per_experiment)]


def threads_per_run(jobs: int, threads: Optional[float] = None) -> int:
    """The threads (``OMP_NUM_THREADS``) each of ``jobs`` runs at once on this machine uses: ``threads`` when given
    (Ray's rule for a fractional CPU count: at least one, the whole part), else this machine's cores shared out."""
    if threads is not None:
        if threads <= 0:
            raise GridError("--cpus-per-run: more than 0")
        return max(1, int(threads))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # a CPU set
    return max(1, cores // jobs)


def run_grid(pipeline: str, repo: Path, jobs: int, pattern: str = TRAIN_STAGES, tracking_uri: Optional[str] = None,
             keep: bool = False, poll_s: float = 2.0, quiet: bool = False, per_experiment: Optional[int] = None,
             threads: Optional[float] = None, log: Callable[[str], None] = print) -> dict[str, object]:
    """Run ``pipeline``'s out-of-date stages matching ``pattern`` on ``jobs`` DVC queue workers, ``per_experiment``
    stages to a queued experiment (see :func:`batches`), each run with :func:`threads_per_run` threads (an
    ``OMP_NUM_THREADS`` already set wins over the default, not over ``threads``), then ``dvc repro`` it here (restoring
    them from the run-cache). Returns the stages queued, the threads a run used, the seconds each phase took."""
    if jobs < 1:
        raise GridError("--jobs: at least 1")
    # a SIGTERM (a cancelled job, `kill`, a script stopping a grid it started in the background, which ignores Ctrl-C's
    # SIGINT) ends the grid as Ctrl-C does, through its `finally`: the queue stopped, the running experiments left to
    # finish, exit status 143 (it died at once, and its workers went on to take the experiments still queued)
    with on_sigterm(exit_on_signal):
        return _run_grid(pipeline, Path(repo), jobs, pattern, tracking_uri, keep, poll_s, quiet, per_experiment, threads, log)


def _run_grid(pipeline: str, repo: Path, jobs: int, pattern: str, tracking_uri: Optional[str], keep: bool, poll_s: float,
              quiet: bool, per_experiment: Optional[int], threads: Optional[float], log: Callable[[str], None]) -> dict[str, object]:
    env = tracking_env(tracking_uri, repo)
    # the runs': N at once, each with as many threads as the machine has cores, fight over the cores; the threads also
    # decide the CPU kernels' sums, so the pipeline's numbers are those of a sequential `OMP_NUM_THREADS=t dvc repro`
    wenv = dict(env)
    if threads is not None or "OMP_NUM_THREADS" not in wenv:
        wenv["OMP_NUM_THREADS"] = str(threads_per_run(jobs, threads))
    # on a machine with several GPUs each run with train.device: auto claims its own (utils/slots.py); the workers
    # run in temporary copies, so the folder is this repository's, absolute
    wenv.setdefault(GPU_SLOTS_ENV, str((repo / ".dvc" / "tmp" / "gpu-slots").resolve()))
    t0 = time.monotonic()
    stages = prepare_grid(pipeline, repo, pattern, env, quiet=quiet, log=log)
    restored = restore_cached(pipeline, repo, stages, env)  # a stopped grid's finished runs: not queued again
    stages = [s for s in stages if s not in restored]
    if restored:
        log(f"grid: {len(restored)} stage(s) restored from this machine's run-cache, not queued")
    others = left_out(pipeline, repo, pattern, stages)
    t_prep = time.monotonic() - t0
    tag = uuid.uuid4().hex[:6]
    names: dict[str, list[str]] = {}  # experiment -> its stages
    # an interrupted grid's experiments still queued or running: this grid's workers take (or wait behind) them first
    earlier = {n: s for n, s in queue_status(repo).items() if s in ("Queued", "Running")} if stages else {}
    if earlier:
        log(f"grid: {len(earlier)} experiment(s) of an earlier grid still in DVC's queue ("
            + ", ".join(f"{n} {s.lower()}" for n, s in sorted(earlier.items())) + "): this grid's workers run them "
            "first; `dvc queue kill <name>` / `dvc queue remove --all` drop them")
    locks = lock_files(repo)
    for i, batch in enumerate(batches(stages, jobs, per_experiment) if stages else []):
        name = f"grid-{tag}-{i:03d}"
        # each stage alone (--single-item): its data and splits were reproduced above, and the experiment's copy of
        # the repository gets this workspace's dvc.lock files (-C; git stashes none that are ignored or untracked),
        # so DVC checks them out there instead of re-hashing everything upstream of every stage
        run_dvc(["exp", "run", "--queue", "--single-item", *(a for f in locks for a in ("-C", f)), "--name", name,
              *(f"{pipeline}:{stage}" for stage in batch)], repo, env)
        names[name] = batch
    t1 = time.monotonic()
    failed: dict[str, list[str]] = {}
    lost: dict[str, list[str]] = {}  # experiments whose worker died under them (SIGKILL, out of memory)
    if names:
        run_dvc(["queue", "start", "--jobs", str(jobs)], repo, wenv, detached=True)
        if not quiet:  # DVC sets up each experiment's copy before its first run ends: minutes without a progress line
            log(f"grid: {len(stages)} stages queued in {len(names)} experiments; {jobs} DVC queue workers started")
        bar = Progress(len(stages), f"grid {pipeline} ({jobs} workers x {wenv['OMP_NUM_THREADS']} threads, "
                       f"{len(names)} experiments)", "run", quiet=quiet)
        done: set[str] = set()
        idle_polls = ghost_polls = 0
        seen, asked = None, -float("inf")
        try:
            while True:
                # `dvc queue status` (a DVC process: a second of CPU, taken from the runs) only when the workers'
                # processes changed (a run ended, a worker came or went), or every STATUS_EVERY_S seconds
                now_s, workers = time.monotonic(), queue_workers(repo)
                activity = queue_activity(workers)
                if activity == seen and now_s - asked < STATUS_EVERY_S:
                    time.sleep(poll_s)
                    continue
                seen, asked, live = activity, now_s, len(workers)
                status = queue_status(repo)
                st = {n: s for n, s in status.items() if n in names}
                # DVC's workers exit when they find the queue empty; one that exits while a task is still being queued
                # (seen after a `dvc queue stop` in the same repository) leaves it Queued with nobody to run it
                idle_polls = idle_polls + 1 if live == 0 and any(s == "Queued" for s in st.values()) else 0
                if idle_polls >= 3:
                    run_dvc(["queue", "start", "--jobs", str(jobs)], repo, wenv, detached=True)
                    idle_polls = 0
                # a task DVC still lists Running with no worker alive lost its worker (killed, out of memory): DVC
                # never ends it, and the grid would wait for it forever. Ended here (`dvc queue kill`), named below
                ghosts = [n for n, s in st.items() if s == "Running" and n not in lost]
                ghost_polls = ghost_polls + 1 if live == 0 and ghosts else 0
                if ghost_polls >= 3:
                    for n in ghosts:
                        run_dvc(["queue", "kill", n], repo, env, check=False)
                        lost[n] = names[n]
                    gone = remove_lost_copies(repo, ghosts)
                    if gone:
                        log(f"grid: removed the copies of the repository the lost experiments ran in: {', '.join(map(str, gone))}")
                    ghost_polls = 0
                now = {n for n, s in st.items() if s in ("Success", "Failed")} | set(lost)
                if now - done:
                    bar.update(sum(len(names[n]) for n in now - done), info=f"{sum(s == 'Failed' for s in st.values())} experiments failed", line=True)
                    done |= now
                failed = {n: names[n] for n, s in st.items() if s == "Failed" and n not in lost}
                if len(done) == len(names):
                    break
                time.sleep(poll_s)
        finally:
            bar.close()
            stop_workers(repo, env, terminate=len(done) == len(names), log=log)
            if env.get("MLFLOW_TRACKING_URI"):  # a worker's run SIGKILLed in its copy of the repository: nothing resumes it
                try:
                    ended = end_stale_runs(env["MLFLOW_TRACKING_URI"])
                except Exception as err:  # noqa: BLE001 - in a finally: the grid's own outcome (or error) is the story
                    log(f"grid: could not look for MLflow runs left RUNNING ({type(err).__name__}: {err}); "
                        "`fedsilo stale-runs --end` does it")
                    ended = []
                if ended:
                    log(f"grid: {len(ended)} MLflow run(s) whose process died marked KILLED: "
                        + ", ".join(str(r.info.run_name) for r in ended))
    t_grid = time.monotonic() - t1
    if lost:
        raise GridError(f"{len(lost)} of {len(names)} queued experiments lost their DVC queue worker (killed, out of "
                        f"memory?) while running: {', '.join(s for b in lost.values() for s in b)}; ended with `dvc queue "
                        "kill`. Run the grid again: the finished runs are restored from DVC's run-cache, and a lost run "
                        "trains again from its first round (its checkpoint was in the worker's copy of the repository)"
                        + (f"; {len(failed)} more failed: {', '.join(s for b in failed.values() for s in b)}" if failed else ""))
    if failed:
        logs = "\n".join(f"--- {', '.join(batch)} (dvc queue logs {n}):\n" + run_dvc(["queue", "logs", n], repo, check=False).stdout[-2000:]
                         for n, batch in failed.items())
        what = "stages" if len(names) == len(stages) else f"experiments ({len(stages)} stages)"
        raise GridError(f"{len(failed)} of {len(names)} queued {what} failed: {', '.join(s for b in failed.values() for s in b)}\n{logs}")
    t2 = time.monotonic()
    ran = restore_grid(pipeline, repo, stages, wenv, others=others, log=log)  # onboarding after the grid: the runs' threads too
    if names and not keep:
        run_dvc(["exp", "remove", *names], repo, check=False)
    return {"queued": stages, "restored_here": restored, "experiments": len(names), "jobs": jobs, "threads_per_run": wenv["OMP_NUM_THREADS"],
            "prepare_s": t_prep, "grid_s": t_grid,
            "restore_and_report_s": time.monotonic() - t2, "ran_after": ran, "left_out": others}
