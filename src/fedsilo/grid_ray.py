"""A paper pipeline's runs on a Ray cluster (``fedsilo grid --ray ADDRESS``): many machines, each run a Ray task.

The queue backend (:mod:`fedsilo.grid`) shares one machine's DVC cache between its workers. Machines of a cluster share
nothing but the DVC remote, so results travel through it, the way DVC users move work between machines:

1. here: ``dvc repro`` of what the runs need (data, splits), then ``dvc push`` of those outputs to the default remote
   (only what the stages produce: the fetched raw sources, the DAG's roots, stay here; workers train from the
   harmonized arrays and the splits);
2. the workspace as it is now (git-tracked and untracked files not ignored, uncommitted edits included, and every
   ``dvc.lock``; never data, results, ``.dvc/config.local`` or anything ignored) travels once through Ray's object
   store;
3. each out-of-date stage is one Ray task asking for ``cpus_per_run`` CPUs and ``gpus_per_run`` GPUs (Ray picks the
   node and sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it granted; a fraction such as 0.5 lets two runs share a GPU).
   The task unpacks the workspace in a temporary folder on its node, ``dvc pull``s the data and splits, runs
   ``dvc repro --single-item`` of its stage with that workspace's ``src/`` first on ``PYTHONPATH`` (the code DVC
   hashed is the code that runs, whatever fedsilo the node has installed), and ``dvc push --run-cache``es the outputs
   and the run-cache entry to the remote, then removes the folder;
4. here: ``dvc fetch --run-cache`` and ``dvc repro --pull``: every stage the cluster ran is found in the run-cache
   ("Stage ... is cached - skipping run, checking out outputs"), its outputs are pulled, ``dvc.lock`` records it, and
   the stages after the grid (onboarding, reports) run. ``dvc status`` is clean; nothing trains twice (the grid stops
   with an error if ``dvc repro`` would).

A node keeps one DVC cache for all its tasks (``worker_cache``, default ``~/.cache/fedsilo/grid-dvc``) so the data is
pulled to a node once, not once per run. The runs log to ``MLFLOW_TRACKING_URI`` (the pipeline's tracking URI made
absolute, as for the queue): a ``sqlite:///`` file is only reachable from this machine, so on a cluster of several
machines point it at an MLflow server (``mlflow server``) every node reaches. Every run is seeded; bit-for-bit equal
metrics with a sequential ``dvc repro`` need the same number of CPU threads: a Ray task runs with
``OMP_NUM_THREADS = cpus_per_run`` (Ray's own rule), so compare with ``OMP_NUM_THREADS=<cpus_per_run> dvc repro``.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from fedsilo.grid import (
    TRAIN_STAGES,
    GridError,
    ancestors,
    git_files,
    left_out,
    lock_files,
    prepare_grid,
    restore_cached,
    restore_grid,
    run_dvc,
    threads_per_run,
    tracking_env,
)
from fedsilo.grid import dag as _dag
from fedsilo.utils.progress import Progress

DEFAULT_WORKER_CACHE = "~/.cache/fedsilo/grid-dvc"
BUNDLE_LIMIT = 256 * 1024 * 1024  # a workspace (code, params, locks) is a few MiB; more means data is not ignored


def worker_inputs(pipeline: str, repo: Path, stages: list[str],
                  dag: Optional[tuple[set[str], dict[str, set[str]]]] = None) -> list[str]:
    """The stages whose outputs a worker needs to run ``stages`` (names as ``dvc stage list`` gives them, without the
    file): every stage upstream of them except the DAG's roots (the fetched sources, ``dvc add``-ed files) that no
    stage of ``stages`` reads directly (a pipeline's ``code_fingerprint``, whose files the train stages read, is
    kept), sorted. ``dag``: :func:`_dag`'s answer, when already at hand."""
    nodes, parents = dag or _dag(pipeline, repo)
    targets = {n for n in nodes if n.rpartition(":")[2] in stages}
    need, direct = ancestors(parents, targets), set().union(*(parents.get(t, set()) for t in targets))
    return sorted(n for n in need if parents.get(n) or n in direct)


def workspace_files(repo: Path) -> list[str]:
    """What a worker gets of the workspace: git-tracked files and untracked ones git does not ignore (as they are now,
    edits included), and every ``dvc.lock`` (this repository commits none, but it says which data the stages read)."""
    files = set(git_files(repo, "--cached", "--others", "--exclude-standard")) | set(lock_files(repo))
    return sorted(f for f in files if (repo / f).is_file())


def bundle(repo: Path) -> bytes:
    """The workspace files as a gzip'ed tar, in memory."""
    buf = io.BytesIO()
    size = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in workspace_files(repo):
            size += (repo / f).stat().st_size
            if size > BUNDLE_LIMIT:
                raise GridError(f"grid --ray: the workspace to send to the workers passed {BUNDLE_LIMIT >> 20} MiB at {f}: "
                                "data or results that git does not ignore? (add them to .gitignore; DVC moves data)")
            tar.add(repo / f, arcname=f, recursive=False)
    return buf.getvalue()


def snapshot_commands(who: str, message: str) -> list[tuple[str, list[str]]]:
    """(step, git command) that make a folder of workspace files a repository of one commit holding them (DVC wants a
    git repository), committed as ``fedsilo <who>``."""
    git = ["git", "-c", f"user.name=fedsilo {who}", "-c", f"user.email={who}@fedsilo.invalid", "-c", "init.defaultBranch=main"]
    return [("git init", [*git, "init", "-q"]), ("git add", [*git, "add", "-A"]),
            ("git commit", [*git, "commit", "-q", "--no-verify", "-m", message])]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str, log: list[str]) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    log.append(f"$ {' '.join(cmd[2:] if cmd[:2] == [sys.executable, '-m'] else cmd)}\n{r.stdout}{r.stderr}")
    if r.returncode != 0:
        raise GridError(f"{what} failed (exit {r.returncode}) on {socket.gethostname()}:\n" + "\n".join(log)[-4000:])
    return r.stdout


def end_stale_here(uri: str) -> list[str]:
    """On a node: :func:`fedsilo.tracking.end_stale_runs` of the MLflow runs this host started (``<run> on <host>``)."""
    from fedsilo.tracking import end_stale_runs

    return [f"{r.info.run_name} on {socket.gethostname()}" for r in end_stale_runs(uri)]


def end_stale_on_nodes(ray: Any, uri: str, log: Any, nodes: Optional[bool] = None) -> list[str]:
    """:func:`end_stale_here` on every live node at once (only a run's own host can tell whether its process is
    gone); a store in a file (``sqlite:///``, ``file:``) is this machine's, where alone runs could log: here only
    (``nodes``, default by the URI, says which)."""
    if not (nodes if nodes is not None else not uri.startswith(("sqlite:", "file:")) and "://" in uri):
        return end_stale_here(uri)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    sweep = ray.remote(end_stale_here)
    refs = {sweep.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False))
            .remote(uri): n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=120)
    ended: list[str] = []
    for ref in ready:
        try:
            ended += ray.get(ref)
        except Exception as err:  # noqa: BLE001 - the runs are done and restored after this; said, not fatal
            log(f"grid: could not look for MLflow runs left RUNNING on {refs[ref]} ({type(err).__name__}: {err}); "
                "`fedsilo stale-runs --end` there does it")
    for ref in late:
        log(f"grid: {refs[ref]} did not say within 120 s which MLflow runs it left RUNNING; `fedsilo stale-runs --end` there does it")
    return list(dict.fromkeys(ended))  # two nodes of one machine (asked at once) both find its runs


def run_stage(workspace: bytes, pipeline: str, stage: str, inputs: list[str], env_vars: dict[str, str],
              worker_cache: Optional[str]) -> dict[str, Any]:
    """One grid run on whatever node Ray placed it: unpack the workspace, pull its inputs, reproduce the stage, push
    its outputs and run-cache entry to the DVC remote. Runs inside a Ray task (or anywhere: it only needs git, DVC and
    fedsilo's dependencies on the node)."""
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="fedsilo-grid-"))
    log: list[str] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(workspace), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        env = tracking_env(None, tmp)  # this node's environment, its interpreter's `dvc` / `fedsilo` first on PATH
        env.update(env_vars)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        for step, cmd in snapshot_commands("grid", "fedsilo grid workspace"):
            _run(cmd, tmp, env, step, log)
        dvc = [sys.executable, "-m", "dvc"]
        if worker_cache:
            cache = Path(os.path.expanduser(worker_cache))
            cache.mkdir(parents=True, exist_ok=True)
            _run([*dvc, "config", "--local", "cache.dir", str(cache)], tmp, env, "dvc config cache.dir", log)
        if inputs:
            _run([*dvc, "pull", *inputs], tmp, env, f"dvc pull of {stage}'s inputs", log)
        out = _run([*dvc, "repro", "--single-item", f"{pipeline}:{stage}"], tmp, env, f"dvc repro of {stage}", log)
        _run([*dvc, "push", "--run-cache", f"{pipeline}:{stage}"], tmp, env, f"dvc push of {stage}", log)
        return {"stage": stage, "host": socket.gethostname(), "node": _ray_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "restored_from_run_cache": "is cached" in out, "seconds": time.monotonic() - t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ray_node_id() -> Optional[str]:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside Ray: no node id
        return None


def _check_cluster(ray: Any, cpus: float, gpus: float, tracking_uri: Optional[str], log) -> list[dict[str, Any]]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if gpus > 0 and not any(n["Resources"].get("GPU", 0) >= gpus for n in nodes):
        most = max((n["Resources"].get("GPU", 0) for n in nodes), default=0)
        raise GridError(f"grid --ray: --gpus-per-run {gpus:g} but no node of the cluster has that many GPUs (the most: "
                        f"{most:g}; `ray status` lists the resources; start GPU nodes with `ray start --num-gpus N`)")
    if not any(n["Resources"].get("CPU", 0) >= cpus for n in nodes):
        most = max((n["Resources"].get("CPU", 0) for n in nodes), default=0)
        raise GridError(f"grid --ray: --cpus-per-run {cpus} but the largest node has {most:g} CPUs")
    hosts = {n["NodeManagerAddress"] for n in nodes}
    if tracking_uri and re.match(r"(sqlite|file):", tracking_uri) and len(hosts) > 1:
        log(f"grid --ray: warning: MLflow logs to {tracking_uri}, a file on this machine, but the cluster spans "
            f"{len(hosts)} hosts ({', '.join(sorted(hosts))}): runs on the others cannot reach it; set MLFLOW_TRACKING_URI "
            "to an MLflow server every node reaches")
    return nodes


def check_address(address: str, timeout_s: float = 5.0) -> None:
    """A cluster address of the form ``host:port`` (or ``ray://host:port``) answers a TCP connection within
    ``timeout_s``: a wrong port or host otherwise leaves Ray retrying its GCS connection for minutes with no word of
    fedsilo's. ``auto`` and ``local`` are Ray's to resolve."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]]+?)\]?:(\d+)", address.strip())
    if not m:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as err:
        if isinstance(err, ConnectionRefusedError):
            why = "nothing answers"
        elif isinstance(err, (socket.timeout, TimeoutError)):
            why = f"no answer within {timeout_s:.0f} s"
        else:
            why = str(err)
        raise GridError(f"grid --ray {address}: {why} at {host}:{port}; start the head node there (`ray start --head "
                        f"--port {port}`) or give the address `ray status` prints on it") from None


def run_grid_ray(pipeline: str, repo: Path, address: str, pattern: str = TRAIN_STAGES, tracking_uri: Optional[str] = None,
                 cpus_per_run: float = 1.0, gpus_per_run: float = 0.0, worker_cache: Optional[str] = DEFAULT_WORKER_CACHE,
                 quiet: bool = False, log=print) -> dict[str, Any]:
    """Run ``pipeline``'s out-of-date stages matching ``pattern`` as Ray tasks on the cluster at ``address``, through
    the default DVC remote, then ``dvc repro`` it here. Returns the stages run, where each ran, and phase seconds."""
    if cpus_per_run <= 0 or gpus_per_run < 0:
        raise GridError("grid --ray: --cpus-per-run must be > 0 and --gpus-per-run >= 0")
    try:
        import ray
    except ImportError as err:
        raise GridError("grid --ray needs Ray: in fedsilo's checkout, pip install -e '.[ray]' -c constraints.txt") from err
    repo = Path(repo)
    r = run_dvc(["remote", "default"], repo, check=False)  # exit 1, "No default remote set", when there is none
    remote = r.stdout.strip() if r.returncode == 0 else ""
    if not remote:
        raise GridError("grid --ray: no default DVC remote; the workers send their results through it. Add one that "
                        "this machine and every node reach: `dvc remote add -d store s3://bucket/path` (or ssh://, "
                        "gs://, a shared folder), credentials in each machine's .dvc/config.local or environment")
    env = tracking_env(tracking_uri, repo)
    t0 = time.monotonic()
    check_address(address)  # before anything is reproduced: a wrong address is refused in seconds
    stages = prepare_grid(pipeline, repo, pattern, env, quiet=quiet, log=log)
    restored = restore_cached(pipeline, repo, stages, env)  # here, from this machine's run-cache: no node trains them
    stages = [s for s in stages if s not in restored]
    if restored:
        log(f"grid: {len(restored)} stage(s) restored from this machine's run-cache, not sent to the cluster")
    others = left_out(pipeline, repo, pattern, stages)
    dag = _dag(pipeline, repo) if stages else None
    own = {s: worker_inputs(pipeline, repo, [s], dag) for s in stages}  # a run pulls its own experiment's data only
    inputs = sorted({i for ins in own.values() for i in ins})
    if inputs:
        run_dvc(["push", *inputs], repo, env)
    t_prep = time.monotonic() - t0
    placed: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    t1 = time.monotonic()
    if stages:
        workspace = bundle(repo)
        started = not ray.is_initialized()
        if started:
            import warnings

            with warnings.catch_warnings():  # Ray's note on a future default; CPU runs keep CUDA_VISIBLE_DEVICES="" today
                warnings.simplefilter("ignore", FutureWarning)
                ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        try:
            nodes = [{"node": n["NodeID"], "address": n["NodeManagerAddress"], "resources": n["Resources"]}
                     for n in _check_cluster(ray, cpus_per_run, gpus_per_run, env.get("MLFLOW_TRACKING_URI"), log)]
            ref = ray.put(workspace)
            task = ray.remote(run_stage)
            env_vars = {k: env[k] for k in ("MLFLOW_TRACKING_URI",) if k in env}
            pending = {task.options(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=0, name=f"fedsilo {s}")
                       .remote(ref, pipeline, s, own[s], env_vars, worker_cache): s for s in stages}
            bar = Progress(len(stages), f"grid {pipeline} (Ray, {cpus_per_run:g} CPU / {gpus_per_run:g} GPU a run)", "run", quiet=quiet)
            try:
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1)
                    for d in done:
                        stage = pending.pop(d)
                        try:
                            placed.append(ray.get(d))
                            last = f"{stage} on {placed[-1]['host']}"
                        except Exception as err:  # noqa: BLE001 - a task's error: collected, reported after the rest
                            cause = getattr(err, "cause", None) or err
                            failed[stage] = str(cause)
                            last = f"{stage} failed"
                        bar.update(1, info=f"{len(failed)} failed, last {last}", line=True)
            finally:
                bar.close()
            reused = [x["stage"] for x in placed if x["restored_from_run_cache"]]
            if reused:  # a node's worker cache had run them before with these inputs (another checkout's grid)
                log(f"grid: {len(reused)} stage(s) restored from a node's run-cache, not trained again: {', '.join(sorted(reused))}")
            if "MLFLOW_TRACKING_URI" in env:  # a run whose process died on its node (SIGKILL, a lost worker)
                ended = end_stale_on_nodes(ray, env["MLFLOW_TRACKING_URI"], log)
                if ended:
                    log(f"grid: {len(ended)} MLflow run(s) whose process died marked KILLED: {', '.join(ended)}")
        finally:
            if started:
                ray.shutdown()
    t_grid = time.monotonic() - t1
    if failed:
        logs = "\n".join(f"--- {s}:\n{msg[-2000:]}" for s, msg in failed.items())
        raise GridError(f"{len(failed)} of {len(stages)} Ray runs failed: {', '.join(failed)}\n{logs}")
    t2 = time.monotonic()
    # the stages that train after the grid (onboarding) with the threads the runs had (Ray's OMP_NUM_THREADS)
    ran = restore_grid(pipeline, repo, stages, {**env, "OMP_NUM_THREADS": str(threads_per_run(1, cpus_per_run))}, pull=True,
                       others=others, log=log)
    return {"queued": stages, "restored_here": restored, "runs": sorted(placed, key=lambda r: r["stage"]), "nodes": nodes,
            "remote": remote, "inputs": inputs, "prepare_s": t_prep, "grid_s": t_grid, "restore_and_report_s": time.monotonic() - t2, "ran_after": ran,
            "left_out": others}
